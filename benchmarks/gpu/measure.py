# SPDX-License-Identifier: Apache-2.0
"""The GPU decode-step benchmark's measurements (``decode_step.py`` runs them): the
variants, a step eager or from a captured graph, timings, profiles, the H2D limits."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import kernel_limits, selection_trace
from benchmarks.gpu.decoder import Decoder, DecoderShape
from benchmarks.gpu.product import Product, Resident, cache_slots
from benchmarks.gpu.variants import Dense, DenseUnits, FullOffload, KVSetup, Streams
from benchmarks.harness import paths
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import BOUND_BITS, BOUND_UNIT, KEY_GROUP, int_key_bits
from vllm_infinigen.platforms.cuda import kernels

# infinigen_resident: --infinigen-residency device-first before the move (dense
# attention plus the product's write-through), what a step costs while memory allows.
VARIANTS = ("dense", "dense_units", "full", "infinigen", "infinigen_resident")
MODES = ("eager", "graph")
CACHE_FACTORS = (2.0, 1.5, 1.25, 1.0)
KEYS = ("bounds", "int", "partial")  # --infinigen-speculation-keys
DEFAULT_KEYS = InfiniGenConfig().speculation_keys  # the product's default
ALPHA = InfiniGenConfig().resolved_alpha()  # the product's default (off: the budget binds)
DEFAULT_OUT = paths.RESULTS / "gpu_decode_step"
MARGIN = 4 << 30  # device memory left free


def product_width(setup: KVSetup, budget: float, budget_tokens: int | None = None) -> int:
    """Blocks per KV head of the product's every selection (its static width)."""
    return kernels.static_width(setup.blocks_per_row, setup.shape.block_size,
                                budget=budget, min_context=0, sink_blocks=1,
                                recent_blocks=1, budget_tokens=budget_tokens)


def build_variant(name: str, setup: KVSetup, streams: Streams, layers, *, budget: float,
                  replay: torch.Tensor | None, cache_factor: float, keys: str = DEFAULT_KEYS,
                  alpha: float = ALPHA, budget_tokens: int | None = None):
    if name == "dense":
        return Dense(setup, streams)
    if name == "dense_units":
        return DenseUnits(setup, streams)
    if name == "full":
        return FullOffload(setup, streams)
    width = max(product_width(setup, budget, budget_tokens),
                replay.shape[-1] if replay is not None else 1)
    product = Resident if name == "infinigen_resident" else Product
    return product(setup, streams, layers, budget=budget, alpha=alpha, keys=keys,
                   replay=replay, slots_per_head=cache_slots(setup, width, cache_factor),
                   budget_tokens=budget_tokens)


def speculation_bytes_per_block(shape: DecoderShape, keys: str, dtype: torch.dtype) -> int:
    """Device bytes of one block's speculation keys over the KV heads."""
    if keys == "bounds":  # per unit: max and min codes, one float16 scale
        per_unit = 2 * shape.head_dim * BOUND_BITS // 8 + 2
        return shape.num_kv_heads * shape.block_size // BOUND_UNIT * per_unit
    if keys == "int":
        per_group = shape.head_dim * (2 * int_key_bits(dtype.itemsize) + 2)
        return shape.num_kv_heads * shape.block_size // KEY_GROUP * per_group
    return shape.num_kv_heads * shape.block_size * shape.partial_channels * dtype.itemsize


