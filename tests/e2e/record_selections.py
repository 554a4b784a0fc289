# SPDX-License-Identifier: Apache-2.0
"""Records every select_tokens call of a real engine (run as a script).

Usage: python -m tests.e2e.record_selections MODEL OUT.pt
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that
wrapping ``vllm_infinigen.runtime.select_tokens`` sees the worker's calls.
"""

from __future__ import annotations

import os
import sys

import torch


def main(model: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_infinigen import runtime

    from tests.e2e.engines import engine, greedy_tokens, random_prompts

    records = []
    original = runtime.select_tokens

    def recording(partial_query, partial_keys, context_lens, **kwargs):
        selection = original(partial_query, partial_keys, context_lens, **kwargs)
        records.append({
            "partial_query": partial_query.clone(),
            "partial_keys": partial_keys.clone(),
            "context_lens": context_lens.clone(),
            "kwargs": dict(kwargs),
            "positions": selection.positions.clone(),
            "valid": selection.valid.clone(),
            "num_selected": selection.num_selected.clone(),
        })
        return selection

    runtime.select_tokens = recording
    with engine(model, kv_manager="infinigen", infinigen_budget=0.2,
                infinigen_recent_tokens=2) as llm:
        greedy_tokens(llm, random_prompts([30, 200, 420], seed=7), max_tokens=12)
    torch.save(records, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
