# SPDX-License-Identifier: Apache-2.0
"""How a worker splits the user's memory grant (CPU: ``platforms/cpu/memory.py``) and
plans its pool (``vllm_infinigen/memory.py``)."""

from __future__ import annotations

import pytest

from vllm_infinigen.memory import BlockCosts, plan_pool
from vllm_infinigen.platforms.cpu.memory import split_grant

GIB = 2**30
# stories260K, block 128, float32: 2 dense layers (2 pages per block id),
# 3 sparse layers x 4 KV heads x rank 6 partial channels, K+V of 32.
COSTS = BlockCosts(pages=2 * 128 * 4 * 2 * 32 * 4, partial=128 * 3 * 4 * 6 * 4,
                   pool=128 * 3 * 4 * 2 * 32 * 4)


def plan(granted, **overrides):
    kwargs = dict(explicit_kv=False, explicit_pool=False, requested=int(3.4 * GIB),
                  resident=int(0.6 * GIB), free=20 * GIB, fraction=0.4)
    return split_grant(granted, COSTS, **{**kwargs, **overrides})


def rows_within(budget: int, bytes_per_token: int, num_slots: int, step_tokens: int = 1,
                block_size: int = 128, free: int = 2**50) -> int:
    """Tokens per (layer, KV head) the planned pool holds in ``budget`` bytes."""
    return plan_pool(num_blocks=num_slots // block_size, block_size=block_size,
                     bytes_per_token=bytes_per_token, step_tokens=step_tokens, cap=None,
                     budget=budget, sized_by="--gpu-memory-utilization 0.3",
                     free=free).num_rows


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
    assert plan(GIB, explicit_kv=True, free=2 * GIB).pool_budget == int(0.9 * 2 * GIB) - GIB
    assert plan(GIB, explicit_kv=True, free=GIB).pool_budget == 0
    assert plan(3 * GIB, explicit_kv=True).pool_budget == 0


def test_an_explicit_pool_is_not_sized_here():
    out = plan(GIB, explicit_pool=True)
    assert out.pool_budget is None and out.kv_space + out.partial == GIB
    assert plan(GIB, explicit_pool=True, explicit_kv=True).pool_budget is None


def test_worker_pool_rows_cap_and_refuse_below_one_step():
    # Two sparse layers of 4 KV heads x 32 float32 channels: 2048 bytes of K/V
    # per token over both layers; 5000 slots of the dense group.
    def pool(budget: int, step_tokens: int):
        return plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048,
                         step_tokens=step_tokens, cap=None, budget=budget,
                         sized_by="--gpu-memory-utilization 0.3", free=2**50)

    plan = pool(2048 * 1000, 256)
    assert (plan.num_rows, plan.sized_by) == (1000, "--gpu-memory-utilization 0.3")
    assert pool(2048 * 10**6, 256).num_rows == 5000
    with pytest.raises(ValueError, match="--max-num-batched-tokens.*--gpu-memory-utilization"
                       ".*--kv-cache-memory-bytes.*--infinigen-cpu-pool-gib"):
        pool(2048 * 100, 256)


def test_fp8_pages_and_pool_cost_one_byte_an_element_the_keys_the_models():
    """``--kv-cache-dtype fp8``: vLLM's pages and the pool in FP8, the
    speculation keys (partial keys here) in the model's dtype."""
    import torch

    from vllm_infinigen.layout import ModelLayout, kv_dtype
    from vllm_infinigen.memory import block_costs

    layout = ModelLayout(model_type="llama", num_layers=5, num_heads=8, num_kv_heads=4,
                         head_dim=32, speculation_keys="partial")  # rank 6
    model = block_costs(layout, 4, 128, 4)
    fp8 = block_costs(layout, 4, 128, 4, kv_dtype("fp8", torch.float32).itemsize)
    assert model == COSTS
    assert (fp8.pages, fp8.pool, fp8.partial) == (COSTS.pages // 4, COSTS.pool // 4,
                                                  COSTS.partial)
    assert kv_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_inc is not supported"):
        kv_dtype("fp8_inc", torch.bfloat16)


def test_a_policy_of_an_uncapped_pool_is_refused_where_the_grant_would_cap_it():
    """The baselines (H2O, StreamingLLM, Quest) read the positions they select
    without a capped pool's row map: a grant that holds fewer tokens than the
    dense layers' slots is refused for them, naming the flags, not run capped."""
    def pool(budget: int, uncapped_only: str | None):
        return plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                         cap=None, budget=budget, sized_by="--gpu-memory-utilization 0.3",
                         free=2**50, uncapped_only=uncapped_only)

    with pytest.raises(ValueError, match="--infinigen-policy h2o runs on an uncapped pool.*"
                       "1000 of the dense layers' 5000 tokens.*--gpu-memory-utilization"):
        pool(2048 * 1000, "--infinigen-policy h2o")
    assert pool(2048 * 1000, None).num_rows == 1000  # InfiniGen's policy evicts
    assert pool(2048 * 10**6, "--infinigen-policy h2o").num_rows == 5000  # every slot held


