# SPDX-License-Identifier: Apache-2.0
"""The GPU throughput benchmark's report (``throughput.py``): its table, the
targets of issues 44 and 46 (FP8 K/V) against the measured points, and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu.report import streams_text
from benchmarks.harness.report import metadata_markdown

# Issue 44's targets: InfiniGen's best tokens/s against dense at its largest batch
# (128K with a 4,096-token cap, 32K with any selection), and each 128K step within
# 1.3x of its floor.
TARGET_SPEEDUP = {131072: 3.0, 32768: 1.5}
TARGET_CAP, TARGET_FLOOR_RATIO = 4096, 1.3
TITLE = "Tokens per second on one GPU: dense, full offload, InfiniGen"
# Issue 46's: with FP8 K/V, InfiniGen (cap 4096) against dense with FP8 K/V.
FP8_TARGET_SPEEDUP = 2.0
DENSE = ("dense", "dense_units")  # dense's point: SDPA, or over FP8 K/V the Triton kernel


def kv_of(context: dict[str, Any]) -> str:
    """A context entry's --kv-cache-dtype (results before FP8 have none: auto)."""
    return context.get("kv_cache_dtype", "auto")


def _key(context: dict[str, Any]) -> str:
    kv = kv_of(context)
    return str(context["context"]) + ("" if kv == "auto" else f" {kv}")


def point_line(point: dict[str, Any]) -> str:
    """One line per measured point, for the log."""
    what = f"{point['variant']} ({point['mode']}) x{point['batch']} at {point['context']}"
    if point.get("kv_dtype"):
        what += f", K/V {point['kv_dtype']}"
    if point.get("selection"):
        what += f", {point['selection']}"
    if "tokens_per_s" in point:
        return (f"{what}: {point['ms_per_step']:.2f} ms/step, "
                f"{point['tokens_per_s']:.1f} tokens/s")
    return f"{what}: {point.get('skipped') or point.get('error')}"


