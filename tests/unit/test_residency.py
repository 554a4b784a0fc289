# SPDX-License-Identifier: Apache-2.0
"""The residency switch's scheduler side (``scheduler/spec.py``): with
``device_first`` the sparse groups hold device blocks until a step's blocks
would not fit; then every sparse group frees every request's blocks, so that
vLLM's allocation succeeds instead of preempting, and allocates none until
every request over the pool has finished: the next request that fits is
resident again."""

from __future__ import annotations

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_infinigen.scheduler.spec import InfiniGenSparseManager, InfiniGenSparseSpec

BLOCK = 16


def _managers(num_blocks: int, device_first: bool = True, groups: int = 2):
    pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=BLOCK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    spec = InfiniGenSparseSpec.of(full, device_first)
    managers = [InfiniGenSparseManager(spec, pool, False, index + 1, BLOCK)
                for index in range(groups)]
    return pool, managers


def _allocate(managers, request_id: str, tokens: int) -> list[int]:
    counts = [m.get_num_blocks_to_allocate(request_id, tokens, [], 0, 0, tokens)
              for m in managers]
    for manager in managers:
        manager.allocate_new_blocks(request_id, tokens, tokens)
    return counts


def test_resident_sparse_groups_hold_blocks_as_full_attention_does():
    pool, managers = _managers(64)
    free = pool.get_num_free_blocks()
    assert _allocate(managers, "a", 5 * BLOCK) == [5, 5]
    assert [len(m.req_to_blocks["a"]) for m in managers] == [5, 5]
    assert pool.get_num_free_blocks() == free - 10
    assert all(m.resident for m in managers)


def test_a_step_that_would_not_fit_moves_every_request_of_every_sparse_group():
    pool, managers = _managers(32)  # 31 usable: the null block is one
    _allocate(managers, "a", 6 * BLOCK)
    _allocate(managers, "b", 6 * BLOCK)  # 24 held, 7 free
    assert pool.get_num_free_blocks() == 7
    # "a" grows by 3 blocks: 3 in each of 3 groups (dense + 2 sparse) > 7 free
    assert managers[0].get_num_blocks_to_allocate("a", 9 * BLOCK, [], 0, 0, 9 * BLOCK) == 0
    assert managers[0].residency.moved and not any(m.resident for m in managers)
    assert pool.get_num_free_blocks() == 31  # every sparse block back
    assert all(m.req_to_blocks[r] == [] for m in managers for r in ("a", "b"))
    # while a request runs over the pool: nothing allocated, whatever the room
    assert _allocate(managers, "c", 2 * BLOCK) == [0, 0]
    assert pool.get_num_free_blocks() == 31


def test_an_estimate_counts_as_moved_but_moves_nothing():
    """Admission and reservations ask with ``apply_admission_cap``: a request the
    device cannot hold resident is not kept waiting, and nothing is freed."""
    pool, managers = _managers(32)
    _allocate(managers, "a", 6 * BLOCK)
    needed = managers[0].get_num_blocks_to_allocate("b", 20 * BLOCK, [], 0, 0, 20 * BLOCK,
                                                    apply_admission_cap=True)
    assert needed == 0 and not managers[0].residency.moved
    assert [len(m.req_to_blocks["a"]) for m in managers] == [6, 6]


def test_without_device_first_the_sparse_groups_hold_nothing():
    pool, managers = _managers(16, device_first=False)
    assert _allocate(managers, "a", 5 * BLOCK) == [0, 0]
    assert pool.get_num_free_blocks() == 15 and not managers[0].residency.managers


def _free(managers, *request_ids: str) -> None:
    for manager in managers:
        for request_id in request_ids:
            manager.free(request_id)


def test_once_every_pool_request_finished_the_next_one_that_fits_is_resident_again():
    pool, managers = _managers(32)
    residency = managers[0].residency
    _allocate(managers, "a", 6 * BLOCK)
    _allocate(managers, "b", 6 * BLOCK)
    managers[0].get_num_blocks_to_allocate("a", 9 * BLOCK, [], 0, 0, 9 * BLOCK)  # moves
    assert residency.take_moves() == {"pool": 1, "device": 0}
    _free(managers, "a")
    # "b" alone, mid-request over the pool: it grows without returning
    assert _allocate(managers, "b", 8 * BLOCK) == [0, 0] and residency.moved
    _free(managers, "b")
    assert residency.take_moves() == {"pool": 0, "device": 0}
    # nothing live: a request whose blocks would not fit stays over the pool
    assert _allocate(managers, "big", 11 * BLOCK) == [0, 0] and residency.moved
    _free(managers, "big")
    assert _allocate(managers, "c", 3 * BLOCK) == [3, 3]
    assert not residency.moved and all(m.resident for m in managers)
    assert [len(m.req_to_blocks["c"]) for m in managers] == [3, 3]
    assert residency.take_moves() == {"pool": 0, "device": 1}
    # and it can move again
    _allocate(managers, "d", 6 * BLOCK)
    managers[0].get_num_blocks_to_allocate("d", 12 * BLOCK, [], 0, 0, 12 * BLOCK)
    assert residency.moved and residency.take_moves() == {"pool": 1, "device": 0}
