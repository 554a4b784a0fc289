# SPDX-License-Identifier: Apache-2.0
"""``device-first`` with vLLM's prefix caching (``scheduler/spec.py``, ``residency.py``):
while resident the sparse groups cache their blocks as full attention does, so that a hit
shares them (one copy of a long prefix for a batch, and a hit on blocks computed in the
same step reads what the forward writes there); what they lack of the dense group's hit
is filled from the pool; a move uncaches what it frees."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.test_residency import BLOCK, _managers, _moved_with
from vllm_infinigen.scheduler.spec import InfiniGenSparseManager

SPARSE_GROUPS = [1, 2]  # the managers' groups (the dense group is 0)


def _request(request_id: str, prefix: int, own: int) -> SimpleNamespace:
    """A request of ``prefix`` shared blocks and ``own`` blocks of its own, with
    vLLM's chained block hashes (equal over the shared prefix)."""
    hashes = [f"prefix-{index}".encode() for index in range(prefix)]
    hashes += [f"{request_id}-{index}".encode() for index in range(own)]
    return SimpleNamespace(request_id=request_id, block_hashes=hashes,
                           shared_prefix_boundary=0)


def _hit(managers, request, max_tokens: int):
    """The sparse groups' hit, as vLLM's coordinator asks after the dense group's."""
    return InfiniGenSparseManager.find_longest_cache_hit(
        request.block_hashes, max_tokens, SPARSE_GROUPS, managers[0].block_pool,
        managers[0].kv_cache_spec, False, alignment_tokens=BLOCK)


def _admit(managers, request, dense_hit: int) -> list[int]:
    """A first allocation of the whole request with ``dense_hit`` tokens of the dense
    group's hit, as vLLM's ``KVCacheManager.allocate_slots`` makes it (the blocks its
    tokens fill cached at once). Returns the blocks each group needed."""
    tokens = len(request.block_hashes) * BLOCK
    hits, length = _hit(managers, request, dense_hit)
    assert length == dense_hit  # never shorter than the dense group's
    rid = request.request_id
    counts = [m.get_num_blocks_to_allocate(rid, tokens, hit, dense_hit, dense_hit, tokens)
              for m, hit in zip(managers, hits)]
    for manager, hit in zip(managers, hits):
        manager.add_local_computed_blocks(rid, hit, dense_hit, 0)
    for manager in managers:
        manager.allocate_new_blocks(rid, tokens, tokens)
        manager.cache_blocks(request, tokens, replay_boundaries=())
    return counts


def _ids(blocks) -> set[int]:
    return {block.block_id for block in blocks}


def test_a_resident_hit_shares_the_sparse_blocks_of_its_prefix():
    pool, managers = _managers(64, caching=True)
    residency = managers[0].residency
    assert _admit(managers, _request("a", 4, 1), 0) == [5, 5]
    free = pool.get_num_free_blocks()
    assert _admit(managers, _request("b", 4, 2), 4 * BLOCK) == [2, 2]
    assert pool.get_num_free_blocks() == free - 4  # its own blocks only
    for manager in managers:
        a, b = manager.req_to_blocks["a"], manager.req_to_blocks["b"]
        assert b[:4] == a[:4] and all(block.ref_cnt == 2 for block in a[:4])
        assert not _ids(b[4:]) & _ids(a)
    assert residency.take_fills() == ()  # nothing to copy from the pool


def test_what_the_sparse_groups_did_not_cache_of_a_hit_is_filled_from_the_pool():
    """The dense group's hit is never shortened: blocks 2 and 3 uncached in the
    sparse groups (evicted, or written over the pool) are fresh, filled from the pool."""
    pool, managers = _managers(64, caching=True)
    _admit(managers, _request("a", 4, 1), 0)
    pool.evict_blocks({m.req_to_blocks["a"][2].block_id for m in managers})
    assert _admit(managers, _request("b", 4, 1), 4 * BLOCK) == [3, 3]
    for manager in managers:
        a, b = manager.req_to_blocks["a"], manager.req_to_blocks["b"]
        assert b[:2] == a[:2] and not _ids(b[2:]) & _ids(a)
    assert managers[0].residency.take_fills() == (("b", 2, 4),)


