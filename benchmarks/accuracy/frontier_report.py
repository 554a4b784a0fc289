# SPDX-License-Identifier: Apache-2.0
"""Tables and the plot of ``frontier``: accuracy against the CPU step at the density kept.

Per setting: retrieval / dense on each recall model (overall and first-quarter
needles), perplexity / dense on the book, the density kept, and the 16K x 1
decode step over dense at that density, interpolated (linear in the density)
between the paired decode runs' measured points. The density at 16K is the one
kept on the 4K model, bounded by the token cap (cap / 16K) where one is set.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from benchmarks.harness import report

RECALL_TARGET, PERPLEXITY_TARGET = 0.97, 1.02
TARGET_TASKS = ("recall-llama-12l", "recall-llama-12l-4k")
DENSITY_TASK = "recall-llama-12l-4k"
SPEED_CONTEXT = 16384


REACH = 0.1  # how far past the measured densities an estimate extrapolates (relative)


def interpolate(points: list[dict], density: float) -> tuple[float, bool] | None:
    """(step / dense, extrapolated?) at ``density``, linear between the measured points;
    None without points or more than ``REACH`` (relative) outside their densities."""
    if not points:
        return None
    xs = [p["density"] for p in points]
    ys = [p["vs_dense"] for p in points]
    if not xs[0] * (1 - REACH) <= density <= xs[-1] * (1 + REACH):
        return None
    if len(points) == 1:
        return ys[0], density != xs[0]
    if density <= xs[0] or density >= xs[-1]:
        low, high = (0, 1) if density <= xs[0] else (-2, -1)
        inside = False
    else:
        high = next(i for i, x in enumerate(xs) if x >= density)
        low, inside = high - 1, True
    slope = (ys[high] - ys[low]) / ((xs[high] - xs[low]) or 1.0)
    return ys[low] + slope * (density - xs[low]), not inside


def _by_task(payload: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for row in payload["results"]:
        out.setdefault(row["task"], {})[row.get("label", row["rule"])] = row
    return out


def ratio(row: dict, dense: dict, bucket: str | None = None) -> float:
    """Accuracy / dense (a bucket's, if given), or perplexity / dense; NaN where dense is 0
    (a bucket dense never retrieves)."""
    value, base = ((row["buckets"][bucket], dense["buckets"][bucket]) if bucket
                   else (row["value"], dense["value"]))
    return value / base if base else math.nan


def speculation_of(rule: str) -> str:
    """A rule's speculation: its name says same-layer (the report's convention)."""
    return "same-layer" if "same-layer" in rule else "previous-layer"


def dense_layers_of(payload: dict) -> int:
    """The run's dense layers: the first sparse layer's index (every task alike)."""
    return min(min(info["sparse_layers"]) for info in payload["tasks"].values())


def points_for(points: list[dict], dense_layers: int, speculation: str) -> list[dict]:
    """The speed points measured with these dense layers and speculation (points
    that do not say, from files before they did, are none's)."""
    return [p for p in points if p.get("dense_layers") == dense_layers
            and p.get("speculation") == speculation]


def frontier_rows(payload: dict) -> list[dict]:
    """One row per setting: its ratios on every task, densities and the speed
    estimate from the points of its own dense layers and speculation (none if
    no paired run measured them)."""
    tasks = _by_task(payload)
    labels = [row["label"] for row in payload["results"] if "label" in row]
    labels = list(dict.fromkeys(labels))
    points = payload.get("speed", [])
    dense_layers = dense_layers_of(payload)
    rows = []
    for label in labels:
        entry: dict = {"label": label, "ratios": {}, "first_quarter": {}, "density": {},
                       "bytes": None}
        for name, rows_of in tasks.items():
            if label not in rows_of:
                continue
            row, dense = rows_of[label], rows_of["dense"]
            entry["ratios"][name] = ratio(row, dense)
            entry["density"][name] = row["density"]
            entry.update(budget=row["budget"], token_cap=row.get("token_cap"), rule=row["rule"])
            if row.get("bytes_per_token") is not None:  # the largest over the tasks
                entry["bytes"] = max(entry["bytes"] or 0.0, row["bytes_per_token"])
            if "buckets" in row:
                entry["first_quarter"][name] = ratio(row, dense, "first_quarter")
        base = entry["density"].get(DENSITY_TASK, max(entry["density"].values(), default=0))
        if entry.get("token_cap"):
            base = min(base, entry["token_cap"] / SPEED_CONTEXT)
        entry["density_16k"] = base
        estimate = interpolate(points_for(points, dense_layers, speculation_of(entry["rule"])),
                               base)
        entry["vs_dense_16k"], entry["extrapolated"] = estimate if estimate else (None, None)
        entry["meets"] = meets(entry)
        rows.append(entry)
    return rows


def meets(entry: dict) -> bool:
    recall = all(entry["ratios"].get(t, 0) >= RECALL_TARGET
                 and entry["first_quarter"].get(t, 0) >= RECALL_TARGET for t in TARGET_TASKS)
    book = entry["ratios"].get("gutenberg-llama-2k", float("inf")) <= PERPLEXITY_TARGET
    return recall and book


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def sections(payload: dict, plot_name: str = "frontier.png") -> list[str]:
    rows = frontier_rows(payload)
    task_names = list(payload["tasks"])
    dense_layers = {payload["tasks"][name]["sparse_layers"][0] for name in task_names}
    out = [
        "Accuracy: torch-only (`benchmarks/accuracy/sparse_llama.py`), float32 models; the "
        "token rules score the int speculation keys of a float32 cache (4 bits, one scale "
        "per channel and 16 tokens), the unit rules their unit summaries; "
        "previous-layer speculation unless named, dense layers: "
        f"{' / '.join(map(str, sorted(dense_layers)))}, sparse from the first "
        "token. Recall: ÷ dense = accuracy / dense (first ¼: needles in the first quarter); "
        "book: perplexity / dense (1 = no loss). Density: selected / context entries over "
        "the sparse layers, rows and KV heads. Speed: the 16K x 1 float32 decode step over "
        f"dense's at the density kept on {DENSITY_TASK} (a token cap bounds it to cap / "
        "16K), interpolated between the measured points of paired decode runs with the "
        "setting's dense layers and speculation, the product's default keys (`*`: "
        f"extrapolated, at most {REACH:.0%} past them; empty: no run measured near it). "
        "Meets: retrieval >= "
        f"{RECALL_TARGET}x dense on both 12-layer models "
        f"overall and first ¼, perplexity <= {PERPLEXITY_TARGET}x. B / token: the bytes "
        "the selection reads per context token and KV head per step at head_dim 128 with "
        "the 2-bit int keys of a bfloat16 cache (48 B; 4-bit: 80), the bounds' 8 / 4-bit "
        "codes and scale per unit, or a summary plus the int keys of the fine pass's "
        "candidates (their measured fraction, the largest over the models).",
    ]
    lines = []
    for name in task_names:
        info = payload["tasks"][name]
        dense = next(r for r in payload["results"] if r["task"] == name and r["rule"] == "dense")
        control = next(r for r in payload["results"]
                       if r["task"] == name and r["rule"] == "control")
        metric = "accuracy" if "buckets" in dense else "perplexity"
        equal = "equals dense" if control["value"] == dense["value"] else "DIFFERS from dense"
        factor = info.get("rope_linear_factor")
        lines.append(f"- {name}"
                     + (f" (RoPE positions interpolated linearly by {factor:g})" if factor else "")
                     + f": {info['num_sequences']} sequences of {info['context']} tokens, "
                     f"dense {metric} {dense['value']:.4f}"
                     + (f" (first ¼ {dense['buckets']['first_quarter']:.3f})"
                        if metric == "accuracy" else "")
                     + f"; select-all control {control['value']:.4f} ({equal}, max |logit - "
                     f"dense| {info['max_control_logit_diff']:.1e})")
    out.append("\n".join(lines))
    headers = ["setting"]
    for name in task_names:
        headers += [f"{name} ÷ dense"] + (["first ¼"] if name != "gutenberg-llama-2k" else [])
        headers.append("density")
    headers += ["B / token", "density at 16K", "16K step ÷ dense", "meets"]
    table = []
    for entry in rows:
        cells = [entry["label"]]
        for name in task_names:
            cells.append(_fmt(entry["ratios"].get(name)))
            if name != "gutenberg-llama-2k":
                cells.append(_fmt(entry["first_quarter"].get(name)))
            cells.append(_fmt(entry["density"].get(name)))
        speed = _fmt(entry["vs_dense_16k"], ".2f")
        cells += [_fmt(entry["bytes"], ".1f"), _fmt(entry["density_16k"], ".4f"),
                  speed + ("*" if speed and entry["extrapolated"] else ""),
                  "yes" if entry["meets"] else ""]
        table.append(cells)
    out.append("## Every setting\n\n" + report.markdown_table(headers, table))
    out += depth_sections(payload)
    winners = sorted((e for e in rows if e["meets"] and e["vs_dense_16k"] is not None),
                     key=lambda e: e["vs_dense_16k"])
    if winners:
        best = winners[0]
        out.append(f"Fastest setting that meets every accuracy target: **{best['label']}**, "
                   f"16K step {best['vs_dense_16k']:.2f}x dense at density "
                   f"{best['density_16k']:.4f}.")
    else:
        missing = [t for t in (*TARGET_TASKS, "gutenberg-llama-2k") if t not in task_names]
        out.append("No setting meets every accuracy target."
                   + (f" (This run leaves out {', '.join(missing)}: none can meet them "
                      "here; read the ratios.)" if missing else ""))
    points = payload.get("speed", [])
    if points:
        out.append("## Speed points (paired decode, 16K x 1)\n\n" + report.markdown_table(
            ["file", "commit", "config", "dense layers", "speculation", "density",
             "ms per step", "÷ dense"],
            [[p["file"], str(p["commit"])[:10], p["config"], str(p.get("dense_layers", "")),
              p.get("speculation", ""), f"{p['density']:.4f}", f"{p['ms_per_step']:.1f}",
              f"{p['vs_dense']:.2f}"] for p in points]))
    out.append(f"![accuracy against the step]({plot_name})")
    return out


DEPTHS = (("first_quarter", "first ¼"), ("middle", "middle"), ("last_quarter", "last ¼"))


def depth_sections(payload: dict) -> list[str]:
    """Per recall task: each setting's accuracy ÷ dense by the needle's depth
    in the context, and overall (dense's own accuracy in its row; "-" where no
    prompt has its needle at that depth, as with a few prompts)."""
    out = []
    for name, rows_of in _by_task(payload).items():
        dense = rows_of["dense"]
        if "buckets" not in dense:
            continue
        headers = ["setting", *[label for _, label in DEPTHS], "all"]
        buckets = [dense["buckets"].get(b) for b, _ in DEPTHS]
        table = [["dense (accuracy)", *["-" if v is None else f"{v:.3f}" for v in buckets],
                  f"{dense['value']:.3f}"]]
        for label, row in rows_of.items():
            if label in ("dense", "control"):
                continue
            table.append([label, *["-" if v is None else _fmt(ratio(row, dense, b)) if v else ""
                                   for (b, _), v in zip(DEPTHS, buckets)],
                          _fmt(ratio(row, dense))])
        out.append(f"## {name} by needle depth (÷ dense)\n\n"
                   + report.markdown_table(headers, table))
    return out


def plot(path: Path, payload: dict) -> Path | None:
    """Two panels against the 16K step over dense: the worse 12-layer retrieval ratio,
    and the book's perplexity ratio; one point per setting."""
    rows = [e for e in frontier_rows(payload) if e["vs_dense_16k"] is not None]
    if not rows:
        print("no plot: no speed points", file=sys.stderr)
        return None
    try:
        plt = report._pyplot()
    except report.PlotUnavailable as e:
        print(f"no plot: {e}", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    panels = (("worst of the 12-layer models' retrieval ÷ dense (overall, first ¼)",
               lambda e: min([e["ratios"].get(t, float("nan")) for t in TARGET_TASKS]
                             + [e["first_quarter"].get(t, float("nan"))
                                for t in TARGET_TASKS]), RECALL_TARGET),
              ("gutenberg perplexity ÷ dense",
               lambda e: e["ratios"].get("gutenberg-llama-2k", float("nan")),
               PERPLEXITY_TARGET))
    for axis, (title, value, target) in zip(axes, panels):
        for index, entry in enumerate(rows):
            axis.scatter(entry["vs_dense_16k"], value(entry), color=f"C{index % 10}",
                         marker="o" if entry["meets"] else "x")
            if entry["meets"] or "paper" in entry["label"]:  # the rest: markers only
                axis.annotate(entry["label"], (entry["vs_dense_16k"], value(entry)),
                              fontsize=5)
        axis.axhline(target, linestyle="--", color="grey")
        axis.set_xlabel("16K x 1 decode step ÷ dense (CPU, float32, at the density kept)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    fig.suptitle("Selection rules: accuracy against the CPU step (o meets every target, "
                 "labelled with the paper's alpha 5; x misses)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
