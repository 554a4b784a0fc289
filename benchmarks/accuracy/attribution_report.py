# SPDX-License-Identifier: Apache-2.0
"""Tables and plot of ``attribution.py``: each factor's loss beside the exact selection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness import report

# Matches attribution.py (not imported: that module imports this one).
FULL_KEYS, DEFAULT_RATIO = 1.0, 0.2
# The select-all control must reproduce dense: same accuracy, perplexity within this.
CONTROL_TOLERANCE = 1e-3


def configurations(args) -> list[tuple[str, str, tuple]]:
    """(factor, description, (r, calibration, speculation, rule)) rows of the attribution."""
    return [(factor, description, key) for factor, description, _, key in _rows(args)]


def _rows(args) -> list[tuple[str, str, str, tuple]]:
    """Attribution rows with a short plot label each."""
    rows = [("exact", "same-layer, full keys, fixed k", "exact",
             (FULL_KEYS, "in-domain", "same-layer", "fixed-k")),
            ("(1) speculation", "previous-layer, full keys, fixed k", "(1) previous-layer",
             (FULL_KEYS, "in-domain", "previous-layer", "fixed-k"))]
    rows += [("(2) partial keys", f"same-layer, r {r:g}, fixed k, in-domain skew",
              f"(2) r {r:g}", (r, "in-domain", "same-layer", "fixed-k"))
             for r in sorted(args.partial_ratio, reverse=True)]
    rows.append(("(3) alpha count", "same-layer, full keys, alpha 5 (capped at the budget)",
                 "(3) alpha 5", (FULL_KEYS, "in-domain", "same-layer", "alpha")))
    rows += [("(4) calibration", f"same-layer, r {DEFAULT_RATIO:g}, fixed k, {c} skew",
              f"(4) {c} text", (DEFAULT_RATIO, c, "same-layer", "fixed-k"))
             for c in args.calibration]
    rows += [("InfiniGen default", f"previous-layer, r {DEFAULT_RATIO:g}, alpha 5, {c} skew",
              f"default, {c} text", (DEFAULT_RATIO, c, "previous-layer", "alpha"))
             for c in args.calibration]
    return rows


def _key(result: dict) -> tuple:
    return (result["r"], result["calibration"], result["speculation"], result["rule"])


def _grid(results: Sequence[dict], task: str) -> dict[tuple, dict]:
    """(r, calibration, speculation, rule, budget) -> result of the task's grid."""
    return {(*_key(r), r["budget"]): r for r in results
            if r["task"] == task and r["kind"] == "grid"}


def quality(task, value: float, dense: float) -> float:
    """Fraction of dense quality: accuracy / dense, or dense perplexity / perplexity."""
    return value / dense if task.higher_is_better else dense / value


def _best(task, grid: dict[tuple, dict], budget: float, **match: Any) -> dict | None:
    """The best grid result at ``budget`` with partial keys (r < 1) matching ``match``."""
    candidates = [r for key, r in grid.items() if key[-1] == budget and r["r"] < FULL_KEYS
                  and all(r[k] == v for k, v in match.items())]
    if not candidates:
        return None
    pick = max if task.higher_is_better else min
    return pick(candidates, key=lambda r: r["value"])


def _describe(result: dict) -> str:
    rule = "fixed k" if result["rule"] == "fixed-k" else "alpha 5"
    return (f"{result['speculation']}, r {result['r']:g}, {rule}, "
            f"{result['calibration']} skew")


def attribution_table(task, results: Sequence[dict], args, dense: float) -> str:
    grid = _grid(results, task.name)
    budgets = list(args.budget)
    rows = []
    for factor, description, key in configurations(args):
        cells = []
        for budget in budgets:
            result = grid.get((*key, budget))
            cells += ([f"{result['value']:.3f}", f"{quality(task, result['value'], dense):.3f}",
                       report.cell(result["density"], ".3f")] if result else ["", "", ""])
        rows.append([factor, description, *cells])
    for label, match in (("best with partial keys", {}),
                         ("best previous-layer (prefetch)", {"speculation": "previous-layer"})):
        cells = []
        for budget in budgets:
            best = _best(task, grid, budget, **match)
            cells += ([f"{best['value']:.3f} ({_describe(best)})",
                       f"{quality(task, best['value'], dense):.3f}",
                       report.cell(best["density"], ".3f")] if best else ["", "", ""])
        rows.append([label, "over every r < 1, calibration, speculation, rule", *cells])
    headers = ["factor", "configuration"]
    for budget in budgets:
        headers += [f"{task.metric} @ {budget:g}", "÷ dense" if task.higher_is_better
                    else "dense ÷", "density"]
    return report.markdown_table(headers, rows)


