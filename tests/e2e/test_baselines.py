# SPDX-License-Identifier: Apache-2.0
"""Baseline policies (--infinigen-policy) in a live engine, switched at run time."""

from __future__ import annotations

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([3, 40, 150, 333], seed=31)
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def stock(shared_engine) -> list[list[int]]:
    return greedy_tokens(shared_engine(BUNDLED_MODEL), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(stock):
    # (h2o, switched to at run time, cannot run with vLLM's prefix caching)
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen", infinigen_policy="streaming",
                enable_prefix_caching=False) as llm:
        yield llm


def _run(llm, policy: str, budget: float) -> tuple[list[list[int]], dict[str, float]]:
    # No recent window: the budget alone (InfiniGen's window on top of it:
    # test_sparse_budget.py).
    llm.collective_rpc("set_infinigen_selection", kwargs={"policy": policy, "budget": budget,
                                                          "recent_tokens": 0})
    before = summarize(llm.get_metrics())
    outputs = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
    after = summarize(llm.get_metrics())
    fractions = {}
    for layer in ("2", "3", "4"):
        selected = after["selected_tokens"][layer] - before.get("selected_tokens", {}).get(layer, 0)
        candidates = after["candidate_tokens"][layer] - before.get("candidate_tokens", {}).get(layer, 0)
        fractions[layer] = selected / candidates
    return outputs, fractions


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_full_budget_equals_stock(llm, stock, policy):
    """At budget 1.0 both keep every token: the machinery is exact."""
    outputs, fractions = _run(llm, policy, 1.0)
    assert outputs == stock
    assert set(fractions.values()) == {1.0}


@pytest.mark.parametrize("policy", ["streaming", "h2o", "quest", "infinigen"])
def test_each_policy_keeps_to_the_budget(llm, stock, policy):
    outputs, fractions = _run(llm, policy, 0.2)
    assert [len(out) for out in outputs] == [MAX_TOKENS] * len(PROMPTS)
    for layer, fraction in fractions.items():
        assert 0 < fraction <= 0.2, (layer, fraction)
    assert outputs != stock  # a fifth of the context changes some greedy token


def test_same_inputs_give_the_same_selections_and_outputs(llm):
    """Determinism: twice the same batch, the same tokens selected in every layer."""
    first_outputs, first = _run_counts(llm)
    second_outputs, second = _run_counts(llm)
    assert first_outputs == second_outputs
    assert first == second


def _run_counts(llm) -> tuple[list[list[int]], dict[str, float]]:
    llm.collective_rpc("set_infinigen_selection", kwargs={"policy": "infinigen", "budget": 0.1})
    before = summarize(llm.get_metrics())
    outputs = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
    after = summarize(llm.get_metrics())
    return outputs, {
        f"{name}.{layer}": after[name][layer] - before.get(name, {}).get(layer, 0)
        for name in ("selected_tokens", "selected_kv_bytes") for layer in after[name]
    }
