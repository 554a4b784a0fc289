# SPDX-License-Identifier: Apache-2.0
"""``--infinigen-residency device-first`` under a steady load after a burst: how many
steps run resident, against the return after a lull alone (the rule before 2026-11-30).

python -m benchmarks.perf.residency_load [--steps 400] [--out benchmarks/results/residency_load]

The bundled stories260K (2 dense + 3 sparse layers; vLLM's CPU blocks of 128 tokens),
in this process, with the default selection from the first token (min-context 0, as the
accuracy benchmarks) and a KV space of ``BLOCKS`` block ids. At
step 0 a burst of ``BURST`` requests (300-token prompts: 3 blocks in each of the 3
KV-cache groups resident) moves the engine to the pool; from then on a request arrives
every ``ARRIVAL`` steps (60-token prompts, ``LENGTH`` tokens: a block per group), so
that two or three are always live: few enough to run resident, never none. Each
variant runs the same arrivals in an engine of its own:

- ``return under load``: this release (``Residency.restore``: back once the live
  requests fit in half the free blocks, their K/V copied from the pool);
- ``after a lull only``: the same engine with ``Residency.step`` never ready, which
  leaves the return of before, once no request over the pool is live.

Per variant: the steps resident after the first move, the first resident step after it,
the moves each way, the requests whose greedy tokens equal stock vLLM's (a dense engine
with room for all; a resident step attends densely, a step over the pool through the
selection), and the wall time (one CPU run: indicative only). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from benchmarks.harness.engines import engine, with_selection_everywhere
from benchmarks.harness.paths import BUNDLED_MODEL, RESULTS
from benchmarks.harness.report import run_metadata, write_results

BLOCKS = 24  # block ids of the KV space (one is vLLM's null block)
# per block id: 2 dense pages of 128 tokens x 4 KV heads x 32 x K|V in float32, and
# the bounds of 3 sparse layers x 4 KV heads x 8 units x 66 B (tests/e2e/test_residency.py)
BLOCK_BYTES = 2 * 128 * 4 * 32 * 2 * 4 + 3 * 4 * 8 * 66
BURST, BURST_PROMPT, BURST_LENGTH = 6, 300, 40
ARRIVAL, PROMPT, LENGTH = 20, 60, 60
VARIANTS = ("return under load", "after a lull only")


def arrivals(steps: int, seed: int = 0) -> dict[int, list[tuple[list[int], int]]]:
    """{step: [(prompt token ids, max tokens)]}: the burst at 0, then one every ARRIVAL."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [1] + [rng.randrange(3, 500) for _ in range(n - 1)]

    plan = {0: [(prompt(BURST_PROMPT), BURST_LENGTH) for _ in range(BURST)]}
    for step in range(ARRIVAL, steps, ARRIVAL):
        plan[step] = [(prompt(PROMPT), LENGTH)]
    return plan


def run(plan: dict[int, list], steps: int, **llm_kwargs) -> dict:
    """Drives an in-process engine through ``plan``; per step whether it was resident."""
    from vllm import SamplingParams

    from vllm_infinigen.scheduler.metrics import summarize
    from vllm_infinigen.scheduler.residency import residency_of

    with engine(str(BUNDLED_MODEL), enforce_eager=True, max_model_len=512,
                max_num_batched_tokens=512, **with_selection_everywhere(llm_kwargs)) as llm:
        core = llm.llm_engine.engine_core.engine_core
        residency = (residency_of(core.scheduler.kv_cache_manager.block_pool)
                     if llm_kwargs.get("kv_manager") == "infinigen" else None)
        tokens: dict[str, list[int]] = {}
        resident: list[bool] = []
        started = time.perf_counter()
        step = 0
        while step < steps or llm.llm_engine.has_unfinished_requests():
            for index, (prompt, length) in enumerate(plan.get(step, [])):
                params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
                llm.llm_engine.add_request(f"{step}-{index}", {"prompt_token_ids": prompt},
                                           params)
            for out in llm.llm_engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            resident.append(residency is not None and not residency.moved)
            step += 1
        seconds = time.perf_counter() - started
        moves = summarize(llm.get_metrics()).get("residency_moves", {})
    return {"tokens": tokens, "resident": resident, "seconds": seconds, "moves": moves}


