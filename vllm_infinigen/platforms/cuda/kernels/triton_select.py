# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernels of a device-only selection (imported on first launch).

One sparse layer's selection, with no host read and grids sized by the step's
bounds (rows x KV heads, the selection's static width), so that a decode step
can be captured in a CUDA graph (``selection.py`` holds the dispatch,
``block_rule.py`` the torch references; ``triton_lru.py`` places the selection
in the device block cache). From the bound keys (the default) two launches,
``bound_scores`` (``triton_bounds.py``) and ``select_blocks``; from the int
keys three::

    int_scores     token scores from the int keys, read in place, and each
                   block's best (grid: rows x KV heads, token tiles;
                   ``triton_scoring.py``)
    alpha_counts   per (row, KV head): tokens within alpha of the best
    select_blocks  per (row, KV head): the budget in blocks (alpha count
                   averaged over the row's KV heads, or counted here from
                   the bound keys' unit scores; capped by the budget,
                   plus the sink and recent blocks; every block below
                   ``min_context``), chosen by a threshold search on the
                   block scores (no sort; the row's keys in registers
                   up to RESIDENT_BLOCKS, the threshold found byte by
                   byte from the top), written ascending with their
                   block ids and the tokens the row then attends

Settings that a running engine may change (alpha, budget, min context) are
read from a device tensor, so a captured graph follows them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Constexpr: a jitted function may read no other global.
_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)
# The most blocks of a row whose keys ``select_blocks`` holds in registers (512K
# tokens of 32-token blocks; 256K of 16-token ones).
RESIDENT_BLOCKS = 16384
# The resident search's threshold by four byte histograms (radix select); False: by 33
# halvings, each a reduction over the row (the search before, ``kernel_candidates``
# times both).
RADIX = True


