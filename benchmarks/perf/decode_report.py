# SPDX-License-Identifier: Apache-2.0
"""Markdown tables and plot of the decode-latency sweep (benchmarks/perf/decode_latency.py).

Besides the per-step times and KV bytes it derives, from the result rows alone
(so that ``--render`` of older JSON files works as well):

- ``achieved_gb_s``: KV bytes read per step / step time, against the machine's
  streaming bandwidth measured in the same run (``meta["bandwidth"]``);
- the context-dependent cost: ms/step at the run's longest context minus
  ms/step at its shortest, per config and batch, and dense's over each
  config's (the "at least 2.5x lower than dense" target);
- ``bytes_bound``: what a config's KV bytes allow at the longest context, the
  step whatever its context plus its bytes at dense's rate and at the
  streaming limit, over dense (whether a ratio target is within reach).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import report
from benchmarks.perf import kv_math
from vllm_infinigen import layout

# Dense's context-dependent cost over a sparse config's that the target asks for.
CONTEXT_COST_TARGET = 2.5


def achieved_gb_s(row: Mapping[str, Any], key: str = "decode_ms_per_step") -> float | None:
    """KV bytes read per step / step time in GB/s (1e9 B/s); recorded or from the row."""
    if key == "decode_ms_per_step" and row.get("achieved_gb_s") is not None:
        return row["achieved_gb_s"]
    ms, kv = row.get(key), row.get("kv_bytes_per_step")
    if not ms or kv is None:
        return None
    return kv / (ms / 1000) / 1e9


def context_cost(rows: Sequence[Mapping[str, Any]],
                 key: str = "decode_ms_per_step") -> list[dict[str, Any]]:
    """Per batch and config: ``key`` at the batch's longest context minus at its shortest.

    The contexts are the shortest and longest of the batch's rows (all configs);
    a config without a row at either has no cost (None). ``dense_over_config``
    is dense's cost over the config's (None for dense, without a dense cost, or
    with a single context; ``inf`` when the config's cost is <= 0 and dense's > 0).
    """
    out = []
    for batch in sorted({row["batch"] for row in rows}):
        batch_rows = [row for row in rows if row["batch"] == batch]
        low = min(row["context"] for row in batch_rows)
        high = max(row["context"] for row in batch_rows)
        by = {(row["config"], row["context"]): row for row in batch_rows}
        costs: dict[str, dict[str, Any]] = {}
        for label in dict.fromkeys(row["config"] for row in batch_rows):
            short, long = by.get((label, low)), by.get((label, high))
            short_ms = short.get(key) if short else None
            long_ms = long.get(key) if long else None
            cost = (long_ms - short_ms if high > low and None not in (short_ms, long_ms)
                    else None)
            costs[label] = {
                "batch": batch, "config": label, "short_context": low, "long_context": high,
                "short_ms": short_ms, "long_ms": long_ms, "context_ms": cost,
                "context_ms_per_1k": None if cost is None else cost * 1000 / (high - low),
            }
        dense = costs.get("dense", {}).get("context_ms")
        for label, entry in costs.items():
            cost, ratio = entry["context_ms"], None
            if label != "dense" and dense is not None and cost is not None:
                ratio = dense / cost if cost > 0 else (math.inf if dense > 0 else None)
            out.append({**entry, "dense_over_config": ratio})
    return out


def bytes_bound(rows: Sequence[Mapping[str, Any]],
                streaming_gb_s: float | None = None,
                weight_bytes: int | None = None) -> list[dict[str, Any]]:
    """Per batch, each sparse config's step time if only its KV bytes set it apart.

    At the batch's longest context: dense's step at the shortest context (what a
    step costs whatever its context: weights, Python, sampling) plus the
    config's KV bytes, read at dense's own rate (dense's context-dependent cost
    x ``kv_read_vs_dense``) and, given ``streaming_gb_s``, at the streaming
    limit. ``bound_vs_dense`` above a target puts it out of reach of kernels
    as fast as dense's; ``streaming_vs_dense`` above it, out of reach of any.
    Given ``weight_bytes`` (the weights a step reads, in the run's dtype),
    ``bytes_vs_dense`` = (weights + the config's KV reads) / (weights + dense's):
    the ratio of the bytes alone, whatever the kernels' rates.
    Rows without dense at both contexts, or a single context, give nothing.
    """
    out = []
    for entry in context_cost(rows):
        if entry["config"] != "dense" or entry["context_ms"] is None:
            continue
        batch, long = entry["batch"], entry["long_context"]
        for row in rows:
            if (row["batch"], row["context"]) != (batch, long) or row["config"] == "dense":
                continue
            fraction = row.get("kv_read_vs_dense")
            if fraction is None:
                continue
            bound = entry["short_ms"] + entry["context_ms"] * fraction
            streaming = (None if not streaming_gb_s else
                         entry["short_ms"] + row["kv_bytes_per_step"] / streaming_gb_s / 1e6)
            out.append({
                "batch": batch, "context": long, "config": row["config"],
                "fixed_ms": entry["short_ms"], "dense_context_ms": entry["context_ms"],
                "kv_read_vs_dense": fraction, "bound_ms": bound,
                "bound_vs_dense": bound / entry["long_ms"],
                "streaming_ms": streaming,
                "streaming_vs_dense": None if streaming is None else streaming / entry["long_ms"],
                "measured_vs_dense": row["decode_ms_per_step"] / entry["long_ms"],
                "measured_vs_bound": row["decode_ms_per_step"] / bound,
                "bytes_vs_dense": None if weight_bytes is None else (
                    (weight_bytes + row["kv_bytes_per_step"])
                    / (weight_bytes + row["dense_kv_bytes_per_step"])),
            })
    return out


def _bytes_bound_table(rows: Sequence[Mapping[str, Any]],
                       bandwidth: Mapping[str, Any] | None,
                       weight_bytes: int | None = None) -> str:
    streaming = (bandwidth or {}).get("read_gb_s_1_thread")
    table = [[str(e["batch"]), str(e["context"]), e["config"],
              report.cell(e["bytes_vs_dense"], ".3f"), f"{e['fixed_ms']:.1f}",
              f"{e['dense_context_ms']:.1f}", f"{e['kv_read_vs_dense']:.3f}",
              f"{e['bound_ms']:.1f}", f"{e['bound_vs_dense']:.2f}",
              report.cell(e["streaming_ms"], ".1f"), report.cell(e["streaming_vs_dense"], ".2f"),
              f"{e['measured_vs_dense']:.2f}", f"{e['measured_vs_bound']:.2f}"]
             for e in bytes_bound(rows, streaming, weight_bytes)]
    if not table:
        return ""
    return (
        "## What the bytes allow (longest context of each batch)\n\n"
        "bytes / dense = (weights + the config's KV reads) / (weights + dense's KV "
        "reads), the weights in the run's dtype: a ratio target below it is out of reach "
        "whatever the kernels (every byte read as fast as dense reads its own, nothing "
        "computed beyond). "
        "fixed = dense's step at the shortest context (what a step costs whatever its "
        "context: weights, Python, sampling); bound = fixed + the config's KV reads at "
        "dense's rate (dense's context ms x reads vs dense); at streaming = fixed + the "
        "config's KV bytes at the one-thread streaming read measured in this run. A "
        "ratio target below `bound / dense` needs kernels faster than dense's; below "
        "`at streaming / dense`, it is out of reach on this model.\n\n"
        + report.markdown_table(
            ["batch", "context", "config", "bytes / dense", "fixed ms", "dense context ms",
             "reads vs dense",
             "bound ms", "bound / dense", "at streaming ms", "at streaming / dense",
             "measured / dense", "measured / bound"], table))


def _paired_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows of a ``--paired`` run: each config's round medians and the paired
    speed-up (median over rounds of dense's round median over the config's)."""
    if not any("round_ms" in row for row in rows):
        return ""
    table = []
    for row in rows:
        rounds = row.get("round_ms") or []
        speedup, span = row.get("paired_speedup"), row.get("paired_speedup_range")
        table.append([
            str(row["context"]), str(row["batch"]), row["config"],
            " / ".join(f"{ms:.1f}" for ms in rounds),
            "" if speedup is None else f"{speedup:.2f} ({span[0]:.2f}-{span[1]:.2f})",
            "" if speedup is None else f"{1 / speedup:.2f}",
        ])
    return (
        "## Paired rounds (engines side by side, windows in turn)\n\n"
        "Each round runs one window per config, one after the other, so that the "
        "machine's drift hits them alike; paired speed-up = the median over rounds of "
        "dense's round median / the config's (range over rounds); ÷ dense = its "
        "inverse.\n\n" + report.markdown_table(
            ["context", "batch", "config", "round medians, ms", "paired speed-up",
             "÷ dense"], table))


def _mib(value: float | None) -> str:
    return report.cell(None if value is None else value / 2**20, ".2f")


def _ratio(value: float | None) -> str:
    if value is None:
        return ""
    return "no growth" if math.isinf(value) else f"{value:.2f}"


def _kv_cache_text(kv_cache_dtype: str) -> str:
    """What the notes say of ``--kv-cache-dtype`` (nothing for the model's dtype). The
    engines run vLLM's own FP8 attention: vLLM refuses FP8 on a host without it, and
    these benchmarks use no double."""
    if kv_cache_dtype == "auto":
        return ""
    return (f", K/V in {kv_cache_dtype} (`--kv-cache-dtype {kv_cache_dtype}`: vLLM's own "
            "CPU FP8 attention; the speculation keys in the model's dtype)")


def bandwidth_text(bandwidth: Mapping[str, Any] | None) -> str:
    """The streaming limit of the run, or "n/a" (results without the measurement)."""
    if not bandwidth:
        return "n/a (not measured in this run)"
    threads = bandwidth.get("threads", "all")
    return (f"read {bandwidth['read_gb_s_1_thread']:.1f} GB/s on 1 thread, "
            f"{bandwidth['read_gb_s_all_threads']:.1f} GB/s on {threads} threads; copy "
            f"{bandwidth['copy_gb_s_1_thread']:.1f} / {bandwidth['copy_gb_s_all_threads']:.1f}"
            f" GB/s (read + write; `tensor.sum()` / `copy_` over "
            f"{bandwidth.get('mib', '?')} MiB float32, best of {bandwidth.get('reps', '?')})")


def _context_cost_table(rows: Sequence[Mapping[str, Any]]) -> str:
    median = context_cost(rows)
    fastest = {(e["batch"], e["config"]): e for e in context_cost(rows, "decode_ms_per_step_min")}
    table = []
    for entry in median:
        low = fastest[(entry["batch"], entry["config"])]
        table.append([
            str(entry["batch"]), entry["config"],
            f"{entry['short_context']} -> {entry['long_context']}",
            report.cell(entry["short_ms"], ".1f"), report.cell(entry["long_ms"], ".1f"),
            report.cell(entry["context_ms"], ".1f"), report.cell(entry["context_ms_per_1k"], ".2f"),
            _ratio(entry["dense_over_config"]), report.cell(low["context_ms"], ".1f"),
            _ratio(low["dense_over_config"]),
        ])
    return (
        "## Context-dependent cost (ms/step at the longest context - at the shortest)\n\n"
        f"dense / config > 1: the config's step time grows more slowly with context than "
        f"dense's; the target is >= {CONTEXT_COST_TARGET}. Fastest: the same from each "
        "window's fastest step (less disturbed by other jobs).\n\n" + report.markdown_table(
            ["batch", "config", "contexts", "ms short", "ms long", "context ms",
             "ms per +1K tokens", "dense / config", "context ms (fastest)",
             "dense / config (fastest)"], table))


def sections(rows: list[dict], args, shape: kv_math.ModelShape,
             bandwidth: Mapping[str, Any] | None = None,
             weight_bytes: int | None = None) -> list[str]:
    """Markdown: timing tables, achieved GB/s, context-dependent cost, bytes table, notes."""
    labels = list(dict.fromkeys(row["config"] for row in rows))
    keys = sorted({(row["context"], row["batch"]) for row in rows}, key=lambda k: (k[1], k[0]))
    by = {(row["config"], row["context"], row["batch"]): row for row in rows}
    timing = []
    for context, batch in keys:
        cells = [str(context), str(batch)]
        dense = by.get(("dense", context, batch))
        for label in labels:
            row = by.get((label, context, batch))
            cells.append(report.cell(row and row["decode_ms_per_step"], ".1f"))
        others = [by[(label, context, batch)].get("other_cores_busy") for label in labels
                  if (label, context, batch) in by]
        others = [o for o in others if o is not None]
        for label in labels:
            row = by.get((label, context, batch))
            if label != "dense" and dense and row:
                cells.append(f"{dense['decode_ms_per_step'] / row['decode_ms_per_step']:.2f}")
            elif label != "dense":
                cells.append("")
        cells.append(report.cell(max(others) if others else None, ".2f"))
        timing.append(cells)
    speed_headers = [f"speed-up {label}" for label in labels if label != "dense"]
    minimum = [[str(context), str(batch)] + [
        report.cell((by.get((label, context, batch)) or {}).get("decode_ms_per_step_min"), ".1f")
        for label in labels] for context, batch in keys]
    achieved = [[str(context), str(batch)] + [
        report.cell(achieved_gb_s(by[(label, context, batch)]), ".2f")
        if (label, context, batch) in by else "" for label in labels]
        for context, batch in keys]
    bytes_rows = []
    for context, batch in keys:
        for label in labels:
            row = by.get((label, context, batch))
            if row is None or label == "dense":
                continue
            bytes_rows.append([
                str(context), str(batch), label, _mib(row["dense_kv_bytes_per_step"]),
                _mib(row["kv_bytes_per_step"]), f"{row['kv_read_vs_dense']:.3f}",
                f"{row['ideal_kv_read_vs_dense']:.3f}", _mib(row.get("metadata_bytes_per_step")),
                _mib(row.get("pool_bytes_per_step")), _mib(row.get("ideal_pool_bytes_per_step")),
                report.cell(row.get("selected_fraction"), ".3f"),
            ])
    sparse = shape.layers - args.dense_layers
    rank = layout.partial_rank(shape.head_dim, args.partial_ratio)
    int_fraction = kv_math.speculation_key_bytes(shape, args.partial_ratio, "int") / (
        2 * shape.head_dim * shape.dtype_bytes)
    min_context = getattr(args, "min_context", None)
    weights = ("" if weight_bytes is None else
               f"; weights {weight_bytes / 2**20:.0f} MiB (read every step, not in the KV "
               "bytes)")
    notes = (
        "## Notes\n\n"
        f"- Model: {shape.layers} layers ({args.dense_layers} dense, {sparse} sparse), "
        f"{shape.kv_heads} KV heads x {shape.head_dim}, {getattr(args, 'dtype', 'float32')}"
        f"{_kv_cache_text(getattr(args, 'kv_cache_dtype', 'auto'))}{weights}; budget "
        f"{args.budget}; speculation keys: the engine default ({kv_math.DEFAULT_KEYS}) "
        f"unless the config names its keys (int-keys, partial-keys); partial: ratio {args.partial_ratio}, "
        f"{rank} of {shape.head_dim} key channels, {rank / (2 * shape.head_dim):.4f} of K+V "
        f"against the nominal r/2 = {args.partial_ratio / 2}; int: every channel, "
        f"{int_fraction:.4f} of K+V with the scales; min_context "
        f"{'engine default' if min_context is None else min_context}.\n"
        f"- Streaming memory bandwidth (the physical limit): {bandwidth_text(bandwidth)}.\n"
        "- ms/step: median over the timed steps of the whole batch (each request gets a "
        "token per step, so this is the TPOT); speed-up = dense ms / config ms (> 1: "
        "faster than dense). others' cores: CPU other processes used during the kept "
        "window (of 2 cores; the largest over the row's configs): rows well above 0 "
        "were measured while other jobs ran.\n"
        "- KV read: dense layers' K/V + selection metadata + selected K/V the "
        "attention reads from the pool (`vllm:infinigen_selected_kv_bytes_total`), per step, over what "
        "dense attention reads in every layer; ideal = (dense layers + sparse layers x "
        "(metadata + budget)) / layers, metadata being the int keys' bytes or r/2 (partial "
        "keys) for InfiniGen, 1/16 (page "
        "min/max) for Quest, one float32 score per token and KV head for H2O, 0 for "
        "StreamingLLM. InfiniGen's alpha rule may select fewer tokens than the budget "
        "(selected < budget).\n"
        "- InfiniGen's windows: the engine's alpha (the product's default is off: the "
        "budget binds, so every row keeps budget x context whatever the weights; results "
        "files before ebff67a had alpha 5 there, which keeps ~1 % of a random model's "
        "context) and, labelled `alpha A`, the alpha of `--alphas` (5: the paper's count; "
        "10000: every token in reach, so the budget binds).\n"
        "- The policies of one window share its prefill and decode successive tokens "
        "of the same requests (see the script's docstring).\n"
    )
    return [
        "## Decode ms per step (batch TPOT)\n\n" + report.markdown_table(
            ["context", "batch", *labels, *speed_headers, "others' cores (max)"], timing),
        *[section for section in [_paired_table(rows)] if section],
        "## Decode ms per step, fastest step of each window\n\n"
        "Other jobs share this machine's 2 cores; the fastest step is the least "
        "disturbed one.\n\n" + report.markdown_table(["context", "batch", *labels], minimum),
        "## Achieved GB/s (KV bytes read / step time)\n\n"
        f"Streaming limit of this machine: {bandwidth_text(bandwidth)}. KV bytes only "
        "(the weights and activations a step also reads are not counted).\n\n"
        + report.markdown_table(["context", "batch", *labels], achieved),
        _context_cost_table(rows),
        *[section for section in [_bytes_bound_table(rows, bandwidth, weight_bytes)]
          if section],
        "## KV bytes read per decode step (MiB, whole batch)\n\n" + report.markdown_table(
            ["context", "batch", "config", "dense reads", "reads", "vs dense", "ideal",
             "metadata", "pool->attention", "ideal pool->attention", "selected"],
            bytes_rows),
        notes,
    ]


def plot(rows: list[dict], path: Path, model_name: str) -> Path | None:
    """ms/step and KV read fraction against context, one panel per batch size."""
    panels = []
    batches = sorted({row["batch"] for row in rows})
    for batch in batches:
        panel = report.Panel(title=f"decode step, batch {batch}", ylabel="ms per step",
                             xlabel="context (tokens)")
        for row in rows:
            if row["batch"] == batch:
                panel.series.setdefault(row["config"], []).append(
                    (row["context"], row["decode_ms_per_step"]))
        panels.append(panel)
    kv = report.Panel(title=f"KV bytes read / ideal (batch {batches[-1]})",
                      ylabel="measured / ideal", xlabel="context (tokens)")
    for row in rows:
        if row["batch"] == batches[-1] and row["policy"]:
            kv.series.setdefault(row["config"], []).append(
                (row["context"], row["kv_read_vs_dense"] / row["ideal_kv_read_vs_dense"]))
    if kv.series:
        kv.references["ideal (r/2 + budget; baselines: metadata + budget)"] = 1.0
        panels.append(kv)
    return report.try_plot(path, panels, suptitle=f"Decode step time, {model_name} (CPU)")
