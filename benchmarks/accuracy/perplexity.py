# SPDX-License-Identifier: Apache-2.0
"""Perplexity of a text under decode-time selection: dense vLLM and every policy per budget.

Each window is P prompt tokens, prefilled densely, then S scored tokens, each
predicted under the selection::

    text tokens  [BOS book ...]                     (Frankenstein: held out)
    window w     [ P prompt tokens | S scored tokens ]   (P + S <= max_model_len)

Scoring (``--scoring``):

- ``decode`` (default): the S tokens are teacher-forced through decode steps
  (``teacher_forcing.py``), one step per token, as in generation;
- ``eval-prefill``: one prefill per window on an engine in InfiniGen's
  evaluation mode (``--infinigen-eval-dense-prefix P``): rows past P attend over
  the selection as decode rows do. Same numbers, much faster; H2O has no
  evaluation mode (its scores accumulate step by step) and is scored by decode.

By default the model is ``../shared/models/gutenberg-llama-2k`` (2,048-token
context) on its held-out book, Frankenstein; ``--model``/``--text`` take any HF
model directory and UTF-8 text. Example::

    flock /tmp/engine.lock python -m benchmarks.accuracy.perplexity \\
        --policy infinigen h2o streaming quest --budget 0.05 0.1 0.2 0.4

One engine per ``--kv-manager``; an InfiniGen engine is switched between
policies and budgets with ``set_infinigen_selection``. Results:
``benchmarks/results/perplexity.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import report
from benchmarks.accuracy import sweeps
from benchmarks.harness import paths
from benchmarks.accuracy.teacher_forcing import (
    perplexity,
    prefill_scores,
    score_continuations,
)

GUTENBERG = paths.shared_path("models/gutenberg-llama-2k")
FRANKENSTEIN = paths.shared_path("data/text/gutenberg-frankenstein.txt")
STORIES = paths.shared_path("models/stories260k-vllm-cpu")
TINYSTORIES = paths.shared_path("data/text/tinystories-sample.txt")
DEFAULT_OUT = paths.RESULTS / "perplexity"
STORY_SEPARATOR = "<|endoftext|>"
SCORINGS = ("decode", "eval-prefill")


def tokenize_text(model: str, text: str) -> list[int]:
    """Token ids of ``text`` as ``[BOS] story [BOS] story ...``.

    Stories are separated by ``<|endoftext|>`` (TinyStories); a text without
    separators (a book) is one story.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    token_ids: list[int] = []
    for story in text.split(STORY_SEPARATOR):
        if story.strip():
            token_ids += tokenizer.encode(story.strip())
    return token_ids


def cut_windows(
    token_ids: list[int], prompt_tokens: int, score_tokens: int, num_windows: int | None
) -> list[tuple[list[int], list[int]]]:
    """Consecutive, non-overlapping (prompt, continuation) windows from the start.

    Raises:
        ValueError: If the text holds fewer than ``num_windows`` windows (or none).
    """
    size = prompt_tokens + score_tokens
    available = len(token_ids) // size
    wanted = available if num_windows is None else num_windows
    if available == 0 or wanted > available:
        raise ValueError(
            f"the text has {len(token_ids)} tokens: {available} window(s) of "
            f"{prompt_tokens} + {score_tokens} tokens, {wanted} wanted; lower "
            "--num-windows, --prompt-tokens or --score-tokens"
        )
    windows = []
    for start in range(0, wanted * size, size):
        window = token_ids[start : start + size]
        windows.append((window[:prompt_tokens], window[prompt_tokens:]))
    return windows


def scoring_of(requested: str, setting: dict | None) -> str:
    """The scoring a setting gets: H2O and dense vLLM are always scored by decode.

    Dense vLLM has no evaluation mode (its prefill is dense whatever the mode,
    and decode gives the same numbers); H2O's has none by design.
    """
    if requested == "eval-prefill" and setting is not None and sweeps.policy_of(setting) != "h2o":
        return "eval-prefill"
    return "decode"


