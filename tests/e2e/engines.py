# SPDX-License-Identifier: Apache-2.0
"""Starting and stopping offline engines in tests."""

from __future__ import annotations

import contextlib
import gc
import random

import vllm_infinigen

ENGINE_DEFAULTS = dict(
    dtype="float32",
    max_model_len=512,
    kv_cache_memory_bytes=32 << 20,
    enforce_eager=True,
    seed=0,
    # Small steps: long prompts are chunked and share steps with decodes.
    max_num_batched_tokens=128,
    disable_log_stats=False,
)

# InfiniGen selecting every token (alpha 1e4 keeps every score in reach of the
# best; budget 1.0 caps nothing): its outputs must equal stock vLLM's.
SELECT_ALL = dict(kv_manager="infinigen", infinigen_budget=1.0, infinigen_alpha=1e4)


def with_selection_everywhere(kwargs: dict) -> dict:
    """InfiniGen engines of the suite select at every context length.

    The tests check the selection on short prompts; the dense attention of
    short contexts (``--infinigen-min-context``) has tests of its own.
    """
    if kwargs.get("kv_manager") == "infinigen":
        return {"infinigen_min_context": 0, **kwargs}
    return kwargs


@contextlib.contextmanager
def engine(model: str, **kwargs):
    from vllm import LLM

    vllm_infinigen.register()  # the kv_manager / infinigen_* keywords
    llm = LLM(model=model, **with_selection_everywhere({**ENGINE_DEFAULTS, **kwargs}))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


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
