# SPDX-License-Identifier: Apache-2.0
"""Tokens per second on one GPU: dense at its largest batch, full offload, InfiniGen at larger batches.

python -m benchmarks.gpu.throughput [--contexts 32768 131072] [--batches 8 16 32]
    [--selections budget=0.2 budget=0.05 cap=2048 cap=4096] [--full-batches 8]
    [--profile-batches 32]
    [--modes graph] [--host-pool-gib 48] [--kv-cache-dtypes auto fp8]
python -m benchmarks.gpu.throughput --self-test      # CPU, tiny shapes, references
python -m benchmarks.gpu.throughput --render benchmarks/results/gpu_throughput.json
python -m benchmarks.gpu.throughput --plan 79.1 139.8   # what fits, by the estimate (no GPU)

What a user of one GPU compares: at each context, dense vLLM-style attention
at the largest batch whose K/V fits in the device memory left beside the
weights (found from the free memory, then measured), full offload (every
layer's K/V copied over PCIe each step), and InfiniGen (the product's runtime
and CUDA data path, ``product.py``) at each batch of ``--batches`` and each
selection of ``--selections``: ``budget=F`` (the fraction) or ``cap=N``
(``--infinigen-budget-tokens N`` at budget 0.2). The same 32-layer
Llama-3.1-8B-shaped decoder, bf16, one token per row per step, as
``decode_step.py`` (whose ``measure_variant`` each point is). InfiniGen's
selections are computed (their cost is in the step) and then replaced by
blocks recorded on a trained model (``selection_trace.py``), thinned to the
selection's fraction of the context (``selection_trace.per_block_for``), so
the device block cache sees recorded step-to-step reuse; each point reports
its hit rate and PCIe bytes per generated token. Where host memory is
short, the layers share pool regions (``variants.KVSetup``): the bandwidth
is real, the contents repeat. A point that does not fit the device says so.

``--kv-cache-dtypes auto fp8`` measures every point with the K/V in the
model's dtype and in FP8 (vLLM's ``--kv-cache-dtype``): the FP8 pool is the
same pinned memory as twice as many FP8 units. Dense with FP8 K/V is what a
vLLM user turns on first (twice the batch); torch's SDPA has no FP8 K/V, so
its point is ``dense_units``: InfiniGen's Triton decode attention over every
block of the device-resident FP8 K/V (the same kernel family as InfiniGen's,
said in the table). Each point gives the host memory its K/V needs beside the
pool it ran on (``host_GiB_needed``).

tokens/s = batch x 1000 / ms per step (the median step, CUDA events, one host
sync per step). Writes benchmarks/results/gpu_throughput.{json,md} (command,
commit, device, date) and a plot (.png, tokens/s against batch, dense's
largest batch marked) where matplotlib is installed (``--render`` draws it
later from the JSON on another machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import selection_trace, throughput_report
from benchmarks.gpu.decoder import LLAMA_31_8B, TINY, Decoder, DecoderShape, random_weights
from benchmarks.gpu.measure import (
    CACHE_FACTORS,
    DEFAULT_KEYS,
    KEYS,
    MARGIN,
    MODES,
    device_bytes,
    fill_random,
    make_pool,
    measure_variant,
    open_gpu_bench,
    pool_as,
    product_width,
    replay_for,
)
from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.gpu.variants import KVSetup, Streams
from benchmarks.harness import paths, report
from vllm_infinigen.layout import FP8_KV_CACHE_DTYPES, KEY_GROUP, kv_dtype
from vllm_infinigen.platforms.cuda import kernels

DEFAULT_OUT = paths.RESULTS / "gpu_throughput"
SELF_TEST_OUT = paths.RESULTS / "gpu_throughput_selftest"
PLAN_OUT = paths.RESULTS / "gpu_throughput_plan"
CAP_BUDGET = 0.2  # the fraction beside a token cap (the product's default budget)
KV_CACHE_DTYPES = ("auto", *sorted(FP8_KV_CACHE_DTYPES))  # vLLM's --kv-cache-dtype


@dataclass(frozen=True)
class Selection:
    """InfiniGen's budget: a fraction of the context, or a cap in tokens beside 0.2."""

    budget: float
    cap: int | None = None

    @classmethod
    def parse(cls, text: str) -> Selection:
        kind, _, value = text.partition("=")
        try:
            if kind == "budget" and 0 < float(value) <= 1:
                return cls(float(value))
            if kind == "cap" and int(value) > 0:
                return cls(CAP_BUDGET, int(value))
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"{text!r}: budget=F (0 < F <= 1) or cap=N tokens")

    @property
    def label(self) -> str:
        return f"cap {self.cap}" if self.cap else f"budget {self.budget:g}"

    def fraction(self, context: int) -> float:
        """The fraction of ``context`` a row keeps."""
        return min(self.budget, self.cap / context) if self.cap else self.budget


