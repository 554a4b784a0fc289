# SPDX-License-Identifier: Apache-2.0
"""The residency switch's scheduler side (``scheduler/spec.py``, ``residency.py``): with
``device_first`` the sparse groups hold device blocks until a step's blocks
would not fit; then every sparse group frees every request's blocks, so that
vLLM's allocation succeeds instead of preempting, and allocates none until
every request over the pool has finished (the next request that fits is
resident again) or the connector finds them all fitting again
(``Residency.restore``: each gets all its blocks at its next allocation, and
the step's metadata names it for the workers' copy from the pool)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec

from types import SimpleNamespace

from vllm_infinigen.scheduler.connector import InfiniGenConnector
from vllm_infinigen.scheduler.residency import residency_of
from vllm_infinigen.scheduler.spec import InfiniGenSparseManager, InfiniGenSparseSpec

BLOCK = 16


def _managers(num_blocks: int, device_first: bool = True, groups: int = 2,
              caching: bool = False):
    pool = BlockPool(num_blocks, enable_caching=caching, hash_block_size=BLOCK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    spec = InfiniGenSparseSpec.of(full, device_first)
    managers = [InfiniGenSparseManager(spec, pool, caching, index + 1, BLOCK)
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


def _moved_with(managers, *requests: tuple[str, int]):
    """Resident ``requests`` (id, blocks), then the first grows past the room: moved."""
    for request_id, blocks in requests:
        _allocate(managers, request_id, blocks * BLOCK)
    first = requests[0][0]
    managers[0].get_num_blocks_to_allocate(first, 99 * BLOCK, [], 0, 0, 99 * BLOCK)
    residency = managers[0].residency
    assert residency.moved
    residency.take_moves()
    return residency


def test_restored_requests_get_all_their_blocks_at_their_next_allocation():
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 4), ("b", 4))
    residency.restore({"a", "b"}, blocks=16, free=31)
    assert not residency.moved and residency.take_moves() == {"pool": 0, "device": 1}
    # "a" is scheduled this step: every block it needs, in each sparse group
    assert _allocate(managers, "a", 5 * BLOCK) == [5, 5]
    assert [len(m.req_to_blocks["a"]) for m in managers] == [5, 5]
    assert residency.take_returns() == (("a",), ("a",))  # named once: rows, copy
    assert residency.to_restore == {"b"}
    assert _allocate(managers, "a", 6 * BLOCK) == [1, 1]  # its next step: no copy
    assert residency.take_returns() == ((), ())
    # "b", not scheduled until now, comes back at its allocation
    assert _allocate(managers, "b", 4 * BLOCK) == [4, 4]
    assert residency.take_returns() == (("b",), ("b",)) and residency.to_restore == set()
    assert not residency.moved


def test_a_restore_pending_request_that_ends_or_a_move_clears_it():
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 6), ("b", 6))
    residency.restore({"a", "b"}, blocks=24, free=31)
    _allocate(managers, "a", 6 * BLOCK)
    _free(managers, "b")  # finished or preempted before its allocation
    assert residency.to_restore == {"a"}
    # "c" would not fit resident: the engine moves again, freeing "a"'s new
    # blocks: nothing to copy, but "a"'s rows are emptied (the runner appends
    # the freed blocks to them), and nothing comes back later
    _allocate(managers, "c", 30 * BLOCK)
    assert residency.moved and residency.to_restore == set()
    assert residency.take_returns() == (("a",), ())
    assert pool.get_num_free_blocks() == 31


def test_vllms_deferred_frees_forget_a_restoration_too():
    """With asynchronous scheduling vLLM pops a request's blocks and frees them
    later (``pop_blocks_for_free``), without ``free``."""
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 4), ("b", 4))
    residency.restore({"a", "b"}, blocks=16, free=31)
    _allocate(managers, "a", 4 * BLOCK)
    for manager in managers:
        pool.free_blocks(reversed(manager.pop_blocks_for_free("a")))
    assert residency.take_returns() == ((), ()) and residency.to_restore == {"b"}


def _steps(residency, count: int, fits: bool | None = None) -> list[bool]:
    """``count`` scheduler steps: resident (None), or over the pool with ``fits``."""
    ready = []
    for _ in range(count):
        residency.tick()
        if fits is not None:
            ready.append(residency.step(fits))
    return ready


def test_a_return_undone_soon_doubles_the_steps_the_next_waits_for():
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 2))
    assert _steps(residency, 1, fits=True) == [True]  # patience 1: at once
    residency.restore({"a"}, blocks=4, free=29)
    _steps(residency, 10)  # 10 steps resident, then a move
    residency.move()
    assert residency.patience == 2
    assert _steps(residency, 2, fits=True) == [False, True]  # 2 in a row
    residency.restore({"a"}, blocks=4, free=29)
    residency.move()  # undone at once
    assert residency.patience == 4
    assert _steps(residency, 2, fits=True) == [False, False]
    assert _steps(residency, 1, fits=False) == [False]  # the count starts again
    assert _steps(residency, 4, fits=True) == [False, False, False, True]
    residency.restore({"a"}, blocks=4, free=29)
    _steps(residency, 64)  # a return that lasted: resident 64 steps
    residency.move()
    assert residency.patience == 1


def test_a_move_counts_the_sliding_window_groups_blocks_too():
    """Gemma 3: beside the dense and sparse groups, sliding-window groups take blocks
    for a request's tokens as well, and vLLM refuses an allocation whose blocks in all
    groups do not fit (it preempts, or keeps the request waiting). A lone request that
    fits over the pool but not resident moves the engine, through vLLM's manager."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    from vllm_infinigen.scheduler.spec import register_spec

    register_spec()
    shape = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    full = FullAttentionSpec(**shape)
    window = SlidingWindowSpec(sliding_window=4 * BLOCK, **shape)
    groups = [KVCacheGroupSpec(["dense"], full),
              KVCacheGroupSpec(["sparse"], InfiniGenSparseSpec.of(full, True))]
    groups += [KVCacheGroupSpec([f"window{i}"], window) for i in range(3)]
    manager = KVCacheManager(KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                           kv_cache_groups=groups),
                             max_model_len=4096, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=False)
    connector = object.__new__(InfiniGenConnector)
    connector.bind_kv_cache_manager(manager)
    residency = residency_of(manager.block_pool)
    assert residency.groups() == 5
    # 13 blocks a group: 65 resident, 52 over the pool, 63 free
    request = Request("r", list(range(13 * BLOCK)), SamplingParams(max_tokens=4), None)
    assert manager.allocate_slots(request, 13 * BLOCK, has_scheduled_reqs=False) is not None
    assert residency.moved


