# SPDX-License-Identifier: Apache-2.0
"""With no pool flag, the KV space and the pool stay within the memory grant.

Checked on the start-up log lines of the worker (vLLM's "Auto set ... GiB
requested memory", InfiniGen's KV-space and pool lines) and on the pool
gauges, for the two ways a user sizes vLLM's memory on the CPU build.
"""

from __future__ import annotations

import re

import pytest
from vllm.utils.cpu_resource_utils import get_memory_node_info

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow
GIB = 2**30
FRACTION = 0.3
NUMBER = r"([0-9.]+)"


def _gib(pattern: str, log: str) -> list[float]:
    match = re.search(pattern, log)
    assert match, f"no line matching {pattern!r} in the log"
    return [float(value) for value in match.groups()]


def _run(**kwargs) -> float:
    """Starts, generates, returns the pool capacity gauge in GiB.

    In vLLM's processes: the worker's memory is its own process's, as a user's is."""
    with engine(str(BUNDLED_MODEL), processes=True, kv_manager="infinigen",
                gpu_memory_utilization=FRACTION, **kwargs) as llm:
        outputs = greedy_tokens(llm, random_prompts([40, 300], seed=2), 8)
        assert [len(ids) for ids in outputs] == [8, 8]
        return sum(summarize(llm.get_metrics())["pool_capacity_bytes"].values()) / GIB


def test_the_fraction_covers_kv_space_partial_keys_and_an_uncapped_pool(capfd):
    capacity = _run(kv_cache_memory_bytes=None)
    log = capfd.readouterr().out
    requested, resident = _gib(rf"with {NUMBER} GiB requested memory for the worker\. "
                               rf"{NUMBER} GiB memory was consumed", log)
    granted, blocks, partial, budget = _gib(
        rf"InfiniGen: KV space {NUMBER} GiB = {NUMBER} GiB vLLM blocks .* \+ {NUMBER} GiB "
        rf"speculation keys; up to {NUMBER} GiB for the pool", log)
    (pool,) = _gib(rf"a row per dense slot \(uncapped: never evicts, --infinigen-eviction "
                   rf"unused\): {NUMBER} GiB host memory, sized by "
                   rf"--gpu-memory-utilization {FRACTION}, shared", log)
    assert granted <= requested - resident + 0.01
    assert blocks + partial + pool <= granted + 0.002
    assert pool <= budget + 0.001
    assert pool > 0.5 * budget  # the pool got its share, not a token amount
    assert capacity == pytest.approx(pool, abs=0.01)


def test_explicit_kv_bytes_cap_the_pool_to_what_the_fraction_leaves(capfd):
    requested = get_memory_node_info(0).total_memory * FRACTION
    kv_bytes = int(requested - GIB)  # leaves ~1 GiB less the worker's own memory
    capacity = _run(kv_cache_memory_bytes=kv_bytes)
    log = capfd.readouterr().out
    (budget,) = _gib(rf"up to {NUMBER} GiB for the pool \(--gpu-memory-utilization "
                     rf"{FRACTION} less the worker's", log)
    rows, slots, pool = _gib(rf"pool of {NUMBER} tokens per sparse layer and KV head .*, "
                             rf"capped below the dense group's {NUMBER} slots, counter "
                             rf"eviction: {NUMBER} GiB host memory", log)
    assert rows < slots
    assert pool <= budget + 0.001 < 1.0
    assert capacity == pytest.approx(pool, abs=0.01)
