# SPDX-License-Identifier: Apache-2.0
"""A capped pool under vLLM's prefix caching: a finished request's entries are
retired (kept, first to go, not counted as held nor as evictions) and revived
by a request that hits its blocks."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_infinigen.platforms.cpu.pool_index import CappedPoolIndex
from vllm_infinigen.worker.pool_index import IdentityPoolIndex

BLOCK = 4


def _pool(policy: str, rows: int = 8) -> CappedPoolIndex:
    """One layer, two heads, blocks of 4 slots; blocks 0 and 1 admitted, in order."""
    pool = CappedPoolIndex(1, 2, num_slots=64, num_rows=rows, policy=policy, block_size=BLOCK)
    pool.admit(torch.arange(2 * BLOCK))
    return pool


def _held_slots(pool: CappedPoolIndex, head: int = 0) -> list[int]:
    owner = pool.owner[0, head]
    return sorted(owner[owner >= 0].tolist())


def _select(pool: CappedPoolIndex, slots: list[int]) -> None:
    """Both heads select ``slots`` once."""
    rows = pool.rows(0, torch.tensor(slots)[None, :], torch.arange(2)[:, None])  # [H, n]
    pool.record_use(0, rows[None], rows[None] >= 0)


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_retired_entries_stay_and_go_first(policy):
    pool = _pool(policy)
    before = pool.row_of.clone()
    # Block 1 (the newer, and the one selected) is retired: kept where it was.
    _select(pool, list(range(BLOCK, 2 * BLOCK)))
    pool.retire_blocks([1])
    assert torch.equal(pool.row_of, before)
    assert pool.occupancy() == (2 * BLOCK, 8 * 2)  # block 0's entries, 2 heads
    pool.retire_blocks([1])  # a second retirement changes nothing
    assert pool.num_retired.tolist() == [[BLOCK, BLOCK]]
    # Full: the next block evicts block 1's retired entries, not block 0's live
    # ones (under fifo the older, under counter the never selected), uncounted.
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    assert _held_slots(pool) == list(range(BLOCK)) + list(range(2 * BLOCK, 3 * BLOCK))
    assert pool.evictions.tolist() == [0]
    assert pool.num_retired.tolist() == [[0, 0]]
    assert pool.occupancy() == (2 * 2 * BLOCK, 16)


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_a_revived_entry_is_held_again(policy):
    pool = _pool(policy)
    pool.retire_blocks([0])
    pool.revive_blocks([0, 1])  # a hit on both: only block 0 was retired
    assert pool.num_retired.tolist() == [[0, 0]]
    assert pool.occupancy() == (2 * 2 * BLOCK, 16)
    # Now block 1 is retired: it goes first, block 0 stays.
    pool.retire_blocks([1])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    assert _held_slots(pool, head=1) == list(range(BLOCK)) + list(range(2 * BLOCK, 3 * BLOCK))
    assert pool.evictions.tolist() == [0]


def test_a_live_entry_evicted_after_the_retired_ones_counts():
    pool = _pool("fifo", rows=8)
    pool.retire_blocks([1])
    pool.admit(torch.arange(2 * BLOCK, 4 * BLOCK))  # 8 new: the 4 retired, then 4 live
    assert pool.evictions.tolist() == [2 * BLOCK]  # the live ones, both heads
    assert pool.num_retired.tolist() == [[0, 0]]


def test_writing_a_retired_slot_again_drops_it():
    """vLLM evicted the block from its prefix cache and gave it to a new request."""
    pool = _pool("lru")
    pool.retire_blocks([1])
    pool.admit(torch.arange(BLOCK, BLOCK + 2))
    assert pool.num_retired.tolist() == [[BLOCK - 2, BLOCK - 2]]
    assert pool.occupancy() == (2 * (BLOCK + 2), 16)
    pool.release_blocks([1])  # the rest of it, freed
    assert pool.num_retired.tolist() == [[0, 0]]
    assert pool.occupancy() == (2 * BLOCK, 16)


def test_the_retired_count_matches_the_entries_under_random_traffic():
    rng = random.Random(0)
    pool = CappedPoolIndex(2, 2, num_slots=64, num_rows=12, policy="counter", block_size=BLOCK)
    for _ in range(300):
        block = rng.randrange(16)
        action = rng.random()
        if action < 0.4:
            pool.admit(torch.arange(block * BLOCK, block * BLOCK + rng.randint(1, BLOCK)))
        elif action < 0.6:
            pool.retire_blocks([block])
        elif action < 0.8:
            pool.revive_blocks([block])
        else:
            pool.release_blocks([block])
        retired = ((pool.inserted == -1) & (pool.owner >= 0)).sum(dim=-1)
        assert torch.equal(pool.num_retired, retired)
        assert 0 <= pool.occupancy()[0] <= pool.occupancy()[1]


def test_the_identity_pool_keeps_every_row_anyway():
    pool = IdentityPoolIndex(64)
    pool.retire_blocks([1])
    pool.revive_blocks([1])
    assert pool.rows(0, torch.tensor([5]), torch.tensor([0])).tolist() == [5]
