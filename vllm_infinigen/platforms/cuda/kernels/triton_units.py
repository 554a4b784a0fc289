# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels behind ``units.py`` (imported on first launch).

    gather_units   missing blocks, pinned pool -> device block cache, one
                   fetch list per KV head with its count on the device
    attend_units   decode attention over each (row, KV head)'s units, the
                   splits merged by a second launch into the caller's rows
    write_tokens   a step's K|V written through to the pinned pool and into
                   the cached copies of their blocks
    encode_groups  the int speculation keys of the groups a step closes
    attend_prompt  causal attention of a request's prompt rows over its
                   units (flash attention)

The selection's kernels are in ``triton_select.py``.

They read and write pool-shaped units, one KV head's block each:
[block_size, 2 * D], a token's K | V side by side. The pool is read through
its UVA pointer (pinned host memory passed as a kernel argument: Triton's
launcher resolves the device address), so one kernel moves every missing
block of a layer. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) they run on CPU tensors, as the unit tests do.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (CI) computes 16-bit dots inexactly: products in float32 there.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_TOKENS_PER_STEP = 64  # attention: K|V tokens loaded per loop step (4 blocks of 16)


@triton.jit
def _gather_units(pool, cache, fetch_units, fetch_slots, num_fetch, list_len, programs_per_list,
                  UNIT: tl.constexpr, CHUNK: tl.constexpr, PER_STEP: tl.constexpr):
    """cache[fetch_slots[l, i]] = pool[fetch_units[l, i]] for i < num_fetch[l].

    A persistent grid of ``programs_per_list`` programs per list: program p of
    list l takes entries p*PER_STEP, p*PER_STEP + programs_per_list*PER_STEP,
    ...; units of UNIT 32-bit words, copied CHUNK at a time.
    """
    which = tl.program_id(0) // programs_per_list
    program = tl.program_id(0) % programs_per_list
    count = tl.load(num_fetch + which).to(tl.int32)
    base = which.to(tl.int64) * list_len
    lanes = tl.arange(0, PER_STEP)
    words = tl.arange(0, CHUNK)
    for start in range(program * PER_STEP, count, programs_per_list * PER_STEP):
        entry = start + lanes
        live = entry < count
        src = tl.load(fetch_units + base + entry, mask=live, other=0).to(tl.int64)
        dst = tl.load(fetch_slots + base + entry, mask=live, other=0).to(tl.int64)
        for offset in tl.static_range(0, UNIT, CHUNK):
            block = tl.load(pool + src[:, None] * UNIT + offset + words[None, :],
                            mask=live[:, None])
            tl.store(cache + dst[:, None] * UNIT + offset + words[None, :], block,
                     mask=live[:, None])


