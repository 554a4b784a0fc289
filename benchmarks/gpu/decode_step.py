# SPDX-License-Identifier: Apache-2.0
"""ms per decode step of a 32-layer Llama-3.1-8B-shaped decoder: dense, offloaded, InfiniGen.

python -m benchmarks.gpu.decode_step [--contexts 32768 131072] [--batches 1 8]
python -m benchmarks.gpu.decode_step --self-test      # CPU, tiny shapes, references

Needs torch (and Triton on CUDA), not vLLM. Random bf16 weights (RoPE left
out), one token per row per step at a fixed context. For every (context,
batch): ``variants.py``'s dense (where it fits), dense_units, full offload,
InfiniGen without and with the device block cache. InfiniGen's selections
are computed (partial scores, block rule) and then replaced by selections
recorded on a trained model (``selection_trace.py``: gutenberg-llama-2k,
budget 0.2, scaled to the context), so the cache sees real step-to-step
reuse. Reported per variant: ms per step (median, CUDA events, a host sync
per step as a serving engine has), host enqueue time, bytes over PCIe per
step, GB/s, the PCIe bound (bytes / the H2D limit measured in the same run),
the cache's hit rate and size. First, select-all (budget 1) must give
dense's logits in every variant. Writes benchmarks/results/gpu_decode_step.{json,md}
(command, commit, device, date); ``--self-test`` writes ..._selftest.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import selection_trace
from benchmarks.gpu.decoder import (
    LLAMA_31_8B,
    TINY,
    Decoder,
    DecoderShape,
    random_weights,
)
from benchmarks.gpu.report import markdown_sections
from benchmarks.gpu.results import gpu_run_metadata, write_gpu_results
from benchmarks.gpu.variants import (
    Dense,
    DenseUnits,
    FullOffload,
    InfiniGen,
    KVSetup,
    Streams,
)
from benchmarks.harness import paths
from vllm_infinigen.layout import KEY_GROUP, int_key_bits
from vllm_infinigen.platforms.cuda import kernels

VARIANTS = ("dense", "dense_units", "full", "infinigen_nocache", "infinigen_cache")
CACHE_FACTORS = (2.0, 1.5, 1.25, 1.0)
DEFAULT_OUT = paths.RESULTS / "gpu_decode_step"
MARGIN = 4 << 30  # device memory left free


KEYS = ("int", "partial")  # --infinigen-speculation-keys (int: the product's default)


def speculation_keys(setup: KVSetup, keys: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Random speculation keys of every sparse layer, in the layout the product scores."""
    shape = setup.shape
    generator = torch.Generator(device=setup.device).manual_seed(1)
    out = []
    for _ in range(shape.num_layers - shape.dense_layers):
        if keys == "int":
            bits = int_key_bits(dtype.itemsize)
            cells = (setup.batch * setup.blocks_per_row, shape.num_kv_heads,
                     shape.block_size // KEY_GROUP, shape.head_dim)
            codes = torch.randint(0, 256, (*cells, 2 * bits), dtype=torch.uint8,
                                  device=setup.device, generator=generator)
            scales = torch.rand(cells, device=setup.device, generator=generator) / 16
            out.append({"codes": codes, "scales": scales.half()})
        else:
            out.append({"partial": torch.randn(
                setup.batch, setup.blocks_per_row, shape.num_kv_heads, shape.partial_channels,
                shape.block_size, device=setup.device, dtype=dtype, generator=generator)})
    return out


def speculation_bytes_per_block(shape: DecoderShape, keys: str, dtype: torch.dtype) -> int:
    """Device bytes of one block's speculation keys over the KV heads."""
    if keys == "int":
        per_group = shape.head_dim * (2 * int_key_bits(dtype.itemsize) + 2)
        return shape.num_kv_heads * shape.block_size // KEY_GROUP * per_group
    return shape.num_kv_heads * shape.block_size * shape.partial_channels * dtype.itemsize


def build_variant(name: str, setup: KVSetup, streams: Streams, layers, *, budget: float,
                  replay: torch.Tensor | None, cache_factor: float, dtype: torch.dtype,
                  keys: str = "int"):
    if name == "dense":
        return Dense(setup, streams)
    if name == "dense_units":
        return DenseUnits(setup, streams)
    if name == "full":
        return FullOffload(setup, streams)
    slots = None
    if name == "infinigen_cache":
        width = replay.shape[-1] if replay is not None else InfiniGen.selection_width(
            setup, budget)
        slots = int(cache_factor * setup.batch * width)
    return InfiniGen(setup, streams, layers, speculation_keys(setup, keys, dtype),
                     budget=budget, replay=replay,
                     slots_per_head=slots, compute_dtype=dtype)


def device_bytes(name: str, shape: DecoderShape, batch: int, context: int, width: int,
                 factor: float, dtype: torch.dtype, keys: str = "int") -> int:
    """Device memory a variant adds to the weights (estimate, temporaries included)."""
    layer = shape.layer_kv_bytes(batch, context, dtype)
    sparse = shape.num_layers - shape.dense_layers
    if name in ("dense", "dense_units"):
        return shape.num_layers * layer + layer
    if name == "full":
        return 3 * layer
    partial = batch * shape.blocks_per_row(context) * speculation_bytes_per_block(shape, keys,
                                                                                 dtype)
    units = batch * shape.num_kv_heads * width * shape.unit_bytes(dtype)
    held = factor * units * sparse if name == "infinigen_cache" else 2 * units
    return int(shape.dense_layers * layer + (sparse + 4) * partial + held + layer // 4)


def fits(name, shape, batch, context, width, factor, dtype, keys) -> bool:
    if not torch.cuda.is_available():
        return True
    free, _ = torch.cuda.mem_get_info()
    return device_bytes(name, shape, batch, context, width, factor, dtype, keys) + MARGIN < free


def run_steps(decoder: Decoder, variant, x: torch.Tensor, warmup: int, steps: int,
              streams: Streams) -> dict[str, Any]:
    """Times ``steps`` decode steps after ``warmup``; counters cover the timed steps."""
    gpu_ms, host_ms = [], []
    logits = None
    for index in range(warmup + steps):
        if index == warmup and hasattr(variant, "take_fetched_units"):
            variant.take_fetched_units()
        if streams.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        logits = decoder.step(x, variant)
        host_ms.append((time.perf_counter() - began) * 1e3)
        if streams.cuda:
            end.record()
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
    timed = (gpu_ms or host_ms)[warmup:]
    result = {"ms_per_step": statistics.median(timed), "ms_min": min(timed),
              "ms_max": max(timed), "host_enqueue_ms": statistics.median(host_ms[warmup:]),
              "steps": steps}
    shape, setup = decoder.shape, variant.setup
    unit = shape.unit_bytes(setup.pool.dtype)
    if hasattr(variant, "take_fetched_units"):
        fetched, hits = variant.take_fetched_units()
        result["pcie_bytes_per_step"] = fetched * unit / steps
        if hits is not None:
            result["hit_rate"] = hits / max(hits + fetched, 1)
            result["cache_slots_per_head"] = variant.cache.slots_per_head
    else:
        result["pcie_bytes_per_step"] = variant.pcie_units * unit
    result["GBps"] = result["pcie_bytes_per_step"] / result["ms_per_step"] / 1e6
    return result, logits


def h2d_limits(pool: torch.Tensor, device: torch.device) -> dict[str, float]:
    """GB/s of one large pinned copy and of the gather kernel, on this machine now."""
    flat = pool.view(-1)
    count = min(flat.numel(), (1 << 30) // flat.element_size())
    target = torch.empty(count, dtype=flat.dtype, device=device)
    unit_count = min(pool.shape[0], 8192)
    units = torch.randperm(pool.shape[0], device=device)[:unit_count].sort().values
    cache = torch.empty((unit_count,) + tuple(pool.shape[1:]), dtype=pool.dtype, device=device)
    slots = torch.arange(unit_count, device=device)
    number = torch.tensor([unit_count], device=device)

    def timed(fn) -> float:
        times = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])

    copy_ms = timed(lambda: target.copy_(flat[:count], non_blocking=True))
    gather_ms = timed(lambda: kernels.gather_units(pool, cache, units, slots, number))
    return {"copy_GBps": count * flat.element_size() / copy_ms / 1e6,
            "gather_GBps": cache.numel() * cache.element_size() / gather_ms / 1e6,
            "gather_ctas": kernels.gather_ctas(
                torch.cuda.get_device_properties(device).multi_processor_count)}


def make_pool(shape: DecoderShape, num_bytes: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, object]:
    """Host units [n, block_size, 2 * D] filled with random values (pinned on CUDA)."""
    unit = shape.unit_bytes(dtype)
    count = num_bytes // unit
    if device.type != "cuda":
        return torch.randn(count, shape.block_size, 2 * shape.head_dim).to(dtype), None
    from vllm_infinigen.platforms.cuda.host_pool import allocate_host_pool

    pool = allocate_host_pool(count, 1, shape.block_size, shape.head_dim, dtype)
    units = pool.tensor.view(count, shape.block_size, 2 * shape.head_dim)
    chunk = torch.randn(64 << 20, device=device).to(dtype)
    flat = units.view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        piece = flat[start : start + chunk.numel()]
        piece.copy_(chunk[: piece.numel()], non_blocking=True)
    torch.cuda.synchronize()
    return units, pool


def replay_for(trace: Path, shape: DecoderShape, batch: int, context: int, steps: int,
               device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    masks, provenance = selection_trace.load_trace(trace)
    replay = selection_trace.replay_blocks(
        masks, num_layers=shape.num_layers - shape.dense_layers, num_kv_heads=shape.num_kv_heads,
        num_rows=batch, context_blocks=context // shape.block_size, num_steps=steps)
    kept = float((replay >= 0).sum()) / (replay[:, :, :, :, 0].numel()
                                          * shape.blocks_per_row(context))
    return replay.to(device), {"trace": trace.name, "kept_fraction": kept,
                               "recorded_on": provenance.get("model")}


def compare(logits: dict[str, torch.Tensor], reference: str = "dense") -> dict[str, float]:
    """Relative L2 difference of each variant's logits from the reference's."""
    base = logits[reference].float()
    return {name: float((value.float() - base).norm() / base.norm())
            for name, value in logits.items() if name != reference}


def select_all_check(shape: DecoderShape, layers, lm_head, pool, device, dtype, *, batch: int,
                     context: int, streams: Streams, keys: str = "int") -> dict[str, Any]:
    """Every variant at budget 1 (every block selected, nothing replayed) against dense."""
    setup = KVSetup(shape, batch, context, pool, device)
    decoder = Decoder(shape, layers, lm_head)
    x = torch.randn(batch, shape.hidden, device=device, generator=torch.Generator(
        device=device).manual_seed(2)).to(dtype)
    logits = {}
    for name in VARIANTS:
        variant = build_variant(name, setup, streams, layers, budget=1.0, replay=None,
                                cache_factor=1.0, dtype=dtype, keys=keys)
        for _ in range(2):  # the second step reads the cache the first one filled
            logits[name] = decoder.step(x, variant)
        del variant
    if streams.cuda:
        torch.cuda.synchronize()
    errors = compare(logits)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return {"batch": batch, "context": context, "keys": keys, "relative_l2_vs_dense": errors,
            "tolerance": tolerance, "passed": all(e < tolerance for e in errors.values())}


def measure_config(shape, layers, lm_head, pool, device, dtype, *, batch: int, context: int,
                   args: argparse.Namespace, streams: Streams,
                   limits: dict[str, float] | None) -> dict[str, Any]:
    setup = KVSetup(shape, batch, context, pool, device)
    decoder = Decoder(shape, layers, lm_head)
    x = torch.randn(batch, shape.hidden, device=device).to(dtype)
    replay, replayed = replay_for(args.trace, shape, batch, context, args.warmup + args.steps,
                                  device)
    out: dict[str, Any] = {"batch": batch, "context": context, "replay": replayed,
                           "layer_kv_bytes": shape.layer_kv_bytes(batch, context, dtype),
                           "distinct_pool_layers": setup.num_regions, "variants": {}}
    width = replay.shape[-1]
    for name in args.variants:
        factors = CACHE_FACTORS if name == "infinigen_cache" else (1.0,)
        factor = next((f for f in factors
                       if fits(name, shape, batch, context, width, f, dtype, args.keys)), None)
        if factor is None:
            needed = device_bytes(name, shape, batch, context, width, factors[-1], dtype,
                                  args.keys)
            out["variants"][name] = {"skipped": f"does not fit ({needed / 2**30:.1f} GiB "
                                                "beside the weights)"}
            continue
        try:
            variant = build_variant(name, setup, streams, layers, budget=args.budget,
                                    replay=replay, cache_factor=factor, dtype=dtype,
                                    keys=args.keys)
            result, _ = run_steps(decoder, variant, x, args.warmup, args.steps, streams)
            if name == "infinigen_cache":
                result["cache_factor"] = factor
            if limits:
                result["pcie_bound_ms"] = result["pcie_bytes_per_step"] / limits["copy_GBps"] / 1e6
            out["variants"][name] = result
        except Exception as error:  # noqa: BLE001 -- keep going; the results say what failed
            out["variants"][name] = {"error": repr(error),
                                     "traceback": traceback.format_exc()[-2000:]}
        variant = None
        gc.collect()
        if streams.cuda:
            torch.cuda.empty_cache()
    return out


SELF_TEST_OUT = DEFAULT_OUT.with_name("gpu_decode_step_selftest")


def self_test(out: Path | None = SELF_TEST_OUT,
              trace: Path = selection_trace.DEFAULT_TRACE) -> dict[str, Any]:
    """The benchmark on the CPU with tiny shapes and the kernels' references: select-all
    equals dense in every variant; with the trace replayed, the cache changes no output
    (same logits as without it) while fetching fewer blocks."""
    torch.manual_seed(0)
    shape, device, dtype = TINY, torch.device("cpu"), torch.float32
    streams = Streams(device)
    layers, lm_head = random_weights(shape, device, dtype)
    batch, context = 2, 2 * 68 * shape.block_size  # two blocks per recorded block
    pool, _ = make_pool(shape, shape.num_layers * shape.layer_kv_bytes(batch, context, dtype),
                        device, dtype)
    checks = {"select_all": select_all_check(shape, layers, lm_head, pool, device, dtype,
                                             batch=batch, context=context, streams=streams),
              "select_all_partial_keys": select_all_check(
                  shape, layers, lm_head, pool, device, dtype, batch=batch, context=context,
                  streams=streams, keys="partial")}
    args = argparse.Namespace(trace=trace, warmup=1, steps=4, budget=0.2, keys="int",
                              variants=["dense", "full", "infinigen_nocache", "infinigen_cache"])
    measured = measure_config(shape, layers, lm_head, pool, device, dtype, batch=batch,
                              context=context, args=args, streams=streams, limits=None)
    setup = KVSetup(shape, batch, context, pool, device)
    decoder = Decoder(shape, layers, lm_head)
    replay, _ = replay_for(trace, shape, batch, context, 4, device)
    x = torch.randn(batch, shape.hidden)
    logits: dict[str, list[torch.Tensor]] = {}
    for name in ("dense", "infinigen_nocache", "infinigen_cache"):
        variant = build_variant(name, setup, streams, layers, budget=0.2, replay=replay,
                                cache_factor=1.5, dtype=dtype)
        logits[name] = [decoder.step(x, variant) for _ in range(4)]
    same = max(float((a - b).abs().max()) for a, b in zip(logits["infinigen_cache"],
                                                         logits["infinigen_nocache"]))
    differs = float((logits["infinigen_nocache"][0] - logits["dense"][0]).abs().max())
    variants = measured["variants"]
    checks["replay"] = {
        "cache_equals_nocache_max_abs": same, "sparse_differs_from_dense_max_abs": differs,
        "hit_rate": variants["infinigen_cache"].get("hit_rate"),
        "passed": bool(same < 1e-5 and differs > 1e-3
                       and 0 < variants["infinigen_cache"]["pcie_bytes_per_step"]
                       < variants["infinigen_nocache"]["pcie_bytes_per_step"])}
    checks["passed"] = (checks["select_all"]["passed"]
                        and checks["select_all_partial_keys"]["passed"]
                        and checks["replay"]["passed"])
    if out is not None:
        meta = gpu_run_metadata()
        results = {"checks": checks, "configs": [measured]}
        write_gpu_results(out, meta, "GPU decode-step benchmark: CPU self-test",
                          {"shape": "TINY", "dtype": "float32", "keys": "int"}, results,
                          markdown_sections(results, self_test=True))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true",
                        help="tiny shapes on the CPU with the references (no GPU needed)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--budget", type=float, default=0.2,
                        help="the computed selection's budget (its cost is measured)")
    parser.add_argument("--keys", choices=KEYS, default="int",
                        help="speculation keys the computed selection scores (the product's "
                        "--infinigen-speculation-keys; int: its default, scored in place by "
                        "a Triton kernel)")
    parser.add_argument("--trace", type=Path, default=selection_trace.DEFAULT_TRACE)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--host-pool-gib", type=float, default=48.0,
                        help="pinned host memory for the K/V; layers share it when it is smaller")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.self_test:
        checks = self_test(args.out or SELF_TEST_OUT, args.trace)
        print(checks)
        return 0 if checks["passed"] else 1
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU self-test: --self-test)")
    device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_31_8B
    streams = Streams(device)
    torch.cuda.set_stream(streams.main)
    layers, lm_head = random_weights(shape, device, dtype)
    largest = max(shape.layer_kv_bytes(b, t, dtype) for b in args.batches for t in args.contexts)
    pool_bytes = max(largest, min(int(args.host_pool_gib * 2**30),
                                  shape.num_layers * largest))
    began = time.perf_counter()
    pool, owner = make_pool(shape, pool_bytes, device, dtype)
    setup_info = {"pool_GiB": pool_bytes / 2**30, "pinned_by": getattr(owner, "pinned_by", None),
                  "pin_seconds": getattr(owner, "seconds", None),
                  "pool_fill_seconds": time.perf_counter() - began}
    limits = h2d_limits(pool, device)
    results: dict[str, Any] = {"h2d_limits": limits, "setup": setup_info,
                               "select_all": select_all_check(shape, layers, lm_head, pool,
                                                              device, dtype, batch=2,
                                                              context=2048, streams=streams,
                                                              keys=args.keys),
                               "configs": []}
    print(results["select_all"], limits, flush=True)
    for context in args.contexts:
        for batch in args.batches:
            config = measure_config(shape, layers, lm_head, pool, device, dtype, batch=batch,
                                    context=context, args=args, streams=streams, limits=limits)
            results["configs"].append(config)
            print(config, flush=True)
    meta = gpu_run_metadata()
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "shape": shape.__dict__, "dtype": str(dtype)}
    write_gpu_results(args.out or DEFAULT_OUT, meta,
                      "InfiniGen decode step on a GPU: dense, offloaded, block cache",
                      settings, results, markdown_sections(results, self_test=False))
    return 0 if results["select_all"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
