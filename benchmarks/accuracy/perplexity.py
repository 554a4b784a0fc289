# SPDX-License-Identifier: Apache-2.0
"""Perplexity of a text under decode-time attention (dense vLLM or InfiniGen).

Each window is P prompt tokens, prefilled densely, then S tokens teacher-forced
through decode, where InfiniGen's selection applies::

    text tokens  [BOS story BOS story ...]
    window w     [ P prompt tokens | S scored tokens ]   (P + S <= max_model_len)

Example::

    python benchmarks/accuracy/perplexity.py --kv-manager vllm infinigen --budget 0.2

Several ``--kv-manager`` values run one after the other, one engine at a time.
InfiniGen sweeps every combination of ``--budget``, ``--sink-tokens`` and
``--recent-tokens`` on one engine, switching with ``set_infinigen_selection``::

    python benchmarks/accuracy/perplexity.py --kv-manager infinigen \
        --budget 0.05 0.2 --sink-tokens 0 4 --recent-tokens 0 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.accuracy.harness import SelectionMeter, start_engine  # noqa: E402
from benchmarks.accuracy.teacher_forcing import (  # noqa: E402
    perplexity,
    score_continuations,
)

DEFAULT_MODEL = "/work/shared/models/stories260k-vllm-cpu"
DEFAULT_TEXT = "/work/shared/data/text/tinystories-sample.txt"
STORY_SEPARATOR = "<|endoftext|>"


def tokenize_text(model: str, text: str) -> list[int]:
    """Token ids of ``text`` as ``[BOS] story [BOS] story ...``.

    Stories are separated by ``<|endoftext|>`` (TinyStories); a text without
    separators is one story.
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


def selection_settings(args: argparse.Namespace) -> list[dict]:
    """Every (budget, sink, recent) combination, in command-line order."""
    return [
        {"budget": budget, "sink_tokens": sink, "recent_tokens": recent}
        for budget, sink, recent in itertools.product(
            args.budget, args.sink_tokens, args.recent_tokens)
    ]


def score(llm, windows: list[tuple[list[int], list[int]]], kv_manager: str,
          selection: dict | None, alpha: float | None) -> dict:
    """Scores every window in one batched call; counters of this call alone."""
    start = time.perf_counter()
    with SelectionMeter(llm) as meter:
        scores = score_continuations(llm, *zip(*windows))
    elapsed = time.perf_counter() - start
    logprobs = [logprob for window in scores for logprob in window]
    return {
        "kv_manager": kv_manager,
        "budget": None, "sink_tokens": None, "recent_tokens": None,
        **(selection or {}),
        "alpha": alpha,
        "num_windows": len(windows),
        "num_scored_tokens": len(logprobs),
        "mean_nll": -sum(logprobs) / len(logprobs),
        "perplexity": perplexity(logprobs),
        "selected_fraction": meter.fraction,
        "score_seconds": elapsed,
        "window_logprobs": scores,
    }


def run_engine(args: argparse.Namespace, kv_manager: str,
               windows: list[tuple[list[int], list[int]]]) -> list[dict]:
    """Starts one engine, scores every window per selection setting, shuts it down.

    Dense vLLM scores once; InfiniGen scores once per ``selection_settings``,
    changed on the running engine.
    """
    infinigen = None
    if kv_manager == "infinigen":
        infinigen = {"budget": args.budget[0], "alpha": args.alpha}
    with start_engine(args.model, kv_manager, max_model_len=args.max_model_len,
                      infinigen=infinigen, kv_cache_memory_bytes=64 << 20) as llm:
        if kv_manager != "infinigen":
            return [score(llm, windows, kv_manager, None, None)]
        results = []
        for selection in selection_settings(args):
            changes = selection if args.alpha is None else {**selection, "alpha": args.alpha}
            llm.collective_rpc("set_infinigen_selection", kwargs=changes)
            results.append(score(llm, windows, kv_manager, selection, args.alpha))
        return results


def markdown_table(results: list[dict]) -> str:
    """mode | budget | sink | recent | NLL | perplexity | selected fraction."""
    def cell(value, spec: str = "") -> str:
        return "" if value is None else format(value, spec)

    lines = ["| mode | budget | sink | recent | NLL (nats/token) | perplexity "
             "| selected fraction |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['kv_manager']} | {cell(r['budget'], 'g')} | {cell(r['sink_tokens'])} "
            f"| {cell(r['recent_tokens'])} | {r['mean_nll']:.4f} | {r['perplexity']:.3f} "
            f"| {cell(r['selected_fraction'], '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", default=DEFAULT_TEXT, help="UTF-8 text file")
    parser.add_argument("--kv-manager", nargs="+", required=True,
                        choices=["vllm", "infinigen"],
                        help="one or more, run one after the other")
    parser.add_argument("--budget", type=float, nargs="+", default=[0.2],
                        help="InfiniGen budget(s)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="InfiniGen alpha (default: the paper's value)")
    parser.add_argument("--sink-tokens", type=int, nargs="+", default=[0],
                        help="InfiniGen sink window(s): first tokens always attended")
    parser.add_argument("--recent-tokens", type=int, nargs="+", default=[0],
                        help="InfiniGen recent window(s): last tokens always attended")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="P: dense-prefill tokens per window")
    parser.add_argument("--score-tokens", type=int, default=400,
                        help="S: teacher-forced, scored tokens per window")
    parser.add_argument("--num-windows", type=int, default=None,
                        help="W (default: every whole window in the text)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--json", help="write the results (with per-token logprobs) here")
    args = parser.parse_args(argv)

    for path, default in ((args.text, DEFAULT_TEXT), (args.model, DEFAULT_MODEL)):
        if not Path(path).exists():
            if path == default:
                print(f"skipped: default input {path} is absent", file=sys.stderr)
                return 0
            parser.error(f"no such file or directory: {path}")
    if not all(0 < budget <= 1 for budget in args.budget):
        parser.error("--budget values must be in (0, 1]")
    if min(args.sink_tokens + args.recent_tokens) < 0:
        parser.error("--sink-tokens and --recent-tokens must be >= 0")
    if args.prompt_tokens < 1 or args.score_tokens < 1:
        parser.error("--prompt-tokens and --score-tokens must be >= 1")
    if args.prompt_tokens + args.score_tokens > args.max_model_len:
        parser.error(f"--prompt-tokens + --score-tokens must be <= --max-model-len "
                     f"({args.max_model_len})")
    token_ids = tokenize_text(args.model, Path(args.text).read_text(encoding="utf-8"))
    try:
        windows = cut_windows(token_ids, args.prompt_tokens, args.score_tokens,
                              args.num_windows)
    except ValueError as e:
        parser.error(str(e))

    results = [result for kv_manager in args.kv_manager
               for result in run_engine(args, kv_manager, windows)]
    print(f"\n{args.text}: {len(windows)} window(s) of {args.prompt_tokens} prompt + "
          f"{args.score_tokens} scored tokens, model {args.model}\n")
    print(markdown_table(results))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}))
    return 0 if all(math.isfinite(r["mean_nll"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