def score(llm, windows: list[tuple[list[int], list[int]]], kv_manager: str,
          setting: dict | None, scoring: str) -> dict:
    """Scores every window in one batched call; counters of this call alone."""
    prompts, continuations = zip(*windows)
    mode = scoring_of(scoring, setting)
    if mode == "eval-prefill":
        llm.collective_rpc("set_infinigen_selection",
                           kwargs={"eval_dense_prefix": len(prompts[0])})
    start = time.perf_counter()
    try:
        with sweeps.SelectionMeter(llm) as meter:
            if mode == "eval-prefill":
                scores = prefill_scores(llm, prompts, continuations)
            else:
                scores = score_continuations(llm, prompts, continuations)
    finally:
        if mode == "eval-prefill":
            llm.collective_rpc("set_infinigen_selection", kwargs={"eval_dense_prefix": None})
    elapsed = time.perf_counter() - start
    logprobs = [logprob for window in scores for logprob in window]
    label = kv_manager if setting is None else (
        "infinigen select-all (control)" if sweeps.is_control(setting)
        else sweeps.policy_of(setting))
    return {
        "label": label,
        "kv_manager": kv_manager,
        "policy": sweeps.policy_of(setting),
        "budget": None if setting is None else setting.get("budget"),
        "alpha": None if setting is None else setting.get("alpha"),
        "scoring": mode,
        "num_windows": len(windows),
        "num_scored_tokens": len(logprobs),
        "mean_nll": -sum(logprobs) / len(logprobs),
        "perplexity": perplexity(logprobs),
        "selected_fraction": meter.fraction,
        "score_seconds": elapsed,
        "window_nll": [-sum(window) / len(window) for window in scores],
    }


def run_engine(args: argparse.Namespace, kv_manager: str,
               windows: list[tuple[list[int], list[int]]]) -> list[dict]:
    """One engine: dense vLLM scores once; InfiniGen once per (policy, budget) and the control."""
    settings = sweeps.selection_grid(args.budget, args.policy,
                              select_all_control=args.select_all_control)
    infinigen = None
    if kv_manager == "infinigen":
        infinigen = {"budget": args.budget[0], "alpha": args.alpha,
                     "sink_tokens": args.sink_tokens, "recent_tokens": args.recent_tokens}
    results = []
    with sweeps.start_engine(str(args.model), kv_manager, max_model_len=args.max_model_len,
                             infinigen=infinigen, kv_cache_memory_bytes=args.kv_cache_bytes,
                             kv_cache_dtype=args.kv_cache_dtype) as llm:
        for setting in sweeps.sweep(llm, kv_manager, settings):
            result = score(llm, windows, kv_manager, setting, args.scoring)
            print(f"[{result['label']} budget {result['budget']}] perplexity "
                  f"{result['perplexity']:.3f} ({result['scoring']}, "
                  f"{result['score_seconds']:.0f} s)", file=sys.stderr, flush=True)
            results.append(result)
    return results


def results_table(results: Sequence[dict]) -> str:
    """setting | budget | scoring | NLL | perplexity | vs dense | selected fraction."""
    dense = next((r for r in results if r["policy"] is None), None)
    rows = []
    for r in results:
        ratio = None if dense is None else r["perplexity"] / dense["perplexity"]
        rows.append([r["label"], report.cell(r["budget"], "g"), r["scoring"],
                     f"{r['mean_nll']:.4f}", f"{r['perplexity']:.3f}",
                     report.cell(ratio, ".3f"), report.cell(r["selected_fraction"], ".3f"),
                     f"{r['score_seconds']:.0f}"])
    return report.markdown_table(
        ["setting", "budget", "scoring", "NLL (nats/token)", "perplexity", "÷ dense",
         "selected fraction", "seconds"], rows)


def budget_table(results: Sequence[dict]) -> str:
    """Perplexity per policy (rows) and budget (columns)."""
    budgets = sorted({r["budget"] for r in results
                      if r["policy"] is not None and not sweeps.is_control(r)})
    by = {(r["policy"], r["budget"]): r for r in results if not sweeps.is_control(r)}
    rows = []
    for policy in dict.fromkeys(r["policy"] for r in results
                                if r["policy"] is not None and not sweeps.is_control(r)):
        rows.append([policy, *[report.cell(by.get((policy, b), {}).get("perplexity"), ".3f")
                               for b in budgets]])
    return report.markdown_table(["policy", *[f"budget {b:g}" for b in budgets]], rows)


