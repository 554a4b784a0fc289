# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform (pure torch, any device): scores from the bound keys.

The default speculation keys (``--infinigen-speculation-keys bounds``) keep,
per unit of U tokens and KV head, each channel's max and min key in a few
bits (``layer_state.py``); a unit scores its upper bound of q . k (Quest's),
and the block rule (``block_selection.select_blocks``, ``select_ops.select``)
takes each block's best unit::

    bound_unit_scores   each complete unit's bound for each row, best over the
                        query heads (the CPU kernel's score, in torch; on CUDA
                        ``triton_bounds.bound_scores``)
    unit_block_scores   each block's best unit
    unit_alpha_counts   the paper's count over units, each counting its tokens
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def bound_unit_scores(query: torch.Tensor, bounds: torch.Tensor, scales: torch.Tensor,
                      block_table: torch.Tensor, context_lens: torch.Tensor, *,
                      scale: float, block_size: int) -> torch.Tensor:
    """[S, H_kv, MB * BLOCK / U] float32 each unit's bound for each row: scale x
    the unit's scale x the max over the KV head's query group of q+ . max codes
    + q- . min codes - 2^(bits-1) x sum q (the CPU kernel's score, in torch);
    -inf past the row's complete units (context // U) and for padding rows.

    Args:
        query: [S, H_kv, G, D].
        bounds, scales: A layer's bound keys (``layer_state.py``).
        block_table: [S, MB] block ids of each row.
        context_lens: [S] tokens before each row's own (< 0: padding).
    """
    num_rows, num_heads, _, head_size = query.shape
    units_per_block = bounds.shape[2]
    bits = 8 * bounds.shape[-1] // head_size
    offset = float(1 << (bits - 1))
    table = block_table.to(torch.int64)
    rows = bounds[table].to(torch.int64)  # [S, MB, H, UPB, 2, R]
    if bits == 4:
        rows = torch.cat([rows & 15, rows >> 4], dim=-1)
    codes = rows.float()  # [S, MB, H, UPB, 2, D]
    unit_scales = scales[table].float()  # [S, MB, H, UPB]
    q = query.float()
    dots = (torch.einsum("shgd,smhud->shgmu", q.clamp(min=0), codes[..., 0, :])
            + torch.einsum("shgd,smhud->shgmu", q.clamp(max=0), codes[..., 1, :])
            - offset * q.sum(dim=-1)[..., None, None])
    best = dots.amax(dim=2) * unit_scales.permute(0, 2, 1, 3) * scale  # [S, H, MB, UPB]
    best = best.flatten(2)
    unit = block_size // units_per_block
    context = context_lens.to(torch.int64)
    complete = torch.where(context >= 0, context.clamp(min=0) // unit, 0)  # [S]
    index = torch.arange(best.shape[-1], device=best.device)
    return best.masked_fill(index[None, None, :] >= complete[:, None, None], _NEG_INF)


def unit_block_scores(unit_scores: torch.Tensor, units_per_block: int) -> torch.Tensor:
    """[S, H_kv, MB] each block's best unit (``bound_unit_scores``): -inf for a
    block without a complete unit."""
    rows, heads, units = unit_scores.shape
    return unit_scores.view(rows, heads, units // units_per_block, units_per_block).amax(dim=-1)


def unit_alpha_counts(unit_scores: torch.Tensor, alpha: torch.Tensor, unit: int) -> torch.Tensor:
    """[S * H_kv] int32 tokens of the complete units scoring above their row and
    KV head's best minus ``alpha`` (a 0-dim tensor): the paper's count over
    units, each counting its ``unit`` tokens (``select_ops.alpha_counts``' role)."""
    best = unit_scores.amax(dim=-1, keepdim=True)
    within = (unit_scores > best - alpha.to(torch.float32)).sum(dim=-1)
    return (within * unit).flatten().to(torch.int32)
