# SPDX-License-Identifier: Apache-2.0
"""Seeded sampling whose prefill is split over steps, with InfiniGen on.

Stock vLLM 0.32 on the CPU build dies on such a request ("CPU Generator does
not use offset"); the InfiniGen worker carries the fix
(``vllm_infinigen/patch/patch_seeded_sampling.py``). Stock vLLM with every
prompt in one step (no split, so no crash) is the reference: with everything
selected, the split InfiniGen run must sample the same tokens.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import SELECT_ALL, engine, random_prompts

pytestmark = pytest.mark.slow

# 300 + 200 + 120 + 40 prompt tokens: in steps of 64 tokens every prompt but
# the last is split, the last behind the others in a busy step.
PROMPTS = random_prompts([300, 200, 120, 40], seed=4)
PARAMS = [SamplingParams(temperature=0.8, seed=seed, n=n, max_tokens=16, ignore_eos=True)
          for seed, n in ((1234, 1), (99, 2), (7, 1), (1234, 1))]


def sample(llm) -> list[list[list[int]]]:
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [[list(choice.token_ids) for choice in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def unsplit() -> list[list[list[int]]]:
    with engine(str(BUNDLED_MODEL), max_num_batched_tokens=1024) as llm:
        return sample(llm)


def test_split_prefill_samples_as_unsplit_stock(unsplit):
    with engine(str(BUNDLED_MODEL), max_num_batched_tokens=64, **SELECT_ALL) as llm:
        split = sample(llm)
        again = sample(llm)
    assert [len(choices) for choices in split] == [1, 2, 1, 1]
    assert all(len(ids) == 16 for choices in split for ids in choices)
    assert split == unsplit
    assert again == split
    assert split[1][0] != split[1][1]  # sampled, not greedy: the seed is in play