def test_an_idle_return_that_lasted_resets_the_patience():
    """Every request over the pool finished (``move_back``): a return too. Hours
    resident after flip-flops, the next burst's requests must not wait the
    flip-flops' patience to come back; undone soon, it keeps the patience."""
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 2))
    for _ in range(3):  # three quick flip-flops
        residency.restore({"a"}, blocks=4, free=29)
        residency.move()
    assert residency.patience == 8
    residency.move_back()
    _steps(residency, 10)
    residency.move()  # undone soon: kept, not doubled (nothing was copied)
    assert residency.patience == 8
    residency.move_back()
    _steps(residency, 1000)
    residency.move()
    assert residency.patience == 1


def test_the_connector_counts_every_step_resident_or_not():
    """A return that stays resident 64 steps has lasted, though no step over the
    pool came between (the connector ticks every step)."""
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 2))
    connector = _connector(managers, pool, dense_blocks={"a": 1})
    connector.build_connector_meta(None)  # over the pool: fits, patience 1: returns
    assert not residency.moved
    _allocate(managers, "a", 2 * BLOCK)
    for _ in range(64):
        connector.build_connector_meta(None)  # resident
    residency.move()
    assert residency.patience == 1


def _connector(managers, pool, *, dense_blocks: dict[str, int], capped: bool = False):
    """The connector's scheduler side over these managers, the dense group
    (group 0; the sparse ones 1 and 2) holding ``dense_blocks`` of each request."""
    dense = SimpleNamespace(req_to_blocks={r: [None] * n for r, n in dense_blocks.items()})
    connector = object.__new__(InfiniGenConnector)
    connector._kv_cache_manager = SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[dense, *managers]))
    full = SimpleNamespace(kv_cache_spec=FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32))
    sparse = SimpleNamespace(kv_cache_spec=managers[0].kv_cache_spec)
    connector._kv_cache_config = SimpleNamespace(kv_cache_groups=[full, sparse, sparse])
    connector._setup = SimpleNamespace(
        config=SimpleNamespace(device_first=True, cpu_pool_gib=None),
        pool_bytes_per_token=1024, step_tokens=BLOCK)
    connector._vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    connector._workers_report_pool = capped
    return connector


@pytest.mark.parametrize("free, returns", [(12, True), (11, False)])
def test_the_engine_returns_when_the_live_requests_fit_in_half_the_free_blocks(free, returns):
    """"a" over the pool holds 3 blocks of the dense group: back in the 2 sparse
    groups it needs 6, which fit in half of 12 free blocks, not of 11."""
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 2))
    pool.get_new_blocks(pool.get_num_free_blocks() - free)
    connector = _connector(managers, pool, dense_blocks={"a": 3})
    metadata = connector.build_connector_meta(None)
    assert metadata.resident is False and metadata.restored == metadata.cleared == ()
    assert residency.moved is not returns
    if returns:
        assert residency.to_restore == {"a"}
        _allocate(managers, "a", 3 * BLOCK)
        metadata = connector.build_connector_meta(None)
        assert metadata.resident is True and metadata.restored == metadata.cleared == ("a",)