def summary(result: dict, stock: dict) -> dict:
    resident = result["resident"]
    moved = resident.index(False) if False in resident else None
    after = resident[moved:] if moved is not None else []
    back = next((moved + i for i, r in enumerate(after) if r), None) if moved is not None else None
    equal = sum(result["tokens"][r] == stock["tokens"][r] for r in stock["tokens"])
    generated = sum(len(t) for t in result["tokens"].values())
    return {"steps": len(resident), "first_move": moved, "first_return": back,
            "resident_after_move": sum(after), "steps_after_move": len(after),
            "moves_to_pool": result["moves"].get("pool", 0),
            "moves_to_device": result["moves"].get("device", 0),
            "equal_to_stock": equal, "requests": len(stock["tokens"]),
            "seconds": round(result["seconds"], 2),
            "tokens_per_s": round(generated / result["seconds"], 1)}


def markdown(rows: dict[str, dict]) -> str:
    head = ("| variant | steps | first move | first return after it | steps resident after "
            "the move | moves to the pool / device | requests equal to stock vLLM | wall s "
            "| tokens/s |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for name, row in rows.items():
        back = "never" if row["first_return"] is None else f"step {row['first_return']}"
        share = row["resident_after_move"] / max(row["steps_after_move"], 1)
        lines.append(
            f"| {name} | {row['steps']} | step {row['first_move']} | {back} | "
            f"{row['resident_after_move']} of {row['steps_after_move']} ({share:.0%}) | "
            f"{row['moves_to_pool']} / {row['moves_to_device']} | "
            f"{row['equal_to_stock']} of {row['requests']} | {row['seconds']} | "
            f"{row['tokens_per_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps with arrivals")
    parser.add_argument("--out", type=Path, default=RESULTS / "residency_load")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    from vllm_infinigen.scheduler.residency import Residency

    plan = arrivals(args.steps)
    stock = run(plan, args.steps, kv_manager="vllm", kv_cache_memory_bytes=32 << 20)
    device_first = dict(kv_manager="infinigen", infinigen_residency="device-first",
                        kv_cache_memory_bytes=BLOCKS * BLOCK_BYTES + 20_000)
    rows = {VARIANTS[0]: summary(run(plan, args.steps, **device_first), stock)}
    ready = Residency.step
    Residency.step = lambda self, fits: ready(self, False)  # never while requests are live
    try:
        rows[VARIANTS[1]] = summary(run(plan, args.steps, **device_first), stock)
    finally:
        Residency.step = ready
    settings = {"blocks": BLOCKS, "burst": [BURST, BURST_PROMPT, BURST_LENGTH],
                "arrival": [ARRIVAL, PROMPT, LENGTH], "steps": args.steps,
                "selection": "the default (budget 0.2, bounds, 16 recent tokens), from the "
                             "first token (min-context 0, as the accuracy benchmarks)"}
    text = markdown(rows)
    write_results(args.out, run_metadata(), "device-first under a steady load after a burst",
                  settings, rows,
                  [f"The bundled stories260K in this process, {BLOCKS} block ids of KV space, "
                   "the default selection from the first token (min-context 0). "
                   f"A burst of {BURST} requests ({BURST_PROMPT}-token "
                   f"prompts, {BURST_LENGTH} tokens) at step 0, then one request every "
                   f"{ARRIVAL} steps ({PROMPT}-token prompts, {LENGTH} tokens) until step "
                   f"{args.steps}: two or three always live. 'after a lull only' is the same "
                   "engine with the return under load turned off (the rule before "
                   "2026-11-30). Stock vLLM: a dense engine with room for all, the same "
                   "arrivals. Wall time: one CPU run each, indicative only.", text])
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
