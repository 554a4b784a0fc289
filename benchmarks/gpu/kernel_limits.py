# SPDX-License-Identifier: Apache-2.0
"""Each CUDA kernel of the product against the memory limits, measured in the same run.

At one context (default 32K) and the 8B model's attention shapes (8 KV heads,
4 query heads each, head_dim 128, 16-token blocks), per kernel: the bytes it
must read, its time (median; on CUDA, events over replays of a CUDA graph
of 10 calls, per call: the device alone, see ``timed``) and GB/s, beside a
streaming read of device memory (a reduction over 1 GiB) and one pinned host-to-device copy:

    attend_units   decode attention over a whole context (select-all), and
                   torch SDPA over the same K/V (what dense attention costs)
    int_scores     the int keys of a whole context scored, block maxima too;
                   on CUDA at 8 rows too, and the forms it replaced at 1 and
                   8 rows: float32 channel sums (``triton_scoring``'s
                   "sums") and the per-token kernel (``baseline_kernels.py``)
    select         the block rule over the block scores (no sort); on CUDA
                   at 8 rows too, and the chunked search at 1 and 8 rows
    place          the cache placement of one step's selection
    gather         a selection's units from the pinned pool
    prompt         a prompt of the context's length: the write-through, the
                   staging from the pool and ``attend_prompt_units``, against
                   SDPA's causal flash attention on the same rows (one
                   layer's attention part of the time to first token); also
                   ``attend_prompt_units`` alone over device units (a prompt
                   the block cache holds) and the Triton prompt kernel alone

``python -m benchmarks.gpu.decode_step --kernels`` runs it (``--self-test``
runs it at tiny sizes on the CPU, to check the code, not to time it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vllm_infinigen.layout import KEY_GROUP, int_key_bits
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache


class Timing(float):
    """Median ms of one call, and how it was taken (``method``)."""

    method: str


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 7,
          graph_calls: int = 10) -> Timing:
    """Median ms of ``fn`` after one warm-up call.

    On CUDA, ``graph_calls`` calls are captured in one CUDA graph and each
    replay is timed by CUDA events, divided by the calls: the device's time
    alone. Events around a single eager call would also time the host's
    launch (a Triton launch from Python takes tens of microseconds, longer
    than a decode-sized kernel runs), and so understate a short kernel's
    GB/s: the rows before 2026-11-27 were taken that way. ``graph_calls=0``
    times eager calls (for work a graph cannot hold, such as host syncs), and
    a capture that fails falls back to it; ``method`` says which, and the
    table prints it. On the CPU: wall clock."""
    times: list[float] = []
    method = "eager"
    if device.type == "cuda":
        fn()  # compile and allocate outside any capture
        torch.cuda.synchronize(device)
        graph, failure = _captured(fn, graph_calls, device) if graph_calls else (None, "")
        method = "graph" if graph is not None else (
            f"eager, host launch included ({failure})" if failure else "eager")
        for index in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay() if graph is not None else fn()
            end.record()
            end.synchronize()
            if index:
                times.append(start.elapsed_time(end) / (graph_calls if graph is not None else 1))
    else:
        for index in range(repeats + 1):
            began = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - began) * 1e3
            if index:
                times.append(elapsed)
    result = Timing(statistics.median(times))
    result.method = method
    return result


def _captured(fn: Callable[[], object], calls: int, device: torch.device):
    """(a CUDA graph of ``calls`` calls of ``fn``, "") or (None, why it failed)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize(device)
    except Exception as error:  # the row then says it timed eager calls, and why
        torch.cuda.synchronize(device)
        return None, f"{type(error).__name__}: {str(error)[:60]}"
    return graph, ""


def _row(name: str, num_bytes: float, ms: float, **extra: Any) -> dict[str, Any]:
    timing = {"timing": ms.method} if isinstance(ms, Timing) else {}
    return {"kernel": name, "MB": num_bytes / 1e6, "ms": float(ms),
            "GBps": num_bytes / ms / 1e6 if ms > 0 else None, **timing, **extra}


def streaming_read_ms(device: torch.device, num_bytes: int = 1 << 30,
                      generator: torch.Generator | None = None):
    """The time of a streaming read of ``num_bytes`` of device memory (a
    reduction of bf16 values); the memory is freed before it returns."""
    stream = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_(
        generator=generator)
    ms = timed(lambda: stream.sum(dtype=torch.float32), device)
    stream.resize_(0)  # its memory back before the caller's tensors
    return ms


