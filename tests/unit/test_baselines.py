# SPDX-License-Identifier: Apache-2.0
"""The baseline policies' rules (StreamingLLM, H2O, Quest) on hand-built inputs."""

from __future__ import annotations

import torch

from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.policies.h2o import h2o_select
from vllm_infinigen.policies.quest import QUEST_PAGE_SIZE, QuestPolicy, quest_select
from vllm_infinigen.policies.streaming import streaming_select
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.step_plan import token_budget


def kept(selection, b: int = 0, h: int = 0) -> list[int]:
    return sorted(selection.positions[b, h][selection.valid[b, h]].tolist())


def test_streaming_keeps_sinks_and_the_most_recent_tokens():
    lens = torch.tensor([100, 10, 3])
    selection = streaming_select(lens, token_budget(lens, 0.1), num_heads=2, num_tokens=100,
                                 width=10)
    assert kept(selection, 0) == [0, 1, 2, 3, 94, 95, 96, 97, 98, 99]
    assert kept(selection, 0, 1) == kept(selection, 0)  # same for every head
    assert kept(selection, 1) == [0]  # budget 1 token: the first sink
    assert kept(selection, 2) == [0]
    assert selection.num_selected.tolist() == [10, 1, 1]


def test_h2o_keeps_recent_half_and_heavy_hitters_among_the_living():
    num_tokens = 20
    accumulated = torch.zeros(1, 2, num_tokens)
    accumulated[0, 0, [3, 7, 11]] = torch.tensor([5.0, 4.0, 3.0])
    accumulated[0, 1, [1, 2]] = torch.tensor([9.0, 8.0])
    alive = torch.ones(1, 2, num_tokens, dtype=torch.bool)
    alive[0, 0, 3] = False  # evicted earlier: never comes back
    lens = torch.tensor([20])
    selection = h2o_select(accumulated, alive, lens, token_budget(lens, 0.2), width=4)
    # Budget 4 tokens: 2 recent (18, 19) + 2 heavy of each head.
    assert kept(selection, 0, 0) == [7, 11, 18, 19]
    assert kept(selection, 0, 1) == [1, 2, 18, 19]


def test_quest_scores_pages_by_their_upper_bound():
    page = QUEST_PAGE_SIZE
    num_pages, head_size = 4, 2
    page_min = torch.zeros(1, num_pages, 1, head_size)
    page_max = torch.zeros(1, num_pages, 1, head_size)
    # q = (1, -1): the bound is max_0 - min_1 per page.
    page_max[0, :, 0, 0] = torch.tensor([1.0, 0.0, 5.0, 2.0])
    page_min[0, :, 0, 1] = torch.tensor([0.0, -3.0, 0.0, 0.0])
    query = torch.tensor([[[1.0, -1.0]]])
    context = torch.tensor([num_pages * page - 5])  # the last page is partial
    selection = quest_select(query, page_min, page_max, context, token_budget(context, 0.5),
                             width=2 * page)
    # Bounds 1, 3, 5, 2; budget floor(59 x 0.5) = 29 tokens = 1 whole page:
    # the page with bound 5.
    assert kept(selection) == list(range(2 * page, 3 * page))


def test_quest_leaves_out_positions_past_the_context():
    page = QUEST_PAGE_SIZE
    page_min = torch.zeros(1, 2, 1, 1)
    page_max = torch.tensor([0.0, 1.0]).view(1, 2, 1, 1)
    context = torch.tensor([page + 3])
    selection = quest_select(torch.ones(1, 1, 1), page_min, page_max, context,
                             token_budget(context, 1.0), width=page)
    assert kept(selection) == [page, page + 1, page + 2]


def test_incremental_pages_equal_pages_rebuilt_from_the_pool():
    """Quest's per-page key bounds: updated on every write, or rebuilt from the
    pool when the policy is switched on in a running engine."""
    torch.manual_seed(0)
    num_slots, heads, dim = 64, 2, 4

    class _Impl:
        num_heads, num_kv_heads, head_size, scale = 2, heads, dim, 1.0

    class _Attn:
        impl = _Impl()

    def layer() -> LayerState:
        skew = torch.eye(dim)[None].repeat(heads, 1, 1)[:, :, :1].contiguous()
        state = LayerState(2, "l2", _Attn(), None, sparse=True, skew=skew, pool_layer=0)
        block_size = 16
        plan = PoolPlan(num_rows=num_slots, num_slots=num_slots, block_size=block_size,
                        num_bytes=0, sized_by="")
        data_path.allocate(state, plan, num_slots // block_size, torch.float32, torch.float32)
        return state

    data_path = CpuDataPath("in-place")

    live, late = layer(), layer()
    live_policy, late_policy = QuestPolicy(), QuestPolicy()
    live_policy.allocate(live)
    # Slots 32..47 are written twice: a later request reuses the block.
    writes = [torch.arange(0, 20), torch.arange(20, 48), torch.arange(32, 40)]
    for slots in writes:
        key = torch.randn(len(slots), heads, dim)
        for state in (live, late):
            data_path.write(state, key, key, slots, None)
        live_policy.on_write(live, key, slots)
    late_policy.allocate(late)
    (live_min, live_max), (late_min, late_max) = live_policy.bounds(live), late_policy.bounds(late)
    for page in range(2):
        assert torch.equal(live_min[page], late_min[page]), page
        assert torch.equal(live_max[page], late_max[page]), page
    # Page 2 restarted at slot 32: it bounds the new request's 8 keys only. A
    # rebuild cannot tell stale slots 40..47 apart, so its bound is looser.
    new_keys = live.keys_at(torch.arange(32, 40))
    assert torch.equal(live_min[2], new_keys.amin(dim=0))
    assert torch.equal(live_max[2], new_keys.amax(dim=0))
    assert (late_min[2] <= live_min[2]).all()
    assert (late_max[2] >= live_max[2]).all()