def test_a_move_uncaches_every_sparse_block_it_frees():
    """A move frees the sparse blocks of every request, among them those of tokens
    the step being scheduled would have written: none may serve a later hit."""
    pool, managers = _managers(32, caching=True)
    _admit(managers, _request("a", 4, 0), 0)
    prefix = _request("b", 4, 0)
    assert [len(blocks) for blocks in _hit(managers, prefix, 4 * BLOCK)[0]] == [4, 4]
    _moved_with(managers, ("a", 4))
    assert _hit(managers, prefix, 4 * BLOCK) == (([], []), 4 * BLOCK)
    assert all(block.block_hash is None for block in pool.blocks)


def test_over_the_pool_a_hit_takes_no_sparse_block():
    pool, managers = _managers(32, caching=True)
    _admit(managers, _request("a", 4, 0), 0)
    held = managers[0].req_to_blocks["a"][:2]
    residency = _moved_with(managers, ("c", 2))
    manager = managers[0]
    assert manager.get_num_blocks_to_allocate("b", 3 * BLOCK, held, 2 * BLOCK, 2 * BLOCK,
                                              3 * BLOCK) == 0
    manager.add_local_computed_blocks("b", held, 2 * BLOCK, 0)
    assert manager.req_to_blocks["b"] == [] and all(block.ref_cnt == 0 for block in held)
    assert residency.moved and residency.take_fills() == ()


def test_a_capped_pool_keeps_a_hit_resident_when_the_sparse_groups_cached_it_all():
    """Nothing to fill, so nothing the pool may have evicted: resident; a hit that
    needs a fill still moves the engine."""
    pool, managers = _managers(64, caching=True)
    residency = managers[0].residency
    residency.pool_capped = True
    _admit(managers, _request("a", 4, 1), 0)
    assert _admit(managers, _request("b", 4, 1), 4 * BLOCK) == [1, 1]
    assert not residency.moved and residency.take_fills() == ()
    pool.evict_blocks({m.req_to_blocks["a"][3].block_id for m in managers})
    assert _admit(managers, _request("c", 4, 1), 4 * BLOCK) == [0, 0]
    assert residency.moved and residency.take_fills() == ()


def test_without_device_first_no_sparse_block_is_cached_or_looked_up():
    pool, managers = _managers(64, device_first=False, caching=True)
    assert not managers[0].kv_cache_spec.prefix_cacheable
    request = _request("a", 4, 0)
    _admit(managers, request, 0)
    assert _hit(managers, request, 4 * BLOCK) == (([], []), 4 * BLOCK)


def test_a_request_freed_before_its_copy_leaves_no_cached_sparse_block():
    """Restored (its blocks to be copied from the pool before the forward), then
    preempted in the same step (vLLM's priority policy): its blocks were cached at
    allocation and will never be written, so no later hit may share them."""
    pool, managers = _managers(64, caching=True)
    residency = _moved_with(managers, ("a", 4))
    residency.restore({"a"}, blocks=8, free=63)
    request = _request("a", 4, 0)
    _admit(managers, request, 0)  # its blocks back, cached
    assert [len(blocks) for blocks in _hit(managers, _request("c", 4, 0), 4 * BLOCK)[0]] == [4, 4]
    for manager in managers:
        manager.free("a")
    assert residency.take_returns() == ((), ())
    assert _hit(managers, _request("c", 4, 0), 4 * BLOCK) == (([], []), 4 * BLOCK)


def test_a_hit_freed_before_its_fill_uncaches_only_the_blocks_to_fill():
    pool, managers = _managers(64, caching=True)
    _admit(managers, _request("a", 4, 1), 0)
    pool.evict_blocks({m.req_to_blocks["a"][2].block_id for m in managers})
    _admit(managers, _request("b", 4, 1), 4 * BLOCK)  # shares 2 blocks, fills 2
    for manager in managers:
        manager.free("b")
    assert managers[0].residency.take_fills() == ()
    hits, _ = _hit(managers, _request("c", 4, 0), 4 * BLOCK)
    assert [len(blocks) for blocks in hits] == [2, 2]  # "a"'s, still cached
