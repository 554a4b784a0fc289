# SPDX-License-Identifier: Apache-2.0
"""How the worker splits the user's memory grant (``vllm_infinigen/memory.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_infinigen.memory import BlockCosts, plan_memory, rows_within

GIB = 2**30
# stories260K, block 128, float32: 2 dense layers (2 pages per block id),
# 3 sparse layers x 4 KV heads x rank 6 partial channels, K+V of 32.
COSTS = BlockCosts(pages=2 * 128 * 4 * 2 * 32 * 4, partial=128 * 3 * 4 * 6 * 4,
                   pool=128 * 3 * 4 * 2 * 32 * 4)


def plan(granted, **overrides):
    kwargs = dict(explicit_kv=False, explicit_pool=False, requested=int(3.4 * GIB),
                  resident=int(0.6 * GIB), free=20 * GIB, fraction=0.4)
    return plan_memory(granted, COSTS, **{**kwargs, **overrides})


@pytest.mark.parametrize("granted", [32 << 20, int(2.74 * GIB), 10**9 + 7])
def test_the_fraction_is_shared_and_the_pool_holds_every_slot(granted):
    out = plan(granted)
    assert out.kv_space + out.partial + out.pool_budget == granted
    num_blocks = out.kv_space // COSTS.pages  # what vLLM makes of the KV space
    assert num_blocks * COSTS.partial <= out.partial
    assert num_blocks * COSTS.pool <= out.pool_budget
    per_token = COSTS.pool // 128
    assert rows_within(out.pool_budget, per_token, num_blocks * 128) == num_blocks * 128
    assert "--gpu-memory-utilization 0.4" in out.source


def test_explicit_kv_bytes_keep_the_kv_space_and_the_pool_gets_what_is_left():
    granted = 1 * GIB
    out = plan(granted, explicit_kv=True, requested=int(2.2 * GIB))
    assert out.kv_space + out.partial == granted
    assert out.kv_space * COSTS.partial == pytest.approx(out.partial * COSTS.pages, rel=1e-6)
    assert out.pool_budget == int(2.2 * GIB) - int(0.6 * GIB) - granted
    # The dense group's slots want more pool than that: capped.
    num_slots = out.kv_space // COSTS.pages * 128
    rows = rows_within(out.pool_budget, COSTS.pool // 128, num_slots)
    assert rows == out.pool_budget // (COSTS.pool // 128) < num_slots
    assert "--kv-cache-memory-bytes" in out.source


def test_explicit_kv_bytes_pool_is_bounded_by_free_memory_and_never_negative():
    assert plan(GIB, explicit_kv=True, free=GIB).pool_budget == int(0.9 * GIB)
    assert plan(3 * GIB, explicit_kv=True).pool_budget == 0


def test_an_explicit_pool_is_not_sized_here():
    out = plan(GIB, explicit_pool=True)
    assert out.pool_budget is None and out.kv_space + out.partial == GIB
    assert plan(GIB, explicit_pool=True, explicit_kv=True).pool_budget is None


def _worker(budget: int, step_tokens: int):
    from vllm_infinigen.config import EngineSetup, InfiniGenConfig
    from vllm_infinigen.layout import ModelLayout
    from vllm_infinigen.memory import MemoryPlan

    # Two sparse layers of 4 KV heads x 32 float32 channels: 1024 bytes of
    # K/V per token and layer.
    layout = ModelLayout("llama", num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32)
    layer = SimpleNamespace(sparse=True, num_kv_heads=4)
    return SimpleNamespace(
        _memory_plan=MemoryPlan(0, 0, budget, "--gpu-memory-utilization 0.3"),
        infinigen=EngineSetup(InfiniGenConfig(), layout, torch.float32.itemsize, step_tokens),
        infinigen_runtime=SimpleNamespace(layers=[layer, layer]))


def test_worker_pool_rows_cap_and_refuse_below_one_step():
    from vllm_infinigen.worker import InfiniGenCPUWorker

    rows, source = InfiniGenCPUWorker._pool_rows(_worker(2048 * 1000, 256), 5000)
    assert (rows, source) == (1000, "--gpu-memory-utilization 0.3")
    assert InfiniGenCPUWorker._pool_rows(_worker(2048 * 10**6, 256), 5000)[0] == 5000
    with pytest.raises(ValueError, match="--max-num-batched-tokens.*--gpu-memory-utilization"
                       ".*--kv-cache-memory-bytes.*--infinigen-cpu-pool-gib"):
        InfiniGenCPUWorker._pool_rows(_worker(2048 * 100, 256), 5000)
