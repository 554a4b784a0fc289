# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernel placing a selection in the device block
cache (imported on first launch; ``selection.place_lru`` dispatches, ``reference.py``
holds its torch reference).

    lookup_lru   per KV head: hits, the least recently used victims for the misses,
                 the cache's maps updated, the fetch list and the counters

The victims are the ``misses`` slots with the oldest last-use ticks among those
not used in this step. They are found by narrowing a range of ticks that holds
the threshold: each pass over the head's slots counts their ticks in BINS parts
of the range (one ``tl.histogram`` of their distance above it, shifted) and
keeps the part where the count reaches the misses, so a pass divides the range
by about BINS. A server's ticks grow with its steps: a halving search (the
kernel before compared each slot with the middle) makes log2(steps) passes, 7
at 100 steps and 17 at 100,000; BINS = 64 makes 2 and 3.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from vllm_infinigen.platforms.cuda.kernels.triton_select import _take

# A miss's claim on its block in ``slot_of`` (int32): CLAIM + entry, below -1.
CLAIM = tl.constexpr(-(2**31))
SEARCH_BINS = 64  # ranges per pass of the victims' search (a power of two >= 2; 0: halving)
# Slots (or entries) a loop step and warps: every pass over a head's slots is serial.
CHUNK, WARPS = 1024, 4


@triton.jit
def _oldest_ticks(used, tick, capacity, misses, BINS: tl.constexpr, ROUNDS: tl.constexpr,
                  CHUNK: tl.constexpr):
    """(V, older) over ``used[:capacity]``'s ticks not equal to ``tick`` (the slots
    not used in this step): V the smallest tick with at least ``misses`` of them at
    or below it, ``older`` how many are below it. Needs misses <= their count.

    Each pass bins the ticks in (low, high] by their distance above low shifted
    right (no division), the shift the least that leaves BINS bins: the range's
    bit length drops by log2(BINS) a pass, so ROUNDS = ceil(63 / log2(BINS)) + 1
    passes finish any tick below 2^62. BINS = 0: each pass halves the range by
    comparing each slot with its middle (the kernel before; no histogram)."""
    lanes = tl.arange(0, CHUNK)
    low = tl.full([], -2, tl.int64)  # free slots hold -1: none at or below low
    high = tick - 1  # every eligible slot at or below high
    below = tl.full([], 0, tl.int32)  # eligible slots at or below low
    if BINS == 0:
        for _ in range(ROUNDS):
            if high - low > 1:
                middle = (low + high) >> 1
                count = tl.full([], 0, tl.int32)
                for start in range(0, capacity, CHUNK):
                    slot = start + lanes
                    key = tl.load(used + slot, mask=slot < capacity, other=tick)
                    count += tl.sum(((key != tick) & (key <= middle)).to(tl.int32), axis=0)
                enough = count >= misses
                below = tl.where(enough, below, count)
                low = tl.where(enough, low, middle)
                high = tl.where(enough, middle, high)
    else:
        bins = tl.arange(0, BINS)
        for _ in range(ROUNDS):
            if high - low > 1:
                shift = tl.full([], 0, tl.int64)
                while ((high - low - 1) >> shift) >= BINS:
                    shift += 1
                counts = tl.zeros([BINS], tl.int32)
                for start in range(0, capacity, CHUNK):
                    slot = start + lanes
                    key = tl.load(used + slot, mask=slot < capacity, other=tick)
                    inside = (key != tick) & (key > low) & (key <= high)
                    part = tl.where(inside, (key - low - 1) >> shift, 0).to(tl.int32)
                    counts += tl.histogram(part, BINS, mask=inside)
                # eligible slots at or below low + (bin + 1) << shift, each bin
                reached = below + tl.cumsum(counts, 0)
                first = tl.min(tl.where(reached >= misses, bins, BINS), axis=0)
                below += tl.sum(tl.where(bins < first, counts, 0), axis=0)
                high = tl.minimum(low + ((first + 1).to(tl.int64) << shift), high)
                low = low + (first.to(tl.int64) << shift)
    return high, below


