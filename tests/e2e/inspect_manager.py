# SPDX-License-Identifier: Apache-2.0
"""Runs an in-process InfiniGen engine and checks its block accounting at every step.

Usage: python -m tests.e2e.inspect_manager MODEL OUT.json
Writes what it saw; tests/e2e/test_manager.py asserts on it.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys


def main(model: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from tests.e2e.engines import engine, random_prompts
    from vllm_infinigen.engine_setup import engine_setup
    from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec

    rng = random.Random(11)
    seen = {"steps": 0, "bound_violations": [], "pool_mismatches": [], "aborted": 0}
    with engine(model, kv_manager="infinigen", infinigen_budget=0.2,
                max_num_seqs=32) as llm:
        core = llm.llm_engine.engine_core.engine_core
        scheduler = core.scheduler
        manager = scheduler.kv_cache_manager
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        token_bytes = engine_setup(llm.llm_engine.vllm_config).pool_bytes_per_token
        groups = manager.coordinator.single_type_managers
        block_pool = manager.block_pool
        lengths = [rng.randrange(4, 400) for _ in range(200)]
        prompts = random_prompts(lengths, seed=12)
        # The aborted third asks for 40 tokens and is cut after its first ones.
        to_abort = set(rng.sample(range(200), 200 // 3))
        engine_ = llm.llm_engine
        for idx, prompt in enumerate(prompts):
            max_tokens = 40 if idx in to_abort else rng.randrange(2, 40)
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
            engine_.add_request(str(idx), prompt, params)
        produced: dict[str, int] = {}
        finished: dict[str, str | None] = {}
        while engine_.has_unfinished_requests():
            for output in engine_.step():
                produced[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    finished[output.request_id] = output.outputs[0].finish_reason
            seen["steps"] += 1
            live_blocks = 0
            for request in scheduler.running:
                bound = math.ceil(request.num_tokens / block_size)
                for group in groups:
                    held = [b for b in group.req_to_blocks.get(request.request_id, [])
                            if not b.is_null]
                    limit = 0 if isinstance(group.kv_cache_spec, InfiniGenSparseSpec) else bound
                    if len(held) > limit:
                        seen["bound_violations"].append(
                            [request.request_id, type(group.kv_cache_spec).__name__,
                             len(held), limit])
                    live_blocks += len(held)
            used = block_pool.num_gpu_blocks - 1 - block_pool.get_num_free_blocks()
            gauge = infinigen_gauge(llm, "pool_used_bytes")
            if used != live_blocks or gauge != used * block_size * token_bytes:
                seen["pool_mismatches"].append([seen["steps"], used, live_blocks, gauge])
            # Abort a third mid-stream, once they have produced tokens.
            ready = [str(i) for i in to_abort if produced.get(str(i), 0) >= 1]
            if ready:
                engine_.abort_request(ready)
                to_abort -= {int(r) for r in ready}
                seen["aborted"] += len(ready)
        engine_.step() if engine_.has_unfinished_requests() else None
        seen["free_blocks_at_end"] = block_pool.get_num_free_blocks()
        seen["total_blocks"] = block_pool.num_gpu_blocks - 1
        seen["groups"] = [type(g.kv_cache_spec).__name__ for g in groups]
        seen["pool_used_bytes_at_end"] = infinigen_gauge(llm, "pool_used_bytes")
        seen["device_blocks_at_end"] = infinigen_gauge(llm, "device_blocks")
        seen["pool_capacity_bytes"] = infinigen_gauge(llm, "pool_capacity_bytes")
        seen["never_aborted"] = sorted(to_abort)
        seen["num_finished_length"] = sum(r == "length" for r in finished.values())
    with open(out, "w") as f:
        json.dump(seen, f)


def infinigen_gauge(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == f"vllm:infinigen_{name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
