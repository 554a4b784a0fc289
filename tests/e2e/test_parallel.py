# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism (vLLM's multiprocessing executor): each rank selects over
its own KV heads, from its own pool, and the output is the single-process one."""

from __future__ import annotations

import os

import pytest

from tests.e2e.engines import engine, greedy_tokens, random_prompts
from tests.models import BUNDLED_MODEL
from vllm_infinigen.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([3, 40, 150, 333], seed=3)
MAX_TOKENS = 30
SELECT_ALL = dict(kv_manager="infinigen", infinigen_budget=1.0, infinigen_alpha=1e4)


@pytest.fixture(scope="module")
def two_ranks(monkeypatch_module):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism on the CPU backend needs 2 cores, one per rank")
    # vLLM's CPU workers bind their OpenMP threads to disjoint cores; with one
    # NUMA node they must be told which (rank 0 | rank 1).
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    return dict(tensor_parallel_size=2, distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def single_process_stock() -> list[list[int]]:
    with engine(str(BUNDLED_MODEL)) as llm:
        return greedy_tokens(llm, PROMPTS, MAX_TOKENS)


def test_two_ranks_select_all_equals_single_process_and_select_per_rank(
        two_ranks, single_process_stock):
    with engine(str(BUNDLED_MODEL), **two_ranks, **SELECT_ALL) as llm:
        assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == single_process_stock
        counters = summarize(llm.get_metrics())
        assert counters["selected_tokens"] == counters["candidate_tokens"]
        # Every rank runs the rule on its own 2 of the 4 KV heads: the budget
        # holds for the whole model.
        llm.collective_rpc("set_infinigen_selection", kwargs={"budget": 0.2, "alpha": 5.0})
        before = summarize(llm.get_metrics())
        outputs = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
        after = summarize(llm.get_metrics())
    assert [len(out) for out in outputs] == [MAX_TOKENS] * len(PROMPTS)
    for layer in ("2", "3", "4"):
        selected = after["selected_tokens"][layer] - before["selected_tokens"][layer]
        candidates = after["candidate_tokens"][layer] - before["candidate_tokens"][layer]
        assert 0 < selected <= 0.2 * candidates
