# SPDX-License-Identifier: Apache-2.0
"""Scheduler side: the KV-cache spec and manager of InfiniGen's sparse layers.

A sparse layer's KV lives in InfiniGen's pool, not in vLLM's paged cache, so
its KV-cache group holds no device blocks: the manager admits requests against
nothing and its block table stays empty. vLLM's hybrid allocator puts the
sparse layers in groups of their own; the dense layers keep stock full
attention. Per request the device holds::

    dense layers   ceil(tokens / block_size) blocks (vLLM's cache, stock)
    sparse layers  0 blocks; partial keys of every token (InfiniGen, by the
                   dense group's slot ids); their K/V in the host pool

With ``--infinigen-residency device-first`` the sparse groups hold device
blocks too, as full attention's do, while the engine is *resident*: the
sparse layers attend with vLLM's own kernel over them (their K/V still
written through to the pool). When a request's next blocks in every group
would not fit in the free blocks (where vLLM would preempt or keep a request
waiting), the engine *moves*: every sparse group frees every request's
blocks, and allocates none while a request that ran over the pool is live;
the workers learn it from the connector's metadata of the same step
(``connector.py``) and select from the pool, which already holds everything
(resident steps write through to it). The engine *returns* in two ways:
once every such request has finished (none is left in the sparse groups) and
a new request's blocks fit, that request and the next ones are resident
again; and, while requests over the pool are still live, as soon as all
their blocks in every sparse group fit in half the free blocks (the
connector decides at the end of a step, ``Residency.restore``): from the next
step each of them gets its blocks back at its next allocation and the
workers copy its K/V there from the pool before the forward (uncapped pools
only: a capped one has evicted). Each move is logged and counted by direction
(``vllm:infinigen_residency_moves``).

vLLM's prefix caching: with ``device_first`` the sparse groups cache their blocks as
full attention's do, while resident, so that a resident request's hit shares the sparse
blocks of the requests it shares the prefix with, as it shares the dense ones (a batch
on one long prefix attends over one copy; a hit on blocks that a request computes in
the same step reads what the forward writes there). Where the sparse groups cached
less of the prefix than the dense group (blocks written over the pool, or evicted),
the rest of the hit gets fresh blocks, which the workers fill from the pool before the
forward (``filled``): the hit's dense slots address the pool's rows, which hold the
prefix's K/V. Those groups never shorten the dense group's hit. A move uncaches every
sparse block it frees (blocks allocated in the same step were never written). Over a
capped pool the hit's entries may be evicted: a resident hit that needs a fill moves the
engine instead, and the pool serves it as it serves every request over it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class InfiniGenSparseSpec(AttentionSpec):
    """A layer whose KV is served from InfiniGen's pool (no device blocks), or
    with ``device_first`` from vLLM's device blocks until the engine moves."""

    device_first: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        """Resident blocks are cached as full attention's (``device_first``)."""
        return self.device_first

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return 0

    # The block table keeps its stock width: vLLM still computes a slot
    # mapping for these layers (into the null block; nothing is written).

    @classmethod
    def merge(cls, specs: list) -> InfiniGenSparseSpec:
        if not all(type(spec) is cls and spec == specs[0] for spec in specs):
            raise AssertionError("InfiniGen sparse layers form groups of their own")
        return specs[0]

    @classmethod
    def of(cls, spec: AttentionSpec, device_first: bool = False) -> InfiniGenSparseSpec:
        """The sparse counterpart of a layer's stock spec (same page layout)."""
        names = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "device_first"]
        return cls(**{name: getattr(spec, name) for name in names}, device_first=device_first)


QUICK_UNDO = 64  # scheduler steps: a return undone by a move sooner doubles the patience
MAX_PATIENCE = 1024