def test_a_pool_beyond_free_memory_names_the_flags_of_the_platform():
    """The CPU build caps the pool with --infinigen-cpu-pool-gib; CUDA refuses that flag
    (its pool has a row per slot), so there the way out is a smaller KV space."""
    from vllm_infinigen.platforms.cuda.worker import InfiniGenCUDAWorker
    from vllm_infinigen.platforms.cpu.worker import InfiniGenCPUWorker

    def pool(free: int, **cappable):
        return plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                         cap=None, budget=None, sized_by="", free=free, **cappable)

    assert pool(GIB, cappable=False).num_bytes == 5000 * 2048  # fits in the free GiB
    with pytest.raises(ValueError, match=r"needs 0\.01 GiB of host memory \(0\.01 GiB of "
                       r"K/V\), 0\.00 GiB is free; set --infinigen-cpu-pool-gib, or lower "
                       "--gpu-memory-utilization or --kv-cache-memory-bytes"):
        pool(2**20)
    with pytest.raises(ValueError, match="is free; lower --gpu-memory-utilization or "
                       r"--kv-cache-memory-bytes \(this platform refuses --infinigen-cpu-pool-gib"):
        pool(2**20, cappable=False)
    with pytest.raises(ValueError, match="is free; lower --infinigen-cpu-pool-gib"):
        plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                  cap=4000, budget=None, sized_by="--infinigen-cpu-pool-gib 0.008",
                  free=2**20)
    assert InfiniGenCPUWorker.infinigen_pool_cappable
    assert not InfiniGenCUDAWorker.infinigen_pool_cappable


@pytest.mark.parametrize("ranks,heads", [(1, 4), (2, 4), (8, 8)])
def test_the_pool_flag_counts_a_replicated_heads_copies(ranks, heads):
    """--infinigen-cpu-pool-gib is all ranks' pool: where the ranks outnumber the KV
    heads (vLLM replicates them), each rank holds a head, so the flag's bytes per
    token count every copy (and the counters, summed over the ranks, divide by them)."""
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    from benchmarks.harness.paths import BUNDLED_MODEL
    from vllm_infinigen.engine_setup import engine_setup

    config = VllmConfig(model_config=ModelConfig(model=str(BUNDLED_MODEL)),  # 4 KV heads
                        parallel_config=ParallelConfig(tensor_parallel_size=ranks),
                        additional_config={"kv_manager": "infinigen"})
    setup = engine_setup(config)
    assert setup.kv_heads_all_ranks == heads
    rank_bytes = setup.layout.pool_bytes_per_token(setup.kv_dtype_bytes, max(1, 4 // ranks))
    assert setup.pool_bytes_per_token == ranks * rank_bytes


def test_a_capped_pools_row_map_comes_out_of_its_budget_and_matches_the_index():
    """A capped pool's row map (an int32 per slot, five int64 per row, per layer
    and KV head) is paid from the same budget as its K/V rows, and counted by
    the free-memory check; the constants are what the CPU pool index holds."""
    from vllm_infinigen.platforms.cpu.pool_index import CappedPoolIndex

    entries = 2 * 4  # two sparse layers x 4 KV heads
    plan = plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                     cap=None, budget=2048 * 1000, sized_by="--gpu-memory-utilization 0.3",
                     free=2**50, entries_per_token=entries)
    slot_map = entries * 4 * 5000
    assert plan.num_rows == (2048 * 1000 - slot_map) // (2048 + entries * 40) == 797
    assert plan.index_bytes == entries * (4 * 5000 + 40 * 797)
    index = CappedPoolIndex(2, 4, 5000, plan.num_rows, "lru", block_size=8)
    held = sum(t.numel() * t.element_size() for t in (
        index.row_map, index.owner, index.inserted, index.last_used, index.count,
        index.free_rows))
    assert held == plan.index_bytes
    # (the K/V rows rounded up to whole blocks: at most one block past the budget)
    assert plan.num_bytes + plan.index_bytes <= 2048 * 1000 + 8 * 2048
    # uncapped: no row map
    assert plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                     cap=None, budget=2048 * 5000, sized_by="", free=2**50,
                     entries_per_token=entries).index_bytes == 0


def test_the_free_memory_check_counts_the_keys_the_row_map_and_the_hosts_workers():
    """What is allocated with the pool (the CPU build's speculation keys, a capped
    pool's row map) and every worker of the host planning at once count against
    free memory: each alone fit, and the host ran out at run time."""
    def pool(free, **kwargs):
        return plan_pool(num_blocks=625, block_size=8, bytes_per_token=2048, step_tokens=256,
                         cap=4000, budget=None, sized_by="--infinigen-cpu-pool-gib 0.008",
                         free=free, entries_per_token=8, **kwargs)

    alone = pool(2**50)
    need = alone.num_bytes + alone.index_bytes
    enough = int(need / 0.9) + 1
    assert pool(enough).num_rows == 4000
    with pytest.raises(ValueError, match=r"GiB of host memory \(0\.01 GiB of K/V, 0\.00 GiB "
                       r"row map, 0\.00 GiB speculation keys\)"):
        pool(enough, beside=2**20)
    with pytest.raises(ValueError, match="on each of this host's 2 workers.*lower "
                       "--infinigen-cpu-pool-gib"):
        pool(enough, ranks=2)
    assert pool(2 * enough, ranks=2).num_rows == 4000


def test_explicit_kv_bytes_pool_shares_free_memory_among_the_hosts_workers():
    """The budget is what free memory holds after the KV space (vLLM makes it
    before the pool), split among the host's workers."""
    assert plan(GIB, explicit_kv=True, free=3 * GIB).pool_budget == int(0.9 * 3 * GIB) - GIB
    assert plan(GIB, explicit_kv=True, free=3 * GIB, ranks=2).pool_budget == (
        int(0.9 * 3 * GIB) // 2 - GIB)


def test_host_ranks_are_vllms_local_world_and_one_under_ray():
    from types import SimpleNamespace

    from vllm_infinigen.worker.base import host_ranks

    assert host_ranks(SimpleNamespace(distributed_executor_backend="mp",
                                      local_world_size=4)) == 4
    assert host_ranks(SimpleNamespace(distributed_executor_backend="ray",
                                      local_world_size=4)) == 1
