# SPDX-License-Identifier: Apache-2.0
"""Decode steps of engines as `vllm serve` and `LLM(...)` run them: the engine core in its
own process, polling a core while the worker computes.

    python -m benchmarks.perf.served_step [--model DIR] [--context 128] [--batch 1]
        [--managers vllm infinigen] [--env GOMP_SPINCOUNT=1000] [--rounds 2]
        [--out PATH]

Each round starts one engine per manager and environment (``--env`` adds a configuration
with those variables; the default environment is always measured), in turn, each in a
child process: ``--batch`` requests of ``--context`` random prompt ids, added to the
engine and stepped through ``LLMEngine.step`` as ``LLM.generate`` does. Each step that
gives every request a token is timed where it returns; after the first tokens (the
prompts) and 2 steps of warm-up, three windows of 64 such steps give three mean step
times. One prefill per engine, outside the windows (timing whole generations of the same
prompts would time a prefill, or a prefix-cache hit, in every one).
The decode benchmarks (``decode_latency``, ``step_profile``) run the engine core in
their own process and never see the polling process beside the worker; this does. On
a host with no core to spare the engine process needs a core of its own: vLLM reserves
one beside each worker's OpenMP threads (docs/serving.md).
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

BUNDLED = Path(__file__).resolve().parents[2] / "vllm_infinigen" / "assets" / "stories260k"


WARMUP_STEPS = 2
WINDOWS = 3
WINDOW_STEPS = 64
# Tokens beyond the windows: requests whose prompts end in different steps (a batch's
# chunked prefill) finish in different steps too, and the last steps are not the batch's.
SLACK_TOKENS = 64
TOKENS = 1 + WARMUP_STEPS + WINDOWS * WINDOW_STEPS + SLACK_TOKENS


def child(model: str, manager: str, context: int, batch: int) -> dict[str, Any]:
    """One engine's decode steps (run in a child process)."""
    import vllm_infinigen

    vllm_infinigen.register()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = {"kv_manager": "infinigen"} if manager == "infinigen" else {}
    llm = LLM(model=model, max_model_len=context + TOKENS, kv_cache_memory_bytes=1 << 30,
              seed=0, max_num_seqs=batch, **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.DELTA)
    for index in range(batch):
        prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(context)]}
        engine.add_request(f"served-step-{index}", prompt, params)
    return {"ms_per_step": decode_step_ms(engine, batch)}


def decode_step_ms(engine: Any, batch: int, clock=time.perf_counter) -> list[float]:
    """Steps ``engine`` until its requests finish; the mean milliseconds between steps
    that give each of the ``batch`` requests a token, per window, after the warm-up."""
    stamps = []  # when each step that gave every request a token returned
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if sum(1 for out in outputs if out.outputs and out.outputs[0].token_ids) == batch:
            stamps.append(clock())
    gaps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])][WARMUP_STEPS:]
    if len(gaps) < WINDOWS * WINDOW_STEPS:
        raise RuntimeError(f"{len(gaps)} decode steps of the whole batch, "
                           f"{WINDOWS * WINDOW_STEPS} expected")
    return [statistics.fmean(gaps[k * WINDOW_STEPS:(k + 1) * WINDOW_STEPS])
            for k in range(WINDOWS)]


def measure(model: str, manager: str, context: int, batch: int,
            env: dict[str, str]) -> dict[str, Any]:
    """``child`` in a fresh process with ``env`` added to this one's."""
    return run_child("benchmarks.perf.served_step", [model, manager, context, batch],
                     f"{manager} {env}", env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, manager, context, batch = argv[1], argv[2], int(argv[3]), int(argv[4])
        print_result(child(model, manager, context, batch))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(BUNDLED))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--managers", nargs="+", default=["vllm", "infinigen"])
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for a second setup")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "served_step")
    args = parser.parse_args(argv)
    setups = [{}] + ([dict(item.split("=", 1) for item in args.env)] if args.env else [])
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for manager in args.managers:
            for env in setups:
                steps = measure(args.model, manager, args.context, args.batch, env)["ms_per_step"]
                rows.append({"round": round_index, "manager": manager, "env": env,
                             "ms_per_step": steps})
                print(f"round {round_index} {manager} {env or 'default'}: "
                      f"{[round(s, 2) for s in steps]} ms a step", flush=True)
    table = []
    for manager in args.managers:
        for env in setups:
            steps = [s for r in rows if r["manager"] == manager and r["env"] == env
                     for s in r["ms_per_step"]]
            table.append([manager, " ".join(f"{k}={v}" for k, v in env.items()) or "default",
                          f"{statistics.median(steps):.2f}", f"{min(steps):.2f}-{max(steps):.2f}"])
    report.write_results(
        args.out, report.run_metadata(), "Decode steps of engines as vllm serve runs them",
        vars(args) | {"out": str(args.out)}, rows,
        [f"{args.batch} request(s) of {args.context} prompt ids, {Path(args.model).name}; the "
         "engine core in its own process; each engine's step: the mean time between steps "
         f"that give every request a token, over {WINDOWS} windows of {WINDOW_STEPS} steps "
         f"after the prompts; {args.rounds} rounds of engines started in turn.",
         report.markdown_table(["manager", "environment", "median ms a step", "range"], table)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