def gather_units(pool_words, cache_words, fetch_units, fetch_slots, num_fetch, *,
                 num_ctas: int, unit_words: int, chunk_words: int, per_step: int,
                 num_warps: int = 4) -> None:
    """Launches ``_gather_units`` on the current stream (arguments: ``kernels.gather_units``;
    fetch lists [L, M] with counts [L], about ``num_ctas`` programs in all)."""
    num_lists = num_fetch.shape[0]
    per_list = max(1, num_ctas // num_lists)
    _gather_units[(num_lists * per_list,)](
        pool_words, cache_words, fetch_units, fetch_slots, num_fetch, fetch_units.shape[-1],
        per_list, UNIT=unit_words, CHUNK=chunk_words, PER_STEP=per_step, num_warps=num_warps)


@triton.jit
def _attend_units(query, units, table, seq_lens, out, out_max, out_sum, scale,
                  query_row_stride, table_stride, blocks_per_split, H: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK: tl.constexpr, UNITS: tl.constexpr, IEEE: tl.constexpr):
    """One decode query group over one sequence's units, one split of its blocks.

    Grid (sequences, splits); sequence i is (row i // H, KV head i % H), whose
    G query heads are ``query[row, head * G:(head + 1) * G]``, padded to G_PAD
    (>= 16) rows so that both products run on the tensor cores. UNITS units
    (UNITS x BLOCK tokens) are read per step: K and V tiles loaded once for
    the G heads. Writes the split's unnormalised output, running max and sum
    (flash-decoding); ``_merge_splits`` combines them. A split past the
    sequence reads nothing.
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
    rows = tl.arange(0, UNITS * BLOCK)
    head_ok = heads < G
    dim_ok = dims < D
    q_base = query + (sequence // H) * query_row_stride + (sequence % H) * G * D
    q = tl.load(q_base + heads[:, None] * D + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    else:  # the dot's operands in the units' 16-bit type (a float32 query too)
        q = q.to(units.dtype.element_ty)
    running_max = tl.full([G_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for block in range(first, last, UNITS):
        token = block * BLOCK + rows  # [UNITS * BLOCK] positions in the sequence
        token_ok = (token < seq_len) & (token < last * BLOCK)
        unit = tl.load(table + sequence * table_stride + token // BLOCK, mask=token_ok,
                       other=0).to(tl.int64)
        base = units + unit * (BLOCK * 2 * D) + (token % BLOCK) * (2 * D)
        mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(base[:, None] + dims[None, :], mask=mask, other=0.0)
        v = tl.load(base[:, None] + D + dims[None, :], mask=mask, other=0.0)
        if IEEE:  # float32 (and the interpreter, whose 16-bit dot is not exact)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, UNITS * BLOCK]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        if IEEE:
            update = tl.dot(weights, v, input_precision="ieee")
        else:
            update = tl.dot(weights.to(v.dtype), v)
        acc = acc * correction[:, None] + update
        running_max = new_max
    slot = sequence * num_splits + split
    tl.store(out + (slot * G + heads[:, None]) * D + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(out_max + slot * G + heads, running_max, mask=head_ok)
    tl.store(out_sum + slot * G + heads, running_sum, mask=head_ok)


@triton.jit
def _read_bytes(source, offsets, out, N: tl.constexpr):
    """out[i] = source[offsets[i]]: a kernel's read of (pinned host) memory."""
    i = tl.arange(0, N)
    tl.store(out + i, tl.load(source + tl.load(offsets + i)))


def read_bytes(source_bytes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``source_bytes[offsets]`` (uint8, offsets a power of two of int64 on the
    GPU) read by a kernel; Triton's launcher raises ValueError where the GPU
    cannot address ``source_bytes``."""
    out = torch.empty(offsets.shape, dtype=torch.uint8, device=offsets.device)
    _read_bytes[(1,)](source_bytes, offsets, out, N=offsets.numel())
    return out


@triton.jit
def _merge_splits(partial, maxima, sums, out, out_row_stride, num_splits, H: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """The softmax-weighted output of one sequence from its splits, into the
    caller's row (``out[row, head * G:(head + 1) * G]``); 0 for an empty
    sequence (a padding row). Grid (sequences)."""
    sequence = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < G
    mask = head_ok[:, None] & (dims < D)[None, :]
    best = tl.full([G_PAD], float("-inf"), tl.float32)
    for split in range(num_splits):
        slot = sequence * num_splits + split
        best = tl.maximum(best, tl.load(maxima + slot * G + heads, mask=head_ok,
                                        other=float("-inf")))
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for split in range(num_splits):
        slot = sequence * num_splits + split
        peak = tl.load(maxima + slot * G + heads, mask=head_ok, other=float("-inf"))
        weight = tl.where(peak > float("-inf"), tl.exp(peak - best), 0.0)
        total += weight * tl.load(sums + slot * G + heads, mask=head_ok, other=0.0)
        acc += weight[:, None] * tl.load(partial + (slot * G + heads[:, None]) * D + dims[None, :],
                                         mask=mask, other=0.0)
    result = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    row = out + (sequence // H) * out_row_stride + (sequence % H) * G * D
    tl.store(row + heads[:, None] * D + dims[None, :], result.to(out.dtype.element_ty), mask=mask)


def attend_units(query, units, table, seq_lens, out, partial, out_max, out_sum, *,
                 num_kv_heads: int, scale: float, blocks_per_split: int,
                 num_warps: int = 4) -> None:
    """Launches ``_attend_units`` and ``_merge_splits`` on the current stream
    (arguments: ``kernels.attend_units``; query, out [S, H_q, D] with unit
    strides but the row's; partial [N, splits, G, D])."""
    num_sequences, num_splits, group, head_size = partial.shape
    block_size = units.shape[1]
    common = {"H": num_kv_heads, "G": group, "D": head_size}
    _attend_units[(num_sequences, num_splits)](
        query, units, table, seq_lens, partial, out_max, out_sum, scale, query.stride(0),
        table.stride(0), blocks_per_split, BLOCK=block_size,
        UNITS=max(1, _TOKENS_PER_STEP // block_size),
        G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=max(16, triton.next_power_of_2(head_size)),
        IEEE=units.dtype == torch.float32 or _INTERPRETING, num_warps=num_warps, **common)
    _merge_splits[(num_sequences,)](partial, out_max, out_sum, out, out.stride(0), num_splits,
                                    G_PAD=triton.next_power_of_2(group),
                                    D_PAD=triton.next_power_of_2(head_size),
                                    num_warps=num_warps, **common)


@triton.jit
def _write_tokens(pool, units, slot_of, key, value, slots, key_row_stride, value_row_stride,
                  capacity, H: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, CACHED: tl.constexpr):
    """Token ``slots[token]``'s K|V of one KV head: into its pool row (the
    write-through, through the pinned pool's UVA pointer) and, with CACHED,
    into its block's cached copy when the cache holds that block
    (``slot_of``). Grid (tokens, heads); padding (slot < 0) is skipped."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    if slot >= 0:
        dims = tl.arange(0, D_PAD)
        ok = dims < D
        k = tl.load(key + token * key_row_stride + head * D + dims, mask=ok)
        v = tl.load(value + token * value_row_stride + head * D + dims, mask=ok)
        block = slot // BLOCK
        offset = slot % BLOCK
        row = pool + ((block * H + head) * BLOCK + offset) * (2 * D)
        tl.store(row + dims, k.to(pool.dtype.element_ty), mask=ok)
        tl.store(row + D + dims, v.to(pool.dtype.element_ty), mask=ok)
        if CACHED:
            cached = tl.load(slot_of + block * H + head).to(tl.int64)
            if cached >= 0:
                copy = units + ((head * capacity + cached) * BLOCK + offset) * (2 * D)
                tl.store(copy + dims, k.to(units.dtype.element_ty), mask=ok)
                tl.store(copy + D + dims, v.to(units.dtype.element_ty), mask=ok)


def write_tokens(pool, units, slot_of, key, value, slots, *, capacity: int,
                 num_warps: int = 1) -> None:
    """Launches ``_write_tokens`` on the current stream (arguments: ``kernels.write_tokens``)."""
    num_tokens, heads, head_size = key.shape
    _write_tokens[(num_tokens, heads)](
        pool, units, slot_of, key, value, slots, key.stride(0), value.stride(0), capacity,
        H=heads, BLOCK=pool.shape[2], D=head_size, D_PAD=triton.next_power_of_2(head_size),
        CACHED=units is not None, num_warps=num_warps)


@triton.jit
def _encode_groups(pool, codes, scales, slots, H: tl.constexpr, BLOCK: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
                   HALF: tl.constexpr, TOP: tl.constexpr):
    """The int keys of the 16-token group that ``slots[token]`` closes, for one KV head.

    Grid (tokens, heads); a token that closes no group (or padding) does
    nothing. Reads the group's 16 keys from the pool (after ``_write_tokens``
    on the same stream), per channel: scale = max |k| / HALF (float16), code
    = round half to even of k / scale + HALF, clamped to [0, TOP] (0 where
    the scale is 0), token t at bits [BITS * t, BITS * t + BITS) of a word
    stored as 2 * BITS bytes, least significant first: ``reference.int_key_codes``.
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
def _attend_prompt(query, units, table, out, scale, first, seq_len, num_rows,
                   query_row_stride, out_row_stride, table_stride, G: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Causal attention of BLOCK_M prompt rows of one query head over the request's
    units (flash attention: key tiles of BLOCK_N tokens, online softmax).

    Grid (row tiles, query heads). Row r sits at position ``first + r``; key
    token t of KV head h lies in unit ``table[h, t // BLOCK]`` at ``t % BLOCK``;
    a row sees the tokens at or before its position, below ``seq_len``.
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
    else:  # the dot's operands in the units' type
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
        if IEEE:  # float32 (and the interpreter, whose 16-bit dot is not exact)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
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
    result = acc / running_sum[:, None]
    tl.store(out + rows[:, None].to(tl.int64) * out_row_stride + query_head * D + dims[None, :],
             result.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def attend_prompt(query, units, table, out, *, first: int, seq_len: int, scale: float,
                  block_m: int = 64, block_n: int = 64, num_warps: int = 4) -> None:
    """Launches ``_attend_prompt`` on the current stream (arguments:
    ``kernels.attend_prompt_units``; query, out [T, H_q, D], table [H_kv, MB])."""
    num_rows, num_heads, head_size = query.shape
    _attend_prompt[(triton.cdiv(num_rows, block_m), num_heads)](
        query, units, table, out, scale, first, seq_len, num_rows, query.stride(0),
        out.stride(0), table.stride(0), G=num_heads // table.shape[0], D=head_size,
        D_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK=units.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=query.dtype == torch.float32 or _INTERPRETING,
        num_warps=num_warps)
