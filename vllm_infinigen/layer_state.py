# SPDX-License-Identifier: Apache-2.0
"""Worker side: one attention layer's InfiniGen state and its pool storage.

A sparse layer keeps, addressed by the dense KV-cache group's block ids
(block-granular, so a request's context is read in runs)::

    kv_pool       [units, H_kv, block_size, 2 * D]   host pool; a token's K | V
                                                     side by side in one row
    partial_keys  [num_blocks, H_kv, R, block_size]  skewed partial keys,
                                                     channel-major per block

Uncapped, a unit is a block id; with ``--infinigen-cpu-pool-gib`` each
(layer, KV head) maps its entries to rows of fewer units (``pool.py``).
"""

from __future__ import annotations

import torch

from vllm_infinigen import baselines, kernels


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Pool memory: pinned host memory where a CUDA device copies from it."""
    return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class LayerState:
    """InfiniGen state of one attention layer on this worker."""

    def __init__(self, layer_idx: int, layer_name: str, attn: torch.nn.Module,
                 self_attn: torch.nn.Module | None, sparse: bool):
        self.layer_idx = layer_idx
        self.layer_name = layer_name
        self.sparse = sparse
        self.pool_layer = -1  # index among the sparse layers, in the pool index
        impl = attn.impl
        self.num_heads = impl.num_heads
        self.num_kv_heads = impl.num_kv_heads
        self.head_size = impl.head_size
        self.scale = impl.scale
        self.qkv_proj = getattr(self_attn, "qkv_proj", None)
        self.rotary_emb = getattr(self_attn, "rotary_emb", None)
        self.skew: torch.Tensor | None = None  # [H_kv, D, R] float32
        # The query rows of qkv_proj, prepacked (``query_weights.py``).
        self.query_proj: torch.nn.Module | None = None
        self.next: LayerState | None = None  # the sparse layer it speculates for
        self.captured_input: torch.Tensor | None = None  # [T, hidden]
        # [S, H_kv, K] int32 positions selected for this layer's sparse rows (-1: none).
        self.selection: torch.Tensor | None = None
        self.kv_pool: torch.Tensor | None = None
        self.partial_keys: torch.Tensor | None = None
        # Entries attended besides the rows' own (over KV heads), context tokens.
        self.stats = torch.zeros(2, dtype=torch.float64)
        # Baseline state, by slot (allocated by ``ensure_policy_state``).
        self.h2o_accumulated: torch.Tensor | None = None  # [S + 1, H_kv]
        self.h2o_alive: torch.Tensor | None = None  # [S + 1, H_kv]
        self.quest_min: torch.Tensor | None = None  # [S / page + 1, H_kv, D]
        self.quest_max: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """Channels of the partial keys (the paper's r x d)."""
        return self.skew.shape[-1]

    @property
    def block_size(self) -> int:
        return self.kv_pool.shape[2]

    def allocate(self, num_units: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """The pool (host) and partial key cache (device) of one sparse layer."""
        self.kv_pool = host_zeros((num_units, self.num_kv_heads, block_size,
                                   2 * self.head_size), dtype)
        self.partial_keys = torch.zeros((num_blocks, self.num_kv_heads, self.rank, block_size),
                                        dtype=dtype, device=device)

    def pool_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_size * dtype.itemsize

    def partial_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_kv_heads * self.rank * dtype.itemsize

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              row_map: torch.Tensor | None) -> None:
        """Stores new K/V in the pool and their partial keys.

        key, value: [T, H_kv, D]; slot_mapping: [T] (< 0: padding).
        """
        slots = slot_mapping.to(torch.int64)
        kernels.write_kv(self.kv_pool, self.partial_keys, key, value, self.skew, slots, row_map)
        if self.h2o_accumulated is None and self.quest_min is None:
            return
        pad_slot = self.num_slots
        slots = torch.where(slots < 0, pad_slot, slots)
        if self.h2o_accumulated is not None:
            self.h2o_accumulated[slots] = 0
            self.h2o_alive[slots] = True
        if self.quest_min is not None:
            self._update_pages(key, slots)

    @property
    def num_slots(self) -> int:
        return self.partial_keys.shape[0] * self.partial_keys.shape[-1]

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """[..., H_kv, D] keys of ``slots`` (uncapped pool: unit = block id)."""
        block_size = self.block_size
        return self.kv_pool[slots // block_size, :, slots % block_size, : self.head_size]

    def ensure_policy_state(self, policy: str) -> None:
        """Allocates a baseline's per-slot state (from the pool, if it has data)."""
        num_slots = self.num_slots + 1  # the last one takes padding
        device = self.partial_keys.device
        if policy == "h2o" and self.h2o_accumulated is None:
            self.h2o_accumulated = torch.zeros((num_slots, self.num_kv_heads),
                                               dtype=torch.float32, device=device)
            self.h2o_alive = torch.ones((num_slots, self.num_kv_heads),
                                        dtype=torch.bool, device=device)
        if policy == "quest" and self.quest_min is None:
            page = baselines.QUEST_PAGE_SIZE
            keys = self.keys_at(torch.arange(self.num_slots)).to(device)
            pages = keys.view(-1, page, self.num_kv_heads, self.head_size)
            pad = torch.zeros((1, self.num_kv_heads, self.head_size), dtype=keys.dtype,
                              device=device)
            self.quest_min = torch.cat([pages.amin(dim=1), pad])
            self.quest_max = torch.cat([pages.amax(dim=1), pad])

    def _update_pages(self, key: torch.Tensor, slots: torch.Tensor) -> None:
        """Folds new keys into their pages' min/max; a page restarts at its first slot."""
        page_size = baselines.QUEST_PAGE_SIZE
        pages = slots // page_size
        first = pages[slots % page_size == 0]
        self.quest_min[first] = float("inf")
        self.quest_max[first] = float("-inf")
        index = pages[:, None, None].expand_as(key)
        self.quest_min.scatter_reduce_(0, index, key.to(self.quest_min.dtype), "amin")
        self.quest_max.scatter_reduce_(0, index, key.to(self.quest_max.dtype), "amax")
