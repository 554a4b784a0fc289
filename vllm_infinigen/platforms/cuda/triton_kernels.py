# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels behind ``kernels.py`` (imported on first launch).

    gather_units   missing blocks, pinned pool -> device block cache
    attend_units   decode attention over a substituted block table
    store_rows     the write-through of a step's K|V into the pinned pool
    encode_groups  the int speculation keys of the groups a step closes
    int_token_scores  speculated scores from the int keys, read in place

They read and write pool-shaped units, one KV head's block each:
[block_size, 2 * D], a token's K | V side by side. The pool is read through
its UVA pointer (pinned host memory passed as a kernel argument: Triton's
launcher resolves the device address), so one kernel moves every missing
block of a layer. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) they run on CPU tensors, as the unit tests do.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gather_units(pool, cache, fetch_units, fetch_slots, num_fetch,
                  UNIT: tl.constexpr, CHUNK: tl.constexpr, PER_STEP: tl.constexpr):
    """cache[fetch_slots[i]] = pool[fetch_units[i]] for i < num_fetch[0].

    A persistent grid: program p takes entries p*PER_STEP, p*PER_STEP +
    grid*PER_STEP, ...; units of UNIT 32-bit words, copied CHUNK at a time.
    """
    program = tl.program_id(0)
    num_programs = tl.num_programs(0)
    count = tl.load(num_fetch).to(tl.int32)
    lanes = tl.arange(0, PER_STEP)
    words = tl.arange(0, CHUNK)
    for start in range(program * PER_STEP, count, num_programs * PER_STEP):
        entry = start + lanes
        live = entry < count
        src = tl.load(fetch_units + entry, mask=live, other=0).to(tl.int64)
        dst = tl.load(fetch_slots + entry, mask=live, other=0).to(tl.int64)
        for offset in tl.static_range(0, UNIT, CHUNK):
            block = tl.load(pool + src[:, None] * UNIT + offset + words[None, :],
                            mask=live[:, None])
            tl.store(cache + dst[:, None] * UNIT + offset + words[None, :], block,
                     mask=live[:, None])


def gather_units(pool_words, cache_words, fetch_units, fetch_slots, num_fetch, *,
                 num_ctas: int, unit_words: int, chunk_words: int, per_step: int,
                 num_warps: int = 4) -> None:
    """Launches ``_gather_units`` on the current stream (arguments: ``kernels.gather_units``)."""
    _gather_units[(num_ctas,)](pool_words, cache_words, fetch_units, fetch_slots, num_fetch,
                               UNIT=unit_words, CHUNK=chunk_words, PER_STEP=per_step,
                               num_warps=num_warps)


