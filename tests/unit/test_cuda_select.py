# SPDX-License-Identifier: Apache-2.0
"""The device-only selection and cache placement on CPU tensors: the kernels' torch
references (``kernels.select``, ``place_lru``) against InfiniGen's block rule in torch
(``block_rule.select_blocks``) and the cache's lookup; the Triton kernels are held to these
references in Triton's interpreter (``triton_interpreter_checks.py``, which
``test_cuda_kernels.py`` runs in a subprocess)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import block_rule
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache
from vllm_infinigen.worker.step_plan import token_budget

BLOCK = 4


def _case(seed: int, context_lens: list[int], table_blocks: int = 8, heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    rows = len(context_lens)
    scores = torch.randn(rows, heads, table_blocks, generator=gen)
    table = torch.stack([torch.randperm(64, generator=gen)[:table_blocks]
                         for _ in range(rows)]).int()
    counts = torch.randint(0, 30, (rows * heads,), generator=gen, dtype=torch.int32)
    return scores, torch.tensor(context_lens), table, counts


def _settings(alpha=5.0, budget=0.3, min_context=0, budget_tokens=None):
    return kernels.settings_tensor(alpha, budget, min_context, "cpu", budget_tokens)


def _rule(scores, context_lens, counts, budget, width, budget_tokens=None):
    """The block rule of ``block_rule`` (alpha caps from the counts, the
    budget in tokens from ``step_plan.token_budget``)."""
    heads = scores.shape[1]
    mean = counts.view(-1, heads).long().sum(dim=1) // heads
    caps = torch.minimum(mean, token_budget(context_lens, budget, budget_tokens)).clamp(min=1)
    return block_rule.select_blocks(scores, context_lens, caps, block_size=BLOCK,
                                    width=width).logical


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget,budget_tokens", [(0.1, None), (0.3, None), (1.0, None),
                                                  (1.0, 6), (0.3, 2)])
def test_select_keeps_the_block_rules_blocks(seed, budget, budget_tokens):
    scores, context_lens, table, counts = _case(seed, [29, 13, 3, 20])
    width = kernels.static_width(8, BLOCK, budget=budget, min_context=0, sink_blocks=1,
                                 recent_blocks=1, budget_tokens=budget_tokens)
    logical, physical, seq_lens = kernels.select(
        scores, counts, context_lens, table,
        _settings(budget=budget, budget_tokens=budget_tokens), block_size=BLOCK, width=width,
        sink_blocks=1, recent_blocks=1)
    expected = _rule(scores, context_lens, counts, budget, width, budget_tokens)
    assert torch.equal(logical, expected)
    assert torch.equal(physical, torch.where(
        logical >= 0, table.long().gather(1, logical.clamp(min=0).flatten(1)).view_as(logical),
        -1))
    kept = (logical >= 0).sum(dim=-1)  # [S, H]
    own = (context_lens % BLOCK + 1)[:, None]
    assert seq_lens.view(4, 2).tolist() == ((kept - 1) * BLOCK + own).tolist()


def test_ties_go_to_the_lower_block():
    scores = torch.zeros(1, 1, 6)
    logical, _, _ = kernels.select(scores, torch.tensor([1], dtype=torch.int32),
                                   torch.tensor([23]), torch.arange(6)[None].int(),
                                   _settings(budget=0.1), block_size=BLOCK, width=6,
                                   sink_blocks=1, recent_blocks=1)
    assert logical.tolist() == [[[0, 1, 5, -1, -1, -1]]]  # sink, the first tie, own


def test_rows_below_min_context_keep_every_block_and_padding_rows_none():
    scores, context_lens, table, counts = _case(3, [13, 22, -1])
    logical, physical, seq_lens = kernels.select(
        scores, counts, context_lens, table, _settings(budget=0.05, min_context=16),
        block_size=BLOCK, width=8, sink_blocks=1, recent_blocks=1)
    assert logical[0].tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]] * 2  # 13 < 16: all 4 blocks
    assert (logical[1] >= 0).sum(dim=-1).tolist() == [3, 3]  # 22: k = 1 -> 1 + sink + own
    assert (logical[2] == -1).all() and (physical[2] == -1).all()
    assert seq_lens.tolist() == [14, 14, 2 * BLOCK + 3, 2 * BLOCK + 3, 0, 0]


@pytest.mark.parametrize("budget,min_context,budget_tokens", [
    (0.2, 0, None), (0.05, 40, None), (1.0, 0, None), (0.01, 4096, None), (1.0, 0, 9),
    (0.5, 20, 3)])
def test_the_width_bounds_every_row(budget, min_context, budget_tokens):
    table_blocks = 12
    width = kernels.static_width(table_blocks, BLOCK, budget=budget,
                                 min_context=min_context, sink_blocks=1,
                                 recent_blocks=1, budget_tokens=budget_tokens)
    contexts = list(range(0, table_blocks * BLOCK))
    scores = torch.randn(len(contexts), 1, table_blocks)
    counts = torch.full((len(contexts),), 10_000, dtype=torch.int32)  # the budget binds
    logical, _, _ = kernels.select(
        scores, counts, torch.tensor(contexts), torch.arange(table_blocks).expand(
            len(contexts), -1).int(),
        _settings(budget=budget, min_context=min_context, budget_tokens=budget_tokens),
        block_size=BLOCK, width=width, sink_blocks=1, recent_blocks=1)
    kept = (logical >= 0).sum(dim=-1)[:, 0]
    for context, count in zip(contexts, kept.tolist()):
        blocks = context // BLOCK + 1
        if context < min_context:
            wanted = blocks
        else:
            cap = max(1, min(math.floor(budget * context), budget_tokens or context))
            wanted = min(-(-cap // BLOCK) + min(blocks, 2), blocks)
        assert count == wanted <= width
    if budget_tokens is not None and not min_context:  # the cap bounds the width itself
        assert width == min(table_blocks, -(-budget_tokens // BLOCK) + 2)


def test_alpha_counts_are_the_rules_count():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randn(3, 2, 8 * BLOCK, generator=gen)
    context_lens = torch.tensor([31, 17, 5])
    encoded = context_lens // 16 * 16
    tokens = tokens.masked_fill(torch.arange(8 * BLOCK)[None, None] >= encoded[:, None, None],
                                float("-inf"))
    blocks = block_rule.block_scores(tokens, context_lens, BLOCK)
    counts = kernels.alpha_counts(tokens, blocks, context_lens, _settings(alpha=1.0),
                                  block_size=BLOCK)
    best = tokens.amax(dim=-1, keepdim=True)
    assert counts.tolist() == (tokens > best - 1.0).sum(dim=-1).flatten().tolist()
    assert counts.view(3, 2)[2].tolist() == [0, 0]  # no encoded group
    caps = block_rule.alpha_token_caps(tokens, context_lens, 1.0, torch.full((3,), 99))
    assert caps.tolist() == counts.view(3, 2).long().sum(dim=1).div(2, rounding_mode="floor")\
        .clamp(min=1).tolist()
    # The default, alpha off (infinity): every encoded token counts, so the budget binds.
    counts = kernels.alpha_counts(tokens, blocks, context_lens, _settings(alpha=math.inf),
                                  block_size=BLOCK)
    assert counts.view(3, 2).tolist() == [[16, 16], [16, 16], [0, 0]]


def _place(cache: DeviceBlockCache, ids: torch.Tensor):
    rows, heads, width = ids.shape
    seq_lens = torch.full((rows * heads,), 5, dtype=torch.int32)
    return cache.place(0, ids, seq_lens, torch.full((rows,), 7))


def _consistent(cache: DeviceBlockCache) -> None:
    """slot_of and block_of are inverse maps."""
    heads, capacity = cache.num_kv_heads, cache.slots_per_head
    for head in range(heads):
        for slot in range(capacity):
            block = int(cache.block_of[0, head, slot])
            if block >= 0:
                assert int(cache.slot_of[0, block * heads + head]) == slot
    mapped = (cache.slot_of[0, :-1] >= 0).sum()
    assert int(mapped) == int((cache.block_of[0, :, :capacity] >= 0).sum())


def test_place_counts_as_lookup_and_keeps_its_maps_inverse():
    gen = torch.Generator().manual_seed(5)
    placed, looked = (DeviceBlockCache(1, 2, 12, 40, "cpu") for _ in range(2))
    for step in range(6):
        ids = torch.stack([torch.randperm(20, generator=gen)[:3] + 20 * row
                           for row in range(2) for _ in range(2)]).view(2, 2, 3)
        ids[1, 0, 2] = -1
        lookup = _place(placed, ids)
        looked.lookup(0, ids)
        _consistent(placed)
        # every selected entry sits in its slot; the fetch list names the misses
        heads = torch.arange(2)[None, :, None]
        valid = ids >= 0
        slot = lookup.slots - heads * 12
        assert torch.equal(torch.where(valid, placed.block_of[0].gather(
            1, slot.permute(1, 0, 2).reshape(2, -1).clamp(min=0)).view(2, 2, 3).permute(1, 0, 2),
            -1), torch.where(valid, ids, -1))
        assert (lookup.slots[~valid] == -1).all()
        if step == 0:  # from the same empty state: the same hits and misses
            assert placed.counters[0, :, 2:].tolist() == looked.counters[0, :, 2:].tolist()
        for head in range(2):
            count = int(lookup.num_fetch[head])
            units = lookup.fetch_units[head, :count]
            assert ((units % 2) == head).all()
            assert (placed.block_of[0, head].gather(
                0, lookup.fetch_slots[head, :count] - head * 12) == units // 2).all()
    hits, misses = placed.take_counters()
    assert hits[0] + misses[0] == 6 * 11


def test_place_evicts_the_least_recently_used_slots():
    cache = DeviceBlockCache(1, 1, 4, 16, "cpu")
    _place(cache, torch.tensor([[[1, 2]]]))
    _place(cache, torch.tensor([[[3, 4]]]))  # full: 1, 2, 3, 4
    _place(cache, torch.tensor([[[1, 3]]]))  # 2 and 4 are the least recently used
    lookup = _place(cache, torch.tensor([[[5, 6]]]))
    assert sorted(cache.block_of[0, 0, :4].tolist()) == [1, 3, 5, 6]
    assert lookup.fetch_units[0, :2].tolist() == [5, 6] and lookup.num_fetch.tolist() == [2]
    # the misses take the victims in slot order: blocks 2 and 4 sat in slots 1 and 3
    assert lookup.slots.tolist() == [[[1, 3]]]
    assert cache.counters[0, 0].tolist() == [4 * 4, 4 * 7, 2, 6]


def test_a_block_two_rows_share_takes_one_slot_and_one_fetch():
    """Prefix caching shares a prompt's full blocks between requests, so two rows may
    select the same block: it is fetched once into one slot that both rows read (a
    second slot would outlive the block's release and, evicted later, unmap the
    block's next owner while a step writes its new token there)."""
    cache = DeviceBlockCache(1, 1, 6, 10, "cpu")
    lookup = _place(cache, torch.tensor([[[5, 6]], [[5, 8]]]))
    _consistent(cache)
    assert (cache.block_of[0, 0, :6] == 5).sum() == 1
    assert lookup.slots[0, 0, 0] == lookup.slots[1, 0, 0]
    assert lookup.num_fetch.tolist() == [3]
    assert sorted(lookup.fetch_units[0, :3].tolist()) == [5, 6, 8]
    assert cache.counters[0, 0, 2:].tolist() == [1, 3]  # the copy counts as a hit
    cache.release_blocks([5, 6, 8])
    assert not (cache.block_of[0] == 5).any() and not (cache.slot_of[0, :-1] >= 0).any()
    # block 5 again, another request's: cached, then kept while others are evicted
    _place(cache, torch.tensor([[[2, 5]]]))
    held = int(cache.slot_of[0, 5])
    lookup = _place(cache, torch.tensor([[[1, 3, 5]], [[7, -1, -1]]]))
    _consistent(cache)
    assert int(cache.slot_of[0, 5]) == held == int(lookup.slots[0, 0, 2])


def test_evicting_a_stale_copy_keeps_the_blocks_map():
    """A slot whose block is mapped to another slot (a stale copy) is evicted without
    unmapping the block, by the device step's placement and by the host-planned
    lookup."""
    for use_place in (True, False):
        cache = DeviceBlockCache(1, 1, 3, 10, "cpu")
        cache.block_of[0, 0, :3] = torch.tensor([5, 5, -1])  # slot 0: a stale copy of 5
        cache.slot_of[0, 5] = 1
        cache.last_used[0, 0, :3] = torch.tensor([1, 3, -1])
        cache.ticks[0] = 3
        ids = torch.tensor([[[7, 8]]])
        if use_place:
            _place(cache, ids)
        else:
            cache.lookup(0, ids)
        assert int(cache.slot_of[0, 5]) == 1 and int(cache.block_of[0, 0, 1]) == 5


def test_place_refuses_a_step_wider_than_the_cache():
    with pytest.raises(ValueError, match="slots per head"):
        _place(DeviceBlockCache(1, 1, 3, 16, "cpu"), torch.tensor([[[1, 2]], [[3, 4]]]))


def test_the_budget_in_tokens_is_the_fraction_capped_by_the_tokens():
    contexts = torch.tensor([0, 3, 40, 1000, 100_000])
    assert token_budget(contexts, 0.2).tolist() == [1, 1, 8, 200, 20_000]
    assert token_budget(contexts, 0.2, 256).tolist() == [1, 1, 8, 200, 256]
    assert token_budget(contexts, 1.0, 4).tolist() == [1, 3, 4, 4, 4]
