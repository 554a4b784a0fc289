# SPDX-License-Identifier: Apache-2.0
"""--infinigen-min-context: short contexts attend densely over the pool, long ones select."""

from __future__ import annotations

import pytest

from benchmarks.harness.engines import SELECT_ALL
from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import engine, greedy_tokens, random_prompts
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow
MIN_CONTEXT = 256
SHORT = random_prompts([20, 90, 150], seed=41)  # contexts stay below MIN_CONTEXT
LONG = random_prompts([300, 420], seed=42)  # contexts above it
MAX_TOKENS = 24


def _delta(llm, before: dict) -> dict[str, dict[str, float]]:
    after = summarize(llm.get_metrics())
    return {name: {layer: value - before.get(name, {}).get(layer, 0.0)
                   for layer, value in values.items()}
            for name, values in after.items()}


@pytest.fixture(scope="module")
def llm():
    # A threshold between the two prompt sets (the suite's helper sets 0 when not given).
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen", infinigen_budget=0.2,
                infinigen_min_context=MIN_CONTEXT) as llm:
        yield llm


def test_short_contexts_attend_every_token_and_equal_select_all(llm):
    before = summarize(llm.get_metrics())
    short = greedy_tokens(llm, SHORT, MAX_TOKENS)
    counters = _delta(llm, before)
    assert sorted(counters["candidate_tokens"], key=int) == ["2", "3", "4"]
    for layer, candidates in counters["candidate_tokens"].items():
        assert candidates > 0
        assert counters["selected_tokens"][layer] == candidates
    # Dense over the pool is exact: the same tokens as selecting everything.
    llm.collective_rpc("set_infinigen_selection",
                       kwargs={"min_context": 0, **SELECT_ALL})
    try:
        assert greedy_tokens(llm, SHORT, MAX_TOKENS) == short
    finally:  # the engine's own settings again (alpha None: off, as it started)
        llm.collective_rpc("set_infinigen_selection",
                           kwargs={"min_context": MIN_CONTEXT, "budget": 0.2,
                                   "alpha": None})


def test_long_contexts_select_within_the_budget(llm):
    """At the engine's settings (alpha off: the budget binds), each selecting row
    keeps its budget and at most the recent window on top."""
    before = summarize(llm.get_metrics())
    greedy_tokens(llm, LONG, MAX_TOKENS)
    counters = _delta(llm, before)
    window = InfiniGenConfig().recent_tokens * len(LONG) * MAX_TOKENS
    for layer, candidates in counters["candidate_tokens"].items():
        assert candidates >= 2 * (MAX_TOKENS - 1) * 300
        assert 0.19 * candidates < counters["selected_tokens"][layer] <= (
            0.2 * candidates + window)
