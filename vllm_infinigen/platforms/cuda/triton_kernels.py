# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels behind ``kernels.py`` (imported on first launch).

Both read and write pool-shaped units, one KV head's block each:
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