@triton.jit
def _attend_units(query, units, table, seq_lens, out, out_max, out_sum, scale,
                  table_stride, blocks_per_split,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One decode query group over one sequence's units, one split of its blocks.

    Grid (sequences, splits); a sequence is one (row, KV head) with G query
    heads. Writes the split's unnormalised output, running max and sum
    (flash-decoding); ``kernels.attend_units`` merges the splits.
    """
    sequence = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    seq_len = tl.load(seq_lens + sequence)
    num_blocks = (seq_len + BLOCK - 1) // BLOCK
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    tokens = tl.arange(0, BLOCK)
    head_ok = heads < G
    dim_ok = dims < D
    q = tl.load(query + (sequence * G + heads[:, None]) * D + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    running_max = tl.full([G_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for block in range(first, last):
        unit = tl.load(table + sequence * table_stride + block).to(tl.int64)
        base = units + unit * (BLOCK * 2 * D)
        token_ok = block * BLOCK + tokens < seq_len
        mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(base + tokens[:, None] * (2 * D) + dims[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        v = tl.load(base + tokens[:, None] * (2 * D) + D + dims[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BLOCK]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    slot = sequence * num_splits + split
    tl.store(out + (slot * G + heads[:, None]) * D + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(out_max + slot * G + heads, running_max, mask=head_ok)
    tl.store(out_sum + slot * G + heads, running_sum, mask=head_ok)


def attend_units(query, units, table, seq_lens, out, out_max, out_sum, *, scale: float,
                 blocks_per_split: int, num_splits: int, num_warps: int = 4) -> None:
    """Launches ``_attend_units`` on the current stream (arguments: ``kernels.attend_units``)."""
    num_sequences, group, head_size = query.shape
    block_size = units.shape[1]
    _attend_units[(num_sequences, num_splits)](
        query, units, table, seq_lens, out, out_max, out_sum, scale, table.stride(0),
        blocks_per_split, G=group, G_PAD=triton.next_power_of_2(group), D=head_size,
        D_PAD=triton.next_power_of_2(head_size), BLOCK=block_size, num_warps=num_warps)


@triton.jit
def _store_rows(pool, rows, slots, H: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
                W_PAD: tl.constexpr):
    """The write-through: pool unit (slot // BLOCK) * H + head, token slot % BLOCK
    <- rows[token, head] (W = 2 * D elements); padding (slot < 0) is skipped.

    Grid (tokens, heads); the pool is pinned host memory read and written
    through its UVA pointer, so a step's new K|V reach it without a host sync.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    if slot >= 0:
        cols = tl.arange(0, W_PAD)
        ok = cols < W
        row = tl.load(rows + (token * H + head) * W + cols, mask=ok)
        unit = (slot // BLOCK) * H + head
        tl.store(pool + (unit * BLOCK + slot % BLOCK) * W + cols, row, mask=ok)


def store_rows(pool, rows, slots, *, num_warps: int = 1) -> None:
    """Launches ``_store_rows`` on the current stream (arguments: ``kernels.store_rows``)."""
    num_tokens, heads, width = rows.shape
    _store_rows[(num_tokens, heads)](pool, rows, slots, H=heads, BLOCK=pool.shape[2], W=width,
                                     W_PAD=triton.next_power_of_2(width), num_warps=num_warps)


@triton.jit
def _encode_groups(pool, codes, scales, slots, H: tl.constexpr, BLOCK: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
                   HALF: tl.constexpr, TOP: tl.constexpr):
    """The int keys of the 16-token group that ``slots[token]`` closes, for one KV head.

    Grid (tokens, heads); a token that closes no group (or padding) does
    nothing. Reads the group's 16 keys from the pool (after ``_store_rows``
    on the same stream), per channel: scale = max |k| / HALF (float16), code
    = round half to even of k / scale + HALF, clamped to [0, TOP] (0 where
    the scale is 0), token t at bits [BITS * t, BITS * t + BITS) of a word
    stored as 2 * BITS bytes, least significant first: ``writes.encode_groups``.
    IEEE divisions (``div_rn``), so the codes equal the CPU kernels' byte for byte.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    if (slot >= 0) & (slot % 16 == 15):
        first = slot - 15
        block = first // BLOCK
        offset = first % BLOCK
        tokens = tl.arange(0, 16)
        dims = tl.arange(0, D_PAD)
        dim_ok = dims < D
        base = ((block * H + head) * BLOCK + offset) * (2 * D)
        keys = tl.load(pool + base + tokens[:, None] * (2 * D) + dims[None, :],
                       mask=dim_ok[None, :], other=0.0).to(tl.float32)  # [16, D_PAD]
        scale = tl.math.div_rn(tl.max(tl.abs(keys), axis=0), HALF).to(tl.float16)
        step = scale.to(tl.float32)
        safe = tl.where(step > 0, step, 1.0)
        scaled = tl.math.div_rn(keys, safe[None, :]) + HALF
        whole = tl.floor(scaled)
        frac = scaled - whole
        odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
        rounded = tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole)
        rounded = tl.minimum(tl.maximum(rounded, 0.0), TOP)
        code = tl.where(step[None, :] > 0, rounded, 0.0).to(tl.int64)
        word = tl.sum(code << (BITS * tokens).to(tl.int64)[:, None], axis=0)  # [D_PAD]
        lanes = tl.arange(0, 2 * BITS)
        packed = ((word[:, None] >> (8 * lanes).to(tl.int64)[None, :]) & 0xFF).to(tl.uint8)
        cell = ((block * H + head) * (BLOCK // 16) + offset // 16) * D + dims  # [D_PAD]
        tl.store(codes + cell[:, None] * (2 * BITS) + lanes[None, :], packed,
                 mask=dim_ok[:, None])
        tl.store(scales + cell, scale, mask=dim_ok)


def encode_groups(pool, codes, scales, slots, *, num_warps: int = 2) -> None:
    """Launches ``_encode_groups`` on the current stream (arguments: ``kernels.encode_groups``)."""
    bits = codes.shape[-1] // 2
    head_size = codes.shape[3]
    _encode_groups[(slots.shape[0], pool.shape[1])](
        pool, codes, scales, slots, H=pool.shape[1], BLOCK=pool.shape[2], D=head_size,
        D_PAD=triton.next_power_of_2(head_size), BITS=bits, HALF=((1 << bits) - 1) / 2,
        TOP=float((1 << bits) - 1), num_warps=num_warps)


@triton.jit
def _int_token_scores(query, codes, scales, table, context_lens, out, scale, table_stride,
                      num_tokens, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                      D_PAD: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                      HALF: tl.constexpr, TILE: tl.constexpr):
    """Speculated scores of TILE tokens of one (row, KV head), the int keys read in place.

    Grid (rows x KV heads, token tiles). Token t of the row lies in block
    ``table[row, t // BLOCK]``, group (t % BLOCK) // 16, whose channel c keeps
    its code in bits [BITS * (t % 16), + BITS) of 2 * BITS bytes; its key is
    (code - HALF) x scale[c]. The score is the best over the G query heads of
    q . k, times ``scale``; tokens of the row's open group (from its context
    rounded down to 16) and later score -inf (``block_selection.int_token_scores``).
    """
    sequence = tl.program_id(0)
    row = sequence // H
    head = sequence % H
    tokens = tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = tokens < num_tokens
    encoded = tl.load(context_lens + row) // 16 * 16
    block = tl.load(table + row * table_stride + tokens // BLOCK, mask=live, other=0).to(tl.int64)
    cell = ((block * H + head) * (BLOCK // 16) + (tokens % BLOCK) // 16) * D  # [TILE]
    in_group = tokens % 16
    dims = tl.arange(0, D_PAD)
    mask = live[:, None] & (dims < D)[None, :]
    packed = tl.load(codes + (cell[:, None] + dims[None, :]) * (2 * BITS)
                     + (BITS * in_group // 8)[:, None], mask=mask, other=0)
    code = (packed.to(tl.int32) >> (BITS * in_group % 8)[:, None]) & ((1 << BITS) - 1)
    step = tl.load(scales + cell[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    keys = (code.to(tl.float32) - HALF) * step  # [TILE, D_PAD]
    best = tl.full([TILE], float("-inf"), tl.float32)
    for group in tl.static_range(G):
        q = tl.load(query + (sequence * G + group) * D + dims, mask=dims < D,
                    other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(keys * q[None, :], axis=1))
    scores = tl.where(tokens < encoded, best * scale, float("-inf"))
    tl.store(out + sequence.to(tl.int64) * num_tokens + tokens, scores, mask=live)


def int_token_scores(query, codes, scales, table, context_lens, out, *, scale: float,
                     tile: int = 64, num_warps: int = 4) -> None:
    """Launches ``_int_token_scores`` on the current stream (arguments:
    ``block_selection.int_token_scores``; out [S, H_kv, T] float32)."""
    rows, heads, group, head_size = query.shape
    num_tokens = out.shape[-1]
    bits = codes.shape[-1] // 2
    _int_token_scores[(rows * heads, triton.cdiv(num_tokens, tile))](
        query, codes, scales, table, context_lens, out, scale, table.stride(0), num_tokens,
        H=heads, G=group, D=head_size, D_PAD=triton.next_power_of_2(head_size),
        BLOCK=codes.shape[2] * 16, BITS=bits, HALF=((1 << bits) - 1) / 2, TILE=tile,
        num_warps=num_warps)
