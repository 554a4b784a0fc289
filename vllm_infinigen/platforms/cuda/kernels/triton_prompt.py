# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernel behind ``attention.attend_prompt_units``.

    attend_prompt  causal attention of a request's prompt rows over its
                   units (flash attention), FP8 units widened as in
                   ``triton_attend._attend_units``

Imported on first launch; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_infinigen.platforms.cuda.kernels.triton_attend import _tile_scores
from vllm_infinigen.platforms.cuda.kernels.triton_units import _INTERPRETING


@triton.jit
def _attend_prompt(query, units, table, out, scale, value_scale, first, seq_len, num_rows,
                   query_row_stride, out_row_stride, table_stride, G: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   FP8: tl.constexpr):
    """Causal attention of BLOCK_M prompt rows of one query head over the request's
    units (flash attention: key tiles of BLOCK_N tokens, online softmax).

    Grid (row tiles, query heads). Row r sits at position ``first + r``; key
    token t of KV head h lies in unit ``table[h, t // BLOCK]`` at ``t % BLOCK``;
    a row sees the tokens at or before its position, below ``seq_len``. FP8
    units as in ``_attend_units``.
    """
    tile = tl.program_id(0)
    query_head = tl.program_id(1)
    head = query_head // G
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    positions = first + rows
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    q = tl.load(query + rows[:, None].to(tl.int64) * query_row_stride + query_head * D
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    elif not FP8:  # the dot's operands in the units' type
        q = q.to(units.dtype.element_ty)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    last = tl.minimum(seq_len, first + (tile + 1) * BLOCK_M)
    for start in range(0, last, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_ok = tokens < seq_len
        unit = tl.load(table + head * table_stride + tokens // BLOCK, mask=token_ok,
                       other=0).to(tl.int64)
        base = (unit * BLOCK + tokens % BLOCK) * (2 * D)
        mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(units + base[:, None] + dims[None, :], mask=mask, other=0.0)
        v = tl.load(units + base[:, None] + D + dims[None, :], mask=mask, other=0.0)
        scores, v = _tile_scores(q, k, v, scale, IEEE, FP8)
        visible = (tokens[None, :] <= positions[:, None]) & token_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        if IEEE:
            update = tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        else:
            update = tl.dot(weights.to(v.dtype), v)
        acc = acc * correction[:, None] + update
        running_max = new_max
    result = acc / running_sum[:, None] * value_scale  # (x 1.0 exactly when not FP8)
    tl.store(out + rows[:, None].to(tl.int64) * out_row_stride + query_head * D + dims[None, :],
             result.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def attend_prompt(query, units, table, out, *, first: int, seq_len: int, scale: float,
                  value_scale: float = 1.0, block_m: int = 64, block_n: int = 64,
                  num_warps: int = 4) -> None:
    """Launches ``_attend_prompt`` on the current stream (arguments:
    ``kernels.attend_prompt_units``; query, out [T, H_q, D], table [H_kv, MB])."""
    num_rows, num_heads, head_size = query.shape
    _attend_prompt[(triton.cdiv(num_rows, block_m), num_heads)](
        query, units, table, out, scale, value_scale, first, seq_len, num_rows, query.stride(0),
        out.stride(0), table.stride(0), G=num_heads // table.shape[0], D=head_size,
        D_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK=units.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32 or _INTERPRETING,
        FP8=units.element_size() == 1, num_warps=num_warps)
