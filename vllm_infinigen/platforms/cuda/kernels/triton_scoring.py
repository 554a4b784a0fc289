# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels that score tokens from the int keys (imported on first launch).

``int_scores`` is the first launch of a device-only selection
(``triton_select.py`` holds the others, ``selection.py`` the dispatch,
``block_rule.py`` the torch references). Two forms compute the scores::

    dot   (the default) a tile of TILE tokens x D channels dequantised in
          float32, times the query heads as one [D, HEADS_PAD] matrix on the
          tensor cores, with both operands in float16 (``precision`` "fp16";
          "tf32" / "tf32x3" / "ieee" keep them in float32 for one, three
          TF32 products or none)
    sums  a tile's keys [groups, D, 16] in float32, times each query head and
          summed over the channels (exact in float32)

The float16 operands put each key and query value within 2^-11 of its
float32 value, relatively (below float16's normal range, 6e-5, within 2^-25) (the torch form rounds them alike: ``block_rule``); the
2-bit codes of a bfloat16 cache are a step of a third of a channel's range.

A group of 16 tokens keeps, per channel, its 16 codes in one run of 2 x
BITS bytes, token i's in bits [BITS x i, + BITS) (``block_rule``
states the layout and dequantises it in torch: the reference)::

    codes  [blocks, H_kv, BLOCK / 16, D, 2 * BITS] uint8, seen as words of
           min(32, 16 * BITS) bits: one or two words per (group, channel)
    key    (code - HALF) x scale[c], HALF = (2^BITS - 1) / 2

On an H200 at 131072 tokens x 1 row (8 KV heads, 4 query heads each, head
dim 128, 2-bit keys; ``benchmarks/results/kernel_candidates_h200.md``, CUDA
graphs): dot in float16 0.079 ms (x8 rows: 0.59), one TF32 product 0.108,
three 0.169; sums 0.142 (tile 32: 0.122); a per-thread loop over the
channels (no reduction across threads; dropped since) 0.364. Each is bound
by its arithmetic (the float16 dot reads 0.15 of the streaming read), not the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 2^23 as float32 bits: (0x4B000000 | code) read as a float is 2^23 + code, exactly
# (a conversion without the slower int-to-float instruction).
_MAGIC = tl.constexpr(0x4B000000)
_MAGIC_VALUE = tl.constexpr(8388608.0)


