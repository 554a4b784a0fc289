# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels behind ``units.py`` (imported on first launch).

    gather_units   missing blocks, pinned pool -> device block cache, one
                   fetch list per KV head with its count on the device
    write_tokens   a step's K|V written through to the pinned pool and into
                   the cached copies of their blocks
    encode_groups  the int speculation keys of the groups a step closes

The decode attention over cached units is in ``triton_attend.py``, the
prompts' flash attention in ``triton_prompt.py``, the selection's kernels in
``triton_select.py``.

They read and write pool-shaped units, one KV head's block each:
[block_size, 2 * D], a token's K | V side by side, in the model's dtype or
FP8 (``--kv-cache-dtype fp8``: K / key_scale and V / value_scale, written
rounded to nearest and saturating by ``_round_fp8``, widened to the query's
16-bit type inside the attention, the scales multiplied back there). The pool is read through
its UVA pointer (pinned host memory passed as a kernel argument: Triton's
launcher resolves the device address), so one kernel moves every missing
block of a layer. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) they run on CPU tensors, as the unit tests do.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (CI) computes 16-bit dots inexactly: products in float32 there.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def fp8_format(dtype: torch.dtype) -> dict[str, float]:
    """``_round_fp8``'s constexprs for a pool of ``dtype`` (FP8_M = 0: not FP8):
    mantissa bits, smallest normal exponent and largest finite value, from
    torch's ``finfo`` (e4m3fn: 3, -6, 448; e5m2: 2, -14, 57344)."""
    if dtype.itemsize != 1:
        return {"FP8_M": 0, "FP8_EMIN": 0, "FP8_MAX": 0.0}
    info = torch.finfo(dtype)
    return {"FP8_M": -math.frexp(info.eps)[1] + 1,
            "FP8_EMIN": math.frexp(info.smallest_normal)[1] - 1, "FP8_MAX": info.max}


@triton.jit
def _round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (as torch and the CPU
    kernels round), in float32 arithmetic that every backend computes alike."""
    whole = tl.floor(x)
    frac = x - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole)


@triton.jit
def _round_fp8(x, M: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
    """float32 ``x`` rounded to nearest even on the grid of an FP8 format (M
    mantissa bits, smallest normal exponent EMIN), saturated at +-MAX: a value
    the format holds exactly, so that the conversion after it cannot round,
    whatever the backend's rounding (the interpreter's is not to nearest).
    Equals torch's conversion of ``x`` clamped to +-MAX, -0 included."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.minimum(tl.abs(x), MAX)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    quantum = ((exponent - M + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent + M) << 23).to(tl.float32, bitcast=True)
    steps = magnitude * inverse  # exact: a power of two
    rounded = tl.minimum(_round_half_even(steps) * quantum, MAX)
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32,
                                                                             bitcast=True)


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
def _write_tokens(pool, units, slot_of, key, value, slots, key_row_stride, value_row_stride,
                  capacity, key_inverse, value_inverse, H: tl.constexpr, BLOCK: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, POOL: tl.constexpr,
                  CACHED: tl.constexpr, FP8_M: tl.constexpr, FP8_EMIN: tl.constexpr,
                  FP8_MAX: tl.constexpr):
    """Token ``slots[token]``'s K|V of one KV head: with POOL, into its pool row
    (the write-through, through the pinned pool's UVA pointer) and, with CACHED,
    into its block's cached copy when the cache holds that block
    (``slot_of``). Grid (tokens, heads); padding (slot < 0) is skipped.
    An FP8 pool (FP8_M > 0) takes K x key_inverse and V x value_inverse
    rounded by ``_round_fp8``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slots + token)
    if slot >= 0:
        dims = tl.arange(0, D_PAD)
        ok = dims < D
        k = tl.load(key + token * key_row_stride + head * D + dims, mask=ok)
        v = tl.load(value + token * value_row_stride + head * D + dims, mask=ok)
        if FP8_M > 0:
            k = _round_fp8(k.to(tl.float32) * key_inverse, FP8_M, FP8_EMIN, FP8_MAX)
            v = _round_fp8(v.to(tl.float32) * value_inverse, FP8_M, FP8_EMIN, FP8_MAX)
        block = slot // BLOCK
        offset = slot % BLOCK
        if POOL:
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
                 key_scale: float = 1.0, value_scale: float = 1.0,
                 num_warps: int = 1) -> None:
    """Launches ``_write_tokens`` on the current stream (arguments: ``kernels.write_tokens``;
    ``pool`` None: the cached copies alone, ``kernels.write_cached_tokens``)."""
    num_tokens, heads, head_size = key.shape
    target = pool if pool is not None else units
    _write_tokens[(num_tokens, heads)](
        target, units, slot_of, key, value, slots, key.stride(0), value.stride(0), capacity,
        1.0 / key_scale, 1.0 / value_scale, H=heads, BLOCK=target.shape[-2], D=head_size,
        D_PAD=triton.next_power_of_2(head_size), POOL=pool is not None,
        CACHED=units is not None, num_warps=num_warps, **fp8_format(target.dtype))


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
        rounded = tl.minimum(tl.maximum(_round_half_even(scaled), 0.0), TOP)
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