class Residency:
    """Whether an engine's sparse layers are still in the device blocks: one
    per scheduler (its block pool), shared by the sparse groups' managers."""

    def __init__(self) -> None:
        self.moved = False
        self.managers: list[InfiniGenSparseManager] = []
        self._moves = {"pool": 0, "device": 0}  # not yet reported, by destination
        # Requests over the pool whose sparse blocks come back at their next
        # allocation (``restore``); of those, the ones that got them in the step
        # being scheduled (``cleared``: the workers empty their sparse rows, which
        # still name the blocks of the move, before appending the new ones) and
        # still hold them (``restored``: the workers copy their K/V from the pool;
        # a move in the same step frees them again).
        self.to_restore: set[str] = set()
        self.cleared: set[str] = set()
        self.restored: set[str] = set()
        # Requests allocated while resident with a prefix-cache hit, in the step
        # being scheduled: the hit's blocks the sparse groups did not have cached
        # (first, stop), which the workers fill from the pool; and whether the pool
        # is capped (the connector says).
        self.filled: dict[str, tuple[int, int]] = {}
        self.pool_capped = False
        # Against flip-flops (each return copies its requests' K/V): the steps the
        # return's condition must hold in a row, doubled when a return is undone
        # by a move within QUICK_UNDO steps, back to 1 after one that lasted.
        self.patience = 1
        self._fit_steps = 0
        self._steps = 0
        self._returned_at: int | None = None

    def move(self) -> int:
        """Frees every sparse group's blocks of every request, which run over the
        pool until they finish or come back (``restore``). Returns the blocks freed."""
        freed = 0
        requests = self.live_requests()
        for manager in self.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                held = [block for block in blocks if not block.is_null]
                # Uncached first: those of this step's tokens are never written now.
                manager.block_pool.evict_blocks(_cached(held))
                manager.block_pool.free_blocks(reversed(held))
                freed += len(held)
                manager.req_to_blocks[request_id] = []
                if request_id in manager.num_cached_block:
                    manager.num_cached_block[request_id] = 0
        self.moved = True
        self.to_restore.clear()  # over the pool again, with the rest
        self.restored.clear()  # their blocks are freed; nothing to copy
        self.filled.clear()  # (the pool serves their hits)
        if self._returned_at is not None:
            undone = self._steps - self._returned_at < QUICK_UNDO
            self.patience = min(2 * self.patience, MAX_PATIENCE) if undone else 1
            self._returned_at = None
        self._fit_steps = 0
        self._moves["pool"] += 1
        logger.info("InfiniGen: the device blocks ran short: %d request(s) moved to the pool "
                    "and the selection (--infinigen-residency device-first), %d blocks of the "
                    "sparse layers freed", len(requests), freed)
        return freed

    def holds_requests(self) -> bool:
        """Whether a request is live in the sparse groups (allocated, not freed)."""
        return any(manager.req_to_blocks for manager in self.managers)

    def move_back(self) -> None:
        """Resident again: every request that ran over the pool has finished."""
        self.moved = False
        self._moves["device"] += 1
        logger.info("InfiniGen: every request that ran over the pool has finished: new "
                    "requests are resident again (device blocks and vLLM's kernel; "
                    "--infinigen-residency device-first)")

    def live_requests(self) -> set[str]:
        """The requests live in the sparse groups (over the pool while moved)."""
        return {request_id for manager in self.managers for request_id in manager.req_to_blocks}

    def tick(self) -> None:
        """One scheduler step, resident or not (the connector, each step)."""
        self._steps += 1

    def step(self, fits: bool) -> bool:
        """A step over the pool (``fits``: whether its live requests would fit
        back); whether to return now (``restore``)."""
        self._fit_steps = self._fit_steps + 1 if fits else 0
        return self._fit_steps >= self.patience

    def restore(self, requests: set[str], blocks: int, free: int) -> None:
        """Resident again from the next step while ``requests`` over the pool
        are live: each gets its sparse blocks (``blocks`` in all, of ``free``)
        at its next allocation, and the workers copy its K/V from the pool."""
        self.moved = False
        self.to_restore = set(requests)
        self._returned_at = self._steps
        self._moves["device"] += 1
        logger.info("InfiniGen: the %d request(s) over the pool fit in the device blocks "
                    "again (%d blocks of the sparse layers, %d free, for %d step(s) in a row): "
                    "resident from the next step, their K/V copied back from the pool "
                    "(--infinigen-residency device-first)", len(requests), blocks, free,
                    self._fit_steps)

    def take_returns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The requests whose sparse blocks came back in the step just scheduled:
        those whose rows the workers empty, and those whose K/V they copy."""
        cleared, restored = tuple(sorted(self.cleared)), tuple(sorted(self.restored))
        self.to_restore -= self.cleared
        self.cleared, self.restored = set(), set()
        return cleared, restored

    def take_fills(self) -> tuple[tuple[str, int, int], ...]:
        """The requests whose prefix-cache hit's sparse blocks the workers fill from
        the pool in the step just scheduled, with the first and the end of them."""
        filled = tuple((request_id, *span) for request_id, span in sorted(self.filled.items()))
        self.filled = {}
        return filled

    def forget(self, request_id: str) -> None:
        """``request_id`` was freed (finished or preempted): nothing comes back. Freed
        before the workers' copy into its blocks (preempted in the step that gave them:
        vLLM's priority policy), those blocks are uncached in every sparse group (their
        hashes were set at allocation; nothing will write them)."""
        unwritten = (slice(None) if request_id in self.restored
                     else slice(*self.filled[request_id]) if request_id in self.filled
                     else None)
        for manager in self.managers if unwritten is not None else ():
            manager.block_pool.evict_blocks(
                _cached(manager.req_to_blocks.get(request_id, [])[unwritten]))
        self.to_restore.discard(request_id)
        self.cleared.discard(request_id)
        self.restored.discard(request_id)
        self.filled.pop(request_id, None)

    def take_moves(self) -> dict[str, int]:
        """The moves since the last call, by destination (``pool``, ``device``)."""
        moves, self._moves = self._moves, {"pool": 0, "device": 0}
        return moves


def _cached(blocks) -> set[int]:
    """The ids of ``blocks`` in vLLM's prefix cache."""
    return {block.block_id for block in blocks if block.block_hash is not None}