@triton.jit
def _tile_groups(context_lens, table, table_stride, num_tokens,
                 H: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """(row, head, first token, read, cell) of a program's GROUPS groups of 16
    tokens: ``read`` where the group is encoded (below the row's context rounded
    down to 16), ``cell`` its (block, head, group) index in ``codes``."""
    sequence = tl.program_id(0)
    row = sequence // H
    head = sequence % H
    first = (tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)) * 16  # [GROUPS]
    encoded = tl.maximum(tl.load(context_lens + row), 0) // 16 * 16
    read = (first < num_tokens) & (first < encoded)
    block = tl.load(table + row * table_stride + first // BLOCK, mask=read, other=0).to(tl.int64)
    cell = (block * H + head) * (BLOCK // 16) + (first % BLOCK) // 16
    return row, head, first, read, cell


@triton.jit
def _group_words(codes, scales, cell, read, dims, D: tl.constexpr, BITS: tl.constexpr):
    """(scales, first words, second words) [GROUPS, D_PAD] of the groups ``cell``
    (the second: tokens 8-15 when a channel takes two words, else the first)."""
    WORDS: tl.constexpr = 2 if BITS == 4 else 1  # words of min(32, 16 x BITS) bits
    mask = read[:, None] & (dims < D)[None, :]
    channel = cell[:, None] * D + dims[None, :]  # [GROUPS, D_PAD]
    step = tl.load(scales + channel, mask=mask, other=0.0).to(tl.float32)
    word = tl.load(codes + channel * WORDS, mask=mask, other=0).to(tl.int32)
    second = word
    if WORDS == 2:
        second = tl.load(codes + channel * 2 + 1, mask=mask, other=0).to(tl.int32)
    return step, word, second


@triton.jit
def _codes_minus_half(word, low_half, lanes, BITS: tl.constexpr, HALF: tl.constexpr):
    """code - HALF of token ``lanes`` (exact in float32) from its channel's words
    (``word`` its first or only one, ``low_half`` its second: tokens 8-15 when
    a channel takes two words; broadcastable shapes)."""
    WORD: tl.constexpr = 32 if BITS * 16 >= 32 else BITS * 16  # bits per word
    if BITS == 4:
        word = tl.where(lanes < 8, word, low_half)
    code = (word >> ((BITS * lanes) % WORD)) & ((1 << BITS) - 1)
    return ((code | _MAGIC).to(tl.float32, bitcast=True) - _MAGIC_VALUE) - HALF


@triton.jit
def _store_scores(best, read, first, token_out, block_out, settings, scale, num_tokens,
                  num_blocks, BLOCK: tl.constexpr, TILE: tl.constexpr,
                  WRITE_BLOCKS: tl.constexpr, GATED: tl.constexpr):
    """Writes a tile's token scores (best [GROUPS, 16] over the query heads) and,
    with WRITE_BLOCKS, each block's best."""
    sequence = tl.program_id(0).to(tl.int64)
    scores = tl.where(read[:, None], best * scale, float("-inf"))  # [GROUPS, 16]
    tokens = first[:, None] + tl.arange(0, 16)[None, :]
    limit = num_tokens
    if GATED:  # alpha off: no token written
        limit = tl.where(tl.load(settings) < float("inf"), num_tokens, 0)
    tl.store(token_out + sequence * num_tokens + tokens, scores, mask=tokens < limit)
    if WRITE_BLOCKS:
        per_block = tl.max(tl.reshape(scores, (TILE // BLOCK, BLOCK)), axis=1)
        index = tl.program_id(1) * (TILE // BLOCK) + tl.arange(0, TILE // BLOCK)
        tl.store(block_out + sequence * num_blocks + index, per_block, mask=index < num_blocks)


@triton.jit
def _int_scores_sums(query, codes, scales, table, context_lens, token_out, block_out, settings,
                     scale, query_row_stride, table_stride, num_tokens, num_blocks,
                     H: tl.constexpr, G: tl.constexpr, HEADS_PAD: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                     HALF: tl.constexpr, TILE: tl.constexpr, WRITE_BLOCKS: tl.constexpr,
                     GATED: tl.constexpr, PRECISION: tl.constexpr):
    """``_int_scores_dot``'s scores as sums: the tile's keys [GROUPS, D_PAD, 16]
    times each query head, summed over the channels (HEADS_PAD, PRECISION unused)."""
    GROUPS: tl.constexpr = TILE // 16
    row, head, first, read, cell = _tile_groups(context_lens, table, table_stride, num_tokens,
                                                H, BLOCK, GROUPS)
    dims = tl.arange(0, D_PAD)
    step, word, second = _group_words(codes, scales, cell, read, dims, D, BITS)
    lanes = tl.arange(0, 16)[None, None, :]
    keys = _codes_minus_half(word[:, :, None], second[:, :, None], lanes, BITS, HALF)
    keys = keys * step[:, :, None]  # [GROUPS, D_PAD, 16]
    best = tl.full([GROUPS, 16], float("-inf"), tl.float32)
    query_row = query + row.to(tl.int64) * query_row_stride + head * G * D
    for group in tl.static_range(G):
        q = tl.load(query_row + group * D + dims, mask=dims < D, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(keys * q[None, :, None], axis=1))
    _store_scores(best, read, first, token_out, block_out, settings, scale, num_tokens,
                  num_blocks, BLOCK, TILE, WRITE_BLOCKS, GATED)


@triton.jit
def _int_scores_dot(query, codes, scales, table, context_lens, token_out, block_out, settings,
                    scale, query_row_stride, table_stride, num_tokens, num_blocks,
                    H: tl.constexpr, G: tl.constexpr, HEADS_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                    HALF: tl.constexpr, TILE: tl.constexpr, WRITE_BLOCKS: tl.constexpr,
                    GATED: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of TILE tokens of one (row, KV head) as one matrix product. Grid (rows x
    KV heads, token tiles).

    The tile's keys [TILE, D_PAD] (each group's words and scales read once)
    times the query [D_PAD, HEADS_PAD] (the G heads, zero columns after), in
    ``PRECISION``; a token's score is its best column, times ``scale``.
    Groups at or past the row's context rounded down to 16 score -inf and
    read nothing. GATED: token scores written only while alpha
    (``settings[0]``) is finite.
    """
    GROUPS: tl.constexpr = TILE // 16
    row, head, first, read, cell = _tile_groups(context_lens, table, table_stride, num_tokens,
                                                H, BLOCK, GROUPS)
    dims = tl.arange(0, D_PAD)
    step, word, second = _group_words(codes, scales, cell, read, dims, D, BITS)
    lanes = tl.arange(0, 16)[None, :, None]
    value = _codes_minus_half(word[:, None, :], second[:, None, :], lanes, BITS, HALF)
    keys = tl.reshape(value * step[:, None, :], (TILE, D_PAD))  # token-major
    heads = tl.arange(0, HEADS_PAD)
    query_row = query + row.to(tl.int64) * query_row_stride + head * G * D
    q = tl.load(query_row + heads[None, :] * D + dims[:, None],
                mask=(heads < G)[None, :] & (dims < D)[:, None], other=0.0).to(tl.float32)
    if PRECISION == "fp16":  # one float16 product (the default)
        products = tl.dot(keys.to(tl.float16), q.to(tl.float16), out_dtype=tl.float32)
    else:
        products = tl.dot(keys, q, input_precision=PRECISION)  # [TILE, HEADS_PAD]
    best = tl.max(tl.where((heads < G)[None, :], products, float("-inf")), axis=1)
    _store_scores(tl.reshape(best, (GROUPS, 16)), read, first, token_out, block_out, settings,
                  scale, num_tokens, num_blocks, BLOCK, TILE, WRITE_BLOCKS, GATED)


KERNELS = {"sums": _int_scores_sums, "dot": _int_scores_dot}


def int_scores(query, codes, scales, table, context_lens, token_out, block_out, *,
               scale: float, settings=None, method: str = "dot", tile: int = 64,
               num_warps: int = 4, precision: str = "fp16") -> None:
    """Launches the int-key scoring on the current stream.

    Args:
        query: [S, H_kv, G, D], unit strides but the row's.
        codes: [blocks, H_kv, block_size / 16, D, 2 * bits] uint8, bits 1, 2 or 4.
        scales: [blocks, H_kv, block_size / 16, D] float16.
        table: [S, MB] block ids; context_lens: [S] (< 0: padding).
        token_out: [S, H_kv, T] float32; block_out: [S, H_kv, MB] or None.
        settings: Given, the token scores are gated by alpha (``selection.int_scores``).
        method: "dot" (the default) or "sums" (the module docstring);
            tile: tokens per program;
            precision: the dot's operands: "fp16" (the default: float16), or its
                ``input_precision`` over float32 ("tf32x3", "tf32", "ieee").
    """
    grid, sizes, constants = int_scores_launch(query, codes, table, token_out, block_out, tile)
    words = codes.view(torch.int16 if constants["BITS"] == 1 else torch.int32)  # the kernel's
    heads_pad = max(16, triton.next_power_of_2(constants["G"])) if method == "dot" else \
        triton.next_power_of_2(constants["G"])
    KERNELS[method][grid](query, words, scales, table, context_lens, token_out, block_out,
                          settings, scale, *sizes, **constants, HEADS_PAD=heads_pad,
                          GATED=settings is not None, PRECISION=precision, num_warps=num_warps)


def int_scores_launch(query, codes, table, token_out, block_out,
                      tile: int) -> tuple[tuple[int, int], tuple[int, ...], dict]:
    """(grid, the size arguments after ``scale``, the constexprs) of an int-scoring
    launch (``int_scores``'s arguments; the benchmarks' kept kernels share them)."""
    rows, heads, group, head_size = query.shape
    num_tokens = token_out.shape[-1]
    block_size = codes.shape[2] * 16
    if block_out is not None:
        tile = max(tile, block_size)  # whole blocks per tile
    bits = codes.shape[-1] // 2
    sizes = (query.stride(0), table.stride(0), num_tokens,
             block_out.shape[-1] if block_out is not None else 0)
    constants = {"H": heads, "G": group, "D": head_size,
                 "D_PAD": max(16, triton.next_power_of_2(head_size)), "BLOCK": block_size,
                 "BITS": bits, "HALF": ((1 << bits) - 1) / 2, "TILE": tile,
                 "WRITE_BLOCKS": block_out is not None}
    return (rows * heads, triton.cdiv(num_tokens, tile)), sizes, constants