def test_a_capped_pool_never_returns_while_requests_are_live():
    """A capped pool evicts: the K/V of a request over it may be gone."""
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 2))
    connector = _connector(managers, pool, dense_blocks={"a": 1}, capped=True)
    connector.build_connector_meta(None)
    assert residency.moved


# vLLM's prefix caching under device-first


def _allocate_hit(managers, request_id: str, tokens: int, hit: int) -> list[int]:
    """A first allocation with ``hit`` tokens of a prefix-cache hit (in the dense
    group; no sparse block of it cached), as vLLM's coordinator makes it."""
    counts = [m.get_num_blocks_to_allocate(request_id, tokens, [], hit, hit, tokens)
              for m in managers]
    for manager in managers:
        manager.add_local_computed_blocks(request_id, [], hit, 0)
    for manager in managers:
        manager.allocate_new_blocks(request_id, tokens, tokens)
    return counts


def test_a_resident_hit_gets_every_block_and_its_hit_filled_from_the_pool():
    pool, managers = _managers(64)
    residency = managers[0].residency
    assert _allocate_hit(managers, "a", 5 * BLOCK, 3 * BLOCK) == [5, 5]
    assert [len(m.req_to_blocks["a"]) for m in managers] == [5, 5]
    assert residency.take_fills() == (("a", 0, 3),) and residency.take_fills() == ()
    assert _allocate(managers, "a", 6 * BLOCK) == [1, 1]  # its next step: nothing
    assert residency.take_fills() == ()
    _allocate_hit(managers, "b", 2 * BLOCK, 0)  # no hit: nothing to fill
    assert residency.take_fills() == ()


def test_a_fill_is_forgotten_when_its_blocks_go():
    pool, managers = _managers(32)
    residency = managers[0].residency
    _allocate_hit(managers, "a", 4 * BLOCK, 2 * BLOCK)
    _free(managers, "a")  # finished or preempted in the same step
    assert residency.take_fills() == ()
    _allocate_hit(managers, "b", 4 * BLOCK, 2 * BLOCK)
    _allocate(managers, "c", 30 * BLOCK)  # moves: "b"'s new blocks are freed
    assert residency.moved and residency.take_fills() == ()


def test_over_the_pool_a_hit_needs_no_fill():
    pool, managers = _managers(32)
    residency = _moved_with(managers, ("a", 4))
    assert _allocate_hit(managers, "b", 4 * BLOCK, 2 * BLOCK) == [0, 0]
    assert residency.moved and residency.take_fills() == ()


def test_a_capped_pool_moves_the_engine_at_a_resident_hit():
    """A capped pool may have evicted the hit's entries: the pool serves the hit
    instead (an estimate moves nothing); once idle, a hit stays over the pool."""
    pool, managers = _managers(64)
    residency = managers[0].residency
    residency.pool_capped = True
    _allocate(managers, "a", 2 * BLOCK)  # no hit: resident
    assert residency.take_fills() == () and not residency.moved
    assert managers[0].get_num_blocks_to_allocate("b", 4 * BLOCK, [], BLOCK, BLOCK, 4 * BLOCK,
                                                  apply_admission_cap=True) == 0
    assert not residency.moved
    assert _allocate_hit(managers, "b", 4 * BLOCK, BLOCK) == [0, 0]
    assert residency.moved and residency.take_moves() == {"pool": 1, "device": 0}
    assert residency.take_fills() == ()
    _free(managers, "a", "b")
    assert _allocate_hit(managers, "c", 4 * BLOCK, BLOCK) == [0, 0]  # idle, a hit: stays
    assert residency.moved
    _free(managers, "c")
    assert _allocate(managers, "d", 2 * BLOCK) == [2, 2] and not residency.moved


def test_the_connector_names_the_fills_and_learns_a_capped_pool():
    pool, managers = _managers(64)
    connector = _connector(managers, pool, dense_blocks={"a": 3})
    _allocate_hit(managers, "a", 3 * BLOCK, 2 * BLOCK)
    metadata = connector.build_connector_meta(None)
    assert metadata.resident is True and metadata.filled == (("a", 0, 2),)
    assert metadata.restored == metadata.cleared == ()
    assert managers[0].residency.pool_capped is False
    capped = _connector(managers, pool, dense_blocks={"a": 3}, capped=True)
    capped.build_connector_meta(None)
    assert managers[0].residency.pool_capped is True
