# SPDX-License-Identifier: Apache-2.0
"""A capped host pool (--infinigen-cpu-pool-gib): exact while it holds the
working set, evicting under every policy when it does not.

The bundled stories260K has 3 sparse layers x 4 KV heads x head_dim 32 in
float32: 3 x 4 x 2 x 32 x 4 B = 3,072 B of pool per token. The cap below holds
1,024 tokens per (layer, head), a fraction of the ~10,000 the 32 MiB KV space
would hold uncapped.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

POOL_TOKENS = 1024
TOKEN_BYTES = 3 * 4 * 2 * 32 * 4
POOL_GIB = POOL_TOKENS * TOKEN_BYTES / 2**30
# 3 + 40 + 150 + 333 prompt tokens + 4 x 40 generated: 686 < 1,024.
FITTING = random_prompts([3, 40, 150, 333], seed=21)
# 6 x 300 + 6 x 40: 2,040 tokens, twice the pool.
OVERFLOWING = random_prompts([300, 290, 280, 270, 260, 250], seed=22)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def stock_fitting(shared_engine) -> list[list[int]]:
    return greedy_tokens(shared_engine(BUNDLED_MODEL), FITTING, MAX_TOKENS)


@pytest.fixture(scope="module")
def capped(stock_fitting):
    with engine(str(BUNDLED_MODEL), infinigen_cpu_pool_gib=POOL_GIB, **SELECT_ALL) as llm:
        yield llm


def _counters(llm) -> dict[str, dict[str, float]]:
    return summarize(llm.get_metrics())


def _total(counters: dict, name: str) -> float:
    return sum(counters.get(name, {}).values())


def _flush_and_read_pool_bytes(llm) -> float:
    """Runs a 3-token request to completion: its step frees what earlier
    requests held (the workers learn of finished requests at the next step),
    and leaves its own 3 prompt tokens in the pool until the step after."""
    greedy_tokens(llm, random_prompts([3], seed=1), 1)
    return _total(_counters(llm), "pool_used_bytes")


def test_select_all_equals_stock_while_the_pool_holds_everything(capped, stock_fitting):
    before = _total(_counters(capped), "evictions")
    assert greedy_tokens(capped, FITTING, MAX_TOKENS) == stock_fitting
    assert _total(_counters(capped), "evictions") == before == 0
    assert _flush_and_read_pool_bytes(capped) == 3 * TOKEN_BYTES
    assert _total(_counters(capped), "pool_capacity_bytes") == POOL_TOKENS * TOKEN_BYTES


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_every_policy_evicts_and_completes(capped, policy):
    # The same prompts in each run: prefilled again, not found in vLLM's prefix
    # cache (their retired entries go first, uncounted; test_prefix_caching.py).
    assert capped.reset_prefix_cache()
    capped.collective_rpc("set_infinigen_selection",
                          kwargs={"eviction": policy, "budget": 0.2, "alpha": 5.0})
    before = _counters(capped).get("evictions", {})
    outputs = greedy_tokens(capped, OVERFLOWING, MAX_TOKENS)
    assert [len(tokens) for tokens in outputs] == [MAX_TOKENS] * len(OVERFLOWING)
    counters = _counters(capped)
    # The working set (2,040 tokens) is twice the pool: at least the excess of
    # every (layer, head) was evicted.
    excess = (6 * 300 + 6 * 40 - POOL_TOKENS) // 2
    assert _total(counters, "evictions") - sum(before.values()) >= excess * 3 * 4
    # Every sparse layer evicted in this run (all of them exported from start-up).
    evicted = {layer: value - before.get(layer, 0)
               for layer, value in counters["evictions"].items()}
    assert sorted(evicted) == ["2", "3", "4"]
    assert all(count > 0 for count in evicted.values()), evicted
    assert _flush_and_read_pool_bytes(capped) == 3 * TOKEN_BYTES


def test_a_baseline_policy_is_refused_on_the_capped_pool_at_run_time(capped):
    """The baselines read what they select without the row map: switching a capped
    engine to one is refused, naming the flag, and the engine still serves."""
    with pytest.raises(Exception, match="--infinigen-policy streaming runs on an uncapped pool"):
        capped.collective_rpc("set_infinigen_selection", kwargs={"policy": "streaming"})
    assert _flush_and_read_pool_bytes(capped) == 3 * TOKEN_BYTES