def dense_largest_batch(shape: DecoderShape, context: int, dtype: torch.dtype,
                        free_bytes: int, kv: torch.dtype | None = None) -> int:
    """The largest batch whose dense K/V (of ``kv``, default ``dtype``; with the
    benchmark's temporaries and ``MARGIN``) fits in ``free_bytes`` beside the
    weights; 0 when none does."""
    batch = 0
    while device_bytes("dense", shape, batch + 1, context, 0, 1.0, dtype,
                       kv_dtype=kv) + MARGIN < free_bytes:
        batch += 1
    return batch


def dense_variant(dtype: torch.dtype, kv: torch.dtype) -> str:
    """Dense's point: torch's SDPA, or over FP8 K/V (which SDPA does not take)
    InfiniGen's Triton attention over every device-resident block."""
    return "dense" if kv == dtype else "dense_units"


def kv_pools(pool: torch.Tensor, names: list[str], dtype: torch.dtype,
             device: torch.device):
    """(name, K/V dtype, units) per ``--kv-cache-dtypes`` entry, lazily: the
    pool's host memory as units of each type, refilled when the type changes."""
    for index, name in enumerate(names):
        kv = kv_dtype(name, dtype)
        if kv == pool.dtype and index > 0 and kv_dtype(names[index - 1], dtype) != kv:
            fill_random(pool, device)  # the bytes of another type read as NaN here and there
        yield name, kv, pool_as(pool, kv, device)


def dense_bound_ms(shape: DecoderShape, batch: int, context: int, dtype: torch.dtype,
                   kv: torch.dtype, read_GBps: float) -> float:
    """Dense's step at the device's streaming read: the weights and every
    layer's K/V read once (its bytes bound, beside the kernel measured)."""
    num_bytes = shape.weight_bytes(dtype) + shape.num_layers * shape.layer_kv_bytes(batch,
                                                                                  context, kv)
    return num_bytes / read_GBps / 1e6


