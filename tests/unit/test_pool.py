# SPDX-License-Identifier: Apache-2.0
"""The capped pool's maps and its eviction policies, on hand-built cases."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_infinigen.platforms.cpu.pool_index import CappedPoolIndex, make_pool_index
from vllm_infinigen.worker.pool_index import IdentityPoolIndex

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


def test_a_count_past_its_bits_saturates_and_is_not_evicted_first():
    """A shared prefix's sink, selected by every row of every step for hours (2^23
    selections), must not wrap into the key's sign bit and go first."""
    pool = CappedPoolIndex(1, 1, num_slots=64, num_rows=8, policy="counter", block_size=4)
    pool.admit(torch.arange(8))
    pool.count[0, 0, int(pool.row_map[0, 0, 0, 0])] = 1 << 23
    pool.admit(torch.tensor([8]))
    assert int(pool.row_map[0, 0, 0, 0]) >= 0


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


def test_release_blocks_frees_exactly_the_blocks_slots():
    pool = CappedPoolIndex(2, 2, num_slots=64, num_rows=40, policy="fifo", block_size=8)
    pool.admit(torch.arange(32))  # blocks 0..3
    pool.release_blocks([1, 3])
    by_slot = pool.row_of[:, :64]
    assert (by_slot[:, 8:16] == -1).all() and (by_slot[:, 24:32] == -1).all()
    assert (by_slot[:, 0:8] >= 0).all() and (by_slot[:, 16:24] >= 0).all()
    assert pool.occupied().tolist() == [2 * 16, 2 * 16]


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


def _random_traffic(pool: CappedPoolIndex, rng: random.Random, live: set[int], *,
                    admit_below: float, release_below: float, max_admitted: int,
                    max_used: int, used_layer: int | None = None, pad: bool = False) -> None:
    """One random step: admit up to ``max_admitted`` free slots (``pad``: plus a -1),
    release some live ones, or record a use of up to ``max_used`` live slots in
    ``used_layer`` (None: a random layer). ``live`` follows admits and releases."""
    action = rng.random()
    free = [s for s in range(pool.num_slots) if s not in live]
    if action < admit_below and free:
        new = rng.sample(free, min(len(free), rng.randint(1, max_admitted)))
        pool.admit(torch.tensor(new + [-1] if pad else new))
        live |= set(new)
    elif action < release_below and live:
        gone = rng.sample(sorted(live), rng.randint(1, len(live)))
        pool.release(torch.tensor(gone))
        live -= set(gone)
    elif live:
        chosen = torch.tensor(rng.sample(sorted(live), min(max_used, len(live))))
        layer = rng.randrange(pool.num_layers) if used_layer is None else used_layer
        heads = torch.arange(pool.num_heads)[None, :, None]
        per_head = pool.rows(layer, chosen[None, None, :], heads)
        pool.record_use(layer, per_head.clamp(min=0), per_head >= 0)


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_maps_stay_consistent_under_random_traffic(policy):
    """owner[l, h, row] == slot exactly when row_of[l, slot, h] == row."""
    rng = random.Random(policy)
    layers, heads, slots, rows = 2, 3, 40, 12
    pool = CappedPoolIndex(layers, heads, num_slots=slots, num_rows=rows, policy=policy)
    live: set[int] = set()
    for _ in range(200):
        _random_traffic(pool, rng, live, admit_below=0.5, release_below=0.7, max_admitted=5,
                        max_used=3, used_layer=1)
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


def _no_scan(monkeypatch, pool: CappedPoolIndex) -> None:
    """Makes computing eviction keys fail the test."""

    def scan(layers):
        raise AssertionError("eviction keys computed")

    monkeypatch.setattr(pool, "_eviction_key", scan)


def test_admitting_into_free_rows_neither_evicts_nor_scans(monkeypatch):
    pool = CappedPoolIndex(2, 3, num_slots=64, num_rows=10, policy="counter", block_size=8)
    _no_scan(monkeypatch, pool)
    pool.admit(torch.arange(6))
    pool.release(_slots(1, 2, 3))
    pool.admit(_slots(40, 41, 42, 43, 44, 45, 46))  # exactly the 10 - 3 free rows
    assert pool.evictions.tolist() == [0, 0]
    assert pool.occupied().tolist() == [30, 30]
    assert pool.num_free.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_a_full_head_evicts_a_batch_then_admits_without_scanning(monkeypatch):
    """64 rows: one token more evicts 1 + 64 // 16 entries per head, at once."""
    pool = CappedPoolIndex(2, 2, num_slots=256, num_rows=64, policy="fifo", block_size=16)
    pool.admit(torch.arange(64))
    pool.admit(_slots(100))
    assert pool.evictions.tolist() == [10, 10]  # 5 entries x 2 heads
    for layer in range(2):
        for head in range(2):
            assert _resident_in(pool, layer, head) == list(range(5, 64)) + [100]
    assert (pool.rows(0, torch.arange(5)[:, None], HEADS) == -1).all()
    assert pool.num_free.tolist() == [[4, 4], [4, 4]]
    scan = pool._eviction_key
    _no_scan(monkeypatch, pool)
    pool.admit(_slots(101, 102, 103, 104))  # the spare rows
    assert pool.evictions.tolist() == [10, 10]
    monkeypatch.setattr(pool, "_eviction_key", scan)
    pool.admit(_slots(105))
    assert pool.evictions.tolist() == [20, 20]
    assert _resident_in(pool, 1, 0) == list(range(10, 64)) + list(range(100, 106))


