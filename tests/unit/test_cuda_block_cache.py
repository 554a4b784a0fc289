# SPDX-License-Identifier: Apache-2.0
"""The device block cache on hand-built cases: exact slots, fetch lists, eviction, release,
the block table substitution, and attention over cached blocks against dense attention."""

from __future__ import annotations

import pytest
import torch

from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import reference
from vllm_infinigen.scheduler.metrics import COUNTERS
from vllm_infinigen.platforms.cuda.block_cache import CACHE_COUNTERS, DeviceBlockCache


def substitute_block_table(slots: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table an attention kernel over cached blocks takes, one row per (row, KV
    head), from ``lookup``'s slots (the product's step attends over ``place``'s
    slots with the selection's lengths, ``CudaDataPath.attend_selected``).

    vLLM's paged attention has one block table per sequence, shared by its KV
    heads; InfiniGen selects per KV head. So each (row, KV head) becomes a
    sequence of one KV head with the G query heads of its group: query
    [S * H_kv, G, D], K and V the cache units' halves viewed as
    [num_units, block_size, 1, D] (row stride 2D), and this table.

    The selected blocks keep their order (``select_blocks``: ascending, the
    row's own block last), so positions run in order and only the own block
    is partial: it holds ``context_len % block_size + 1`` tokens, its own
    token included (written into the cache before attending).

    Args:
        slots: [S, H_kv, W] flat cache slots of the selection, valid first, -1 after.
        context_lens: [S] tokens before each row's own.

    Returns:
        (table [S * H_kv, W] int32 with padding as 0, seq_lens [S * H_kv] int32).
    """
    num_rows, num_heads, width = slots.shape
    num_valid = (slots >= 0).sum(dim=-1)  # [S, H]
    partial = context_lens.to(torch.int64)[:, None] % block_size + 1
    seq_lens = (num_valid - 1) * block_size + partial
    table = slots.clamp(min=0).reshape(num_rows * num_heads, width).to(torch.int32)
    return table, seq_lens.reshape(-1).to(torch.int32)


def _ids(*heads):
    """[1, H, W] selection of one row from per-head lists (padded with -1)."""
    width = max(len(h) for h in heads)
    return torch.tensor([[list(h) + [-1] * (width - len(h)) for h in heads]])


def test_admission_places_missing_blocks_in_free_slots_and_lists_them_by_pool_unit():
    cache = DeviceBlockCache(1, 2, 4, 10, "cpu")
    got = cache.lookup(0, _ids([3, 1], [2, 5, 7]))
    # head 0: blocks 1, 3 -> slots 0, 1; head 1: 2, 5, 7 -> slots 0, 1, 2 (flat 4, 5, 6)
    assert got.slots.tolist() == [[[1, 0, -1], [4, 5, 6]]]
    assert got.fetch_units.tolist() == [2, 5, 6, 11, 15, -1]  # block * 2 + head, ascending
    assert got.fetch_slots.tolist() == [0, 4, 1, 5, 6, -1]
    assert got.num_fetch.tolist() == [5]
    assert cache.take_counters() == ([0], [5])


def test_hits_are_not_fetched_again():
    cache = DeviceBlockCache(1, 1, 4, 10, "cpu")
    cache.lookup(0, _ids([1, 2]))
    cache.take_counters()
    got = cache.lookup(0, _ids([2, 1, 6]))
    assert got.slots.tolist() == [[[1, 0, 2]]]
    assert got.fetch_units.tolist()[:1] == [6] and got.num_fetch.tolist() == [1]
    assert cache.take_counters() == ([2], [1])


def test_lru_evicts_the_least_recently_selected_block():
    cache = DeviceBlockCache(1, 1, 3, 20, "cpu", eviction="lru")
    cache.lookup(0, _ids([1, 2, 3]))  # slots 0, 1, 2
    cache.lookup(0, _ids([1, 3]))  # 2 now least recent
    got = cache.lookup(0, _ids([9]))
    assert got.fetch_slots.tolist()[:1] == [1]  # block 2's slot
    assert cache.block_of[0, 0, :3].tolist() == [1, 9, 3]
    assert cache.slot_of[0, 2].item() == -1  # block 2 unmapped


def test_a_block_hit_in_the_step_is_never_the_victim():
    cache = DeviceBlockCache(1, 1, 3, 20, "cpu")
    cache.lookup(0, _ids([1]))
    cache.lookup(0, _ids([2, 3]))  # block 1 is the least recent
    got = cache.lookup(0, _ids([1, 7]))  # 1 hits: 7 must take slot 1 or 2, not 0
    assert got.slots.tolist() == [[[0, 1]]]
    assert cache.block_of[0, 0, :3].tolist() == [1, 7, 3]
    # counter: after this step's hit, block 1 ties block 2 on uses and is older; it stays
    counter = DeviceBlockCache(1, 1, 3, 20, "cpu", eviction="counter")
    for blocks in ([1], [2], [2, 3], [1, 7]):
        got = counter.lookup(0, _ids(blocks))
    assert got.slots.tolist() == [[[0, 1]]]
    assert counter.block_of[0, 0, :3].tolist() == [1, 7, 3]


def test_counter_evicts_the_least_selected_among_the_older_half():
    cache = DeviceBlockCache(1, 1, 4, 20, "cpu", eviction="counter")
    for blocks in ([1], [2], [3], [4]):  # inserted in this order, one per step
        cache.lookup(0, _ids(blocks))
    cache.lookup(0, _ids([1, 3]))  # block 1 twice; 2 once (older half: 1, 2)
    got = cache.lookup(0, _ids([8]))
    assert got.fetch_slots.tolist()[:1] == [1]  # block 2: oldest half, fewest uses
    lru = DeviceBlockCache(1, 1, 4, 20, "cpu", eviction="lru")
    for blocks in ([1], [2], [3], [4], [1, 3], [8]):
        got = lru.lookup(0, _ids(blocks))
    assert got.fetch_slots.tolist()[:1] == [1]  # lru agrees here: 2 is also least recent


def test_a_block_shared_by_two_rows_is_fetched_once():
    cache = DeviceBlockCache(1, 1, 4, 10, "cpu")
    got = cache.lookup(0, torch.tensor([[[5, 6]], [[5, 8]]]))  # rows share block 5
    assert got.num_fetch.tolist() == [3]
    assert got.fetch_units.tolist()[:3] == [5, 6, 8]
    assert got.slots[0, 0, 0] == got.slots[1, 0, 0]
    assert cache.take_counters() == ([0], [3])


def test_release_frees_the_slots_and_a_reused_block_id_is_fetched_again():
    cache = DeviceBlockCache(2, 1, 3, 10, "cpu")
    for layer in (0, 1):
        cache.lookup(layer, _ids([4, 5, 6]))
    cache.release_blocks([5])
    assert cache.block_of[:, 0, :3].tolist() == [[4, -1, 6], [4, -1, 6]]
    assert (cache.slot_of[:, 5] == -1).all()
    cache.take_counters()
    got = cache.lookup(0, _ids([5, 6]))  # block 5 now belongs to a new request
    assert got.fetch_units.tolist()[:1] == [5] and got.fetch_slots.tolist()[:1] == [1]
    assert cache.take_counters() == ([1, 0], [1, 0])


def test_counters_per_layer_for_the_metrics():
    """(hits, misses) per sparse layer, drained; ``CudaDataPath.take_stats`` keys them
    by model layer (test_cuda_data_path.py)."""
    cache = DeviceBlockCache(2, 1, 4, 10, "cpu")
    cache.lookup(1, _ids([2, 3]))
    cache.lookup(1, _ids([3]))
    assert cache.take_counters() == ([0, 1], [0, 2])
    assert cache.take_counters() == ([0, 0], [0, 0])
    assert set(CACHE_COUNTERS) == {"cache_hits", "cache_misses", "pcie_bytes"}
    assert set(CACHE_COUNTERS) <= set(COUNTERS)  # exported as vllm:infinigen_<name>_total


def test_a_step_wider_than_the_cache_is_refused():
    cache = DeviceBlockCache(1, 1, 3, 10, "cpu")
    with pytest.raises(ValueError, match="slots per head"):
        cache.lookup(0, torch.zeros(2, 1, 2, dtype=torch.int64))


def test_unknown_eviction_rule_is_refused():
    with pytest.raises(ValueError, match="eviction"):
        DeviceBlockCache(1, 1, 3, 10, "cpu", eviction="fifo")


def test_the_bookkeeping_needs_no_host_sync():
    """Meta tensors have no values: any .item()/.tolist() in lookup would raise."""
    cache = DeviceBlockCache(2, 3, 16, 50, "meta")
    got = cache.lookup(1, torch.empty(2, 3, 4, dtype=torch.int64, device="meta"))
    assert got.slots.shape == (2, 3, 4) and got.fetch_units.shape == (24,)
    table, seq_lens = substitute_block_table(got.slots, torch.empty(2, dtype=torch.int64,
                                                                    device="meta"), 4)
    assert table.shape == (6, 4) and seq_lens.shape == (6,)


def test_substituted_table_and_lengths():
    slots = torch.tensor([[[3, 7, 2], [5, 1, -1]]])  # own block last among the valid
    table, seq_lens = substitute_block_table(slots, torch.tensor([21]), 4)
    assert table.tolist() == [[3, 7, 2], [5, 1, 0]]
    assert seq_lens.tolist() == [2 * 4 + 2, 4 + 2]  # the own block holds tokens 20, 21


def test_new_tokens_reach_the_cached_copy_of_their_block():
    """The own block was fetched before this step's token: the device write must
    update the cached copy, or attention reads a stale block."""
    cache = DeviceBlockCache(1, 2, 4, 10, "cpu")
    units = torch.zeros(cache.num_units, 4, 6)
    cache.lookup(0, _ids([3], [3]))
    slot_mapping = torch.tensor([3 * 4 + 2, -1, 9 * 4])  # block 3 offset 2; padding; uncached
    flat = cache.cached_token_slots(0, slot_mapping, 4)
    assert flat.tolist() == [[0, 4], [-1, -1], [-1, -1]]
    key, value = torch.ones(3, 2, 3), torch.full((3, 2, 3), 2.0)
    reference.write_cached_tokens(units, flat, slot_mapping, key, value)
    assert units[0, 2].tolist() == [1, 1, 1, 2, 2, 2]
    assert units[4, 2].tolist() == [1, 1, 1, 2, 2, 2]
    assert units[:-1].sum() == 2 * 9  # nothing else written but the scratch unit


def test_attention_over_cached_blocks_equals_attention_over_the_selected_tokens():
    """pool -> lookup -> gather -> own token -> substituted table -> attention, over two
    steps (hits and misses), against softmax over the selected positions of a dense K/V
    (the cache starts as NaN: a wrong slot or a missed fetch shows)."""
    torch.manual_seed(0)
    heads, group, dim, block, blocks_per_row = 2, 3, 8, 4, 6
    context = 21  # the own token at 21, in block 5
    pool = torch.randn(2 * blocks_per_row, heads, block, 2 * dim)  # two rows' blocks
    table = torch.arange(2 * blocks_per_row).view(2, blocks_per_row)
    cache = DeviceBlockCache(1, heads, 8, 2 * blocks_per_row, "cpu")
    units = torch.full((cache.num_units, block, 2 * dim), float("nan"))
    for logical in ([[[0, 2, 5], [1, 5, -1]], [[3, 5, -1], [0, 4, 5]]],
                    [[[0, 3, 5], [1, 4, 5]], [[2, 3, 5], [4, 5, -1]]]):
        logical = torch.tensor(logical)
        ids = torch.where(logical >= 0, table.gather(1, logical.clamp(min=0).view(2, -1))
                          .view_as(logical), -1)
        got = cache.lookup(0, ids)
        kernels.gather_units(pool, units, got.fetch_units, got.fetch_slots, got.num_fetch)
        seq_table, seq_lens = substitute_block_table(got.slots, torch.tensor([context] * 2), block)
        key, value = torch.randn(2 * heads, dim), torch.randn(2 * heads, dim)
        reference.write_own_tokens(units, seq_table, seq_lens, key, value)
        query = torch.randn(2 * heads, group, dim)
        out = kernels.attend_units(query, units, seq_table, seq_lens, num_kv_heads=1,
                                   scale=0.35)
        for row in range(2):
            for head in range(heads):
                blocks = [b for b in logical[row, head].tolist() if b >= 0]
                positions = [p for b in blocks for p in range(b * block, b * block + block)
                             if p < context]
                rows = pool[table[row]][:, head].reshape(-1, 2 * dim)
                keys = torch.cat([rows[positions, :dim], key[row * heads + head][None]])
                values = torch.cat([rows[positions, dim:], value[row * heads + head][None]])
                q = query[row * heads + head]
                expected = torch.softmax(q @ keys.T * 0.35, dim=-1) @ values
                assert torch.allclose(out[row * heads + head], expected, atol=1e-5)
    # step 1: 10 distinct (block, head) entries, all missing; step 2: 8 of 11 cached
    assert cache.take_counters() == ([8], [13])


def test_a_use_count_past_its_bits_saturates_and_is_not_evicted_first():
    cache = DeviceBlockCache(1, 1, 4, 20, "cpu", eviction="counter")
    for blocks in ([1], [2], [3], [4]):
        cache.lookup(0, _ids(blocks))
    cache.num_uses[0, 0, int(cache.slot_of[0, 1])] = 1 << 27  # block 1: hours of hits
    got = cache.lookup(0, _ids([8]))
    assert got.fetch_slots.tolist()[:1] == [1]  # block 2 (oldest half, fewest uses), not 1
