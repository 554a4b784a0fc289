# SPDX-License-Identifier: Apache-2.0
"""Pure-torch reads of the kernels' block layouts that only the tests need
(``vllm_infinigen/block_layout.py`` documents the layouts)."""

from __future__ import annotations

import torch

from vllm_infinigen.block_layout import block_coordinates


def partial_keys_of(partial_keys: torch.Tensor, block_table: torch.Tensor,
                    num_tokens: int) -> torch.Tensor:
    """[B, N, H_kv, R] partial keys of positions 0..N-1 of each row's request."""
    block_size = partial_keys.shape[-1]
    positions = torch.arange(num_tokens).expand(block_table.shape[0], num_tokens)
    block_ids, offsets = block_coordinates(positions, block_table, block_size)
    # partial_keys[block, :, :, offset] -> [B, N, H_kv, R]
    return partial_keys.permute(0, 3, 1, 2)[block_ids, offsets]


def present_of(row_map: torch.Tensor, block_table: torch.Tensor,
               num_tokens: int) -> torch.Tensor:
    """[B, N, H_kv] whether a capped pool still holds each entry."""
    block_size = row_map.shape[-1]
    positions = torch.arange(num_tokens).expand(block_table.shape[0], num_tokens)
    block_ids, offsets = block_coordinates(positions, block_table, block_size)
    return row_map.permute(0, 2, 1)[block_ids, offsets] >= 0
