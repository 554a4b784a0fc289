# SPDX-License-Identifier: Apache-2.0
"""Offline engines of the end-to-end tests: small, eager, selecting at every context."""

from __future__ import annotations

import random

from benchmarks.harness import engines
from benchmarks.harness.engines import infinigen_kwargs, with_selection_everywhere

TEST_ENGINE = dict(
    max_model_len=512,
    kv_cache_memory_bytes=32 << 20,
    enforce_eager=True,
    # Small steps: long prompts are chunked and share steps with decodes.
    max_num_batched_tokens=128,
)
# ``engines.SELECT_ALL`` as ``engine`` keyword arguments.
SELECT_ALL = {"kv_manager": "infinigen", **infinigen_kwargs(engines.SELECT_ALL)}


def engine(model: str, **kwargs):
    """``engines.engine`` with the tests' settings (``TEST_ENGINE``), ``kwargs`` winning."""
    return engines.engine(model, **with_selection_everywhere({**TEST_ENGINE, **kwargs}))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[dict]:
    """Token-id prompts of the given lengths (ids 3..vocab-1, BOS first)."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]}
        for n in lengths
    ]


def greedy_tokens(llm, prompts, max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]
