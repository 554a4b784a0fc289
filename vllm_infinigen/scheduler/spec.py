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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec


@dataclass(frozen=True, kw_only=True)
class InfiniGenSparseSpec(AttentionSpec):
    """A layer whose KV is served from InfiniGen's pool (no device blocks)."""

    @property
    def prefix_cacheable(self) -> bool:
        return False

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
    def of(cls, spec: AttentionSpec) -> InfiniGenSparseSpec:
        """The sparse counterpart of a layer's stock spec (same page layout)."""
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        return cls(**{name: getattr(spec, name) for name in names})


class InfiniGenSparseManager(SingleTypeKVCacheManager):
    """Allocates nothing: a sparse layer reads its KV from the pool."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence, *args, **kwargs) -> int:
        return 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        self.req_to_blocks[request_id]  # creates the (empty) entry
        self.num_cached_block[request_id] = 0
        return []

    def cache_blocks(self, *args, **kwargs) -> None:
        return None

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids,
                               *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0


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