def key_bytes_per_step(shape: DecoderShape, batch: int, context: int, dtype: torch.dtype,
                       keys: str) -> int:
    """The speculation keys the sparse layers' scoring reads in a step (the product's
    ``ModelLayout.key_bytes_per_group``, per group of KEY_GROUP context tokens)."""
    layout = shape.layout(keys)
    return (layout.num_sparse * batch * shape.num_kv_heads * (context // KEY_GROUP)
            * layout.key_bytes_per_group(dtype.itemsize))


def infinigen_bound_ms(shape: DecoderShape, batch: int, context: int, kept: float,
                       dtype: torch.dtype, kv: torch.dtype, keys: str, gathered: float,
                       read_GBps: float) -> float:
    """InfiniGen's step at the device's streaming read (its HBM floor): the weights,
    the dense layers' whole K/V, the sparse layers' ``kept`` share of the context's K/V
    (read from the block cache) and their speculation keys, and the ``gathered``
    bytes written into the cache."""
    sparse = (shape.num_layers - shape.dense_layers) * batch * shape.num_kv_heads
    selected = sparse * (kept * context + 1) * 2 * shape.head_dim * kv.itemsize
    num_bytes = (shape.weight_bytes(dtype) + shape.dense_layers * shape.layer_kv_bytes(
        batch, context, kv) + selected + key_bytes_per_step(shape, batch, context, dtype, keys)
        + gathered)
    return num_bytes / read_GBps / 1e6


def host_bytes_needed(name: str, shape: DecoderShape, batch: int, context: int,
                      kv: torch.dtype) -> int | None:
    """Pinned host memory the point's K/V needs (the pool it ran on may be smaller:
    layers then share regions): every layer's for full offload, the sparse layers'
    for InfiniGen, none for dense."""
    layers = {"full": shape.num_layers, "infinigen": shape.num_layers - shape.dense_layers}
    if name not in layers:
        return None
    return layers[name] * shape.layer_kv_bytes(batch, context, kv)


def memory_plan(device_gib: list[float], contexts: list[int], batches: list[int],
                selections: list[Selection], dtype: torch.dtype = torch.bfloat16,
                shape: DecoderShape = LLAMA_31_8B, context_gib: float = 1.0) -> dict[str, Any]:
    """What fits, by the benchmark's own estimate (``measure.device_bytes``),
    on devices of ``device_gib`` (``context_gib`` left to the CUDA context):
    dense's largest batch, and per InfiniGen point the largest block-cache
    factor that fits (None: it does not)."""
    weights = shape.weight_bytes(dtype)
    plans = []
    for gib in device_gib:
        free = int((gib - context_gib) * 2**30) - weights
        for context in contexts:
            blocks = shape.blocks_per_row(context)
            points = {}
            for batch in batches:
                for selection in selections:
                    width = kernels.static_width(
                        blocks, shape.block_size, budget=selection.budget, min_context=0,
                        sink_blocks=1, recent_blocks=1, budget_tokens=selection.cap)
                    points[f"x{batch} {selection.label}"] = next(
                        (f for f in CACHE_FACTORS
                         if device_bytes("infinigen", shape, batch, context, width, f, dtype,
                                         DEFAULT_KEYS) + MARGIN < free), None)
            plans.append({"device_GiB": gib, "context": context, "free_GiB": free / 2**30,
                          "dense_largest_batch": dense_largest_batch(shape, context, dtype,
                                                                     free),
                          "infinigen_cache_factor": points})
    return {"weights_GiB": weights / 2**30, "context_GiB": context_gib, "plans": plans}


def _gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / 2**30


def tokens_per_second(batch: int, ms_per_step: float) -> float:
    return batch * 1000.0 / ms_per_step


def measure_point(name: str, shape: DecoderShape, layers, lm_head, pool, device, dtype, *,
                  batch: int, context: int, mode: str, args: argparse.Namespace,
                  streams: Streams, limits: dict[str, float] | None,
                  selection: Selection | None = None) -> dict[str, Any]:
    """One (variant, batch, selection) at ``context``: its step and tokens/s."""
    point: dict[str, Any] = {"variant": name, "mode": mode, "batch": batch, "context": context,
                             "selection": selection.label if selection else None,
                             "kv_dtype": str(pool.dtype).removeprefix("torch."),
                             "host_GiB_needed": _gib(host_bytes_needed(
                                 name, shape, batch, context, pool.dtype))}
    began = time.perf_counter()
    setup = KVSetup(shape, batch, context, pool, device)
    decoder = Decoder(shape, layers, lm_head)
    x = torch.randn(batch, shape.hidden, device=device).to(dtype)
    replay, width, budget, cap = None, 1, CAP_BUDGET, None
    if selection is not None:
        budget, cap = selection.budget, selection.cap
        fraction = selection.fraction(context)
        replay, point["replay"] = replay_for(args.traces, shape, batch, context,
                                             args.warmup + args.steps + 8, device, fraction)
        point["selected_fraction"] = fraction
        width = max(replay.shape[-1], product_width(setup, budget, cap))
    profiled = name == "infinigen" and batch in args.profile_batches
    args = argparse.Namespace(**{**vars(args), "profile": profiled})
    result = measure_variant(name, setup, decoder, x, layers, mode=mode, args=args,
                             streams=streams, replay=replay, width=width, limits=limits,
                             budget=budget, budget_tokens=cap)
    point.update(result)
    if "ms_per_step" in result:
        point["tokens_per_s"] = tokens_per_second(batch, result["ms_per_step"])
        point["pcie_bytes_per_token"] = result["pcie_bytes_per_step"] / batch
    if name.startswith("dense") and limits and limits.get("read_GBps"):
        point["bytes_bound_ms"] = dense_bound_ms(shape, batch, context, dtype, pool.dtype,
                                                 limits["read_GBps"])
    if name == "infinigen" and limits and limits.get("read_GBps") and "ms_per_step" in result:
        kept = (point["replay"]["kept_fraction"] if replay is not None
                else point.get("selected_fraction", budget))
        point["bytes_bound_ms"] = infinigen_bound_ms(
            shape, batch, context, kept, dtype, pool.dtype, args.keys,
            result["pcie_bytes_per_step"], limits["read_GBps"])
        point["key_bytes_per_step"] = key_bytes_per_step(shape, batch, context, dtype,
                                                         args.keys)
    point["seconds"] = time.perf_counter() - began
    print(throughput_report.point_line(point), flush=True)
    return point


def measure_context(shape, layers, lm_head, pool, device, dtype, *, context: int,
                    free_bytes: int, args: argparse.Namespace, streams: Streams,
                    limits: dict[str, float] | None,
                    kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Dense at its largest batch, full offload and InfiniGen at one context, the
    K/V in ``pool``'s dtype (``kv_cache_dtype``: its --kv-cache-dtype)."""
    kv = pool.dtype
    largest = dense_largest_batch(shape, context, dtype, free_bytes, kv)
    out: dict[str, Any] = {"context": context, "kv_cache_dtype": kv_cache_dtype,
                           "free_bytes": free_bytes, "dense_largest_batch": largest,
                           "points": []}
    common = {"context": context, "args": args, "streams": streams, "limits": limits}
    for mode in args.modes:
        if largest:
            out["points"].append(measure_point(dense_variant(dtype, kv), shape, layers, lm_head,
                                               pool, device, dtype, batch=largest, mode=mode,
                                               **common))
        for batch in args.full_batches:
            out["points"].append(measure_point("full", shape, layers, lm_head, pool, device,
                                               dtype, batch=batch, mode=mode, **common))
        for batch in args.batches:
            for selection in args.selections:
                out["points"].append(measure_point("infinigen", shape, layers, lm_head, pool,
                                                   device, dtype, batch=batch, mode=mode,
                                                   selection=selection, **common))
    return out


def self_test(out: Path | None = SELF_TEST_OUT,
              traces: list[Path] | None = None) -> dict[str, Any]:
    """Every point of the benchmark on the CPU with tiny shapes and the kernels'
    references (eager), with the K/V in float32 and in FP8: dense at the batch a
    made-up free memory allows, full offload, InfiniGen at two batches with a
    fraction and a cap; each measured point has its tokens/s, the replay keeps
    about the selection's fraction, and FP8 moves a quarter of float32's bytes
    over PCIe at each InfiniGen point."""
    torch.manual_seed(0)
    shape, device, dtype = TINY, torch.device("cpu"), torch.float32
    streams = Streams(device)
    layers, lm_head = random_weights(shape, device, dtype)
    traces = selection_trace.recorded_traces() if traces is None else traces
    context, batches = selection_trace.recorded_blocks(traces) * shape.block_size, [2, 3]
    free = device_bytes("dense", shape, 2, context, 0, 1.0, dtype) + MARGIN + 1
    pool, _ = make_pool(shape, shape.num_layers * shape.layer_kv_bytes(max(batches), context,
                                                                       dtype), device, dtype)
    args = argparse.Namespace(traces=traces, warmup=1, steps=3, keys=DEFAULT_KEYS,
                              profile_batches=[],
                              modes=["eager"], batches=batches, full_batches=[2],
                              selections=[Selection(0.2), Selection(CAP_BUDGET, context // 8)],
                              budget=CAP_BUDGET)
    contexts = [measure_context(shape, layers, lm_head, units, device, dtype, context=context,
                                free_bytes=free, args=args, streams=streams, limits=None,
                                kv_cache_dtype=name)
                for name, _, units in kv_pools(pool, ["auto", "fp8"], dtype, device)]
    points = [p for measured in contexts for p in measured["points"]]
    sparse = [p for p in points if p["variant"] == "infinigen"]
    pcie = {(p["kv_dtype"], p["batch"], p["selection"]): p.get("pcie_bytes_per_token")
            for p in sparse}
    checks = {
        "dense_largest_batch": [measured["dense_largest_batch"] for measured in contexts],
        "dense_variants": [p["variant"] for p in points if p["variant"].startswith("dense")],
        "all_measured": all("tokens_per_s" in p for p in points),
        "replay_fractions": [(p["selected_fraction"], p["replay"]["kept_fraction"])
                             for p in sparse],
        "fp8_pcie_over_float32": sorted({pcie[("float8_e4m3fn", b, s)] / pcie[("float32", b, s)]
                                         for (_, b, s) in pcie if pcie[("float32", b, s)]}),
    }
    checks["passed"] = bool(
        checks["dense_largest_batch"][0] == 2 and checks["dense_largest_batch"][1] >= 6
        and checks["dense_variants"] == ["dense", "dense_units"] and checks["all_measured"]
        and len(points) == 2 * (1 + 1 + len(batches) * 2)
        and checks["fp8_pcie_over_float32"] == [0.25]
        # the replay keeps the selection's fraction, within a recorded block's rounding
        # and the sink and own blocks it always adds
        and all(abs(kept - wanted) < 0.05 + wanted / 2
                for wanted, kept in checks["replay_fractions"]))
    if out is not None:
        results = {"checks": checks, "contexts": contexts}
        report.write_results(out, gpu_run_metadata(), throughput_report.TITLE + ": CPU self-test",
                             {"shape": "TINY", "dtype": "float32"}, results,
                             throughput_report.markdown_sections(results))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true",
                        help="tiny shapes on the CPU with the references (no GPU needed)")
    parser.add_argument("--render", type=Path, default=None,
                        help="rewrite the Markdown and plot of a results JSON, and stop")
    parser.add_argument("--plan", type=float, nargs="+", default=None, metavar="GIB",
                        help="write what fits on devices of these GiB, by the benchmark's "
                        "memory estimate (no GPU needed), and stop")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--selections", type=Selection.parse, nargs="+",
                        default=[Selection.parse(s) for s in
                                 ("budget=0.2", "budget=0.05", "cap=2048", "cap=4096")],
                        help="budget=F (a fraction of the context) or cap=N (a token cap "
                        "beside budget 0.2)")
    parser.add_argument("--full-batches", type=int, nargs="*", default=[8],
                        help="batches of full offload (its step is the PCIe copy of the K/V)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["graph"])
    parser.add_argument("--keys", choices=KEYS, default=DEFAULT_KEYS)
    parser.add_argument("--traces", type=Path, nargs="+", default=selection_trace.recorded_traces(),
                        help="recorded selections; each point replays the one recorded at "
                        "its fraction of the context (default: recall-llama-12l-4k's at 4K, "
                        "benchmarks/gpu/traces/)")
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[],
                        help="InfiniGen's points at these batches also get a profile: the "
                        "kernels' device time per step and each stream's busy and idle time "
                        "(the gather's side stream among them)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--host-pool-gib", type=float, default=48.0,
                        help="pinned host memory for the K/V; layers share it when it is smaller")
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES,
                        default=["auto"], help="vLLM's --kv-cache-dtype of each pass over "
                        "every point (auto: the model's bf16)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.render is not None:
        print(throughput_report.render(args.render))
        return 0
    if args.plan:
        plan = memory_plan(args.plan, args.contexts, args.batches, args.selections)
        settings = {"device_GiB": args.plan, "contexts": args.contexts,
                    "batches": args.batches, "selections": [s.label for s in args.selections]}
        report.write_results(args.out or PLAN_OUT, gpu_run_metadata(),
                             throughput_report.TITLE + ": what fits, by the memory estimate",
                             settings, plan, throughput_report.plan_sections(plan))
        return 0
    if args.self_test:
        result = self_test(args.out or SELF_TEST_OUT, args.traces)
        print(result)
        return 0 if result["passed"] else 1
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU self-test: --self-test)")
    bench = open_gpu_bench(args.batches, args.contexts, args.host_pool_gib)
    device, dtype, shape, streams = bench.device, bench.dtype, bench.shape, bench.streams
    layers, lm_head, pool, limits = bench.layers, bench.lm_head, bench.pool, bench.limits
    results: dict[str, Any] = {"h2d_limits": limits, "pool_GiB": bench.setup["pool_GiB"],
                               "weights_GiB": shape.weight_bytes(dtype) / 2**30,
                               "keys": args.keys, "contexts": []}
    for name, _, units in kv_pools(pool, args.kv_cache_dtypes, dtype, device):
        for context in args.contexts:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            results["contexts"].append(measure_context(
                shape, layers, lm_head, units, device, dtype, context=context,
                free_bytes=free, args=args, streams=streams, limits=limits,
                kv_cache_dtype=name))
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k != "selections"},
                "selections": [s.label for s in args.selections],
                "shape": shape.__dict__, "dtype": str(dtype)}
    out = args.out or DEFAULT_OUT
    report.write_results(out, gpu_run_metadata(), throughput_report.TITLE, settings, results, throughput_report.markdown_sections(results))
    throughput_report.plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
