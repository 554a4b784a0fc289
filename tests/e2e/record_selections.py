# SPDX-License-Identifier: Apache-2.0
"""Records every select_tokens call of a real engine (run as a script).

Usage: python -m tests.e2e.record_selections MODEL OUT.pt
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that
wrapping ``vllm_infinigen.kernels.select_tokens`` sees the worker's calls.
"""

from __future__ import annotations

import os
import sys

import torch


def main(model: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_infinigen import kernels
    from vllm_infinigen.kernels.reference import partial_keys_of

    from tests.e2e.engines import engine, greedy_tokens, random_prompts

    records = []
    original = kernels.select_tokens
    speculation = ["previous-layer"]  # the setting of the calls being recorded

    def recording(partial_query, partial_keys, block_table, context_lens, **kwargs):
        positions, num_selected = original(partial_query, partial_keys, block_table,
                                           context_lens, **kwargs)
        # The reference's inputs: [B, H_q, R] queries, [B, N, H_kv, R] keys.
        width = int(context_lens.max())
        row_map = kwargs.pop("row_map", None)
        assert row_map is None, "record with an uncapped pool"
        records.append({
            "partial_query": partial_query.flatten(1, 2).clone(),
            "partial_keys": partial_keys_of(partial_keys, block_table, width),
            "context_lens": context_lens.clone(),
            "kwargs": dict(kwargs),
            "positions": positions.to(torch.int64),
            "valid": positions >= 0,
            "num_selected": num_selected.clone(),
            "speculation": speculation[0],
        })
        return positions, num_selected

    kernels.select_tokens = recording
    with engine(model, kv_manager="infinigen", infinigen_budget=0.2,
                infinigen_recent_tokens=2) as llm:
        prompts = random_prompts([30, 200, 420], seed=7)
        greedy_tokens(llm, prompts, max_tokens=12)
        # The same requests with each layer selecting for itself.
        speculation[0] = "same-layer"
        llm.collective_rpc("set_infinigen_selection", kwargs={"speculation": "same-layer"})
        greedy_tokens(llm, prompts, max_tokens=12)
    torch.save(records, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