@triton.jit
def _lookup_lru(ids, slots, slot_of, block_of, last_used, ticks, victims, fetch_units,
                fetch_slots, num_fetch, counters, seq_lens, context_lens, num_rows, width,
                capacity, H: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                ROUNDS: tl.constexpr):
    """One KV head's selection placed in its cache (LRU). Grid (KV heads).

    Entries ``ids[s, head, w]`` (block ids, -1: none). A block may repeat across
    rows (a prefix-cache hit's blocks, shared): the first copy of a miss in entry
    order claims it (an atomic minimum of ``CLAIM`` + entry in its ``slot_of``,
    below -1: still uncached to a later look) and is the miss; a later copy takes
    its slot and counts as a hit. A hit refreshes its slot's tick; the misses, in
    entry order, take the free or least recently used slots not hit in this
    step, in slot order (ties: the lower slot), and are listed for the gather; a
    victim's old block is unmapped where its map names the victim.
    ``counters[head]`` += (entries attended besides the rows' own, context
    tokens (head 0), hits, misses).
    """
    head = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    tick = tl.load(ticks + head) + 1
    tl.store(ticks + head, tick)
    used = last_used + head * (capacity + 1)
    owner = block_of + head * (capacity + 1)
    total = num_rows * width
    hits = tl.full([], 0, tl.int32)
    misses = tl.full([], 0, tl.int32)
    for start in range(0, total, CHUNK):
        entry = start + lanes
        live = entry < total
        at = ((entry // width) * H + head) * width + entry % width
        block_id = tl.load(ids + at, mask=live, other=-1).to(tl.int64)
        wanted = live & (block_id >= 0)
        cached = tl.load(slot_of + block_id * H + head, mask=wanted, other=-1).to(tl.int64)
        hit = wanted & (cached >= 0)
        miss = wanted & (cached < 0)
        tl.atomic_min(slot_of + block_id * H + head, (entry + CLAIM).to(tl.int32), mask=miss)
        tl.store(used + cached, tick, mask=hit)
        tl.store(slots + at, tl.where(hit, head * capacity + cached, tl.where(miss, -2, -1)),
                 mask=live)
        hits += tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()
    for start in range(0, total, CHUNK):  # the claims' losers: later copies (-3)
        entry = start + lanes
        live = entry < total
        at = ((entry // width) * H + head) * width + entry % width
        miss = tl.load(slots + at, mask=live, other=-1) == -2
        block_id = tl.load(ids + at, mask=miss, other=0).to(tl.int64)
        claim = tl.load(slot_of + block_id * H + head, mask=miss, other=0)
        first = miss & (claim == (entry + CLAIM).to(tl.int32))
        tl.store(slots + at, tl.full([CHUNK], -3, tl.int64), mask=miss & ~first)
        hits += tl.sum((miss & ~first).to(tl.int32), axis=0)
        misses += tl.sum(first.to(tl.int32), axis=0)
    tl.debug_barrier()
    if misses > 0:
        high, older = _oldest_ticks(used, tick, capacity, misses, BINS, ROUNDS, CHUNK)
        ties = misses - older
        taken = 0
        tied = 0
        for start in range(0, capacity, CHUNK):
            slot = start + lanes
            key = tl.load(used + slot, mask=slot < capacity, other=tick)
            equal = (key != tick) & (key == high)
            chosen, place = _take((key != tick) & (key < high), equal, tied, ties, taken)
            tl.store(victims + head * total + place, slot.to(tl.int64), mask=chosen)
            taken += tl.sum(chosen.to(tl.int32), axis=0)
            tied += tl.sum(equal.to(tl.int32), axis=0)
    tl.debug_barrier()
    ranked = 0
    for start in range(0, total, CHUNK):
        entry = start + lanes
        live = entry < total
        at = ((entry // width) * H + head) * width + entry % width
        miss = tl.load(slots + at, mask=live, other=-1) == -2
        rank = ranked + tl.cumsum(miss.to(tl.int32), 0) - 1
        victim = tl.load(victims + head * total + rank, mask=miss, other=0)
        block_id = tl.load(ids + at, mask=miss, other=0).to(tl.int64)
        old = tl.load(owner + victim, mask=miss, other=-1)
        names = tl.load(slot_of + old * H + head, mask=miss & (old >= 0), other=-1)
        tl.store(slot_of + old * H + head, tl.full([CHUNK], -1, tl.int32),
                 mask=miss & (old >= 0) & (names.to(tl.int64) == victim))
        tl.store(slot_of + block_id * H + head, victim.to(tl.int32), mask=miss)
        tl.store(owner + victim, block_id, mask=miss)
        tl.store(used + victim, tick, mask=miss)
        tl.store(slots + at, head * capacity + victim, mask=miss)
        tl.store(fetch_units + head * total + rank, block_id * H + head, mask=miss)
        tl.store(fetch_slots + head * total + rank, head * capacity + victim, mask=miss)
        ranked += tl.sum(miss.to(tl.int32), axis=0)
    tl.store(num_fetch + head, misses.to(tl.int64))
    tl.debug_barrier()
    for start in range(0, total, CHUNK):  # the later copies: their first's slot
        entry = start + lanes
        live = entry < total
        at = ((entry // width) * H + head) * width + entry % width
        copy = tl.load(slots + at, mask=live, other=-1) == -3
        block_id = tl.load(ids + at, mask=copy, other=0).to(tl.int64)
        slot = tl.load(slot_of + block_id * H + head, mask=copy, other=0).to(tl.int64)
        tl.store(slots + at, head * capacity + slot, mask=copy)
    attended = tl.zeros([], tl.int64)  # a loop-carried variable keeps its type
    context = tl.zeros([], tl.int64)
    for start in range(0, num_rows, CHUNK):
        row = start + lanes
        live = row < num_rows
        length = tl.load(seq_lens + row * H + head, mask=live, other=0).to(tl.int64)
        attended += tl.sum(tl.maximum(length - 1, 0), axis=0)
        before = tl.load(context_lens + row, mask=live, other=0).to(tl.int64)
        context += tl.sum(tl.maximum(before, 0), axis=0)
    counter = counters + head * 4
    tl.store(counter, tl.load(counter) + attended)
    tl.store(counter + 1, tl.load(counter + 1) + tl.where(head == 0, context, 0))
    tl.store(counter + 2, tl.load(counter + 2) + hits)
    tl.store(counter + 3, tl.load(counter + 3) + misses)


def lookup_lru(ids, slots, slot_of, block_of, last_used, ticks, victims, fetch_units,
               fetch_slots, num_fetch, counters, seq_lens, context_lens, *, capacity: int,
               chunk: int = CHUNK, num_warps: int = WARPS, bins: int = SEARCH_BINS) -> None:
    """Launches ``_lookup_lru`` (ids, slots: [S, H, W] int64; ``bins``: the victims'
    search, a power of two >= 2, or 0: halving by comparison, the kernel before)."""
    if bins != 0 and (bins < 2 or bins & (bins - 1)):
        raise ValueError(f"the victims' search needs 0 or a power of two >= 2 bins, got {bins}")
    rows, heads, width = ids.shape
    _lookup_lru[(heads,)](ids, slots, slot_of, block_of, last_used, ticks, victims,
                          fetch_units, fetch_slots, num_fetch, counters, seq_lens, context_lens,
                          rows, width, capacity, H=heads, CHUNK=chunk, BINS=bins,
                          ROUNDS=math.ceil(63 / math.log2(bins or 2)) + 1,
                          num_warps=num_warps)
