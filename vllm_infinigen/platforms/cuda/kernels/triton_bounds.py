# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels of the bound speculation keys (imported on first launch).

    encode_bounds  per unit of UNIT tokens a step closes and KV head, each
                   channel's max and min key as BITS-bit codes rounded
                   outwards, and one float16 scale, read from the pool
    bound_scores   each complete unit's upper bound of q . k for a row's
                   KV head, and each block's best unit: the first launch of a
                   selection over the bounds (``triton_select.select_blocks``,
                   which counts the units within alpha itself, the second)

The layout is the CPU kernels' (``platforms/cpu/kernels/csrc/bounds.cpp``,
byte for byte)::

    bounds  [blocks, H_kv, BLOCK / UNIT, 2, D * BITS / 8] uint8: row 0 the
            maxima, row 1 the minima, codes c = v / s + OFF (OFF = 2^(BITS-1));
            8 bits: channel j at byte j; 4 bits: byte j holds channel j (low
            nibble) and channel j + D/2 (high)
    scales  [blocks, H_kv, BLOCK / UNIT] float16 s = max |key| / (OFF - 1),
            rounded up to float16

So both kernels handle a unit's channels as two halves, j and j + D/2. A
unit scores s x max over the query heads of (q+ . max codes + q- . min codes
- OFF x sum q): 4 D multiply-adds per unit and query head over 2 D bytes, a
16th of what the int keys read and compute per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _encode_bounds(pool, bounds, scales, slots, H: tl.constexpr, BLOCK: tl.constexpr,
                   UNIT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr):
    """The bounds of the unit that ``slots[token]`` closes, for one KV head.

    Grid (tokens, heads); a token that closes no unit (or padding) does
    nothing. IEEE divisions (``div_rn``) and float16 rounding to nearest even,
    then up: the codes and scales equal the CPU kernel's.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    if (slot >= 0) & (slot % UNIT == UNIT - 1):
        first = slot - (UNIT - 1)
        block = first // BLOCK
        offset = first % BLOCK
        tokens = tl.arange(0, UNIT)
        dims = tl.arange(0, HALF_PAD)
        ok = dims < HALF
        base = pool + ((block * H + head) * BLOCK + offset) * (2 * D) + tokens[:, None] * (2 * D)
        low_keys = tl.load(base + dims[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        high_keys = tl.load(base + HALF + dims[None, :], mask=ok[None, :],
                            other=0.0).to(tl.float32)
        max_a = tl.max(low_keys, axis=0)  # channels j
        min_a = tl.min(low_keys, axis=0)
        max_b = tl.max(high_keys, axis=0)  # channels j + D/2
        min_b = tl.min(high_keys, axis=0)
        largest = tl.maximum(tl.maximum(tl.abs(max_a), tl.abs(min_a)),
                             tl.maximum(tl.abs(max_b), tl.abs(min_b)))
        magnitude = tl.max(tl.where(ok, largest, 0.0), axis=0)
        offset_code = OFF
        value = tl.math.div_rn(magnitude, OFF - 1.0)
        scale = value.to(tl.float16)
        bits16 = scale.to(tl.int16, bitcast=True)
        above = (bits16 + 1).to(tl.int16).to(tl.float16, bitcast=True)
        scale = tl.where(scale.to(tl.float32) < value, above, scale)
        step = scale.to(tl.float32)
        safe = tl.where(step > 0, step, 1.0)
        top = 2.0 * OFF - 1.0
        up_a = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(max_a, safe)) + offset_code, 0.0), top)
        up_b = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(max_b, safe)) + offset_code, 0.0), top)
        down_a = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(min_a, safe)) + offset_code, 0.0),
                            top)
        down_b = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(min_b, safe)) + offset_code, 0.0),
                            top)
        up_a = tl.where(step > 0, up_a, offset_code).to(tl.int32)
        up_b = tl.where(step > 0, up_b, offset_code).to(tl.int32)
        down_a = tl.where(step > 0, down_a, offset_code).to(tl.int32)
        down_b = tl.where(step > 0, down_b, offset_code).to(tl.int32)
        cell = (block * H + head) * (BLOCK // UNIT) + offset // UNIT
        row_bytes = D * BITS // 8
        rows = bounds + cell * 2 * row_bytes
        if BITS == 8:
            tl.store(rows + dims, up_a.to(tl.uint8), mask=ok)
            tl.store(rows + HALF + dims, up_b.to(tl.uint8), mask=ok)
            tl.store(rows + row_bytes + dims, down_a.to(tl.uint8), mask=ok)
            tl.store(rows + row_bytes + HALF + dims, down_b.to(tl.uint8), mask=ok)
        else:
            tl.store(rows + dims, (up_a | (up_b << 4)).to(tl.uint8), mask=ok)
            tl.store(rows + row_bytes + dims, (down_a | (down_b << 4)).to(tl.uint8), mask=ok)
        tl.store(scales + cell, scale)


def encode_bounds(pool, bounds, scales, slots, *, unit: int, num_warps: int = 2) -> None:
    """Launches ``_encode_bounds`` on the current stream (arguments: ``kernels.encode_bounds``)."""
    head_size = pool.shape[-1] // 2
    bits = 8 * bounds.shape[-1] // head_size
    _encode_bounds[(slots.shape[0], pool.shape[1])](
        pool, bounds, scales, slots, H=pool.shape[1], BLOCK=pool.shape[2], UNIT=unit,
        D=head_size, HALF=head_size // 2, HALF_PAD=triton.next_power_of_2(head_size // 2),
        BITS=bits, OFF=float(1 << (bits - 1)), num_warps=num_warps)


@triton.jit
def _centred(codes, OFF: tl.constexpr):
    """Codes (0..255) less OFF as exact float16 with no conversion instruction (the
    I2F and F2F of ``.to`` run at a quarter of the integer rate): under float16's
    exponent of 1024 (0x6400) a 10-bit mantissa c is the number 1024 + c."""
    return (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFF)


@triton.jit
def _bound_scores(query, bounds, scales, table, context_lens, out, block_out, scale,
                  query_row_stride,
                  table_stride, num_units, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, UNITS_PER_BLOCK: tl.constexpr,
                  UNIT: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr,
                  TILE: tl.constexpr, DOT: tl.constexpr, G_PAD: tl.constexpr,
                  TILES: tl.constexpr):
    """out[row, head, i] for TILES tiles of TILE units i of one (row, KV head): the
    unit's bound (-inf past the row's complete units, or for a padding row);
    block_out[row, head, j] the best of block j's units (TILE a multiple of
    UNITS_PER_BLOCK: a tile holds whole blocks).

    Grid (rows x heads, groups of TILES unit tiles): a program loops over its
    tiles (TILES > 1: Triton pipelines the next tile's loads under this one's
    products). The query heads' positive and negative parts are held for the
    program; each unit's codes are read once for all. DOT: the four products of
    a tile as float16 tensor-core dots over G_PAD query heads (codes less OFF,
    -128..127, made float16 by ``_centred``, exact; a 16-bit query exact within
    float16's range, its parts below 2^-14 rounded, beyond 65504 clamped; a float32
    one rounded to float16), else per query head as float32 sums.
    """
    sequence = tl.program_id(0)
    row = sequence // H
    head = sequence % H
    complete = tl.maximum(tl.load(context_lens + row), 0) // UNIT
    row_bytes = D * BITS // 8
    dims = tl.arange(0, HALF_PAD)
    ok = dims < HALF
    if DOT:
        heads = tl.arange(0, G_PAD)
        take = ok[:, None] & (heads < G)[None, :]
        base = query + row * query_row_stride + (head * G + heads[None, :]) * D + dims[:, None]
        # [HALF_PAD, G_PAD], within float16's range (a larger part would score inf or NaN)
        q_a = tl.clamp(tl.load(base, mask=take, other=0.0).to(tl.float32), -65504.0, 65504.0)
        q_b = tl.clamp(tl.load(base + HALF, mask=take, other=0.0).to(tl.float32), -65504.0,
                       65504.0)
        up_q_a, up_q_b = tl.maximum(q_a, 0.0).to(tl.float16), tl.maximum(q_b, 0.0).to(tl.float16)
        down_q_a = tl.minimum(q_a, 0.0).to(tl.float16)
        down_q_b = tl.minimum(q_b, 0.0).to(tl.float16)
    for tile in range(tl.program_id(1) * TILES, tl.program_id(1) * TILES + TILES):
        units = tile * TILE + tl.arange(0, TILE)
        read = (units < num_units) & (units < complete)
        block = tl.load(table + row * table_stride + units // UNITS_PER_BLOCK, mask=read,
                        other=0).to(tl.int64)
        cell = (block * H + head) * UNITS_PER_BLOCK + units % UNITS_PER_BLOCK  # [TILE]
        mask = read[:, None] & ok[None, :]
        rows = bounds + cell[:, None] * (2 * row_bytes)
        if BITS == 8:
            up_a = tl.load(rows + dims[None, :], mask=mask, other=0)
            up_b = tl.load(rows + HALF + dims[None, :], mask=mask, other=0)
            down_a = tl.load(rows + row_bytes + dims[None, :], mask=mask, other=0)
            down_b = tl.load(rows + row_bytes + HALF + dims[None, :], mask=mask, other=0)
        else:
            up = tl.load(rows + dims[None, :], mask=mask, other=0).to(tl.int32)
            down = tl.load(rows + row_bytes + dims[None, :], mask=mask, other=0).to(tl.int32)
            up_a, up_b, down_a, down_b = up & 15, up >> 4, down & 15, down >> 4
        if DOT:
            dots = tl.dot(_centred(up_a, OFF), up_q_a)
            dots += tl.dot(_centred(up_b, OFF), up_q_b)
            dots += tl.dot(_centred(down_a, OFF), down_q_a)
            dots += tl.dot(_centred(down_b, OFF), down_q_b)
            best = tl.max(tl.where((heads < G)[None, :], dots, float("-inf")), axis=1)
        else:
            best = tl.full([TILE], float("-inf"), tl.float32)
            for g in tl.static_range(G):
                base = query + row * query_row_stride + (head * G + g) * D
                q_a = tl.load(base + dims, mask=ok, other=0.0).to(tl.float32)
                q_b = tl.load(base + HALF + dims, mask=ok, other=0.0).to(tl.float32)
                total = tl.sum(q_a, axis=0) + tl.sum(q_b, axis=0)
                dot = tl.sum(up_a.to(tl.float32) * tl.maximum(q_a, 0.0)[None, :]
                             + up_b.to(tl.float32) * tl.maximum(q_b, 0.0)[None, :]
                             + down_a.to(tl.float32) * tl.minimum(q_a, 0.0)[None, :]
                             + down_b.to(tl.float32) * tl.minimum(q_b, 0.0)[None, :], axis=1)
                best = tl.maximum(best, dot - OFF * total)
        step = tl.load(scales + cell, mask=read, other=0.0).to(tl.float32)
        result = tl.where(read, best * step * scale, float("-inf"))
        tl.store(out + sequence.to(tl.int64) * num_units + units, result,
                 mask=units < num_units)
        blocks = tl.max(tl.reshape(result, [TILE // UNITS_PER_BLOCK, UNITS_PER_BLOCK]), axis=1)
        block_index = tile * (TILE // UNITS_PER_BLOCK) + tl.arange(0, TILE // UNITS_PER_BLOCK)
        num_blocks = num_units // UNITS_PER_BLOCK
        tl.store(block_out + sequence.to(tl.int64) * num_blocks + block_index, blocks,
                 mask=block_index < num_blocks)


def bound_scores(query, bounds, scales, table, context_lens, out, block_out, *, scale: float,
                 unit: int, tile: int = 32, num_warps: int = 4, method: str = "sums",
                 tiles_per_program: int = 1) -> None:
    """Launches ``_bound_scores``: out [S, H_kv, MB * BLOCK / UNIT] and block_out
    [S, H_kv, MB] float32 from query [S, H_kv, G, D] (unit strides within a row),
    a layer's bounds and scales, table [S, MB] and context_lens [S] (< 0: padding).
    method: "sums" (float32) or "dot" (tensor-core dots, ``selection.bound_scores``'
    choice for a 16-bit query; a tile of at least 16
    units; ``benchmarks/gpu/kernel_candidates.py`` times both, ``sass_mix.py`` counts
    what each issues); tiles_per_program: the tiles one program loops over."""
    if method not in ("sums", "dot"):
        raise ValueError(f"bound_scores: method {method!r} is not 'sums' or 'dot'")
    rows, heads, group, head_size = query.shape
    num_units = out.shape[-1]
    bits = 8 * bounds.shape[-1] // head_size
    tile = max(tile, bounds.shape[2], 16 if method == "dot" else 1)  # whole blocks per tile
    if method == "dot" and head_size < 32:
        raise ValueError(f"bound_scores: method 'dot' needs a head size of at least 32 "
                         f"(a dot's 16 channels per half), not {head_size}")
    grid = (rows * heads, triton.cdiv(num_units, tile * tiles_per_program))
    _bound_scores[grid](
        query, bounds, scales, table, context_lens, out, block_out, scale, query.stride(0),
        table.stride(0), num_units, H=heads, G=group, D=head_size, HALF=head_size // 2,
        HALF_PAD=triton.next_power_of_2(head_size // 2), UNITS_PER_BLOCK=bounds.shape[2],
        UNIT=unit, BITS=bits, OFF=float(1 << (bits - 1)), TILE=tile, DOT=method == "dot",
        G_PAD=max(16, triton.next_power_of_2(group)), TILES=tiles_per_program,
        num_warps=num_warps)
