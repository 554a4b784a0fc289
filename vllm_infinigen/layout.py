# SPDX-License-Identifier: Apache-2.0
"""A model's attention shape and how InfiniGen lays it out, computed once.

Everything that sizes something reads it from here: the front-end checks
(``patch/patch_arg_utils.py``), the scheduler-side connector, the worker's
memory split and pool, and the benchmarks' byte arithmetic::

    layers 0 .. dense_layers - 1          dense: vLLM's paged cache, stock
    layers dense_layers .. num_layers - 1  sparse: K/V in InfiniGen's host pool,
                                           ``rank`` partial-key channels per
                                           KV head beside vLLM's KV space

Counts are of the whole model (all tensor-parallel ranks) unless a name says
``on_rank``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def partial_rank(head_dim: int, partial_ratio: float) -> int:
    """Channels of the partial keys: the paper's r x d, at least one."""
    return max(1, int(head_dim * partial_ratio))


def kv_cache_group_size(num_dense: int, num_sparse: int) -> int:
    """Layers per KV-cache group, as vLLM's hybrid allocator picks it.

    Mirrors ``kv_cache_utils._get_kv_cache_groups_uniform_page_size``: the
    smaller layer count, unless the larger is under 1.5 times it. Every block
    id then has this many pages, one per layer of its group.
    """
    group_size = min(num_dense, num_sparse)
    if max(num_dense, num_sparse) < 1.5 * group_size:
        group_size = max(num_dense, num_sparse)
    return group_size


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelLayout:
    """Attention shape of a model and its dense/sparse split (all ranks)."""

    model_type: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    dense_layers: int = 2
    partial_ratio: float = 0.2

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, dense_layers: int = 2,
                       partial_ratio: float = 0.2) -> ModelLayout:
        """From a ``config.json`` dict or a transformers config object."""
        get = hf.get if isinstance(hf, Mapping) else (lambda key: getattr(hf, key, None))
        num_heads = get("num_attention_heads")
        return cls(
            model_type=get("model_type") or "",
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=get("head_dim") or get("hidden_size") // num_heads,
            dense_layers=dense_layers,
            partial_ratio=partial_ratio,
        )

    @classmethod
    def of_model_dir(cls, model_dir: str | os.PathLike, dense_layers: int = 2,
                     partial_ratio: float = 0.2) -> ModelLayout:
        return cls.from_hf_config(read_hf_config(model_dir), dense_layers, partial_ratio)

    @property
    def num_sparse(self) -> int:
        return max(self.num_layers - self.dense_layers, 0)

    @property
    def rank(self) -> int:
        """Partial-key channels per KV head."""
        return partial_rank(self.head_dim, self.partial_ratio)

    @property
    def group_size(self) -> int:
        """Pages per block id of vLLM's KV space (``kv_cache_group_size``)."""
        return kv_cache_group_size(self.dense_layers, self.num_sparse)

    def kv_bytes_per_token_layer(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """K + V of one token in one layer (``kv_heads``: all of the model's)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * heads * self.head_dim * dtype_bytes

    def pool_bytes_per_token(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """K + V of every sparse layer for one token: the host pool's row."""
        return self.num_sparse * self.kv_bytes_per_token_layer(dtype_bytes, kv_heads)

    def partial_bytes_per_token(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """Partial keys of every sparse layer for one token."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return self.num_sparse * heads * self.rank * dtype_bytes