def residency_of(block_pool) -> Residency:
    """The residency of the scheduler owning ``block_pool`` (kept on the pool,
    which every group's manager shares)."""
    residency = getattr(block_pool, "infinigen_residency", None)
    if residency is None:
        residency = block_pool.infinigen_residency = Residency()
    return residency


class InfiniGenSparseManager(SingleTypeKVCacheManager):
    """Allocates nothing (a sparse layer reads its KV from the pool), or with
    ``device_first`` full attention's blocks until the engine moves."""

    def __init__(self, kv_cache_spec, block_pool, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, *args, **kwargs)
        self.residency = residency_of(block_pool)
        if kv_cache_spec.device_first:
            self.residency.managers.append(self)

    @property
    def resident(self) -> bool:
        return self.kv_cache_spec.device_first and not self.residency.moved

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, **kwargs) -> int:
        residency = self.residency
        # A request not yet allocated while none is live: nothing runs over the pool.
        moved_and_idle = (self.kv_cache_spec.device_first and residency.moved
                          and not residency.holds_requests())
        if not self.resident and not moved_and_idle:
            return 0
        # A prefix-cache hit that needs a fill (the sparse groups cached less of it)
        # which a capped pool cannot make (it may have evicted the hit's entries):
        # over the pool, which serves it as it serves the rest.
        hit = num_local_computed_tokens
        unfillable = (hit > len(new_computed_blocks) * self.block_size and residency.pool_capped
                      and not self.req_to_blocks.get(request_id))
        if moved_and_idle and unfillable:
            return 0  # (stays over the pool)
        needed = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap=apply_admission_cap, **kwargs)
        if moved_and_idle:
            # The first request after the pool's last one: resident again where
            # its blocks fit in every group (no request holds device blocks).
            if needed * (len(residency.managers) + 1) > self.block_pool.get_num_free_blocks():
                return 0
            residency.move_back()
            return needed
        if unfillable:
            if not apply_admission_cap:
                logger.info("InfiniGen: request %s hits %d tokens of vLLM's prefix cache, "
                            "which a capped pool cannot copy into the device blocks",
                            request_id, hit)
                residency.move()
            return 0
        # The blocks in every group (the dense one and each sparse one need as
        # many): where they would not fit, move instead of waiting or
        # preempting, and need none here. An estimate (admission, a
        # reservation: ``apply_admission_cap``) moves nothing but counts as
        # moved, so that a request the device cannot hold resident is not kept
        # waiting for room that only a move makes.
        groups = len(self.residency.managers) + 1
        free = self.block_pool.get_num_free_blocks()
        if needed and needed * groups > free:
            if not apply_admission_cap:
                logger.info("InfiniGen: request %s needs %d blocks in each of %d groups, "
                            "%d free of %d", request_id, needed, groups, free,
                            self.block_pool.num_gpu_blocks)
                self.residency.move()
            return 0
        return needed

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence,
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """A first allocation's prefix-cache hit: resident, the sparse groups' cached
        blocks of it, and the rest of the hit filled from the pool; over the pool,
        none (the pool serves the hit)."""
        if not self.resident:
            new_computed_blocks = []
        super().add_local_computed_blocks(request_id, new_computed_blocks,
                                          num_local_computed_tokens,
                                          num_external_computed_tokens)
        first, stop = len(new_computed_blocks), num_local_computed_tokens // self.block_size
        if self.resident and first < stop:
            # (one span for every sparse group: they are looked up together)
            if self.residency.filled.setdefault(request_id, (first, stop)) != (first, stop):
                raise RuntimeError(f"InfiniGen: the sparse groups hold different parts of "
                                   f"request {request_id}'s prefix-cache hit")

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        if self.resident:
            blocks = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            if blocks and request_id in self.residency.to_restore:
                self.residency.cleared.add(request_id)  # all its blocks: copy them
                self.residency.restored.add(request_id)
            return blocks
        self.req_to_blocks[request_id]  # creates the (empty) entry
        self.num_cached_block[request_id] = 0
        return []

    def cache_blocks(self, request, *args, **kwargs) -> None:
        """Resident blocks only (over the pool a request holds none)."""
        if self.resident and self.req_to_blocks.get(request.request_id):
            super().cache_blocks(request, *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str) -> list:
        """(``free`` calls it, and vLLM directly where it defers the frees.)"""
        self.residency.forget(request_id)  # finished or preempted
        return super().pop_blocks_for_free(request_id)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids,
                               block_pool, kv_cache_spec, *args, **kwargs):
        """The run of the hit's blocks these groups have cached (``device_first``), as
        full attention finds its own; the hit's length stays the dense group's (what
        they lack is filled from the pool: ``add_local_computed_blocks``)."""
        hits = tuple([] for _ in kv_cache_group_ids)
        if kv_cache_spec.device_first:
            block_size = kv_cache_spec.block_size
            block_hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size,
                                                block_size)
            for block_hash in itertools.islice(block_hashes, max_length // block_size):
                cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
                if not cached:
                    break
                for blocks, block in zip(hits, cached):
                    blocks.append(block)
        return hits, max_length


def dense_group_index(kv_cache_groups: Sequence) -> int:
    """The KV-cache group of the dense full-attention layers, whose block ids
    address the pool: neither InfiniGen's sparse spec nor a sliding window
    (Gemma 3's windowed layers have groups of their own)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return next(idx for idx, group in enumerate(kv_cache_groups)
                if not isinstance(group.kv_cache_spec, (InfiniGenSparseSpec, SlidingWindowSpec)))


_registered = False


def register_spec() -> None:
    """Registers the spec with vLLM's registry, after its built-ins; once."""
    global _registered
    if _registered:
        return
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(InfiniGenSparseSpec, InfiniGenSparseManager)
    _registered = True
