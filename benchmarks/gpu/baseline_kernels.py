# SPDX-License-Identifier: Apache-2.0
"""Kernels the product no longer runs, kept so that a GPU run measures the new ones
against them (``kernel_limits.py``).

    int_scores_per_token   the int-key scoring until 2026-11-26: a tile of
                           tokens x channels, each (token, channel) loading
                           its code's byte and its group's scale, so a group's
                           bytes are loaded 16 times (4 % of an H200's
                           streaming read at 32K x 1, gpu_decode_step.md).
                           Its replacement, ``triton_scoring._int_scores_sums``,
                           reads each group's words and scales once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_infinigen.platforms.cuda.kernels import triton_scoring


@triton.jit
def _int_scores_per_token(query, codes, scales, table, context_lens, token_out, block_out, scale,
                query_row_stride, table_stride, num_tokens, num_blocks,
                H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr,
                TILE: tl.constexpr, WRITE_BLOCKS: tl.constexpr):
    """Speculated scores of TILE tokens of one (row, KV head), the int keys read in place.

    Grid (rows x KV heads, token tiles). Token t of the row lies in block
    ``table[row, t // BLOCK]``, group (t % BLOCK) // 16, whose channel c keeps
    its code in bits [BITS * (t % 16), + BITS) of 2 * BITS bytes; its key is
    (code - HALF) x scale[c]. The score is the best over the G query heads of
    q . k, times ``scale``; tokens of the row's open group (from its context
    rounded down to 16) and later score -inf and read nothing. With
    WRITE_BLOCKS, each block's best token score too (TILE a multiple of BLOCK).
    """
    sequence = tl.program_id(0)
    row = sequence // H
    head = sequence % H
    tokens = tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = tokens < num_tokens
    encoded = tl.maximum(tl.load(context_lens + row), 0) // 16 * 16
    read = live & (tokens < encoded)
    block = tl.load(table + row * table_stride + tokens // BLOCK, mask=read, other=0).to(tl.int64)
    cell = ((block * H + head) * (BLOCK // 16) + (tokens % BLOCK) // 16) * D  # [TILE]
    in_group = tokens % 16
    dims = tl.arange(0, D_PAD)
    mask = read[:, None] & (dims < D)[None, :]
    packed = tl.load(codes + (cell[:, None] + dims[None, :]) * (2 * BITS)
                     + (BITS * in_group // 8)[:, None], mask=mask, other=0)
    code = (packed.to(tl.int32) >> (BITS * in_group % 8)[:, None]) & ((1 << BITS) - 1)
    step = tl.load(scales + cell[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    keys = (code.to(tl.float32) - HALF) * step  # [TILE, D_PAD]
    best = tl.full([TILE], float("-inf"), tl.float32)
    query_row = query + row.to(tl.int64) * query_row_stride + head * G * D
    for group in tl.static_range(G):
        q = tl.load(query_row + group * D + dims, mask=dims < D, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(keys * q[None, :], axis=1))
    scores = tl.where(read, best * scale, float("-inf"))
    tl.store(token_out + sequence.to(tl.int64) * num_tokens + tokens, scores, mask=live)
    if WRITE_BLOCKS:
        per_block = tl.max(tl.reshape(scores, (TILE // BLOCK, BLOCK)), axis=1)
        index = tl.program_id(1) * (TILE // BLOCK) + tl.arange(0, TILE // BLOCK)
        tl.store(block_out + sequence.to(tl.int64) * num_blocks + index, per_block,
                 mask=index < num_blocks)


def int_scores_per_token(query, codes, scales, table, context_lens, token_out, block_out, *,
                         scale: float, tile: int = 64, num_warps: int = 4) -> None:
    """Launches ``_int_scores_per_token`` (``triton_scoring.int_scores``' arguments)."""
    grid, sizes, constants = triton_scoring.int_scores_launch(query, codes, table, token_out,
                                                              block_out, tile)
    _int_scores_per_token[grid](query, codes, scales, table, context_lens, token_out, block_out,
                                scale, *sizes, **constants, num_warps=num_warps)
