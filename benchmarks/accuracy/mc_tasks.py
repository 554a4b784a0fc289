# SPDX-License-Identifier: Apache-2.0
"""5-shot log-likelihood multiple choice (COPA, OpenBookQA, PIQA, WinoGrande, RTE) under selection.

The tasks, prompts and metrics are lm-evaluation-harness 0.4's
(``mc_prompts.py``); this script scores them on an offline engine, dense vLLM
and InfiniGen at each budget.

Scoring (``--scoring``):

- ``decode`` (default): InfiniGen sparsifies decode only, so the last
  ``--decode-context-tokens`` of the context and every continuation token are
  teacher-forced through decode: each continuation token is predicted in a
  decode step, under the selection; the rest of the context is prefilled densely;
- ``eval-prefill``: each (context, continuation) in one prefill, scored from
  its prompt logprobs (what lm-eval reads from ``/v1/completions``), on an
  engine in InfiniGen's evaluation mode with ``--eval-dense-prefix N``: every
  row at position >= N, context included, attends over the selection as a
  decode row would. H2O has no evaluation mode and is scored by decode; dense
  vLLM is scored from its (dense) prompt logprobs.

``--policy`` adds the runtime's baseline rules (H2O, StreamingLLM, Quest) at
the same budgets, switched on the same engine. Example::

    flock /tmp/engine.lock python -m benchmarks.accuracy.mc_tasks --limit 20 \\
        --kv-manager vllm infinigen --budget 0.05 0.1 0.2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.accuracy import mc_prompts, sweeps
from benchmarks.harness import paths, report

DEFAULT_MODEL = paths.shared_path("models/gutenberg-llama-2k")
DEFAULT_DATA = paths.shared_path("data/lm-eval")
DEFAULT_OUT = paths.RESULTS / "mc_tasks"
SCORINGS = ("decode", "eval-prefill")


def score_requests(llm, requests: Sequence[mc_prompts.Request], decode_context_tokens: int,
                   batch_size: int, desc: str) -> list[float]:
    """Summed continuation log-likelihood per request, every continuation token in decode."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import score_continuations, split_for_decode

    sums: list[float] = []
    with tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr) as bar:
        for chunk in sweeps.batched(requests, batch_size):
            cut = [min(decode_context_tokens, len(r.context_ids) - 1) for r in chunk]
            pairs = [split_for_decode(r.context_ids, r.continuation_ids, n)
                     for r, n in zip(chunk, cut)]
            scores = score_continuations(llm, *zip(*pairs))
            sums += [sum(logprobs[n:]) for logprobs, n in zip(scores, cut)]
            bar.update(len(chunk))
    return sums


