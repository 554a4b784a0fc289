# SPDX-License-Identifier: Apache-2.0
"""The capped pool's maps and its eviction policies, on hand-built cases."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_infinigen.pool import CappedPoolIndex, IdentityPoolIndex

HEADS = torch.arange(2)


def _slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def _use(pool: CappedPoolIndex, slot: int, head: int) -> None:
    """One selection of ``slot`` by ``head`` of layer 0 (one decode row)."""
    rows = pool.rows(0, _slots(slot), torch.tensor(head))
    rows_bhk = torch.full((1, 2, 1), 0, dtype=torch.int64)
    valid = torch.zeros((1, 2, 1), dtype=torch.bool)
    rows_bhk[0, head, 0] = rows[0]
    valid[0, head, 0] = True
    pool.record_use(0, rows_bhk, valid)


def _filled(policy: str) -> CappedPoolIndex:
    """Four rows per head holding slots 0..3 (inserted in that order).

    Head 0 then selects slot 0, slot 1, slot 0; head 1 selects slot 3.
    """
    pool = CappedPoolIndex(1, 2, num_slots=16, num_rows=4, policy=policy)
    for slot in range(4):
        pool.admit(_slots(slot))
    for slot in (0, 1, 0):
        _use(pool, slot, head=0)
    _use(pool, 3, head=1)
    return pool


def _resident(pool: CappedPoolIndex, head: int) -> list[int]:
    return sorted(pool.owner[0, head][pool.owner[0, head] >= 0].tolist())


@pytest.mark.parametrize(
    ("policy", "evicted_head0", "evicted_head1"),
    [
        # The oldest entry, whatever was selected.
        ("fifo", 0, 0),
        # The entry whose last use (or insertion) is oldest: head 0 used 0 and 1
        # after slot 2 was inserted; head 1 used only slot 3.
        ("lru", 2, 0),
        # Among the oldest half {0, 1}, the least often selected: head 0 chose
        # slot 0 twice and slot 1 once; head 1 chose neither (tie: the oldest).
        ("counter", 1, 0),
    ],
)
def test_each_policy_evicts_its_token(policy, evicted_head0, evicted_head1):
    pool = _filled(policy)
    pool.admit(_slots(9))
    assert _resident(pool, 0) == sorted({0, 1, 2, 3, 9} - {evicted_head0})
    assert _resident(pool, 1) == sorted({0, 1, 2, 3, 9} - {evicted_head1})
    assert pool.evictions.tolist() == [2]  # one entry in each head
    gone = pool.rows(0, _slots(evicted_head0, evicted_head1), HEADS)
    assert gone.tolist() == [-1, -1]
    # The new token took the freed row of each head.
    assert pool.rows(0, _slots(9, 9), HEADS).tolist() == [
        pool.rows(0, _slots(9), torch.tensor(0)).item(),
        pool.rows(0, _slots(9), torch.tensor(1)).item(),
    ]


def test_counter_keeps_the_newer_half_even_if_never_selected():
    pool = CappedPoolIndex(1, 1, num_slots=16, num_rows=4, policy="counter")
    for slot in range(4):
        pool.admit(_slots(slot))
    rows = pool.rows(0, _slots(0, 1), torch.tensor(0))
    for _ in range(3):  # the two oldest are selected often
        pool.record_use(0, rows.view(1, 1, 2), torch.ones((1, 1, 2), dtype=torch.bool))
    pool.admit(_slots(5))
    # The oldest half is {0, 1}; of these, 0 and 1 tie at 3 uses: the oldest goes.
    assert sorted(pool.owner[0, 0].tolist()) == [1, 2, 3, 5]


def test_free_rows_are_used_before_anything_is_evicted():
    pool = CappedPoolIndex(2, 2, num_slots=32, num_rows=6, policy="fifo")
    pool.admit(_slots(0, 1, 2))
    pool.release(_slots(1))
    pool.admit(_slots(3, 4, 5, 6))
    assert pool.evictions.tolist() == [0, 0]
    assert pool.occupied().tolist() == [12, 12]  # 6 slots x 2 heads, each layer
    pool.admit(_slots(7))
    assert pool.evictions.tolist() == [2, 2]
    assert (pool.rows(1, _slots(0), HEADS) == -1).all()  # fifo: slot 0 was first


def test_release_frees_everything():
    pool = CappedPoolIndex(3, 2, num_slots=64, num_rows=10, policy="counter")
    pool.admit(torch.arange(8))
    pool.release(torch.arange(8))
    assert pool.occupied().tolist() == [0, 0, 0]
    assert (pool.row_of[:, :64] == -1).all()


def test_a_step_larger_than_the_pool_names_the_flags():
    pool = CappedPoolIndex(1, 1, num_slots=64, num_rows=4, policy="lru")
    with pytest.raises(ValueError, match="--infinigen-cpu-pool-gib.*--max-num-batched-tokens"):
        pool.admit(torch.arange(5))


def test_unknown_policy_names_the_flag():
    with pytest.raises(ValueError, match="--infinigen-eviction"):
        CappedPoolIndex(1, 1, num_slots=4, num_rows=2, policy="random")


def test_padding_slots_map_to_the_padding_row():
    capped = CappedPoolIndex(1, 2, num_slots=8, num_rows=4, policy="fifo")
    identity = IdentityPoolIndex(num_slots=8)
    pad = _slots(-1)[:, None]
    assert capped.rows(0, pad, HEADS).tolist() == [[4, 4]]
    assert identity.rows(0, pad, HEADS).tolist() == [[8, 8]]
    assert identity.rows(0, _slots(3)[:, None], HEADS).tolist() == [[3, 3]]


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_maps_stay_consistent_under_random_traffic(policy):
    """owner[l, h, row] == slot exactly when row_of[l, slot, h] == row."""
    rng = random.Random(policy)
    layers, heads, slots, rows = 2, 3, 40, 12
    pool = CappedPoolIndex(layers, heads, num_slots=slots, num_rows=rows, policy=policy)
    live: set[int] = set()
    for _ in range(200):
        action = rng.random()
        free = [s for s in range(slots) if s not in live]
        if action < 0.5 and free:
            new = rng.sample(free, min(len(free), rng.randint(1, 5)))
            pool.admit(torch.tensor(new))
            live |= set(new)
        elif action < 0.7 and live:
            gone = rng.sample(sorted(live), rng.randint(1, len(live)))
            pool.release(torch.tensor(gone))
            live -= set(gone)
        elif live:
            chosen = torch.tensor(rng.sample(sorted(live), min(3, len(live))))
            per_head = pool.rows(1, chosen[None, None, :], torch.arange(heads)[None, :, None])
            pool.record_use(1, per_head.clamp(min=0), per_head >= 0)
        for layer in range(layers):
            for head in range(heads):
                owner = pool.owner[layer, head]
                for row in range(rows):
                    if owner[row] >= 0:
                        assert pool.row_of[layer, owner[row], head] == row
                mapped = pool.row_of[layer, :slots, head]
                for slot in torch.nonzero(mapped >= 0).flatten().tolist():
                    assert slot in live
                    assert owner[mapped[slot]] == slot
        assert int(pool.occupied().max()) <= heads * rows