def device_bytes(name: str, shape: DecoderShape, batch: int, context: int, width: int,
                 factor: float, dtype: torch.dtype, keys: str = DEFAULT_KEYS,
                 kv_dtype: torch.dtype | None = None) -> int:
    """Device memory a variant adds to the weights (estimate, temporaries included);
    ``kv_dtype``: the K/V's elements (None: the model's ``dtype``)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    layer = shape.layer_kv_bytes(batch, context, kv_dtype)
    sparse = shape.num_layers - shape.dense_layers
    if name in ("dense", "dense_units"):
        return shape.num_layers * layer + layer
    if name == "full":
        return 3 * layer
    blocks = batch * shape.blocks_per_row(context)
    speculation = blocks * speculation_bytes_per_block(shape, keys, dtype)
    held = factor * batch * shape.num_kv_heads * width * shape.unit_bytes(kv_dtype) * sparse
    scores = batch * shape.num_kv_heads * shape.blocks_per_row(context) * shape.block_size * 4
    if name == "infinigen_resident":  # every layer's K/V beside the product's structures
        return int(shape.num_layers * layer + layer + sparse * speculation + held)
    return int(shape.dense_layers * layer + sparse * speculation + held + 4 * scores)


def fits(name, shape, batch, context, width, factor, dtype, keys, kv_dtype=None) -> bool:
    if not torch.cuda.is_available():
        return True
    free, _ = torch.cuda.mem_get_info()
    needed = device_bytes(name, shape, batch, context, width, factor, dtype, keys, kv_dtype)
    return needed + MARGIN < free


class Stepper:
    """One decode step of ``variant``, eager or replayed from a CUDA graph of it.

    In graph mode the first call runs ``warmup`` eager steps (compilation,
    lazy initialisation), then captures one step; each call after replays it.
    """

    def __init__(self, decoder: Decoder, variant, x: torch.Tensor, mode: str):
        self.decoder, self.variant, self.x, self.mode = decoder, variant, x, mode
        self.graph = None
        self.logits: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.mode == "eager":
            return self.decoder.step(self.x, self.variant)
        if self.graph is None:
            for _ in range(2):
                self.decoder.step(self.x, self.variant)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.decoder.step(self.x, self.variant)
        self.graph.replay()
        return self.logits


def run_steps(step: Stepper, warmup: int, steps: int, streams: Streams) -> dict[str, Any]:
    """Times ``steps`` decode steps after ``warmup``; counters cover the timed steps."""
    gpu_ms, host_ms = [], []
    variant = step.variant
    for index in range(warmup + steps):
        if index == warmup and hasattr(variant, "take_fetched_units"):
            variant.take_fetched_units()
        if streams.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - began) * 1e3)
        if streams.cuda:
            end.record()
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
    timed = (gpu_ms or host_ms)[warmup:]
    result = {"ms_per_step": statistics.median(timed), "ms_min": min(timed),
              "ms_max": max(timed), "host_enqueue_ms": statistics.median(host_ms[warmup:]),
              "steps": steps}
    setup = variant.setup
    unit = setup.shape.unit_bytes(setup.pool.dtype)
    if hasattr(variant, "take_fetched_units"):
        fetched, hits = variant.take_fetched_units()
        result["pcie_bytes_per_step"] = fetched * unit / steps
        result["hit_rate"] = hits / (hits + fetched) if hits + fetched else None
        result["cache_slots_per_head"] = variant.data_path.slots_per_head
    else:
        result["pcie_bytes_per_step"] = variant.pcie_units * unit
    result["GBps"] = result["pcie_bytes_per_step"] / result["ms_per_step"] / 1e6
    return result


TOP_KERNELS = 12


def profile_steps(step: Stepper, steps: int) -> dict[str, Any]:
    """Kernel launches and host synchronizations per step (torch profiler, CPU side),
    and the device time per step of the kernels that took most (CUDA side: where
    the step's time goes on the device, a graph's kernels included where the
    profiler sees them)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # a captured graph is made before the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    result: dict[str, Any] = _launches_and_syncs(prof, steps)
    result.update(_device_kernels(prof, steps))
    result["streams"] = stream_times(_device_events(prof), steps)
    return result


def _device_events(prof) -> list:
    return [event for event in prof.events()
            if str(getattr(event, "device_type", "")).split(".")[-1] == "CUDA"
            and not getattr(event, "is_user_annotation", False)]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the intervals (overlaps counted once)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def stream_times(events, steps: int) -> list[dict[str, Any]]:
    """Per device stream (``device_resource_id``), busiest first: the time per step
    some kernel or copy of it runs (busy), the rest of the profiled device span
    (idle: from the first device event to the last, per step), and whether it
    ran the gather (``_gather_units``: the side stream that fills the block cache)."""
    if not events:
        return []
    span = (max(e.time_range.end for e in events)
            - min(e.time_range.start for e in events)) / 1e3 / steps
    by_stream: dict[int, list] = {}
    for event in events:
        by_stream.setdefault(int(event.device_resource_id), []).append(event)
    out = []
    for stream, of_stream in by_stream.items():
        busy = _union_us([(e.time_range.start, e.time_range.end) for e in of_stream])
        busy_ms = busy / 1e3 / steps
        out.append({"stream": stream, "busy_ms_per_step": busy_ms,
                    "idle_ms_per_step": max(span - busy_ms, 0.0),
                    "gather": any("_gather_units" in e.name for e in of_stream),
                    "events_per_step": len(of_stream) / steps})
    return sorted(out, key=lambda entry: -entry["busy_ms_per_step"])


def _device_kernels(prof, steps: int) -> dict[str, Any]:
    """{device_ms_per_step, top_kernels: [{kernel, ms_per_step, calls_per_step}]}
    over the profiler's device events (kernels, copies and fills; summed over
    streams, so overlapping work counts twice)."""
    kernels: dict[str, list[float]] = {}
    for event in _device_events(prof):  # not host events, nor ranges annotated around them
        us = event.device_time_total  # a device event: its own duration
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"device_ms_per_step": sum(v[0] for v in kernels.values()) / 1e3 / steps,
            "top_kernels": [{"kernel": name[:90], "ms_per_step": us / 1e3 / steps,
                             "calls_per_step": calls / steps}
                            for name, (us, calls) in top]}