def _dense(context: dict[str, Any]) -> dict[str, Any] | None:
    return next((p for p in context["points"]
                 if p["variant"] in DENSE and "tokens_per_s" in p), None)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """At each context (and K/V dtype, keyed "131072 fp8" beside "131072"):
    dense's largest batch and tokens/s, InfiniGen's best tokens/s per
    selection and over dense, its largest measured batch."""
    out = {}
    for context in results["contexts"]:
        dense = _dense(context)
        sparse = [p for p in context["points"]
                  if p["variant"] == "infinigen" and "tokens_per_s" in p]
        best: dict[str, dict[str, Any]] = {}
        for point in sparse:
            if point["tokens_per_s"] > best.get(point["selection"], {}).get("tokens_per_s", 0):
                best[point["selection"]] = point
        row: dict[str, Any] = {
            "dense_largest_batch": context["dense_largest_batch"],
            "dense_tokens_per_s": dense["tokens_per_s"] if dense else None,
            "infinigen_largest_batch": max((p["batch"] for p in sparse), default=0),
            "best": {label: {"batch": p["batch"], "tokens_per_s": p["tokens_per_s"],
                             "over_dense": (p["tokens_per_s"] / dense["tokens_per_s"]
                                            if dense else None),
                             "pcie_bytes_per_token": p.get("pcie_bytes_per_token")}
                     for label, p in best.items()}}
        if context["dense_largest_batch"]:
            row["batch_ratio"] = row["infinigen_largest_batch"] / context["dense_largest_batch"]
        out[_key(context)] = row
    return out


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _table(context: dict[str, Any]) -> list[str]:
    dense = _dense(context)
    kv = kv_of(context)
    lines = [f"### Context {context['context']}, --kv-cache-dtype {kv}: dense fits "
             f"{context['dense_largest_batch']} request(s) beside the weights "
             f"({context['free_bytes'] / 2**30:.1f} GiB free)", ""]
    if dense is not None and dense["variant"] == "dense_units":
        lines += ["Dense over FP8 K/V is `dense_units`: InfiniGen's Triton decode attention "
                  "over every device-resident block (torch's SDPA takes no FP8 K/V; a kernel "
                  "of InfiniGen's own family, not vLLM's).", ""]
    lines += ["| variant | selection | batch | ms/step | tokens/s | x dense's largest batch "
              "| hit rate | PCIe MB/token | kept (replayed) | host GiB needed | bytes bound "
              "ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in context["points"]:
        head = f"| {p['variant']} ({p['mode']}) | {p.get('selection') or '-'} | {p['batch']} |"
        host = _fmt(p.get("host_GiB_needed"), ".3g")
        bound = _fmt(p.get("bytes_bound_ms"))
        if "tokens_per_s" not in p:
            lines.append(f"{head} {p.get('skipped') or p.get('error')} | | | | | | {host} | "
                         f"{bound} |")
            continue
        over = p["tokens_per_s"] / dense["tokens_per_s"] if dense else None
        kept = (f"{p['selected_fraction']:.3f} ({p['replay']['kept_fraction']:.3f})"
                if "replay" in p else "-")
        lines.append(f"{head} {p['ms_per_step']:.2f} | {p['tokens_per_s']:.1f} | "
                     f"{_fmt(over)}x | {_fmt(p.get('hit_rate'))} | "
                     f"{p['pcie_bytes_per_token'] / 1e6:.1f} | {kept} | {host} | {bound} |")
    lines += [line for p in context["points"] for line in profile_lines(p)]
    replayed = {p["selection"]: p["replay"] for p in context["points"] if "replay" in p}
    if replayed:
        lines += ["", "Selections replayed (`benchmarks/gpu/traces/`, the trace recorded at "
                  "the smallest fraction at least the point's): " + "; ".join(
                      f"{selection}: `{r['trace']}`"
                      + (f" ({r['recorded_on']} at {r['recorded_context']} tokens, "
                         f"{r['recorded_fraction']:.3f} selected)"
                         if r.get("recorded_context") else "")
                      for selection, r in replayed.items()) + "."]
    return lines


def profile_lines(point: dict[str, Any]) -> list[str]:
    """A profiled point's streams (busy / idle ms per step, the gather's marked)
    and its kernels' device time per step."""
    if "streams" not in point:
        return []
    streams = streams_text(point["streams"])
    kernels = ", ".join(f"{k['kernel']} {k['ms_per_step']:.2f} ms"
                        for k in point.get("top_kernels", []))
    return ["", f"Profile of {point['variant']} ({point['mode']}) {point.get('selection')} x "
            f"{point['batch']}, per step: {streams}. Kernels (device time, streams "
            f"summed): {kernels}."]


def _speedup_line(context: int, row: dict[str, Any]) -> str:
    target = TARGET_SPEEDUP.get(context)
    if context == max(TARGET_SPEEDUP):
        what, best = f"cap {TARGET_CAP}", row["best"].get(f"cap {TARGET_CAP}")
    else:
        what = "any selection"
        best = max(row["best"].values(), key=lambda b: b["tokens_per_s"], default=None)
    speedup = best["over_dense"] if best else None
    verdict = ("not measured (no dense point or no such InfiniGen point)" if speedup is None
               else "no target at this context" if target is None
               else "met" if speedup >= target else "missed")
    return (f"- {context} tokens, {what}: best InfiniGen tokens/s over dense at its largest "
            f"batch: {_fmt(speedup)}x" + (f" at batch {best['batch']}" if best else "")
            + (f" (target >= {target:g}x)" if target else "") + f"; {verdict}")


def _floor_lines(context: dict[str, Any]) -> list[str]:
    """Each InfiniGen point's step over the larger of its PCIe floor (its bytes over the
    pinned copy's measured rate) and its HBM floor (``bytes_bound_ms``: its device bytes
    at the streaming read; results before 2026-11-30 have none, the PCIe floor alone)."""
    points = [p for p in context["points"]
              if p["variant"] == "infinigen" and "tokens_per_s" in p and p.get("pcie_bound_ms")]
    if not points:
        return []
    with_hbm = all(p.get("bytes_bound_ms") for p in points)

    def floor(p: dict[str, Any]) -> tuple[float, str]:
        hbm = p.get("bytes_bound_ms") or 0.0
        return (hbm, "HBM") if hbm > p["pcie_bound_ms"] else (p["pcie_bound_ms"], "PCIe")

    over = [(p, p["ms_per_step"] / ms, ms, kind) for p in points for ms, kind in [floor(p)]]
    ratios = "; ".join(f"{p.get('selection')} x {p['batch']} {ratio:.2f}x "
                       f"({p['ms_per_step']:.1f} / {ms:.1f} ms" + (f" {kind})" if with_hbm else ")")
                       for p, ratio, ms, kind in over)
    met = max(ratio for _, ratio, _, _ in over) <= TARGET_FLOOR_RATIO
    which = ("the larger of its PCIe and HBM floors" if with_hbm else
             "its PCIe floor (the HBM floor is not in these results)")
    return [f"- {context['context']} tokens, each step over {which} (target at most "
            f"{TARGET_FLOOR_RATIO:g}x the larger of the two): {ratios}; "
            f"{'met' if met else 'missed'}"]


SCORING_KERNELS = ("_bound_scores", "_int_scores")  # the scoring's kernels, by name prefix
TARGET_SCORING_SHARE = 0.6  # issue 44: the scoring at 60 % of the streaming read


def _scoring_lines(context: dict[str, Any], read_GBps: float | None) -> list[str]:
    """The scoring's read rate in each profiled InfiniGen step: its keys' bytes a step
    over its kernels' device time, against the streaming read."""
    lines = []
    for p in context["points"]:
        spent = sum(k["ms_per_step"] for k in p.get("top_kernels", [])
                    if k["kernel"].startswith(SCORING_KERNELS))
        if not (spent and p.get("key_bytes_per_step") and read_GBps):
            continue
        rate = p["key_bytes_per_step"] / spent / 1e6
        share = rate / read_GBps
        lines.append(f"- {context['context']} tokens, {p.get('selection')} x {p['batch']}: "
                     f"the scoring reads {p['key_bytes_per_step'] / 1e9:.1f} GB a step in "
                     f"{spent:.2f} ms, {rate:.0f} GB/s, {share:.2f} of the streaming read "
                     f"(target >= {TARGET_SCORING_SHARE:g}); "
                     f"{'met' if share >= TARGET_SCORING_SHARE else 'missed'}")
    return lines


def _targets(results: dict[str, Any]) -> list[str]:
    rows = summary(results)
    plain = [c for c in results["contexts"] if kv_of(c) == "auto"]
    if not plain:
        return _fp8_targets(rows)
    lines = ["## Targets (issue 44)", ""]
    for context in sorted(plain, key=lambda c: -c["context"]):
        row = rows[_key(context)]
        lines.append(_speedup_line(context["context"], row))
        if context["context"] == max(TARGET_SPEEDUP):
            lines += _floor_lines(context)
            lines += _scoring_lines(context, results.get("h2d_limits", {}).get("read_GBps"))
        lines.append(f"- {context['context']} tokens: largest InfiniGen batch measured over "
                     f"dense's largest: {_fmt(row.get('batch_ratio'))}x (a batch that does not "
                     "fit is skipped, so this is at most the largest batch asked for)")
    return lines + [
        "- 32K x 1 sparse step at most 1.3x dense (graph): not measured here "
        "(benchmarks.gpu.decode_step)"] + _fp8_targets(rows)


def _fp8_targets(rows: dict[str, Any]) -> list[str]:
    """Issue 46's, at the longest context measured in FP8: InfiniGen (cap 4096)
    over dense, both with FP8 K/V; PCIe bytes per token against the model's dtype."""
    fp8 = [key for key in rows if " " in key]
    if not fp8:
        return []
    key = max(fp8, key=lambda k: int(k.split()[0]))
    context, kv = key.split()
    row, plain = rows[key], rows.get(context)
    capped = row["best"].get(f"cap {TARGET_CAP}")
    speedup = capped["over_dense"] if capped else None
    lines = ["", "## Targets (issue 46, FP8 K/V)", "",
             f"- {context} tokens, --kv-cache-dtype {kv}, cap {TARGET_CAP}: best InfiniGen "
             f"tokens/s over dense with the same K/V at its largest batch "
             f"({row['dense_largest_batch']}): {_fmt(speedup)}x (target >= "
             f"{FP8_TARGET_SPEEDUP:g}x)"
             + (f"; {'met' if speedup >= FP8_TARGET_SPEEDUP else 'missed'}" if speedup
                else "; not measured")]
    if plain and capped and plain["best"].get(f"cap {TARGET_CAP}"):
        before = plain["best"][f"cap {TARGET_CAP}"]
        ratio = (capped["pcie_bytes_per_token"] / before["pcie_bytes_per_token"]
                 if before.get("pcie_bytes_per_token") else None)
        lines.append(f"- PCIe bytes per generated token, FP8 over the model's dtype, at each "
                     f"one's best batch (x{capped['batch']}, x{before['batch']}): "
                     f"{_fmt(ratio)} (target 0.5)")
    return lines


def markdown_sections(results: dict[str, Any]) -> list[str]:
    sections = []
    if "h2d_limits" in results:
        limits = results["h2d_limits"]
        read = (f", streaming read of device memory {limits['read_GBps']:.0f} GB/s (dense's "
                "bytes bound: the weights and every layer's K/V at that rate)"
                if limits.get("read_GBps") else "")
        sections.append(f"Pinned host-to-device copy {limits['copy_GBps']:.1f} GB/s, gather "
                        f"kernel {limits['gather_GBps']:.1f} GB/s{read}; host pool "
                        f"{results['pool_GiB']:.0f} GiB (layers share regions where it is "
                        f"smaller than the K/V); weights {results['weights_GiB']:.1f} GiB.")
    if "checks" in results:
        sections.append("## Self-test\n\n```\n" + json.dumps(results["checks"], indent=1)
                        + "\n```")
    sections.append("\n".join(_targets(results)))
    for context in results["contexts"]:
        sections.append("\n".join(_table(context)))
    return sections


def plan_sections(plan: dict[str, Any]) -> list[str]:
    """The memory estimate's table: dense's largest batch and, per InfiniGen
    point, the block cache's factor that fits ("-": it does not fit)."""
    points = list(plan["plans"][0]["infinigen_cache_factor"]) if plan["plans"] else []
    lines = [f"Weights {plan['weights_GiB']:.1f} GiB (bf16), {plan['context_GiB']:g} GiB left "
             "to the CUDA context; estimate `benchmarks/gpu/measure.device_bytes` with its "
             "margin. An InfiniGen cell is the largest block-cache factor (x the widest "
             "selection) that fits, \"-\" where none does.", "",
             "| device GiB | context | free GiB | dense largest batch | "
             + " | ".join(points) + " |", "|---" * (4 + len(points)) + "|"]
    for row in plan["plans"]:
        cells = [_fmt(row["infinigen_cache_factor"][p], "g") for p in points]
        lines.append(f"| {row['device_GiB']:g} | {row['context']} | {row['free_GiB']:.1f} | "
                     f"{row['dense_largest_batch']} | " + " | ".join(cells) + " |")
    return ["\n".join(lines)]


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """tokens/s against batch per context, dense's largest batch marked; None
    when matplotlib is not installed (``--render`` draws it elsewhere)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    contexts = results["contexts"]
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        measured = [p for p in context["points"] if "tokens_per_s" in p]
        series: dict[str, list[tuple[int, float]]] = {}
        for p in measured:
            label = p["variant"] + (f", {p['selection']}" if p.get("selection") else "")
            label += f", {p['kv_dtype']}" if p.get("kv_dtype", "bfloat16") != "bfloat16" else ""
            series.setdefault(label, []).append((p["batch"], p["tokens_per_s"]))
        for label, values in sorted(series.items()):
            values.sort()
            style = "*" if label == "dense" else ("s" if label == "full" else "o-")
            ax.plot([b for b, _ in values], [t for _, t in values], style, label=label,
                    markersize=12 if label == "dense" else 6)
        if context["dense_largest_batch"]:
            ax.axvline(context["dense_largest_batch"], color="grey", linestyle=":",
                       label="dense's largest batch")
        ax.set_title(f"context {context['context']}, K/V {kv_of(context)}")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render(json_path: Path) -> str:
    """Rewrites the Markdown (and the plot) of a results JSON; says what it wrote."""
    record = json.loads(Path(json_path).read_text())
    results, meta = record["results"], record["meta"]
    md = Path(json_path).with_suffix(".md")
    title = TITLE if "checks" not in results else TITLE + ": CPU self-test"
    body = [f"# {title}", metadata_markdown(meta),
            *markdown_sections(results)]
    md.write_text("\n\n".join(part.strip("\n") for part in body if part) + "\n")
    png = plot(results, Path(json_path).with_suffix(".png"))
    return f"wrote {md}" + (f" and {png}" if png else " (no matplotlib: no plot)")
