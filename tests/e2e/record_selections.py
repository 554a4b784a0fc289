# SPDX-License-Identifier: Apache-2.0
"""Records every select_tokens call of a real engine (``record``, or run as a script).

Usage: python -m tests.e2e.record_selections MODEL OUT.pt
The engine runs in the caller's process (``tests.e2e.engines.engine``), so that
wrapping ``vllm_infinigen.platforms.cpu.kernels.select_tokens`` sees the worker's
calls; the wrappers are removed when the recording ends.
Calls made by the previous-layer speculation also record what went into the
partial query (the speculating layer's attention input, the positions, the
target layer and its skew), so that a test can recompute the query on its own.
The output holds the records and each request's tokens (prompt + generated).
"""

from __future__ import annotations

import sys

import torch

PROMPT_LENGTHS = [30, 200, 420]
MAX_TOKENS = 12
BUDGET = 0.2


def record(model: str) -> dict:
    """{"records": every select_tokens call, "sequences": each request's tokens}."""
    from vllm_infinigen.platforms.cpu import kernels
    from tests.reference.layouts import partial_keys_of
    from vllm_infinigen.policies import infinigen as infinigen_policy

    from tests.e2e.engines import engine, greedy_tokens, random_prompts

    records = []
    original = kernels.select_tokens
    original_partial_query = infinigen_policy.partial_query
    speculation = ["previous-layer"]  # the setting of the calls being recorded
    query_inputs: list[dict] = []  # of the partial query the next call scores

    def recording_partial_query(target, hidden, positions):
        query_inputs.append({"layer_idx": target.layer_idx, "hidden": hidden.clone(),
                             "positions": positions.clone(), "skew": target.skew.clone()})
        return original_partial_query(target, hidden, positions)

    def recording(partial_query, partial_keys, block_table, context_lens, token_caps,
                  **kwargs):
        positions, num_selected = original(partial_query, partial_keys, block_table,
                                           context_lens, token_caps, **kwargs)
        # The reference's inputs: [B, H_q, R] queries, [B, N, H_kv, R] keys.
        width = int(context_lens.max())
        row_map = kwargs.pop("row_map", None)
        assert row_map is None, "record with an uncapped pool"
        records.append({
            "partial_query": partial_query.flatten(1, 2).clone(),
            "partial_keys": partial_keys_of(partial_keys, block_table, width),
            "context_lens": context_lens.clone(),
            # The engine's budget: the reference computes its own caps from it.
            "kwargs": {**kwargs, "budget": BUDGET},
            "token_caps": token_caps.clone(),
            "positions": positions.to(torch.int64),
            "valid": positions >= 0,
            "num_selected": num_selected.clone(),
            "speculation": speculation[0],
            "query_inputs": query_inputs.pop() if query_inputs else None,
        })
        return positions, num_selected

    kernels.select_tokens = recording
    infinigen_policy.partial_query = recording_partial_query
    try:
        # The partial keys: the reference scores them from the recorded skew (the int
        # keys are held to their reference in tests/unit/test_int_keys.py).
        with engine(model, kv_manager="infinigen", infinigen_speculation_keys="partial",
                    infinigen_budget=BUDGET,
                    infinigen_recent_tokens=2) as llm:
            prompts = random_prompts(PROMPT_LENGTHS, seed=7)
            outputs = greedy_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            # The same requests with each layer selecting for itself.
            speculation[0] = "same-layer"
            llm.collective_rpc("set_infinigen_selection", kwargs={"speculation": "same-layer"})
            greedy_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    finally:
        kernels.select_tokens = original
        infinigen_policy.partial_query = original_partial_query
    sequences = [prompt["prompt_token_ids"] + tokens for prompt, tokens in zip(prompts, outputs)]
    return {"records": records, "sequences": sequences}


def main(model: str, out: str) -> None:
    torch.save(record(model), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
