# SPDX-License-Identifier: Apache-2.0
"""Requests that share a long prefix (a document, a system prompt), with and without
vLLM's prefix caching: time to first token and to the last.

    python -m benchmarks.perf.prefix_reuse [--model DIR] [--prefix 3968] [--suffix 128]
        [--batch 4] [--tokens 32] [--out PATH]
        [--setups vllm infinigen infinigen-no-prefix-caching infinigen-capped
                  infinigen-device-first infinigen-device-first-no-prefix-caching]

Each setup runs in a child process (an ``LLM(...)`` engine as `vllm serve` runs one: the
engine core in its own process), in turn: first one request alone (``--prefix`` shared
prompt ids and ``--suffix`` of its own), then ``--batch`` more that share its prefix,
added at once. Each request's time to first token is measured from when the requests
were added to the step that returned its first token, through ``LLMEngine.step`` as
``LLM.generate`` does; the last token's time is the batch's. Setups: ``vllm`` (stock,
prefix caching on: vLLM's default), ``infinigen`` (the default, which keeps it on),
``infinigen-no-prefix-caching`` (what InfiniGen did before it kept prefix caching on) and,
when named, ``infinigen-capped`` (a pool capped at 0.25 GiB: each KV head evicts on its
own, and the prompt rows attend over what each holds) and ``infinigen-device-first``
(resident: vLLM's kernel over the sparse layers' own blocks, which a hit shares),
with or without (``-no-prefix-caching``, as before b5e8156) prefix caching.
The default model is the decode benchmarks' head_dim-128 one (``models.GQA128_MODEL``,
random weights: the default budget of 0.2 binds whatever the weights).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report
from benchmarks.harness.child import print_result, run_child

SETUPS = {
    "vllm": {},
    "infinigen": {"kv_manager": "infinigen"},
    "infinigen-no-prefix-caching": {"kv_manager": "infinigen", "enable_prefix_caching": False},
    # A capped pool (the default model: ~9,500 tokens per layer and KV head in float32,
    # twice what the run holds at once; an uncapped one would want ~7 GiB).
    "infinigen-capped": {"kv_manager": "infinigen", "infinigen_cpu_pool_gib": 0.25},
    # Dense while memory allows (resident here: 1 GiB holds ~32K tokens of every layer);
    # before b5e8156 device-first turned prefix caching off.
    "infinigen-device-first": {"kv_manager": "infinigen", "infinigen_residency": "device-first"},
    "infinigen-device-first-no-prefix-caching": {
        "kv_manager": "infinigen", "infinigen_residency": "device-first",
        "enable_prefix_caching": False},
}
# What a run without --setups measures (the others: when named)
DEFAULT_SETUPS = ("vllm", "infinigen", "infinigen-no-prefix-caching")


def timed(engine: Any, prompts: list[dict], params: Any, tag: str,
          clock=time.perf_counter) -> dict[str, Any]:
    """Adds ``prompts`` at once and steps ``engine`` until they finish: seconds from the
    start to each request's first token, and to the last token of all."""
    start = clock()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = clock() - start
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(first)} of {len(prompts)} requests gave a token")
    return {"ttft_s": [first[f"{tag}-{index}"] for index in range(len(prompts))],
            "total_s": clock() - start}


def child(model: str, setup: str, prefix: int, suffix: int, batch: int,
          tokens: int) -> dict[str, Any]:
    """One engine: a request alone, then ``batch`` sharing its prefix (a child process)."""
    import vllm_infinigen

    vllm_infinigen.register()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=prefix + suffix + tokens, seed=0, disable_log_stats=False,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=batch, **SETUPS[setup])
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def ids(count: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(count)]

    shared = ids(prefix)
    prompts = [{"prompt_token_ids": shared + ids(suffix)} for _ in range(batch + 1)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    engine = llm.llm_engine
    caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    result = {"prefix_caching": caching,
              "alone": timed(engine, prompts[:1], params, "alone"),
              "batch": timed(engine, prompts[1:], params, "batch")}
    metrics = llm.get_metrics()
    result["hit_tokens"] = int(sum(metric.value for metric in metrics
                                   if metric.name == "vllm:prefix_cache_hits"))
    if SETUPS[setup].get("infinigen_residency") == "device-first":
        from vllm_infinigen.scheduler.metrics import summarize

        result["residency_moves"] = summarize(metrics).get("residency_moves", {})
    return result


def measure(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    """``child`` in a fresh process."""
    return run_child("benchmarks.perf.prefix_reuse", [args.model, setup, args.prefix,
                                                      args.suffix, args.batch, args.tokens], setup)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, setup = argv[1], argv[2]
        prefix, suffix, batch, tokens = (int(value) for value in argv[3:7])
        print_result(child(model, setup, prefix, suffix, batch, tokens))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the decode benchmark's")
    parser.add_argument("--prefix", type=int, default=3968)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS),
                        choices=list(SETUPS))
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "prefix_reuse")
    args = parser.parse_args(argv)
    if args.model is None:
        from benchmarks.harness import models

        args.model = str(models.long_context_model(**models.GQA128_MODEL))
    rows, table = [], []
    for setup in args.setups:
        result = measure(args, setup)
        rows.append({"setup": setup, **result})
        alone, batch = result["alone"], result["batch"]
        table.append([setup, "on" if result["prefix_caching"] else "off",
                      str(result["hit_tokens"]),
                      f"{alone['ttft_s'][0]:.2f}", f"{statistics.median(batch['ttft_s']):.2f}",
                      f"{max(batch['ttft_s']):.2f}", f"{batch['total_s']:.2f}"])
        print(f"{setup}: {table[-1][1:]}", flush=True)
    moves = [f"{row['setup']}: {row['residency_moves'] or 'none'}" for row in rows
             if "residency_moves" in row]
    report.write_results(
        args.out, report.run_metadata(), "Requests sharing a prefix, with vLLM's prefix caching",
        vars(args) | {"out": str(args.out)}, rows,
        [f"One request of {args.prefix} shared + {args.suffix} own prompt ids alone, then "
         f"{args.batch} sharing its prefix at once, {args.tokens} tokens each, "
         f"{Path(args.model).name}; the engine core in its own process; seconds from adding "
         "the requests.",
         report.markdown_table(["setup", "prefix caching", "prompt tokens hit",
                                "alone: first token s",
                                "batch: median first token s", "batch: last first token s",
                                "batch: all tokens s"], table),
         *([f"`device-first` moves between the device blocks and the pool: "
            f"{'; '.join(moves)}."] if moves else [])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