def matched_table(task, results: Sequence[dict]) -> str | None:
    """Density-matched runs beside the run they match."""
    grid = _grid(results, task.name)
    rows = []
    for r in results:
        if r["task"] != task.name or r["kind"] not in ("density-matched", "artifact-density"):
            continue
        if r["kind"] == "density-matched":
            base = grid[(FULL_KEYS, "in-domain", "same-layer", "alpha", r["matched_budget"])]
            what = "fixed k at the alpha rule's density (same-layer, full keys)"
        else:
            base = grid[(r["r"], r["calibration"], "previous-layer", "alpha", r["matched_budget"])]
            what = (f"InfiniGen default ({r['calibration']} skew) at the artifact's density "
                    "for this nominal budget")
        rows.append([what, f"{r['matched_budget']:g}", f"{base['value']:.3f}",
                     report.cell(base["density"], ".3f"), f"{r['budget']:g}",
                     f"{r['value']:.3f}", report.cell(r["density"], ".3f")])
    if not rows:
        return None
    return report.markdown_table(
        ["comparison", "nominal budget", f"{task.metric} at nominal", "density at nominal",
         "matched budget", f"{task.metric} matched", "density matched"], rows)


def acceptance_text(task, results: Sequence[dict], args, dense: float) -> str:
    """Budget 0.1: does the best configuration reach 0.95x dense, and if not, which factor
    alone already falls below it."""
    budget = 0.1 if 0.1 in args.budget else args.budget[0]
    grid = _grid(results, task.name)
    best = _best(task, grid, budget)
    if best is None:
        return ""
    ratio = quality(task, best["value"], dense)
    text = (f"At budget {budget:g} the best configuration with partial keys is "
            f"{_describe(best)}: {best['value']:.3f} = {ratio:.3f}x dense "
            f"({'reaches' if ratio >= 0.95 else 'below'} 0.95x).")
    below = []
    for factor, description, key in configurations(args):
        result = grid.get((*key, budget))
        if result and factor != "InfiniGen default":
            q = quality(task, result["value"], dense)
            if q < 0.95:
                below.append(f"{factor} ({description}): {q:.3f}x")
    if below:
        text += " Alone below 0.95x dense: " + "; ".join(below) + "."
    return text


def sections(tasks, results: Sequence[dict], args) -> tuple[list[str], bool]:
    """Markdown sections, and whether every select-all control equals dense."""
    out = [
        "Each row switches one factor from the exact selection (same-layer, full keys, "
        "fixed k = budget x context per KV head) to InfiniGen's setting. `÷ dense`: "
        "accuracy / dense accuracy; `dense ÷`: dense perplexity / perplexity (both 1 = no "
        "loss). Density: selected / candidate tokens of the sparse layers, measured "
        "from the counters of that setting alone. Full keys (r = 1) rotate every channel, "
        "so the calibration text does not matter there."]
    control_ok = True
    for task in tasks:
        dense = next(r["value"] for r in results
                     if r["task"] == task.name and r["kind"] == "dense")
        control = next((r for r in results
                        if r["task"] == task.name and r["kind"] == "control"), None)
        same = control is not None and abs(control["value"] - dense) <= CONTROL_TOLERANCE * (
            1 if task.higher_is_better else dense)
        control_ok &= same
        tokens = sorted({(r["calibration"], r.get("calibration_tokens")) for r in results
                         if r["task"] == task.name and r.get("calibration_tokens")})
        out += [f"## {task.name}: {task.model.name}, {task.metric}",
                f"Dense {task.metric}: {dense:.4f}; select-all control "
                f"{report.cell(control and control['value'], '.4f')} "
                f"({'equals dense' if same else 'DIFFERS FROM DENSE'}). Calibration tokens: "
                + ", ".join(f"{c} {n}" for c, n in tokens) + ".",
                attribution_table(task, results, args, dense),
                acceptance_text(task, results, args, dense)]
        matched = matched_table(task, results)
        if matched:
            out += ["### Density-matched", matched]
    out.append("## Every setting")
    out.append(report.markdown_table(
        ["task", "kind", "r", "calibration", "speculation", "rule", "budget", "value",
         "density", "seconds"],
        [[r["task"], r["kind"], report.cell(r["r"], "g"), report.cell(r["calibration"]),
          report.cell(r.get("speculation")), report.cell(r["rule"]),
          report.cell(r.get("budget"), "g"), f"{r['value']:.4f}",
          report.cell(r["density"], ".3f"), f"{r['seconds']:.0f}"] for r in results]))
    return out, control_ok


def panels(tasks, results: Sequence[dict], args) -> list[report.Panel]:
    """Per task: the metric against measured density, a line per attribution row."""
    rows = {key: label for _, _, label, key in _rows(args)}
    out = []
    for task in tasks:
        panel = report.Panel(f"{task.name} ({task.model.name})", task.metric,
                             xlabel="attended density (sparse layers, measured)",
                             xscale="linear")
        for r in results:
            if r["task"] != task.name:
                continue
            if r["kind"] == "dense":
                panel.references["dense"] = r["value"]
            elif r["kind"] == "grid" and r["density"] is not None and _key(r) in rows:
                panel.series.setdefault(rows[_key(r)], []).append((r["density"], r["value"]))
        out.append(panel)
    return out