def score_requests_prefill(llm, requests: Sequence[mc_prompts.Request], batch_size: int,
                           desc: str) -> list[float]:
    """Summed continuation log-likelihood per request, from one prefill's prompt logprobs."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import prefill_scores

    sums: list[float] = []
    with tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr) as bar:
        for chunk in sweeps.batched(requests, batch_size):
            scores = prefill_scores(llm, [r.context_ids for r in chunk],
                                    [r.continuation_ids for r in chunk])
            sums += [sum(logprobs) for logprobs in scores]
            bar.update(len(chunk))
    return sums


def scoring_for(requested: str, setting: dict | None) -> str:
    """The scoring a setting gets: ``eval-prefill`` falls back to decode for H2O only.

    Dense vLLM (``setting`` None) keeps ``eval-prefill``: its prompt logprobs
    are dense attention, which is what dense vLLM serves.
    """
    if requested not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {requested!r}")
    if requested == "eval-prefill" and sweeps.policy_of(setting) == "h2o":
        return "decode"
    return requested


def mode_label(kv_manager: str, setting: dict | None) -> str:
    """"vllm" (dense), the selection policy, or the select-all control."""
    if setting is None:
        return kv_manager
    if sweeps.is_control(setting):
        return "infinigen select-all (control)"
    return sweeps.policy_of(setting)


def run_engine(args: argparse.Namespace, kv_manager: str,
               work: dict[str, tuple[mc_prompts.Task, list[dict], list[mc_prompts.Request]]],
               ) -> list[dict]:
    """One engine; per selection setting, every task."""
    infinigen = {"budget": args.budget[0]} if kv_manager == "infinigen" else None
    results = []
    eval_mode = {"eval_dense_prefix": args.eval_dense_prefix}
    with sweeps.start_engine(str(args.model), kv_manager, max_model_len=args.max_model_len,
                             infinigen=infinigen, kv_cache_memory_bytes=args.kv_cache_bytes) as llm:
        for setting in sweeps.sweep(llm, kv_manager, sweeps.selection_grid(
                args.budget, args.policy, args.select_all_control)):
            mode = mode_label(kv_manager, setting)
            label = mode if setting is None else f"{mode} b={setting['budget']:g}"
            scoring = scoring_for(args.scoring, setting)
            switch = scoring == "eval-prefill" and setting is not None
            if switch:
                llm.collective_rpc("set_infinigen_selection", kwargs=eval_mode)
            for name, (task, docs, requests) in work.items():
                start = time.perf_counter()
                with sweeps.SelectionMeter(llm) as meter:
                    if scoring == "eval-prefill":
                        lls = score_requests_prefill(llm, requests, args.batch_size,
                                                     f"{name} [{label}, eval-prefill]")
                    else:
                        lls = score_requests(llm, requests, args.decode_context_tokens,
                                             args.batch_size, f"{name} [{label}]")
                results.append({
                    "kv_manager": mode, "budget": (setting or {}).get("budget"),
                    "task": name, "scoring": scoring,
                    **mc_prompts.aggregate(task, docs, requests, lls),
                    "selected_fraction": meter.fraction,
                    "seconds": time.perf_counter() - start,
                })
            if switch:
                llm.collective_rpc("set_infinigen_selection",
                                   kwargs={"eval_dense_prefix": None})
    return results


def results_table(results: Sequence[dict]) -> str:
    rows = [[r["task"], r["kv_manager"], report.cell(r["budget"], "g"), r["scoring"],
             str(r["num_docs"]),
             f"{r['acc']:.3f}", report.cell(r["acc_norm"], ".3f"), f"{r['chance']:.3f}",
             report.cell(r.get("vs_dense_same_choice"), ".3f"),
             report.cell(r.get("vs_dense_mean_abs_delta"), ".3f"),
             report.cell(r["selected_fraction"], ".3f")] for r in results]
    return report.markdown_table(
        ["task", "mode", "budget", "scoring", "docs", "acc", "acc_norm", "chance",
         "same choice as dense", "mean abs dLL vs dense", "selected fraction"], rows)


def mean_table(results: Sequence[dict]) -> tuple[str, dict[tuple, dict]]:
    """Mean acc / acc_norm over the tasks, per (mode, budget)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kv_manager"], r["budget"]), []).append(r)
    means = {}
    rows = []
    for (mode, budget), group in groups.items():
        norms = [r["acc_norm"] for r in group if r["acc_norm"] is not None]
        means[(mode, budget)] = {
            "acc": sum(r["acc"] for r in group) / len(group),
            "acc_norm": sum(norms) / len(norms) if norms else None}
        rows.append([mode, report.cell(budget, "g"), str(len(group)),
                     f"{means[(mode, budget)]['acc']:.3f}",
                     report.cell(means[(mode, budget)]["acc_norm"], ".3f")])
    return report.markdown_table(
        ["mode", "budget", "tasks", "mean acc", "mean acc_norm (tasks that have it)"],
        rows), means