def _launches_and_syncs(prof, steps: int) -> dict[str, float]:
    launches = syncs = 0
    for event in prof.events():
        name = event.name
        if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                    "cuLaunchKernelEx", "cudaGraphLaunch"):
            launches += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                      "cudaEventSynchronize") or (name == "cudaMemcpy"):
            syncs += 1
    syncs -= 1  # the profile's own closing torch.cuda.synchronize
    return {"launches_per_step": launches / steps, "syncs_per_step": max(syncs, 0) / steps}


def h2d_limits(pool: torch.Tensor, device: torch.device) -> dict[str, float]:
    """GB/s of one large pinned copy and of the gather kernel, and of a streaming
    read of device memory (a reduction over 1 GiB), on this machine now."""
    flat = pool.view(-1)
    count = min(flat.numel(), (1 << 30) // flat.element_size())
    target = torch.empty(count, dtype=flat.dtype, device=device)
    unit_count = min(pool.shape[0], 8192)
    units = torch.randperm(pool.shape[0], device=device)[:unit_count].sort().values
    cache = torch.empty((unit_count + 1,) + tuple(pool.shape[1:]), dtype=pool.dtype,
                        device=device)
    slots = torch.arange(unit_count, device=device)
    number = torch.tensor([unit_count], device=device)

    # Eager calls: each moves ~1 GiB, so the host's launch is no part of the time.
    copy_ms = kernel_limits.timed(lambda: target.copy_(flat[:count], non_blocking=True),
                                  device, repeats=5, graph_calls=0)
    gather_ms = kernel_limits.timed(lambda: kernels.gather_units(pool, cache, units, slots, number),
                                    device, repeats=5, graph_calls=0)
    read_ms = kernel_limits.streaming_read_ms(device, 1 << 30)
    return {"copy_GBps": count * flat.element_size() / copy_ms / 1e6,
            "read_GBps": (1 << 30) / float(read_ms) / 1e6,
            "gather_GBps": unit_count * cache[0].numel() * cache.element_size() / gather_ms / 1e6,
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
    fill_random(units, device)
    return units, pool


def fill_random(units: torch.Tensor, device: torch.device) -> None:
    """Standard normal values in ``units``' dtype (on CUDA, drawn on the device in
    64 Mi-element chunks and copied into the pinned memory)."""
    if device.type != "cuda":
        units.copy_(torch.randn(units.shape).to(units.dtype))
        return
    chunk = torch.randn(64 << 20, device=device).to(units.dtype)
    flat = units.view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        piece = flat[start : start + chunk.numel()]
        piece.copy_(chunk[: piece.numel()], non_blocking=True)
    torch.cuda.synchronize()


def pool_as(pool: torch.Tensor, kv_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The same host memory as units of ``kv_dtype`` (FP8: twice bf16's units),
    refilled with random values of that type (speed only; the bytes of another
    type would read as NaN here and there); ``pool`` itself when it has the type."""
    if pool.dtype == kv_dtype:
        return pool
    block_size, width = pool.shape[1], pool.shape[2]
    units = pool.view(torch.uint8).view(kv_dtype).view(-1, block_size, width)
    fill_random(units, device)
    return units


@dataclass
class GpuBench:
    """What every GPU benchmark sets up first: the Llama-3.1-8B-shaped decoder's
    random bf16 weights on the device, the streams, the pinned host pool
    (sized for the largest layer of the run, at most ``host_pool_gib`` unless
    one layer needs more) and the H2D limits measured over it."""

    device: torch.device
    dtype: torch.dtype
    shape: DecoderShape
    streams: Streams
    layers: list
    lm_head: torch.Tensor
    pool: torch.Tensor
    limits: dict[str, float]
    setup: dict[str, Any]
    # The pool's HostPool: collecting it unregisters the pinned memory that
    # ``pool`` (a view of it) still addresses, and kernels can no longer read it.
    pool_owner: object = None


def open_gpu_bench(batches: list[int], contexts: list[int],
                   host_pool_gib: float) -> GpuBench:
    from benchmarks.gpu.decoder import LLAMA_31_8B, random_weights

    device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_31_8B
    streams = Streams(device)
    torch.cuda.set_stream(streams.main)
    layers, lm_head = random_weights(shape, device, dtype)
    largest = max(shape.layer_kv_bytes(b, t, dtype) for b in batches for t in contexts)
    pool_bytes = max(largest, min(int(host_pool_gib * 2**30), shape.num_layers * largest))
    began = time.perf_counter()
    pool, owner = make_pool(shape, pool_bytes, device, dtype)
    setup = {"pool_GiB": pool_bytes / 2**30, "pinned_by": getattr(owner, "pinned_by", None),
             "pin_seconds": getattr(owner, "seconds", None),
             "pool_fill_seconds": time.perf_counter() - began}
    return GpuBench(device, dtype, shape, streams, layers, lm_head, pool,
                    h2d_limits(pool, device), setup, owner)


def replay_for(traces: list[Path], shape: DecoderShape, batch: int, context: int, steps: int,
               device: torch.device, fraction: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The trace of ``traces`` recorded at the fraction nearest above ``fraction``
    (``selection_trace.trace_for``), its blocks replayed at ``context``
    (``selection_trace.replay_blocks``), thinned to about ``fraction`` of the context."""
    trace = selection_trace.trace_for(fraction, traces)
    masks, provenance = selection_trace.load_trace(trace)
    context_blocks = context // shape.block_size
    per_block = selection_trace.per_block_for(masks, context_blocks, fraction,
                                              provenance["selection_fraction"])
    replay = selection_trace.replay_blocks(
        masks, num_layers=shape.num_layers - shape.dense_layers, num_kv_heads=shape.num_kv_heads,
        num_rows=batch, context_blocks=context_blocks, num_steps=steps, per_block=per_block)
    kept = float((replay >= 0).sum()) / (replay[:, :, :, :, 0].numel()
                                          * shape.blocks_per_row(context))
    return replay.to(device), {
        "trace": trace.name, "kept_fraction": kept, "recorded_on": provenance.get("model"),
        "recorded_context": provenance.get("context_tokens"),
        "recorded_fraction": provenance["selection_fraction"]}


def measure_variant(name: str, setup: KVSetup, decoder: Decoder, x: torch.Tensor, layers, *,
                    mode: str, args: argparse.Namespace, streams: Streams,
                    replay: torch.Tensor | None, width: int, limits: dict[str, float] | None,
                    budget: float | None = None,
                    budget_tokens: int | None = None) -> dict[str, Any]:
    """One variant's steps (``run_steps``) at the largest cache factor that fits;
    what failed or did not fit is said in the result instead.

    Args:
        args: ``warmup``, ``steps``, ``profile``, ``keys`` and (unless given)
            ``budget``.
        width: Blocks per KV head of the widest selection (the cache's size).
        budget, budget_tokens: The computed selection's budget and token cap.
    """
    shape, batch, context = setup.shape, setup.batch, setup.context
    dtype, kv_dtype = x.dtype, setup.pool.dtype  # the model's, the K/V's
    budget = args.budget if budget is None else budget
    factors = CACHE_FACTORS if name == "infinigen" else (1.0,)
    factor = next((f for f in factors if fits(name, shape, batch, context, width, f, dtype,
                                              args.keys, kv_dtype)), None)
    if factor is None:
        needed = device_bytes(name, shape, batch, context, width, factors[-1], dtype, args.keys,
                              kv_dtype)
        return {"skipped": f"does not fit ({needed / 2**30:.1f} GiB beside the weights)"}
    variant = step = None
    try:
        variant = build_variant(name, setup, streams, layers, budget=budget, replay=replay,
                                cache_factor=factor, keys=args.keys,
                                budget_tokens=budget_tokens)
        step = Stepper(decoder, variant, x, mode)
        result = run_steps(step, args.warmup, args.steps, streams)
        if args.profile and streams.cuda:
            result.update(profile_steps(step, 3))
        if name.startswith("infinigen"):
            result["cache_factor"] = factor
        if limits:
            result["pcie_bound_ms"] = result["pcie_bytes_per_step"] / limits["copy_GBps"] / 1e6
        return result
    except Exception as error:  # noqa: BLE001 -- keep going; the results say what failed
        return {"error": repr(error), "traceback": traceback.format_exc()[-2000:]}
    finally:
        variant = step = None
        gc.collect()
        if streams.cuda:
            torch.cuda.empty_cache()


def measure_config(shape, layers, lm_head, pool, device, dtype, *, batch: int, context: int,
                   args: argparse.Namespace, streams: Streams,
                   limits: dict[str, float] | None) -> dict[str, Any]:
    setup = KVSetup(shape, batch, context, pool, device)
    decoder = Decoder(shape, layers, lm_head)
    x = torch.randn(batch, shape.hidden, device=device).to(dtype)
    total = args.warmup + args.steps + 8
    replay, replayed = replay_for(args.traces, shape, batch, context, total, device,
                                  args.budget)
    out: dict[str, Any] = {"batch": batch, "context": context, "replay": replayed,
                           "layer_kv_bytes": shape.layer_kv_bytes(batch, context, dtype),
                           "distinct_pool_layers": setup.num_regions, "variants": {}}
    width = max(replay.shape[-1], product_width(setup, args.budget))
    for mode in args.modes:
        for name in args.variants:
            out["variants"][f"{name} ({mode})"] = measure_variant(
                name, setup, decoder, x, layers, mode=mode, args=args, streams=streams,
                replay=replay, width=width, limits=limits)
    return out