@triton.jit
def _alpha_counts(token_scores, block_scores, context_lens, settings, counts, num_tokens,
                  num_blocks, H: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """counts[row, head] = the row's encoded tokens scoring above best - alpha
    (``settings[0]``), best over its blocks. Grid (rows x KV heads). Alpha off
    (infinite, the default): every encoded token counts (their scores are
    finite), so neither score is read (``_int_scores`` gated by the settings
    has not written the token scores then)."""
    sequence = tl.program_id(0).to(tl.int64)
    encoded = tl.maximum(tl.load(context_lens + sequence // H), 0) // 16 * 16
    alpha = tl.load(settings)
    if alpha == float("inf"):
        tl.store(counts + sequence, encoded.to(tl.int32))
    else:
        lanes = tl.arange(0, CHUNK)
        best = tl.full([CHUNK], float("-inf"), tl.float32)
        for start in range(0, (encoded + BLOCK - 1) // BLOCK, CHUNK):
            index = start + lanes
            best = tl.maximum(best, tl.load(block_scores + sequence * num_blocks + index,
                                            mask=index < num_blocks, other=float("-inf")))
        floor = tl.max(best, axis=0) - alpha.to(tl.float32)
        total = tl.zeros([CHUNK], tl.int32)
        for start in range(0, encoded, CHUNK):
            index = start + lanes
            score = tl.load(token_scores + sequence * num_tokens + index, mask=index < encoded,
                            other=float("-inf"))
            total += (score > floor).to(tl.int32)
        tl.store(counts + sequence, tl.sum(total, axis=0))


def alpha_counts(token_scores, block_scores, context_lens, settings, counts, *,
                 block_size: int, chunk: int = 1024, num_warps: int = 4) -> None:
    """Launches ``_alpha_counts`` (token_scores [S, H, T], block_scores [S, H, MB])."""
    rows, heads, num_tokens = token_scores.shape
    _alpha_counts[(rows * heads,)](token_scores, block_scores, context_lens, settings, counts,
                                   num_tokens, block_scores.shape[-1], H=heads, BLOCK=block_size,
                                   CHUNK=chunk, num_warps=num_warps)


@triton.jit
def _block_keys(scores, index, blocks, sink_blocks, recent_blocks):
    """int64 keys of a row's blocks ``index``, in the order of their float scores:
    forced blocks (the sink and recent ones) first, blocks past the row last
    (never chosen); -0.0 and 0.0 tie."""
    score = tl.load(scores + index, mask=index < blocks, other=0.0)
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where((index < sink_blocks) | (index >= blocks - recent_blocks), _INT32_MAX, key)
    return tl.where(index < blocks, key, _INT32_MIN)


@triton.jit
def _take(beyond, at, tied, ties, taken):
    """A chunk's chosen entries: those ``beyond`` the threshold and, by index, the
    ones ``at`` it while fewer than ``ties`` are taken (``tied`` in earlier
    chunks); (chosen, each one's place after the ``taken`` before)."""
    chosen = beyond | (at & (tied + tl.cumsum(at.to(tl.int32), 0) <= ties))
    return chosen, taken + tl.cumsum(chosen.to(tl.int32), 0) - 1


@triton.jit
def _row_count(counts, context_lens, settings, row, num_units, H: tl.constexpr,
               H_PAD: tl.constexpr, UNIT: tl.constexpr, CHUNK: tl.constexpr):
    """The alpha counts of a row's KV heads, summed (int64): given (UNIT 0: ``counts``
    [S * H] int32, ``alpha_counts``), or counted here from the bound keys' unit scores
    (``counts`` [S, H, num_units] float32, UNIT tokens each): per KV head the units
    scoring above its best minus alpha (``settings[0]``; ``block_rule.
    unit_alpha_counts``). Alpha off (infinite, the default): every complete unit of
    the row counts (their scores are finite), so no score is read; alpha on, each
    (row, KV head) program reads all H heads' scores twice (H times a launch of its
    own per (row, KV head): 4 bytes a unit against the bounds' 2 D)."""
    if UNIT == 0:
        heads = tl.arange(0, H_PAD)
        total = tl.sum(tl.load(counts + row * H + heads, mask=heads < H, other=0).to(tl.int64),
                       axis=0)
    else:
        alpha = tl.load(settings)
        complete = tl.maximum(tl.load(context_lens + row).to(tl.int64), 0) // UNIT
        total = H * tl.minimum(complete, num_units) * UNIT
        if alpha != float("inf"):
            total = tl.full([], 0, tl.int64)
            lanes = tl.arange(0, CHUNK)
            for head in range(H):
                base = counts + (row * H + head).to(tl.int64) * num_units
                best = tl.full([CHUNK], float("-inf"), tl.float32)
                for start in range(0, num_units, CHUNK):
                    index = start + lanes
                    best = tl.maximum(best, tl.load(base + index, mask=index < num_units,
                                                    other=float("-inf")))
                floor = tl.max(best, axis=0) - alpha.to(tl.float32)
                within = tl.zeros([CHUNK], tl.int32)
                for start in range(0, num_units, CHUNK):
                    index = start + lanes
                    values = tl.load(base + index, mask=index < num_units, other=float("-inf"))
                    within += (values > floor).to(tl.int32)
                total += tl.sum(within, axis=0).to(tl.int64) * UNIT
    return total


@triton.jit
def _selection_size(counts, context_lens, settings, row, width, sink_blocks, recent_blocks,
                    num_units, H: tl.constexpr, H_PAD: tl.constexpr, BLOCK: tl.constexpr,
                    UNIT: tl.constexpr, CHUNK: tl.constexpr):
    """(context, the row's blocks, n) of a row: ``_select_blocks``' docstring."""
    context = tl.load(context_lens + row).to(tl.int64)
    blocks = tl.where(context >= 0, tl.maximum(context, 0) // BLOCK + 1, 0)
    summed = _row_count(counts, context_lens, settings, row, num_units, H, H_PAD, UNIT, CHUNK)
    cap = tl.floor(context.to(tl.float64) * tl.load(settings + 1)).to(tl.int64)
    limit = tl.load(settings + 3).to(tl.int64)
    cap = tl.maximum(tl.where(limit > 0, tl.minimum(cap, limit), cap), 1)
    wanted = tl.maximum(tl.minimum(summed // H, cap), 1)
    num_selected = tl.minimum((wanted + BLOCK - 1) // BLOCK
                              + tl.minimum(blocks, sink_blocks + recent_blocks), blocks)
    below = context < tl.load(settings + 2).to(tl.int64)
    num_selected = tl.minimum(tl.where(below, blocks, num_selected), width)
    return context, blocks, num_selected


@triton.jit
def _write_rest(logical, physical, seq_lens, out, num_selected, context, width,
                BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """-1 after the n chosen blocks of a (row, KV head) (its entries from ``out``),
    and the tokens it attends."""
    lanes = tl.arange(0, CHUNK)
    for start in range(0, width, CHUNK):
        index = start + lanes
        pad = (index >= num_selected) & (index < width)
        tl.store(logical + out + index, tl.full([CHUNK], -1, tl.int64), mask=pad)
        tl.store(physical + out + index, tl.full([CHUNK], -1, tl.int64), mask=pad)
    length = tl.where(num_selected > 0,
                      (num_selected - 1) * BLOCK + tl.maximum(context, 0) % BLOCK + 1, 0)
    tl.store(seq_lens + tl.program_id(0), length.to(tl.int32))


@triton.jit
def _select_blocks(block_scores, counts, context_lens, table, settings, logical, physical,
                   seq_lens, num_blocks, table_stride, width, sink_blocks, recent_blocks,
                   num_units, H: tl.constexpr, H_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   UNIT: tl.constexpr, CHUNK: tl.constexpr):
    """One (row, KV head): which of the row's blocks it attends. Grid (rows x KV heads).

    k = max(1, min(floor(mean over the row's KV heads of their alpha counts
    (``_row_count``: given, or counted from the unit scores)),
    max(1, min(floor(budget x context), budget_tokens)))); n = min(ceil(k / BLOCK) + the sink and
    recent blocks, the row's blocks), or every block of a row whose context
    is below ``min_context`` (``settings``: alpha, budget, min_context,
    budget_tokens, 0 for none). The
    n blocks with the best keys (``_block_keys``; ties: the lower index) come out
    ascending in ``logical`` and, through the table, ``physical``; -1 after.
    A row with a negative context (padding) selects nothing (seq_len 0).
    """
    sequence = tl.program_id(0).to(tl.int64)
    row = sequence // H
    context, blocks, num_selected = _selection_size(counts, context_lens, settings, row, width,
                                                    sink_blocks, recent_blocks, num_units, H,
                                                    H_PAD, BLOCK, UNIT, CHUNK)
    lanes = tl.arange(0, CHUNK)
    scores = block_scores + sequence * num_blocks
    # The n-th best key: the largest t with count(key >= t) >= n (bisection).
    low = tl.full([], _INT32_MIN, tl.int64)
    high = tl.full([], _INT32_MAX, tl.int64) + 1
    if num_selected < blocks:
        for _ in range(33):
            middle = (low + high) >> 1
            above = 0
            for start in range(0, blocks, CHUNK):
                index = start + lanes
                key = _block_keys(scores, index, blocks, sink_blocks, recent_blocks)
                above += tl.sum((key >= middle).to(tl.int32), axis=0)
            enough = above >= num_selected
            low = tl.where(enough, middle, low)
            high = tl.where(enough, high, middle)
    greater = 0
    for start in range(0, blocks, CHUNK):
        index = start + lanes
        key = _block_keys(scores, index, blocks, sink_blocks, recent_blocks)
        greater += tl.sum(((key > low) & (index < blocks)).to(tl.int32), axis=0)
    ties = num_selected - greater
    taken = 0
    tied = 0
    out = sequence * width
    for start in range(0, blocks, CHUNK):
        index = start + lanes
        in_row = index < blocks
        key = _block_keys(scores, index, blocks, sink_blocks, recent_blocks)
        equal = in_row & (key == low)
        chosen, place = _take(in_row & (key > low), equal, tied, ties, taken)
        block_id = tl.load(table + row * table_stride + index, mask=chosen, other=0)
        tl.store(logical + out + place, index.to(tl.int64), mask=chosen)
        tl.store(physical + out + place, block_id.to(tl.int64), mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        tied += tl.sum(equal.to(tl.int32), axis=0)
    _write_rest(logical, physical, seq_lens, out, num_selected, context, width, BLOCK,
                CHUNK)


@triton.jit
def _nth_largest(key, in_row, n):
    """The n-th largest of the row's keys (1 <= n <= their count; int64 in
    [INT32_MIN, INT32_MAX]) by its four bytes from the top: each pass one
    256-bin histogram of the keys that share the bytes found so far."""
    unsigned = key - _INT32_MIN  # 0 .. 2^32 - 1, in the keys' order
    digits = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)
    above = tl.full([], 0, tl.int32)  # keys past the prefix's range
    for byte in tl.static_range(4):
        shift = 24 - 8 * byte
        sharing = in_row & ((unsigned >> (shift + 8)) == prefix)
        counts = tl.histogram(((unsigned >> shift) & 255).to(tl.int32), 256, mask=sharing)
        at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts
        digit = tl.max(tl.where(above + at_or_above >= n, digits, -1), axis=0)
        above += tl.sum(tl.where(digits > digit, counts, 0), axis=0)
        prefix = prefix * 256 + digit
    return prefix + _INT32_MIN


@triton.jit
def _select_resident(block_scores, counts, context_lens, table, settings, logical, physical,
                     seq_lens, num_blocks, table_stride, width, sink_blocks, recent_blocks,
                     num_units, H: tl.constexpr, H_PAD: tl.constexpr, BLOCK: tl.constexpr,
                     UNIT: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_PAD: tl.constexpr,
                     RADIX: tl.constexpr):
    """``_select_blocks`` with the row's keys read once and held in registers
    (num_blocks <= BLOCKS_PAD): each pass of the threshold search is one sum
    over them (RADIX: four byte histograms instead of 33 halvings), the choice
    one prefix sum. Grid (rows x KV heads)."""
    sequence = tl.program_id(0).to(tl.int64)
    row = sequence // H
    context, blocks, num_selected = _selection_size(counts, context_lens, settings, row, width,
                                                    sink_blocks, recent_blocks, num_units, H,
                                                    H_PAD, BLOCK, UNIT, CHUNK)
    index = tl.arange(0, BLOCKS_PAD)
    in_row = index < blocks
    key = _block_keys(block_scores + sequence * num_blocks, index, blocks, sink_blocks,
                      recent_blocks)  # [BLOCKS_PAD] int64
    low = tl.full([], _INT32_MIN, tl.int64)
    high = tl.full([], _INT32_MAX, tl.int64) + 1
    if num_selected < blocks:
        if RADIX:
            low = _nth_largest(key, in_row, num_selected)
        else:
            for _ in range(33):
                middle = (low + high) >> 1
                enough = tl.sum((key >= middle).to(tl.int32), axis=0) >= num_selected
                low = tl.where(enough, middle, low)
                high = tl.where(enough, high, middle)
    beyond = in_row & (key > low)
    ties = num_selected - tl.sum(beyond.to(tl.int32), axis=0)
    chosen, place = _take(beyond, in_row & (key == low), 0, ties, 0)
    block_id = tl.load(table + row * table_stride + index, mask=chosen, other=0)
    out = sequence * width
    tl.store(logical + out + place, index.to(tl.int64), mask=chosen)
    tl.store(physical + out + place, block_id.to(tl.int64), mask=chosen)
    _write_rest(logical, physical, seq_lens, out, num_selected, context, width, BLOCK, CHUNK)


def select_blocks(block_scores, counts, context_lens, table, settings, logical, physical,
                  seq_lens, *, block_size: int, sink_blocks: int, recent_blocks: int,
                  unit: int = 0, chunk: int = 1024, num_warps: int | None = None,
                  resident: int = RESIDENT_BLOCKS, radix: bool | None = None) -> None:
    """Launches ``_select_resident`` when a row's blocks fit ``resident`` (a power of
    two; 0: never), else ``_select_blocks`` (logical, physical: [S, H, W] int64).
    counts: [S * H] int32 alpha counts, or with ``unit`` (tokens per unit) the bound
    keys' unit scores [S, H, N] float32, counted in the same launch (``_row_count``);
    num_warps: None picks by the blocks (4 for the chunked kernel); radix: the
    resident kernel's byte-wise search, None: ``RADIX``."""
    rows, heads, num_blocks = block_scores.shape
    num_units = counts.shape[-1] if unit else 0
    padded = triton.next_power_of_2(max(num_blocks, 16))
    kernel, extra, warps = _select_blocks, {}, 4
    if padded <= resident:
        kernel, extra = _select_resident, {"BLOCKS_PAD": padded,
                                           "RADIX": RADIX if radix is None else radix}
        warps = 4 if padded <= 1024 else 8  # 8: 0.051 ms at 8193 blocks on an H200
    kernel[(rows * heads,)](
        block_scores, counts, context_lens, table, settings, logical, physical, seq_lens,
        num_blocks, table.stride(0), logical.shape[-1], sink_blocks, recent_blocks, num_units,
        H=heads, H_PAD=triton.next_power_of_2(heads), BLOCK=block_size, UNIT=unit,
        CHUNK=chunk, **extra, num_warps=num_warps or warps)
