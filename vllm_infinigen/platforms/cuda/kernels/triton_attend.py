# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the Triton kernel of the decode attention over cached units (imported on first launch).

    attend_units   each (row, KV head)'s query group over the units of its
                   table, the blocks split across programs (flash-decoding),
                   the splits merged into the caller's rows by the last of a
                   sequence's programs to finish (one launch; FUSED_MERGE off:
                   by a second launch, ``_merge_splits``, the form before)

The last split merges: each program writes its split's unnormalised output,
running max and sum, then counts itself in the sequence's arrival counter
(an atomic add, acquire-release at GPU scope, after a barrier that orders
every thread's stores before it, as a CUTLASS semaphore does); the program
that counts last reads every split's (past L1: ``.cg``), writes the row and
sets the counter back to 0 for the next launch. The counters (``arrivals``)
are one int32 per sequence, kept per device and zero between launches, so
launches share them in stream order: one stream attends at a time (the
compute stream). A sequence of one split writes its row at once.

Units: ``units.py``'s [block_size, 2 * D], K | V per token, in the model's
dtype or FP8 (widened to the query's 16-bit type inside, ``key_scale`` in
``scale``, ``value_scale`` on the output). ``triton_prompt.py`` shares the
tile's scores (``_tile_scores``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_infinigen.platforms.cuda.kernels.triton_units import _INTERPRETING

TOKENS_PER_STEP = 64  # K|V tokens loaded per loop step (4 blocks of 16)
# The last split merges (one launch); False: a second launch merges (the form before).
FUSED_MERGE = True
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
# Counters outgrown, never freed: a graph captured before still counts in them.
_RETIRED: list[torch.Tensor] = []
_MIN_ARRIVALS = 1 << 16  # counters made at first use: 8,192 rows of 8 KV heads


@triton.jit
def _tile_scores(q, k, v, scale, IEEE: tl.constexpr, FP8: tl.constexpr):
    """(q . k^T x scale, v) of one key tile, the dots' operands as the attention
    kernels take them: float32 with IEEE (and the interpreter, whose 16-bit dot
    is not exact), FP8 units widened to the query's 16-bit type, else as loaded."""
    if IEEE:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale
    return scores, v


def _ieee(query: torch.Tensor, units: torch.Tensor) -> bool:
    """Whether the attention's dots run in float32: float32 units, FP8 units
    under a float32 query, and the interpreter (whose 16-bit dot is inexact)."""
    return (_INTERPRETING or units.dtype == torch.float32
            or (units.element_size() == 1 and query.dtype == torch.float32))


@triton.jit
def _merge(partial, maxima, sums, out, out_row_stride, sequence, num_splits, H: tl.constexpr,
           G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
           CACHE: tl.constexpr):
    """The softmax-weighted output of ``sequence`` from its splits, into the
    caller's row (``out[row, head * G:(head + 1) * G]``); 0 for an empty sequence
    (a padding row). CACHE: the loads' cache modifier (".cg" for splits other
    programs of the launch wrote)."""
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < G
    mask = head_ok[:, None] & (dims < D)[None, :]
    best = tl.full([G_PAD], float("-inf"), tl.float32)
    for split in range(num_splits):
        slot = sequence * num_splits + split
        best = tl.maximum(best, tl.load(maxima + slot * G + heads, mask=head_ok,
                                        other=float("-inf"), cache_modifier=CACHE))
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for split in range(num_splits):
        slot = sequence * num_splits + split
        peak = tl.load(maxima + slot * G + heads, mask=head_ok, other=float("-inf"),
                       cache_modifier=CACHE)
        weight = tl.where(peak > float("-inf"), tl.exp(peak - best), 0.0)
        total += weight * tl.load(sums + slot * G + heads, mask=head_ok, other=0.0,
                                  cache_modifier=CACHE)
        acc += weight[:, None] * tl.load(partial + (slot * G + heads[:, None]) * D + dims[None, :],
                                         mask=mask, other=0.0, cache_modifier=CACHE)
    _store_row(out, out_row_stride, sequence, acc, total, H, G, G_PAD, D, D_PAD)


@triton.jit
def _store_row(out, out_row_stride, sequence, acc, total, H: tl.constexpr, G: tl.constexpr,
               G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """``acc / total`` (0 where total is 0: an empty sequence) into the caller's row of
    ``sequence`` (``out[row, head * G:(head + 1) * G]``)."""
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    result = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    row = out + (sequence // H) * out_row_stride + (sequence % H) * G * D
    tl.store(row + heads[:, None] * D + dims[None, :], result.to(out.dtype.element_ty),
             mask=(heads < G)[:, None] & (dims < D)[None, :])


@triton.jit
def _attend_units(query, units, table, seq_lens, partial, maxima, sums, out, arrivals, scale,
                  value_scale, query_row_stride, table_stride, out_row_stride, blocks_per_split,
                  H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK: tl.constexpr, UNITS: tl.constexpr,
                  IEEE: tl.constexpr, FP8: tl.constexpr, MERGE: tl.constexpr):
    """One decode query group over one sequence's units, one split of its blocks.

    Grid (sequences, splits); sequence i is (row i // H, KV head i % H), whose
    G query heads are ``query[row, head * G:(head + 1) * G]``, padded to G_PAD
    (>= 16) rows so that both products run on the tensor cores. UNITS units
    (UNITS x BLOCK tokens) are read per step: K and V tiles loaded once for
    the G heads. Writes the split's unnormalised output, running max and sum
    (flash-decoding); MERGE: the last of the sequence's programs merges them
    into ``out`` (the module's docstring), else ``_merge_splits`` does. A split
    past the sequence reads nothing. FP8 units widen to the query's 16-bit type
    (or float32 with IEEE); ``scale`` carries the key scale, the output is
    multiplied by ``value_scale``.
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
    elif not FP8:  # the dot's operands in the units' 16-bit type (a float32 query too)
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
        scores, v = _tile_scores(q, k, v, scale, IEEE, FP8)  # [G_PAD, UNITS * BLOCK]
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
    acc = acc * value_scale
    if MERGE:
        if num_splits == 1:  # the row at once (as the merge of one split gives it)
            _store_row(out, out_row_stride, sequence, acc, running_sum, H, G, G_PAD, D, D_PAD)
        else:
            _store_split(partial, maxima, sums, sequence * num_splits + split, acc,
                         running_max, running_sum, G, G_PAD, D, D_PAD)
            tl.debug_barrier()  # every thread's stores, before the one arrival (CTA order)
            arrived = tl.atomic_add(arrivals + sequence, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last: every other split has landed
                tl.debug_barrier()  # (the branch is the CTA's: one arrival, broadcast)
                _merge(partial, maxima, sums, out, out_row_stride, sequence, num_splits, H, G,
                       G_PAD, D, D_PAD, ".cg")
                tl.atomic_xchg(arrivals + sequence, 0, sem="relaxed", scope="gpu")
    else:
        _store_split(partial, maxima, sums, sequence * num_splits + split, acc, running_max,
                     running_sum, G, G_PAD, D, D_PAD)


@triton.jit
def _store_split(partial, maxima, sums, slot, acc, running_max, running_sum, G: tl.constexpr,
                 G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """A split's unnormalised output, running max and sum, at ``slot`` (sequence x
    splits + split)."""
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < G
    tl.store(partial + (slot * G + heads[:, None]) * D + dims[None, :], acc,
             mask=head_ok[:, None] & (dims < D)[None, :])
    tl.store(maxima + slot * G + heads, running_max, mask=head_ok)
    tl.store(sums + slot * G + heads, running_sum, mask=head_ok)


@triton.jit
def _merge_splits(partial, maxima, sums, out, out_row_stride, num_splits, H: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """``_merge`` of each sequence, in a launch of its own (FUSED_MERGE off).
    Grid (sequences)."""
    _merge(partial, maxima, sums, out, out_row_stride, tl.program_id(0).to(tl.int64),
           num_splits, H, G, G_PAD, D, D_PAD, "")


def arrivals(device: torch.device, count: int) -> torch.Tensor:
    """The fused merge's [>= count] int32 arrival counters on ``device`` (zero
    between launches), made at first use: a CUDA graph's capture cannot make
    them (its memset would run only when the graph replays). Outgrown counters
    are kept (``_RETIRED``): the graphs captured before count in them.

    Raises:
        RuntimeError: If a capture needs more than the counters made before it.
    """
    if device.type == "cuda" and device.index is None:  # one key per GPU ("cuda" is "cuda:N")
        device = torch.device("cuda", torch.cuda.current_device())
    held = _ARRIVALS.get(device)
    if held is None or held.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attend_units: {count} sequences in a CUDA graph's capture, "
                               f"beyond the {0 if held is None else held.numel()} arrival "
                               "counters made before it; attend once eagerly first")
        if held is not None:
            _RETIRED.append(held)
        held = _ARRIVALS[device] = torch.zeros(max(count, _MIN_ARRIVALS), dtype=torch.int32,
                                               device=device)
    return held


def attend_units(query, units, table, seq_lens, out, partial, out_max, out_sum, *,
                 num_kv_heads: int, scale: float, blocks_per_split: int,
                 value_scale: float = 1.0, num_warps: int = 4,
                 tokens_per_step: int = TOKENS_PER_STEP, num_stages: int | None = None,
                 fused_merge: bool | None = None) -> None:
    """Launches ``_attend_units`` on the current stream, and ``_merge_splits``
    after it unless the last split merges (``fused_merge``, None: FUSED_MERGE)
    (arguments: ``kernels.attend_units``; query, out [S, H_q, D] with unit strides
    but the row's; partial [N, splits, G, D]; num_stages: Triton's software
    pipelining of the loop, None its default)."""
    num_sequences, num_splits, group, head_size = partial.shape
    fused = FUSED_MERGE if fused_merge is None else fused_merge
    block_size = units.shape[1]
    common = {"H": num_kv_heads, "G": group, "D": head_size}
    stages = {} if num_stages is None else {"num_stages": num_stages}
    counters = arrivals(query.device, num_sequences) if fused else out_max  # (unread)
    _attend_units[(num_sequences, num_splits)](
        query, units, table, seq_lens, partial, out_max, out_sum, out, counters, scale,
        value_scale, query.stride(0), table.stride(0), out.stride(0), blocks_per_split,
        BLOCK=block_size, UNITS=max(1, tokens_per_step // block_size),
        G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=max(16, triton.next_power_of_2(head_size)),
        IEEE=_ieee(query, units), FP8=units.element_size() == 1, MERGE=fused,
        num_warps=num_warps, **stages, **common)
    if not fused:
        _merge_splits[(num_sequences,)](partial, out_max, out_sum, out, out.stride(0),
                                        num_splits, G_PAD=triton.next_power_of_2(group),
                                        D_PAD=triton.next_power_of_2(head_size),
                                        num_warps=num_warps, **common)