def kernel_limits(device: torch.device, dtype: torch.dtype, *, context: int = 32768,
                  kv_heads: int = 8, group: int = 4, head_size: int = 128, block: int = 16,
                  budget: float = 0.2, stream_bytes: int = 1 << 30,
                  pinned_copy_GBps: float | None = None) -> dict[str, Any]:
    """The table of ``kernel_limits`` at one context (see the module docstring)."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = context // block + 1
    scale = head_size ** -0.5
    rows: list[dict[str, Any]] = [_row("streaming read (reduction)", stream_bytes,
                                       streaming_read_ms(device, stream_bytes, gen))]
    # K|V units of one request, every block of every head, in the pool's order
    units = torch.randn(blocks * kv_heads + 1, block, 2 * head_size, device=device,
                        generator=gen).to(dtype)
    table = (torch.arange(blocks, device=device)[None, :] * kv_heads
             + torch.arange(kv_heads, device=device)[:, None])  # [H, blocks]
    query = torch.randn(1, kv_heads * group, head_size, device=device, generator=gen).to(dtype)
    kv_bytes = blocks * kv_heads * units[0].numel() * units.element_size()
    seq_lens = torch.full((kv_heads,), context + 1, dtype=torch.int32, device=device)
    rows.append(_row("attend_units (select-all)", kv_bytes, timed(
        lambda: kernels.attend_units(query, units, table, seq_lens, num_kv_heads=kv_heads,
                                     scale=scale), device)))
    dense = units[:-1].view(blocks, kv_heads, block, 2 * head_size).permute(1, 0, 2, 3)
    dense = dense.reshape(1, kv_heads, blocks * block, 2 * head_size)
    keys, values = dense[..., :head_size].contiguous(), dense[..., head_size:].contiguous()
    rows.append(_row("SDPA, same K/V", kv_bytes, timed(
        lambda: F.scaled_dot_product_attention(query.view(1, -1, 1, head_size), keys, values,
                                               enable_gqa=True, scale=scale), device)))
    # int keys of the context
    bits = int_key_bits(dtype.itemsize)
    groups = block // KEY_GROUP
    codes = torch.randint(0, 256, (blocks, kv_heads, groups, head_size, 2 * bits),
                          dtype=torch.uint8, device=device, generator=gen)
    scales = (torch.rand((blocks, kv_heads, groups, head_size), device=device,
                         generator=gen) / 16).half()
    block_table = torch.arange(blocks, dtype=torch.int32, device=device)[None, :]
    speculation = query.view(1, kv_heads, group, head_size)
    context_lens = torch.tensor([context], device=device)
    key_bytes = codes.numel() + scales.numel() * 2
    rows.append(_row("int_scores", key_bytes, timed(
        lambda: kernels.int_scores(speculation, codes, scales, block_table, context_lens,
                                   scale=scale), device)))
    if device.type == "cuda":
        rows.extend(_int_scores_rows(codes, scales, speculation, context, block, scale, gen))
    tokens, block_scores = kernels.int_scores(speculation, codes, scales, block_table,
                                              context_lens, scale=scale)
    settings = kernels.settings_tensor(5.0, budget, 0, device)
    counts = kernels.alpha_counts(tokens, block_scores, context_lens, settings,
                                  block_size=block)
    width = kernels.static_width(blocks, block, budget=budget, min_context=0,
                                 sink_blocks=1, recent_blocks=1)
    rows.append(_row("alpha_counts", tokens.numel() * 4, timed(
        lambda: kernels.alpha_counts(tokens, block_scores, context_lens, settings,
                                     block_size=block), device)))
    counts = torch.full_like(counts, context)  # the budget binds: the widest selection
    rows.append(_row("select", block_scores.numel() * 4, timed(
        lambda: kernels.select(block_scores, counts, context_lens, block_table, settings,
                               block_size=block, width=width, sink_blocks=1,
                               recent_blocks=1), device), width=width))
    if device.type == "cuda":
        rows.extend(_select_rows(block_scores, counts, context_lens, settings, width, block))
    _, physical, selected = kernels.select(block_scores, counts, context_lens, block_table,
                                           settings, block_size=block, width=width,
                                           sink_blocks=1, recent_blocks=1)
    cache = DeviceBlockCache(1, kv_heads, 2 * width, blocks, device)
    # The same selection each call: hits after the first, no victims searched
    # (``kernel_candidates``' lookup rows time a step with misses on a worn cache).
    rows.append(_row("place (lookup, LRU; all hits)", cache.num_units * 8, timed(
        lambda: cache.place(0, physical, selected, context_lens), device)))
    rows.append(_prompt_row(device, dtype, context, kv_heads, group, head_size, block, gen))
    return {"context": context, "dtype": str(dtype), "pinned_copy_GBps": pinned_copy_GBps,
            "streaming_read_GBps": rows[0]["GBps"], "rows": rows}


def _int_scores_rows(codes: torch.Tensor, scales: torch.Tensor, speculation: torch.Tensor,
                     context: int, block: int, scale: float,
                     gen: torch.Generator) -> list[dict[str, Any]]:
    """The int-key scoring at 8 rows (each its own context's keys), and the kernels
    it replaced at 1 and 8 rows: the float32 channel sums (on CUDA) and the
    per-token kernel (``baseline_kernels.int_scores_per_token``)."""
    from benchmarks.gpu.baseline_kernels import int_scores_per_token

    device, out = codes.device, []
    blocks = codes.shape[0]
    for batch in (1, 8):
        many_codes = codes.repeat(batch, 1, 1, 1, 1)
        many_scales = scales.repeat(batch, 1, 1, 1)
        table = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, -1)
        query = torch.randn((batch,) + tuple(speculation.shape[1:]), device=device,
                            generator=gen).to(speculation.dtype)
        lens = torch.full((batch,), context, device=device)
        tokens = torch.empty((batch, codes.shape[1], blocks * block), dtype=torch.float32,
                             device=device)
        block_scores = torch.empty((batch, codes.shape[1], blocks), dtype=torch.float32,
                                   device=device)
        key_bytes = many_codes.numel() + many_scales.numel() * 2
        if batch > 1:
            out.append(_row(f"int_scores x{batch}", key_bytes, timed(
                lambda: kernels.int_scores(query, many_codes, many_scales, table, lens,
                                           scale=scale), device)))
        if device.type == "cuda":  # the exact form (channel sums), against the default
            from vllm_infinigen.platforms.cuda.kernels import triton_scoring

            out.append(_row(f"int_scores x{batch}, channel sums (float32, the form before)",
                            key_bytes, timed(
                lambda: triton_scoring.int_scores(query, many_codes, many_scales, table, lens,
                                                  tokens, block_scores, scale=scale,
                                                  method="sums"), device)))
        out.append(_row(f"int_scores x{batch}, per token (the kernel before)", key_bytes, timed(
            lambda: int_scores_per_token(query, many_codes, many_scales, table, lens, tokens,
                                         block_scores, scale=scale), device)))
    return out


def _select_rows(block_scores: torch.Tensor, counts: torch.Tensor, context_lens: torch.Tensor,
                 settings: torch.Tensor, width: int, block: int) -> list[dict[str, Any]]:
    """The block choice at 8 rows, and the chunked threshold search it replaced (each
    pass re-reading the scores) at 1 and 8 rows."""
    from vllm_infinigen.platforms.cuda.kernels import triton_select

    out, device = [], block_scores.device
    for batch in (1, 8):
        scores = block_scores.repeat(batch, 1, 1)
        many_counts, lens = counts.repeat(batch), context_lens.repeat(batch)
        table = torch.arange(batch * scores.shape[-1], dtype=torch.int32,
                             device=device).view(batch, -1)
        got = (torch.empty(scores.shape[:2] + (width,), dtype=torch.int64, device=device),
               torch.empty(scores.shape[:2] + (width,), dtype=torch.int64, device=device),
               torch.empty(scores.shape[0] * scores.shape[1], dtype=torch.int32, device=device))
        forms = ((f"select x{batch}", triton_select.RESIDENT_BLOCKS),
                 (f"select x{batch}, chunked (the kernel before)", 0))
        for name, resident in forms[batch == 1:]:
            out.append(_row(name, scores.numel() * 4, timed(
                lambda resident=resident: triton_select.select_blocks(
                    scores, many_counts, lens, table, settings, *got, block_size=block,
                    sink_blocks=1, recent_blocks=1, resident=resident), device), width=width))
    return out


def _prompt_row(device, dtype, context, kv_heads, group, head_size, block, gen):
    """A prompt of ``context`` rows in one chunk: the product's attention part
    (write-through to a host pool, staging back, the flash kernel) against SDPA's
    causal flash attention on the same K/V."""
    from vllm_infinigen.platforms.cuda.host_pool import allocate_host_pool

    blocks = -(-context // block)
    query = torch.randn(context, kv_heads * group, head_size, device=device,
                        generator=gen).to(dtype)
    key = torch.randn(context, kv_heads, head_size, device=device, generator=gen).to(dtype)
    value = torch.randn_like(key)
    slots = torch.arange(context, device=device)
    owner = None
    if device.type == "cuda":
        owner = allocate_host_pool(blocks, kv_heads, block, head_size, dtype)
        pool = owner.tensor
    else:
        pool = torch.zeros((blocks, kv_heads, block, 2 * head_size), dtype=dtype)
    staged = torch.empty(blocks * kv_heads + 1, block, 2 * head_size, dtype=dtype, device=device)
    units = torch.arange(blocks * kv_heads, device=device)
    count = torch.tensor([blocks * kv_heads], device=device)
    table = (torch.arange(blocks, device=device)[None, :] * kv_heads
             + torch.arange(kv_heads, device=device)[:, None])

    def product():
        kernels.write_tokens(pool, key, value, slots)
        kernels.gather_units(pool, staged, units, units, count)
        kernels.attend_prompt_units(query, staged, table, first=0, seq_len=context,
                                    scale=head_size ** -0.5)

    product_ms = timed(product, device, repeats=3, graph_calls=0)  # host copies, ~30 ms
    cached_ms = timed(lambda: kernels.attend_prompt_units(
        query, staged, table, first=0, seq_len=context, scale=head_size ** -0.5), device,
        repeats=3, graph_calls=0)
    triton_ms = None
    if device.type == "cuda":
        from vllm_infinigen.platforms.cuda.kernels import triton_prompt

        out = torch.empty_like(query)
        triton_ms = timed(lambda: triton_prompt.attend_prompt(
            query, staged, table, out, first=0, seq_len=context, scale=head_size ** -0.5),
            device, repeats=3, graph_calls=0)
    q = query.view(1, context, -1, head_size).transpose(1, 2)
    k, v = key.view(1, context, kv_heads, head_size).transpose(1, 2), None
    v = value.view(1, context, kv_heads, head_size).transpose(1, 2)
    dense_ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True), device, repeats=3,
                     graph_calls=0)
    if owner is not None:
        owner.close()
    kv_bytes = 2 * context * kv_heads * head_size * key.element_size()
    return _row("prompt (write-through, staging, attend_prompt_units)", 3 * kv_bytes,
                product_ms, sdpa_causal_ms=dense_ms, ratio_to_sdpa=product_ms / dense_ms,
                over_device_units_ms=cached_ms, triton_kernel_ms=triton_ms)


def markdown(limits: dict[str, Any]) -> str:
    """The table, each kernel's GB/s also as a fraction of the streaming read
    (the note says how each row was timed: ``timed``)."""
    stream = limits["streaming_read_GBps"] or 0
    lines = [f"Kernels at {limits['context']} tokens ({limits['dtype']}), against a streaming "
             f"read of {stream:.0f} GB/s and a pinned copy of "
             f"{limits['pinned_copy_GBps'] or float('nan'):.1f} GB/s measured in this run:",
             "", "| kernel | MB read | ms | GB/s | of the streaming read | note |",
             "|---|---:|---:|---:|---:|---|"]
    for row in limits["rows"]:
        share = row["GBps"] / stream if row["GBps"] and stream else None
        note = (f"SDPA causal {row['sdpa_causal_ms']:.2f} ms: {row['ratio_to_sdpa']:.2f}x; "
                f"over device units {float(row['over_device_units_ms']):.2f} ms"
                + (f"; the Triton kernel {float(row['triton_kernel_ms']):.2f} ms"
                   if row.get("triton_kernel_ms") is not None else "")
                if "ratio_to_sdpa" in row else (f"width {row['width']}" if "width" in row
                                                else ""))
        if row.get("timing"):
            note = f"{note}; {row['timing']}" if note else row["timing"]
        lines.append(f"| {row['kernel']} | {row['MB']:.1f} | {row['ms']:.3f} | "
                     f"{row['GBps'] or 0:.1f} | {share if share is not None else 0:.2f} | "
                     f"{note} |")
    return "\n".join(lines)
