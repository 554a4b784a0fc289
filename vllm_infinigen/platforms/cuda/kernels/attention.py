# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the wrappers of the attention over pool units.

    attend_units        decode attention of each (row, KV head) over its units
                        (the cache's slots of its selection), the blocks split
                        across programs (``attention_splits``) and merged into
                        the caller's rows by the last of them: one launch
                        (``reserve_attention``: its counters, before a capture)
    attend_prompt_units causal attention of one request's prompt rows over
                        its units (prefill, chunked or not): with a 16-bit
                        query, torch's SDPA (FlashAttention on CUDA) over the
                        units gathered in position order; else a Triton
                        flash-attention kernel over the units

A call on CUDA tensors launches the Triton kernel (``triton_attend.py``,
``triton_prompt.py``, imported then); on any other device it runs the torch
reference (``reference.py``), so the CPU build never touches CUDA or Triton.
Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch

from vllm_infinigen.platforms.cuda.kernels import reference
from vllm_infinigen.platforms.cuda.kernels.units import num_sms as _device_sms

_SPLITS_PER_SM = 2  # (sequences x splits) >= 2 x SMs when the blocks allow


def attention_splits(num_sequences: int, width: int, num_sms: int | None,
                     per_sm: int = _SPLITS_PER_SM) -> tuple[int, int]:
    """(splits per sequence, blocks per split) for ``attend_units``' grid: (sequences x
    splits) >= ``per_sm`` x SMs when the blocks allow."""
    wanted = 1 if num_sms is None else -(-per_sm * num_sms // max(num_sequences, 1))
    splits = max(1, min(wanted, width))
    per_split = -(-width // splits)
    return -(-width // per_split), per_split


def reserve_attention(device: torch.device) -> None:
    """Makes ``attend_units``' arrival counters on a CUDA ``device`` now, before any
    CUDA graph capture (which cannot make them); elsewhere nothing."""
    if device.type == "cuda":
        from vllm_infinigen.platforms.cuda.kernels import triton_attend

        triton_attend.arrivals(device, 0)


def attend_units(query: torch.Tensor, units: torch.Tensor, table: torch.Tensor,
                 seq_lens: torch.Tensor, *, num_kv_heads: int, scale: float,
                 out: torch.Tensor | None = None, key_scale: float = 1.0,
                 value_scale: float = 1.0) -> torch.Tensor:
    """Decode attention of each (row, KV head) over the units of its table.

    Sequence i = (row i // H_kv, KV head i % H_kv) attends with that head's
    G query heads over its first ``seq_lens[i]`` tokens, token t lying in
    unit ``table[i, t // block_size]`` at offset ``t % block_size``; a
    sequence of length 0 (a padding row) gives 0.

    Args:
        query: [S, H_q, D] (unit strides within a row).
        units: [num_units, block_size, 2 * D] K | V per token.
        table: [S * H_kv, W] int32 or int64 units of each sequence (entries
            past its blocks are not read).
        seq_lens: [S * H_kv] int32 tokens of each sequence.
        out: [S, H_q, D] to write (unit strides within a row), or None.
        key_scale, value_scale: FP8 units' (K and V over them; 1.0 otherwise).

    Returns:
        [S, H_q, D] in the query's dtype (``out`` when given).
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if not query.is_cuda:
        out.copy_(reference.attend_units_reference(
            query, units, table, seq_lens, num_kv_heads=num_kv_heads, scale=scale,
            key_scale=key_scale, value_scale=value_scale))
        return out
    from vllm_infinigen.platforms.cuda.kernels import triton_attend

    num_rows, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    block_size = units.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the attention kernel needs a power-of-two block size, got {block_size}")
    num_sequences = num_rows * num_kv_heads
    num_splits, per_split = attention_splits(num_sequences, table.shape[1],
                                             _device_sms(query.device))
    partial = query.new_empty((num_sequences, num_splits, group, head_size), dtype=torch.float32)
    maxima = query.new_empty((num_sequences, num_splits, group), dtype=torch.float32)
    triton_attend.attend_units(query, units, table, seq_lens, out, partial, maxima,
                               torch.empty_like(maxima), num_kv_heads=num_kv_heads,
                               scale=scale * key_scale, blocks_per_split=per_split,
                               value_scale=value_scale)
    return out


def attend_prompt_units(query: torch.Tensor, units: torch.Tensor, table: torch.Tensor, *,
                        first: int, seq_len: int, scale: float, key_scale: float = 1.0,
                        value_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of one request's prompt rows over its units.

    Row r of ``query`` sits at position ``first + r`` and attends to every
    token at or before it; token t of KV head h lies in unit ``table[h, t //
    block_size]`` at offset ``t % block_size`` (the request's blocks, its
    earlier chunks and this step's rows, written before).

    Args:
        query: [T, H_q, D] the request's rows (unit strides within a row).
        units: [N, block_size, 2 * D] K | V per token.
        table: [H_kv, MB] units of each KV head's blocks, in position order.
        first: Position of the first row (the chunk's start).
        seq_len: Tokens of the request after this step (first + T).
        key_scale, value_scale: FP8 units' (as ``attend_units``).

    Returns:
        [T, H_q, D] in the query's dtype.
    """
    if query.dtype in (torch.float16, torch.bfloat16):
        return _prompt_sdpa(query, units, table, seq_len=seq_len, scale=scale * key_scale,
                            value_scale=value_scale)
    if not query.is_cuda:
        return reference.attend_prompt_units_reference(
            query, units, table, first=first, seq_len=seq_len, scale=scale,
            key_scale=key_scale, value_scale=value_scale)
    from vllm_infinigen.platforms.cuda.kernels import triton_prompt

    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    triton_prompt.attend_prompt(query, units, table.contiguous(), out, first=first,
                                seq_len=seq_len, scale=scale * key_scale,
                                value_scale=value_scale)
    return out


def _prompt_sdpa(query: torch.Tensor, units: torch.Tensor, table: torch.Tensor, *,
                 seq_len: int, scale: float, value_scale: float) -> torch.Tensor:
    """``attend_prompt_units`` through torch's SDPA: the request's tokens gathered
    from its units in position order (FP8 widened exactly to the query's type),
    each KV head's repeated for its query heads, the causal mask aligned to the
    last row (``causal_lower_right``: row r at position seq_len - T + r).
    Measured on an H200 at 32K (one layer, bf16): 13.3 ms against 32.4 for
    the Triton kernel over staged units (``kernel_limits.py``)."""
    from torch.nn.attention.bias import causal_lower_right

    num_rows, num_heads, head_size = query.shape
    kv_heads = table.shape[0]
    rows = units[table.to(torch.int64)].reshape(kv_heads, -1, 2 * head_size)[:, :seq_len]
    rows = rows.to(query.dtype).repeat_interleave(num_heads // kv_heads, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], rows[None, ..., :head_size], rows[None, ..., head_size:],
        attn_mask=causal_lower_right(num_rows, seq_len), scale=scale)
    out = out[0].transpose(0, 1)
    return out if value_scale == 1.0 else (out * value_scale).to(query.dtype)
