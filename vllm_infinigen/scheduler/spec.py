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

from vllm_infinigen.scheduler.residency import residency_of

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
            if needed * residency.groups() > self.block_pool.get_num_free_blocks():
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
        # many, a sliding window's at most as many: ``Residency.groups``): where
        # they would not fit, move instead of waiting or preempting, and need
        # none here. An estimate (admission, a
        # reservation: ``apply_admission_cap``) moves nothing but counts as
        # moved, so that a request the device cannot hold resident is not kept
        # waiting for room that only a move makes.
        groups = self.residency.groups()
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