def test_a_batch_eviction_never_evicts_more_than_a_head_holds():
    pool = CappedPoolIndex(1, 1, num_slots=128, num_rows=32, policy="lru", block_size=16)
    pool.admit(torch.arange(32))
    pool.admit(torch.arange(64, 96))  # needs all 32 rows; the reserve would ask 34
    assert pool.evictions.tolist() == [32]
    assert _resident_in(pool, 0, 0) == list(range(64, 96))
    assert pool.num_free.tolist() == [[0]]


def test_counter_batch_evicts_the_least_selected_of_the_oldest_half():
    pool = CappedPoolIndex(1, 2, num_slots=128, num_rows=64, policy="counter", block_size=16)
    pool.admit(torch.arange(64))
    chosen = torch.arange(5)  # head 0 selects slots 0..4 once; head 1 nothing
    rows = pool.rows(0, chosen[None, None, :], HEADS[None, :, None])
    valid = torch.tensor([True, False]).view(1, 2, 1).expand_as(rows)
    pool.record_use(0, rows, valid)
    pool.admit(_slots(100))
    assert _resident_in(pool, 0, 0) == [0, 1, 2, 3, 4] + list(range(10, 64)) + [100]
    assert _resident_in(pool, 0, 1) == list(range(5, 64)) + [100]


def test_block_size_must_divide_the_slots():
    with pytest.raises(ValueError, match="block size 16"):
        CappedPoolIndex(1, 1, num_slots=40, num_rows=4, policy="fifo", block_size=16)
    capped = make_pool_index(2, 3, 64, 8, "fifo", torch.device("cpu"), block_size=16)
    assert isinstance(capped, CappedPoolIndex) and capped.row_map.shape == (2, 4, 3, 16)
    assert isinstance(make_pool_index(2, 3, 64, 64, "fifo", torch.device("cpu"), block_size=16),
                      IdentityPoolIndex)


def test_repeated_slots_take_one_row():
    pool = CappedPoolIndex(1, 2, num_slots=32, num_rows=8, policy="fifo", block_size=8)
    pool.admit(_slots(3, 5, 3, -1))
    assert pool.occupied().tolist() == [4]
    pool.release(_slots(5, 5, 3))
    assert pool.occupied().tolist() == [0]
    assert pool.num_free.tolist() == [[8, 8]]


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_row_map_agrees_with_rows_under_random_traffic(policy):
    """row_map is [L, blocks, H, block] int32, the free stacks hold the free rows."""
    rng = random.Random(f"row_map-{policy}")
    layers, heads, block, blocks, rows = 2, 3, 4, 24, 48  # reserve 3
    slots = block * blocks
    pool = CappedPoolIndex(layers, heads, num_slots=slots, num_rows=rows, policy=policy,
                           block_size=block)
    assert pool.row_map.shape == (layers, blocks, heads, block)
    assert pool.row_map.dtype == torch.int32 and pool.row_map.is_contiguous()
    all_slots = torch.arange(slots)
    live: set[int] = set()
    for _ in range(150):
        _random_traffic(pool, rng, live, admit_below=0.55, release_below=0.75, max_admitted=9,
                        max_used=6, pad=True)
        assert pool.row_map.is_contiguous()
        for layer in range(layers):
            mapped = pool.rows(layer, all_slots[:, None], torch.arange(heads)[None, :])
            assert mapped.dtype == torch.int64
            by_block = pool.row_map[layer].permute(0, 2, 1).reshape(slots, heads)
            assert torch.equal(mapped, by_block.to(torch.int64))
            for head in range(heads):
                owner = pool.owner[layer, head]
                held = torch.nonzero(mapped[:, head] >= 0).flatten()
                assert set(held.tolist()) <= live
                assert torch.equal(owner[mapped[held, head]], held)
                assert int((owner >= 0).sum()) == held.numel()
                stack = pool.free_rows[layer, head, : pool.num_free[layer, head]]
                assert sorted(stack.tolist()) == torch.nonzero(owner < 0).flatten().tolist()
        occupied = (pool.owner >= 0).sum(dim=(1, 2))
        assert torch.equal(pool.occupied(), occupied)


def _resident_in(pool: CappedPoolIndex, layer: int, head: int) -> list[int]:
    return sorted(pool.owner[layer, head][pool.owner[layer, head] >= 0].tolist())
