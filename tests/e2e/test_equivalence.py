# SPDX-License-Identifier: Apache-2.0
"""With everything selected, InfiniGen's greedy output equals stock vLLM's."""

from __future__ import annotations

import pytest

from tests import models
from tests.e2e.engines import engine, greedy_tokens, random_prompts
from vllm_infinigen.metrics import summarize

pytestmark = pytest.mark.slow

# Several lengths in one batch; with 128-token steps the long prompts are
# prefilled in chunks while the short ones already decode (mixed batches).
PROMPT_LENGTHS = [3, 40, 150, 333]
MAX_TOKENS = 40
SELECT_ALL = dict(kv_manager="infinigen", infinigen_budget=1.0, infinigen_alpha=1e4)


def _model_path(name: str, tiny_models: dict[str, str]) -> str:
    if name == "stories260k":
        path = models.shared_path("models/stories260k-vllm-cpu")
        if path is None:
            pytest.skip("../shared/models/stories260k-vllm-cpu is absent")
        return str(path)
    return tiny_models[name]


@pytest.mark.parametrize("name", ["llama-mha", "llama-gqa", "opt", "stories260k"])
def test_select_all_equals_stock(name, tiny_models):
    model = _model_path(name, tiny_models)
    prompts = random_prompts(PROMPT_LENGTHS, seed=len(name))
    with engine(model) as llm:
        stock = greedy_tokens(llm, prompts, MAX_TOKENS)
    with engine(model, **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, prompts, MAX_TOKENS)
        counters = summarize(llm.get_metrics())
    assert ours == stock
    # Every sparse layer (2 and 3 of 4) ran and selected every candidate.
    assert sorted(counters["candidate_tokens"], key=int)[:2] == ["2", "3"]
    for layer, candidates in counters["candidate_tokens"].items():
        assert candidates > 0
        assert counters["selected_tokens"][layer] == candidates
