# SPDX-License-Identifier: Apache-2.0
"""Markdown sections of ``speculation_keys.py``'s results (tables per model and rule, verdict)."""

from __future__ import annotations

from benchmarks.harness import report

RULE_TITLES = {"alpha": "alpha 5 capped by the budget (the product's default rule)",
               "cap": "cap binding (alpha 1000: k = floor(budget x context))"}
BUCKET_SHORT = {"first_quarter": "fq", "middle": "mid", "last_quarter": "lq"}


def _better(metric: str, value: float, than: float) -> bool:
    return value >= than if metric == "accuracy" else value <= than


def _metric_of(results: list[dict], task: str) -> str:
    dense = next(r for r in results if r["task"] == task and r["group"] == "dense")
    return "accuracy" if "buckets" in dense else "perplexity"


def _cell(result: dict | None, metric: str) -> str:
    if result is None:
        return ""
    spec = ".3f" if metric == "accuracy" else ".2f"
    text = format(result["value"], spec)
    if metric == "accuracy" and "first_quarter" in result.get("buckets", {}):
        text += f" [fq {result['buckets']['first_quarter']:.3f}]"
    text += f" (d {result['density']:.3f}"
    if result.get("rerank_density"):
        text += f", rr {result['rerank_density']:.3f}"
    return text + ")"


def _bytes(result: dict, head_dim: int) -> str:
    bits = result["bits_per_token"]
    return f"{bits / 8:g} ({bits / head_dim:.2g} b/ch)"


def task_table(results: list[dict], task: str, rule: str, budgets: list[float],
               info: dict) -> str:
    metric = _metric_of(results, task)
    rows = []
    forms = [r for r in results if r["task"] == task and r.get("rule") == rule
             and r["group"] not in ("dense", "control")]
    names = list(dict.fromkeys((r["group"], r["form"]) for r in forms))
    for group, name in names:
        cells = {r["budget"]: r for r in forms if r["form"] == name and r["group"] == group}
        first = next(iter(cells.values()))
        rows.append([group, name, _bytes(first, info["head_dim"]),
                     format(first["mean_channels"], ".3g"),
                     *[_cell(cells.get(b), metric) for b in budgets]])
    headers = ["cache", "form", "B/token/KV head", "channels",
               *[f"{metric} @ {b:g}" for b in budgets]]
    return report.markdown_table(headers, rows)


def verdict(results: list[dict], budgets: list[float], rules: list[str]) -> str:
    """Forms at today's bytes or fewer that match or beat today's form in every task x budget."""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    lines = []
    for group, today in (("fp32", "today: skew r0.2 fp32"), ("bf16", "today: skew r0.2 bf16")):
        names = list(dict.fromkeys(r["form"] for r in results if r["group"] == group))
        for rule in rules:
            every, some = [], []
            for name in names:
                if name == today:
                    continue
                wins = losses = 0
                for task in tasks:
                    metric = _metric_of(results, task)
                    for budget in budgets:
                        pick = [r for r in results if r["task"] == task and r["form"] == name
                                and r.get("rule") == rule and r.get("budget") == budget]
                        base = [r for r in results if r["task"] == task and r["form"] == today
                                and r.get("rule") == rule and r.get("budget") == budget]
                        if not pick or not base:
                            continue
                        if _better(metric, pick[0]["value"], base[0]["value"]):
                            wins += pick[0]["value"] != base[0]["value"]
                        else:
                            losses += 1
                (every if losses == 0 and wins else some if wins else []).append(
                    f"{name} ({wins} better, {losses} worse)")
            lines.append(f"- {group} cache, {rule} rule: never worse than today in any "
                         f"model x budget: {', '.join(every) or 'none'}; better somewhere, "
                         f"worse elsewhere: {', '.join(some) or 'none'}")
    return "\n".join(lines)


def sections(payload: dict, settings: dict) -> list[str]:
    results, tasks = payload["results"], payload["tasks"]
    budgets, rules = settings["budget"], settings["rules"]
    out = [
        "Torch-only harness (`benchmarks/accuracy/speculation_keys.py`), "
        f"{settings.get('model_dtype', 'float32')} model, "
        f"{settings['dense_layers']} dense layers, {settings['speculation']} speculation. Cell: "
        "metric [fq: first-quarter needles] (d: density = selected / context entries over "
        "sparse layers, rows and KV heads; rr: entries re-scored with full keys / context, "
        "two-pass forms). Bytes: stored per token per KV head, scales amortized over 16-token "
        "blocks; today's budget is R = int(0.2 D) channels: 4R B in a float32 cache, 2R B "
        "in a bfloat16 one. The model stays float32 in both; only the speculation keys are "
        "rounded."]
    if settings.get("calibration_text"):
        out.append(f"Every skew, low-rank projection and channel choice is calibrated on "
                   f"`{settings['calibration_text']}`, not on the task's own kind of text.")
    for task, info in tasks.items():
        dense = next(r for r in results if r["task"] == task and r["group"] == "dense")
        control = next(r for r in results if r["task"] == task and r["group"] == "control")
        metric = _metric_of(results, task)
        buckets = ", ".join(f"{BUCKET_SHORT.get(b, b)} {v:.3f}"
                            for b, v in dense.get("buckets", {}).items())
        out.append(
            f"## {task}: {metric}\n\n"
            f"head_dim {info['head_dim']}, R = {info['partial_channels']} channels, "
            f"{info['num_kv_heads']} KV heads x {info['group']} query heads, sparse layers "
            f"{info['sparse_layers'][0]}-{info['sparse_layers'][-1]}, {info['num_sequences']} "
            f"sequences, calibration {info['calibration_tokens']} tokens. Dense "
            f"{dense['value']:.4f}{f' ({buckets})' if buckets else ''}; control (full keys, "
            f"select all) {control['value']:.4f}, max |logit - dense| "
            f"{info['max_control_logit_diff']:.1e}. Budget: {info['budget_bits']['fp32'] // 8} B "
            f"(fp32), {info['budget_bits']['bf16'] // 8} B (bf16).")
        for rule in rules:
            out.append(f"### {RULE_TITLES[rule]}\n\n"
                       + task_table(results, task, rule, budgets, info))
    out.append("## Verdict (versus today's form in the same cache dtype)\n\n"
               + verdict(results, budgets, rules))
    return out
