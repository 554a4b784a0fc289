# SPDX-License-Identifier: Apache-2.0
"""Pure-torch integer speculation keys: what ``write_int_keys`` stores and what a
selection over them scores (``vllm_infinigen/platforms/cpu/kernels/csrc/int_keys.cpp``)."""

from __future__ import annotations

import torch

from tests.reference.layouts import present_of
from vllm_infinigen.block_layout import entries_of

GROUP = 16


def half_range(bits: int) -> float:
    return ((1 << bits) - 1) / 2


def encode_group(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 16-token group of one KV head: keys [16, D] -> (codes [D, 16] int64,
    scales [D] float16)."""
    half = half_range(bits)
    scales = (keys.float().abs().amax(dim=0) / half).to(torch.float16)
    step = scales.float()[:, None]  # [D, 1]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round(keys.float().t() / safe + half).clamp(0, (1 << bits) - 1)
    codes = torch.where(step > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.int64), scales


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., 16] int64 -> [..., 2 * bits] uint8, token t at bits [bits*t, bits*t + bits)."""
    word = (codes << (bits * torch.arange(GROUP))).sum(dim=-1)  # [...]
    shifts = 8 * torch.arange(2 * bits)
    return ((word[..., None] >> shifts) & 0xFF).to(torch.uint8)


def unpack(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """rows [..., 2 * bits] uint8 -> codes [..., 16] int64."""
    word = (rows.to(torch.int64) << (8 * torch.arange(2 * bits))).sum(dim=-1)
    return (word[..., None] >> (bits * torch.arange(GROUP))) & ((1 << bits) - 1)


def keys_for_scoring(kv_pool: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor,
                     row_map: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N, H_kv, D] float32 keys a selection scores for each row (N: the longest
    context): complete groups dequantized from the codes, the open group (the
    row's context ends inside it) as the pool holds it."""
    num_rows, bits = block_table.shape[0], codes.shape[-1] // 2
    num_tokens = int(context_lens.max())
    block_size, head_size = kv_pool.shape[2], codes.shape[3]
    positions = torch.arange(num_tokens)
    block_ids = torch.gather(block_table.to(torch.int64), 1,
                             (positions // block_size).expand(num_rows, -1))  # [B, N]
    groups = (positions % block_size) // GROUP
    cells = codes[block_ids, :, groups.expand(num_rows, -1)]  # [B, N, H, D, 2 bits]
    # Each token's own code: [B, N, H, D].
    token_in_group = (positions % GROUP).expand(num_rows, -1)
    values = unpack(cells, bits).gather(-1, token_in_group[:, :, None, None, None].expand(
        -1, -1, cells.shape[2], head_size, 1))[..., 0].float()
    step = scales[block_ids, :, groups.expand(num_rows, -1)].float()  # [B, N, H, D]
    keys = (values - half_range(bits)) * step
    everything = positions.expand(num_rows, kv_pool.shape[1], num_tokens).contiguous()
    raw = entries_of(kv_pool, block_table, everything, row_map)[..., :head_size]
    raw = raw.permute(0, 2, 1, 3).float()  # [B, N, H, D]
    group_end = (positions // GROUP + 1) * GROUP
    open_group = group_end[None, :] > context_lens[:, None]  # [B, N]
    keys = torch.where(open_group[..., None, None], raw, keys)
    if row_map is not None:
        present = present_of(row_map, block_table, num_tokens)  # [B, N, H]
        keys = keys.masked_fill(~present[..., None], 0.0)
    return keys
