# SPDX-License-Identifier: Apache-2.0
"""A model's attention shape and how InfiniGen lays it out, computed once.

Everything that sizes something reads it from here: the front-end checks
(``patch/patch_arg_utils.py``), the scheduler-side connector, the worker's
memory split and pool, and the benchmarks' byte arithmetic. The split is
over the full-attention layers, in order (all layers, unless the model keeps
sliding-window layers beside them, as Gemma 3 does)::

    first dense_layers full-attention layers   dense: vLLM's paged cache, stock
    the other full-attention layers            sparse: K/V in InfiniGen's host
                                               pool, ``rank`` partial-key channels
                                               per KV head beside vLLM's KV space
    window_layers                              windowed: vLLM's sliding-window
                                               cache, stock, never touched

Counts are of the whole model (all tensor-parallel ranks) unless a name says
``on_rank``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


# Speculation keys: "bounds" (per unit of BOUND_UNIT tokens, each channel's
# max and min key in BOUND_BITS bits and one float16 scale: Quest's page
# summary; whole units selected by their upper bound of q . k), "int" (every
# key channel, a few bits per token, a scale per channel and 16-token group)
# or "partial" (the paper's partial keys: r of the skewed channels in the
# cache's dtype).
SPECULATION_KEYS = ("bounds", "int", "partial")
KEY_GROUP = 16  # tokens sharing one scale per channel in the int form
BOUND_UNIT = 16  # tokens per unit of the bounds: a multiple of KEY_GROUP
BOUND_BITS = 8  # bits per channel of each bound (8 or 4)


def closes_key_group(slots) -> bool:
    """Whether any of ``slots`` ([T] int64 slot ids, < 0: padding) is the last
    of its 16-token group: the int keys encode a group when it is written, so
    a step without one has nothing to encode (nor do the bounds, whose units
    are whole groups)."""
    return bool(((slots >= 0) & (slots % KEY_GROUP == KEY_GROUP - 1)).any())


# --kv-cache-dtype values InfiniGen takes beside "auto", and the element its
# pool stores for each: vLLM's CPU build reads "fp8" as e4m3 (its own pages
# are bytes of the same formats).
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                       "fp8_e5m2": "float8_e5m2"}


def kv_dtype(cache_dtype: str | None, model_dtype):
    """The torch dtype of InfiniGen's pool for vLLM's ``--kv-cache-dtype``
    (``auto``: the model's dtype).

    Raises:
        ValueError: For a value InfiniGen does not take (the front end refuses
            it first, ``frontend/checks.py``).
    """
    if cache_dtype in (None, "auto"):
        return model_dtype
    if cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {cache_dtype} is not supported with --kv-manager "
                         f"infinigen; use auto or one of {sorted(FP8_KV_CACHE_DTYPES)}")
    import torch

    return getattr(torch, FP8_KV_CACHE_DTYPES[cache_dtype])


def int_key_bits(dtype_bytes: int) -> int:
    """Bits per channel of the int form: 4 in a float32 cache, 2 in a 16-bit one
    (then it costs the bytes of the partial form at r = 0.2, or fewer)."""
    return 4 if dtype_bytes >= 4 else 2


def partial_rank(head_dim: int, partial_ratio: float) -> int:
    """Channels of the partial keys: the paper's r x d, at least one."""
    return max(1, int(head_dim * partial_ratio))


def kv_cache_group_size(num_dense: int, num_sparse: int, num_windowed: int = 0) -> int:
    """Layers per KV-cache group, as vLLM's hybrid allocator picks it.

    Mirrors vLLM's ``_get_kv_cache_groups_uniform_page_size`` (``kv_cache_utils``;
    ``kv_cache_planning`` from vLLM 0.33) over the layer counts of each kind
    (dense, sparse, sliding-window): the smallest, unless the largest is under
    1.5 times it. Every block id then has this many pages, one per layer of
    its group.
    """
    counts = [count for count in (num_dense, num_sparse, num_windowed) if count]
    group_size = min(counts)
    if max(counts) < 1.5 * group_size:
        group_size = max(counts)
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
    window_layers: tuple[int, ...] = ()  # layers vLLM runs with a sliding window
    speculation_keys: str = "int"  # one of SPECULATION_KEYS

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, dense_layers: int = 2,
                       partial_ratio: float = 0.2, window_layers: tuple[int, ...] = (),
                       speculation_keys: str = "int") -> ModelLayout:
        """From a ``config.json`` dict or a transformers config object.

        Args:
            window_layers: The sliding-window layers InfiniGen leaves to vLLM
                (``architectures.AttentionPlan.window_layers``).
            speculation_keys: ``--infinigen-speculation-keys``.
        """
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
            window_layers=tuple(window_layers),
            speculation_keys=speculation_keys,
        )

    @classmethod
    def of_model_dir(cls, model_dir: str | os.PathLike, dense_layers: int = 2,
                     partial_ratio: float = 0.2) -> ModelLayout:
        """From ``config.json`` alone: every layer full attention."""
        return cls.from_hf_config(read_hf_config(model_dir), dense_layers, partial_ratio)

    @property
    def full_layers(self) -> list[int]:
        """Full-attention layers, in order: the ones dense_layers counts."""
        windowed = set(self.window_layers)
        return [idx for idx in range(self.num_layers) if idx not in windowed]

    @property
    def sparse_layers(self) -> list[int]:
        return self.full_layers[self.dense_layers:]

    @property
    def num_sparse(self) -> int:
        return len(self.sparse_layers)

    @property
    def rank(self) -> int:
        """Partial-key channels per KV head."""
        return partial_rank(self.head_dim, self.partial_ratio)

    @property
    def group_size(self) -> int:
        """Pages per block id of vLLM's KV space (``kv_cache_group_size``)."""
        return kv_cache_group_size(min(self.dense_layers, len(self.full_layers)),
                                   self.num_sparse, len(self.window_layers))

    def max_dense_layers(self) -> int:
        """The most dense layers that keep them in one KV-cache group (0: none)."""
        fits = [count for count in range(1, len(self.full_layers))
                if count <= kv_cache_group_size(count, len(self.full_layers) - count,
                                                len(self.window_layers))]
        return max(fits, default=0)

    def kv_bytes_per_token_layer(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """K + V of one token in one layer (``kv_heads``: all of the model's)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * heads * self.head_dim * dtype_bytes

    def pool_bytes_per_token(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """K + V of every sparse layer for one token: the host pool's row."""
        return self.num_sparse * self.kv_bytes_per_token_layer(dtype_bytes, kv_heads)

    def key_bytes_per_group(self, dtype_bytes: int) -> int:
        """Speculation keys of one KV head for ``KEY_GROUP`` tokens: the bounds'
        codes and float16 scales, int codes and float16 scales, or partial
        channels in the cache's dtype. What a selection reads per ``KEY_GROUP``
        context tokens (rounded up)."""
        if self.speculation_keys == "bounds":
            per_unit = 2 * self.head_dim * BOUND_BITS // 8 + 2
            return -(-KEY_GROUP * per_unit // BOUND_UNIT)
        if self.speculation_keys == "int":
            bits = int_key_bits(dtype_bytes)
            return self.head_dim * (2 * bits + 2)
        return KEY_GROUP * self.rank * dtype_bytes

    def partial_bytes_per_token(self, dtype_bytes: int, kv_heads: int | None = None) -> int:
        """Speculation keys of every sparse layer for one token (rounded up)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return -(-self.num_sparse * heads * self.key_bytes_per_group(dtype_bytes) // KEY_GROUP)
