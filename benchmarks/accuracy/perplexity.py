# SPDX-License-Identifier: Apache-2.0
"""Perplexity of a text under decode-time attention (dense vLLM or InfiniGen).

Each window is P prompt tokens, prefilled densely, then S tokens teacher-forced
through decode, where InfiniGen's selection applies::

    text tokens  [BOS story BOS story ...]
    window w     [ P prompt tokens | S scored tokens ]   (P + S <= max_model_len)

Example::

    python benchmarks/accuracy/perplexity.py --kv-manager vllm infinigen --budget 0.2

Several ``--kv-manager`` values run one after the other, one engine at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

from teacher_forcing import engine_kwargs, perplexity, score_continuations

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


def run_engine(args: argparse.Namespace, kv_manager: str,
               windows: list[tuple[list[int], list[int]]]) -> dict:
    """Starts one engine, scores every window in one batched call, shuts it down."""
    import vllm_infinigen  # noqa: F401  (adds the kv_manager keyword)
    from vllm import LLM

    from vllm_infinigen.metrics import summarize

    infinigen = {}
    if kv_manager == "infinigen":
        infinigen = {"infinigen_budget": args.budget, "infinigen_alpha": args.alpha}
    llm = LLM(
        model=args.model,
        kv_manager=kv_manager,
        **infinigen,
        **engine_kwargs(),
        dtype="float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    try:
        start = time.perf_counter()
        scores = score_continuations(llm, *zip(*windows))
        elapsed = time.perf_counter() - start
        counters = summarize(llm.get_metrics())
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    logprobs = [logprob for window in scores for logprob in window]
    selected = sum(counters.get("selected_tokens", {}).values())
    candidates = sum(counters.get("candidate_tokens", {}).values())
    return {
        "kv_manager": kv_manager,
        "budget": args.budget if kv_manager == "infinigen" else None,
        "alpha": args.alpha if kv_manager == "infinigen" else None,
        "num_windows": len(windows),
        "num_scored_tokens": len(logprobs),
        "mean_nll": -sum(logprobs) / len(logprobs),
        "perplexity": perplexity(logprobs),
        "selected_fraction": selected / candidates if candidates else None,
        "score_seconds": elapsed,
        "window_logprobs": scores,
    }


def print_table(results: list[dict]) -> None:
    dense = next((r for r in results if r["kv_manager"] == "vllm"), None)
    print(f"{'kv_manager':>10} {'budget':>6} {'windows':>7} {'tokens':>6} "
          f"{'mean_nll':>8} {'ppl':>7} {'d_nll':>7} {'selected':>8} {'seconds':>7}")
    for r in results:
        d_nll = "" if dense is None else f"{r['mean_nll'] - dense['mean_nll']:+.4f}"
        budget = "" if r["budget"] is None else f"{r['budget']:g}"
        fraction = "" if r["selected_fraction"] is None else f"{r['selected_fraction']:.3f}"
        print(f"{r['kv_manager']:>10} {budget:>6} {r['num_windows']:>7} "
              f"{r['num_scored_tokens']:>6} {r['mean_nll']:>8.4f} {r['perplexity']:>7.3f} "
              f"{d_nll:>7} {fraction:>8} {r['score_seconds']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", default=DEFAULT_TEXT, help="UTF-8 text file")
    parser.add_argument("--kv-manager", nargs="+", required=True,
                        choices=["vllm", "infinigen"],
                        help="one or more, run one after the other")
    parser.add_argument("--budget", type=float, default=0.2, help="InfiniGen budget")
    parser.add_argument("--alpha", type=float, default=None,
                        help="InfiniGen alpha (default: the paper's value)")
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

    results = [run_engine(args, kv_manager, windows) for kv_manager in args.kv_manager]
    print(f"\n{args.text}: {len(windows)} window(s) of {args.prompt_tokens} prompt + "
          f"{args.score_tokens} scored tokens, model {args.model}")
    print_table(results)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}))
    return 0 if all(math.isfinite(r["mean_nll"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
