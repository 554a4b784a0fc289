# SPDX-License-Identifier: Apache-2.0
"""Dense while memory allows (``--infinigen-residency device-first``): the sparse
layers stay in vLLM's device blocks and kernel while they fit, and the engine
moves to the pool and InfiniGen's selection when a step's blocks would not.

The bundled stories260K (2 dense + 3 sparse layers, KV-cache groups of 2
layers: one dense group, two sparse ones) with the selection taking every
token (``SELECT_ALL``): greedy output equals stock vLLM's whether the engine
stays resident, or moves in the middle of the batch. Four prompts of ~290
tokens and 40 generated each hold ~82 blocks in the dense group: resident,
three times that (every group); moved, the dense group's alone.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([300, 290, 280, 270], seed=31)
MAX_TOKENS = 40
DEVICE_FIRST = {**SELECT_ALL, "infinigen_residency": "device-first"}


@pytest.fixture(scope="module")
def stock(shared_engine) -> list[list[int]]:
    return greedy_tokens(shared_engine(BUNDLED_MODEL), PROMPTS, MAX_TOKENS)


def _run(kv_bytes: int) -> tuple[list[list[int]], dict, float]:
    with engine(str(BUNDLED_MODEL), kv_cache_memory_bytes=kv_bytes, **DEVICE_FIRST) as llm:
        outputs = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
        metrics = llm.get_metrics()
    preemptions = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
    return outputs, summarize(metrics), preemptions


def test_a_resident_engine_attends_with_vllms_kernel_and_equals_stock(stock):
    outputs, counters, preemptions = _run(32 << 20)
    assert outputs == stock
    assert counters["resident"] == {"": 1.0}
    assert sum(counters.get("selected_tokens", {}).values()) == 0  # no InfiniGen step
    assert preemptions == 0


def test_an_engine_short_of_blocks_moves_instead_of_preempting_and_equals_stock(stock):
    outputs, counters, preemptions = _run(5 << 20)
    assert outputs == stock
    assert counters["resident"] == {"": 0.0}
    assert sum(counters["selected_tokens"].values()) > 0  # InfiniGen after the move
    assert preemptions == 0