def plot_panels(results: Sequence[dict]) -> list[report.Panel]:
    """Perplexity vs budget per policy; dense vLLM (and the control) as lines."""
    panel = report.Panel("perplexity (lower is better)", "perplexity")
    for r in results:
        if r["policy"] is None:
            panel.references["dense vLLM"] = r["perplexity"]
        elif sweeps.is_control(r):
            panel.references["select-all control"] = r["perplexity"]
        else:
            panel.series.setdefault(r["policy"], []).append((r["budget"], r["perplexity"]))
    return [panel]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: gutenberg-llama-2k if present, "
                             "else stories260k-vllm-cpu)")
    parser.add_argument("--text", type=Path, default=None,
                        help="UTF-8 text (default: Frankenstein for gutenberg-llama-2k, "
                             "the TinyStories sample otherwise)")
    parser.add_argument("--kv-manager", nargs="+", default=list(sweeps.KV_MANAGERS),
                        choices=sweeps.KV_MANAGERS, help="one engine each, one after the other")
    sweeps.add_selection_options(parser, [0.05, 0.1, 0.2, 0.4], sweeps.POLICIES)
    parser.add_argument("--alpha", type=float, default=None,
                        help="InfiniGen alpha (default: the paper's value)")
    parser.add_argument("--sink-tokens", type=int, default=None,
                        help="--infinigen-sink-tokens (default: the engine's)")
    parser.add_argument("--recent-tokens", type=int, default=None,
                        help="--infinigen-recent-tokens (default: the engine's; 0 for "
                             "InfiniGen beside a baseline policy)")
    parser.add_argument("--scoring", choices=SCORINGS, default="decode")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="P: dense-prefill tokens per window")
    parser.add_argument("--score-tokens", type=int, default=960,
                        help="S: scored tokens per window")
    parser.add_argument("--num-windows", type=int, default=8,
                        help="W (0: every whole window in the text)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: P + S + 1")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    sweeps.add_kv_cache_dtype_option(parser)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output path without suffix")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = GUTENBERG if GUTENBERG.exists() else STORIES
    if args.text is None:
        args.text = FRANKENSTEIN if args.model == GUTENBERG else TINYSTORIES
    sweeps.check_budgets(parser, args.budget)
    if min(args.sink_tokens or 0, args.recent_tokens or 0) < 0:
        parser.error("--sink-tokens and --recent-tokens must be >= 0")
    if args.prompt_tokens < 1 or args.score_tokens < 1:
        parser.error("--prompt-tokens and --score-tokens must be >= 1")
    if args.max_model_len is None:
        args.max_model_len = args.prompt_tokens + args.score_tokens + 1
    if args.prompt_tokens + args.score_tokens > args.max_model_len:
        parser.error(f"--prompt-tokens + --score-tokens must be <= --max-model-len "
                     f"({args.max_model_len})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sweeps.inputs_missing(args.model, args.text):
        return 0
    token_ids = tokenize_text(str(args.model), Path(args.text).read_text(encoding="utf-8"))
    windows = cut_windows(token_ids, args.prompt_tokens, args.score_tokens,
                          args.num_windows or None)
    with sweeps.kv_cache_dtype_run(args.kv_cache_dtype) as attention:
        results = [result for kv_manager in args.kv_manager
                   for result in run_engine(args, kv_manager, windows)]

    meta = report.run_metadata(model=str(args.model), text=str(args.text))
    sections = [
        f"{Path(args.text).name}: {len(windows)} window(s) of {args.prompt_tokens} dense "
        f"prompt tokens + {args.score_tokens} scored tokens ({len(windows) * args.score_tokens} "
        f"scored in all), model {Path(args.model).name}. Scoring: `decode` = each scored "
        "token teacher-forced through a decode step; `eval-prefill` = InfiniGen's evaluation "
        "mode (`--infinigen-eval-dense-prefix`), the same rule in one prefill."
        + (f" {attention}." if attention else ""),
        "## Perplexity per policy and budget", budget_table(results),
        "## Every setting", results_table(results),
        "'select all (control)': InfiniGen at budget 1 with alpha 1e4 selects every token, "
        "so it must equal dense vLLM. Selected fraction: selected / candidate tokens of the "
        "sparse layers, from the counters of that setting's scoring alone.",
    ]
    png = report.try_plot(args.out.with_suffix(".png"), plot_panels(results),
                          f"{Path(args.model).name} on {Path(args.text).name}")
    if png:
        sections.append(f"![perplexity vs budget]({png.name})")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report.write_results(args.out, meta, "Perplexity under decode-time selection", settings,
                         results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0 if all(math.isfinite(r["mean_nll"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