def plot_panels(results: Sequence[dict]) -> list[report.Panel]:
    """One panel per task (acc), dense as a reference line."""
    panels: dict[str, report.Panel] = {}
    for r in results:
        panel = panels.setdefault(r["task"], report.Panel(r["task"], "acc"))
        if r["budget"] is None:
            panel.references[f"{r['kv_manager']} (dense)"] = r["acc"]
        elif r["kv_manager"].endswith("(control)"):
            continue  # the select-all control equals dense; it is in the table
        else:
            panel.series.setdefault(r["kv_manager"], []).append((r["budget"], r["acc"]))
        panel.references.setdefault("chance", r["chance"])
    agree = report.Panel("all tasks: same choice as dense", "fraction of documents")
    by_mode: dict[str, dict[float, list[float]]] = {}
    for r in results:
        if (r["budget"] is not None and not r["kv_manager"].endswith("(control)")
                and r.get("vs_dense_same_choice") is not None):
            by_mode.setdefault(r["kv_manager"], {}).setdefault(r["budget"], []).append(
                r["vs_dense_same_choice"])
    for mode, by_budget in by_mode.items():
        agree.series[mode] = [(b, sum(v) / len(v)) for b, v in by_budget.items()]
    agree.references["vllm (dense)"] = 1.0
    return [*panels.values(), agree] if by_mode else list(panels.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", nargs="+", default=list(mc_prompts.TASKS),
                        choices=list(mc_prompts.TASKS))
    parser.add_argument("--limit", type=int, default=None,
                        help="first N documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=mc_prompts.NUM_FEWSHOT)
    parser.add_argument("--kv-manager", nargs="+", default=list(sweeps.KV_MANAGERS),
                        choices=sweeps.KV_MANAGERS, help="one engine each, one after the other")
    sweeps.add_selection_options(parser, [0.05, 0.1, 0.2])
    parser.add_argument("--scoring", choices=SCORINGS, default="decode",
                        help="decode: teacher forcing; eval-prefill: prompt logprobs of one "
                             "prefill in InfiniGen's evaluation mode (H2O: decode)")
    parser.add_argument("--eval-dense-prefix", type=int, default=16,
                        help="eval-prefill: rows at positions >= N attend over the selection")
    parser.add_argument("--decode-context-tokens", type=int, default=8,
                        help="last context tokens forced through decode with the continuation")
    sweeps.add_run_options(parser, max_model_len=2048, kv_cache_bytes=512 << 20,
                           batch_size=64, out=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sweeps.check_budgets(parser, args.budget)
    if args.decode_context_tokens < 1:
        parser.error("--decode-context-tokens must be >= 1: the first continuation "
                     "token would be scored by the dense prefill")
    if args.eval_dense_prefix < 1:
        parser.error("--eval-dense-prefix must be >= 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sweeps.inputs_missing(args.model, args.data_dir):
        return 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))

    def encode(text: str) -> list[int]:
        return tokenizer(text).input_ids

    work = {}
    for name in args.tasks:
        task = mc_prompts.TASKS[name]
        docs = mc_prompts.load_docs(task, args.data_dir)
        work[name] = (task, docs, mc_prompts.task_requests(task, docs, args.limit, encode,
                                                args.max_model_len, args.num_fewshot))
    results = [r for kv in args.kv_manager for r in run_engine(args, kv, work)]
    mc_prompts.add_dense_agreement(results)

    stats = {name: {"requests": len(reqs), "truncated": sum(r.truncated for r in reqs),
                    "mean_context_tokens": sum(len(r.context_ids) for r in reqs) / len(reqs),
                    "mean_continuation_tokens":
                        sum(len(r.continuation_ids) for r in reqs) / len(reqs)}
             for name, (_, _, reqs) in work.items()}
    mean_md, _ = mean_table(results)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta = report.run_metadata(model=str(args.model))
    if args.scoring == "eval-prefill":
        how = (f"each request is scored from the prompt logprobs of one prefill in InfiniGen's "
               f"evaluation mode (rows at positions >= {args.eval_dense_prefix}, context "
               "included, attend over the selection; H2O by decode, dense vLLM from its dense "
               "prompt logprobs)")
    else:
        how = (f"the last {args.decode_context_tokens} context tokens and every continuation "
               "token are teacher-forced through decode (InfiniGen's selection applies to "
               "every scored token)")
    sections = [
        f"Model `{args.model}`, {args.num_fewshot}-shot, first {args.limit or 'all'} "
        f"documents per task; {how}. acc_norm: lm-eval's per-character normalisation "
        "(none for WinoGrande). 'same choice as dense': fraction of documents where the "
        "run picks the choice dense vLLM picks; 'mean abs dLL': mean absolute change of a "
        "choice's summed log-likelihood (nats) against dense.",
        "## Per task", results_table(results),
        "## Mean over tasks", mean_md,
        "## Inputs", report.markdown_table(
            ["task", "requests", "truncated", "mean context tokens", "mean continuation tokens"],
            [[n, str(s["requests"]), str(s["truncated"]), f"{s['mean_context_tokens']:.0f}",
              f"{s['mean_continuation_tokens']:.1f}"] for n, s in stats.items()]),
    ]
    png = report.try_plot(args.out.with_suffix(".png"), plot_panels(results),
                          f"{args.num_fewshot}-shot multiple choice, {args.model.name}")
    if png:
        sections.append(f"![acc vs budget]({png.name})")
    report.write_results(args.out, meta, "Multiple choice (lm-eval style) under decode-time "
                         "selection", {**settings, "inputs": stats}, results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
