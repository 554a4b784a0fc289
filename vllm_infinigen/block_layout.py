# SPDX-License-Identifier: Apache-2.0
"""The block layouts of the pool and the partial keys, pure-torch reads of
them, and the widest selection a step keeps (in tokens): below both the
worker (``worker/``) and the policies (``policies/``), which read them.

Layouts (one sparse layer; ``block_id`` from the dense group's block table)::

    kv_pool       [units, H_kv, block_size, 2 * D]   a token's K | V side by side
    partial_keys  [num_blocks, H_kv, R, block_size]  channel-major per block
    row_map       [num_blocks, H_kv, block_size]     capped pool: row, -1 evicted

Uncapped, the token at position p of a request sits at unit
``block_table[p // block_size]``, offset ``p % block_size``; capped, its row r
in head h sits at unit ``r // block_size``, offset ``r % block_size``.
"""

from __future__ import annotations

import torch


def block_coordinates(positions: torch.Tensor, block_table: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of token positions; positions: [B, ...] (< 0 -> position 0)."""
    num_rows = positions.shape[0]
    flat = positions.clamp(min=0).reshape(num_rows, -1).to(torch.int64)
    block_ids = torch.gather(block_table.to(torch.int64), 1, flat // block_size)
    return block_ids.view_as(positions), (flat % block_size).view_as(positions)


def entries_of(kv_pool: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
               row_map: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H_kv, K, 2 * D] K|V rows of ``positions`` [B, H_kv, K] (per KV head).

    Evicted entries (capped pool) and padding come back as zeros.
    """
    num_heads, block_size = kv_pool.shape[1], kv_pool.shape[2]
    block_ids, offsets = block_coordinates(positions, block_table, block_size)
    heads = torch.arange(num_heads, device=kv_pool.device)[None, :, None].expand_as(block_ids)
    units = block_ids
    missing = positions < 0
    if row_map is not None:
        rows = row_map[block_ids, heads, offsets].to(torch.int64)
        missing = missing | (rows < 0)
        rows = rows.clamp(min=0)
        units, offsets = rows // block_size, rows % block_size
    entries = kv_pool[units, heads, offsets]
    if entries.element_size() == 1:  # FP8 (torch has no masked_fill for it): byte 0 is +0.0
        return entries.view(torch.uint8).masked_fill(missing[..., None], 0).view(entries.dtype)
    return entries.masked_fill(missing[..., None], 0)


def widest(context_host: list[int], caps_host: list[int], num_window: int = 0) -> int:
    """Host-side bound of a step's selection width in tokens: the most any row
    keeps, min(context, budget in tokens + window), at least 1 (CUDA's bounds
    in blocks: ``platforms/cuda/kernels/widths.py``)."""
    return max((min(n, cap + num_window) for n, cap in zip(context_host, caps_host)),
               default=1)
