# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform (pure torch, any device): InfiniGen's selection in blocks.

On a GPU the unit that crosses PCIe is one KV head's block (16 tokens x K|V:
8 KiB in bf16 at D = 128; smaller units lose bandwidth, see
shared/docs/GPU_DATA_PATH.md), so the rule keeps whole blocks. Here in torch:
the references of ``selection.py``'s ops (what they run off CUDA, what the
tests hold the Triton kernels to) and the host-side form the accuracy
studies run::

    int_token_scores      speculated score of every context token from the int
                          keys (every channel in a few bits, one scale per
                          channel and 16-token group), best over the query
                          heads of each KV head (``int_scores``)
    partial_token_scores  the same from the paper's partial query x partial keys
                          (``--infinigen-speculation-keys partial``)
    block_scores          the best token score of each block
    bound_unit_scores     each complete unit's upper bound of q . k from the
                          bound keys (the default; Quest's), best over the
                          query heads (``bound_scores``), and
      unit_block_scores   each block's best unit
    alpha_counts_reference, unit_alpha_counts
                          the paper's count per (row, KV head), over tokens
                          or units (``alpha_counts``, ``select``'s own)
    select_reference      the device rule over a settings tensor (``select``)
    alpha_token_caps,     the host-side rule: per row, the budget in tokens
      select_blocks       rounded up to blocks, plus the sink blocks and the
                          recent blocks (the row's own block always among
                          them); each KV head keeps its own top blocks

Blocks are numbered per row (logical: block j holds positions j*block_size ..
(j+1)*block_size - 1); ``physical_block_ids`` maps them through the row's
block table. A row with ``context_len`` tokens before its own has
``context_len // block_size + 1`` blocks, the last one holding its own token.
No ``.item()``: every bound a shape needs comes from the host side
(``widths.py``), once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_infinigen.layout import KEY_GROUP

_NEG_INF = float("-inf")
_POS_INF = float("inf")
_BIG = 1 << 62


@dataclass(frozen=True)
class BlockSelection:
    """The blocks one sparse layer attends to, for a step's selecting rows.

    ``logical[s, h]`` lists row s's selected blocks for KV head h, ascending,
    then -1; the row's own block (its highest) is always the last valid one.
    """

    logical: torch.Tensor  # [S, H_kv, W] int64 block index within the row, -1 padded
    num_selected: torch.Tensor  # [S] int64 blocks kept per KV head


def num_row_blocks(context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S] blocks of each row, its own token's block included."""
    return context_lens.to(torch.int64) // block_size + 1


# -- scores


def int_token_scores(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                     compute_dtype: torch.dtype = torch.float32,
                     operands: torch.dtype | None = torch.float16) -> torch.Tensor:
    """Speculated scores of the tokens of every block in the rows' tables, from
    the int keys (the layout ``write_int_keys`` stores, CPU and CUDA alike).

    Token t of a group's channel c holds code[c, t] in bits [bits * t, bits * t
    + bits) of the channel's 2 * bits bytes; its key is (code - half) x
    scale[c], half = (2^bits - 1) / 2. A row's open group (its context ends
    inside it: not encoded yet) scores -inf: it lies in the row's own block,
    which the block rule always keeps, so no score of it is needed there (the
    alpha count leaves its at most 15 tokens out). On CUDA (float32) one Triton
    kernel reads the codes in place (``triton_scoring.int_scores``);
    elsewhere this torch form materializes the dequantized keys of the rows'
    blocks (the kernel's reference). The keys are dequantized in float32 and,
    as the kernel's product takes them, rounded with the query to
    ``operands`` (float16: ~5e-4 of each, far below the codes' own step).

    Args:
        query: [S, H_kv, G, D] the target layer's query (G query heads per KV head).
        codes: [num_blocks, H_kv, block_size / 16, D, 2 * bits] uint8, bits 1, 2 or 4.
        scales: [num_blocks, H_kv, block_size / 16, D] float16.
        block_table: [S, MB] block ids of each row.
        context_lens: [S] tokens before each row's own.
        scale: The attention scale, so that scores are logits.
        compute_dtype: Dtype of the product (float64: a reference for the kernels).
        operands: Keys and query rounded to it before the product, as the CUDA
            kernel's float16 product rounds them (the default); None: float32
            keys and query (the exact form, ``triton_scoring``'s "sums").

    Returns:
        [S, H_kv, MB * block_size] float32, token t of row s at index t.

    Raises:
        ValueError: If bits do not divide 8 (a code would straddle two bytes), or
            ``operands`` is neither float16 nor None.
    """
    bits = codes.shape[-1] // 2
    if bits not in (1, 2, 4):
        raise ValueError(f"int keys of {bits} bits: 1, 2 or 4 are supported")
    if operands not in (torch.float16, None):
        raise ValueError(f"operands {operands}: torch.float16 (the kernel's) or None (exact)")
    if codes.is_cuda and compute_dtype == torch.float32:
        from vllm_infinigen.platforms.cuda.kernels import triton_scoring

        num_rows, num_heads = query.shape[:2]
        out = torch.empty((num_rows, num_heads, block_table.shape[1] * codes.shape[2] * KEY_GROUP),
                          dtype=torch.float32, device=codes.device)
        exact = {} if operands is torch.float16 else {"method": "sums"}  # float32 sums
        triton_scoring.int_scores(query.float().contiguous(), codes, scales,
                                  block_table.to(codes.device).contiguous(),
                                  context_lens.to(codes.device, torch.int64), out, None,
                                  scale=scale, **exact)
        return out
    table = block_table.to(torch.int64)
    per_byte = 8 // bits  # byte i holds tokens i * per_byte .. i * per_byte + per_byte - 1
    shifts = bits * torch.arange(per_byte, device=codes.device, dtype=torch.uint8)
    row_codes = codes[table]  # [S, MB, H_kv, G16, D, 2 * bits]
    tokens = ((row_codes[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)  # [..., D, 16]
    half = ((1 << bits) - 1) / 2
    keys = (tokens.float() - half) * scales[table].float()[..., None]
    if operands is not None:  # the kernel's operands: keys and query rounded to them
        keys, query = keys.to(operands), query.to(operands)
    scores = torch.einsum("shgd,smhjdt->shgmjt", query.to(compute_dtype), keys.to(compute_dtype))
    out = scores.amax(dim=2).flatten(2).float() * scale  # [S, H_kv, MB * block_size]
    encoded = context_lens.to(torch.int64) // KEY_GROUP * KEY_GROUP
    positions = torch.arange(out.shape[-1], device=out.device)
    return out.masked_fill(positions[None, None, :] >= encoded[:, None, None], _NEG_INF)


def partial_token_scores(partial_query: torch.Tensor, partial_keys: torch.Tensor,
                         block_table: torch.Tensor, *, scale: float,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Speculated scores of the tokens of every block in the rows' tables.

    Layout: ``partial_keys [num_blocks, H_kv, R, block_size]`` (channel-major
    per block, ``block_layout.py``).

    Args:
        partial_query: [S, H_kv, G, R] skewed partial queries (G query heads
            per KV head).
        partial_keys: [num_blocks, H_kv, R, block_size] the target layer's.
        block_table: [S, MB] block ids of each row (entries past a row's
            blocks may hold any valid id: ``block_scores`` masks them).
        scale: The attention scale, so that scores are logits.
        compute_dtype: Dtype of the product (float32: exact enough to compare
            with the CPU kernels; bfloat16 halves the bytes on a GPU).

    Returns:
        [S, H_kv, MB * block_size] float32, token t of row s at index t.
    """
    # row_keys: [S, MB, H_kv, R, block_size]
    row_keys = partial_keys[block_table.to(torch.int64)]
    return row_token_scores(partial_query, row_keys, scale=scale, compute_dtype=compute_dtype)


def row_token_scores(partial_query: torch.Tensor, row_keys: torch.Tensor, *, scale: float,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``partial_token_scores`` over partial keys already laid out per row.

    Args:
        partial_query: [S, H_kv, G, R].
        row_keys: [S, MB, H_kv, R, block_size] (a view where a row's blocks
            are consecutive, as in the GPU benchmark; no gather).
    """
    query = partial_query.to(compute_dtype)
    # scores: [S, H_kv, G, MB, block_size] -> best query head of the group
    scores = torch.einsum("shgr,smhrb->shgmb", query, row_keys.to(compute_dtype))
    return scores.amax(dim=2).flatten(2).float() * scale


def block_scores(token_scores: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[S, H_kv, MB] the best score of each block's context tokens.

    Tokens at or past ``context_lens`` (the row's own and later) do not count;
    a block without context tokens scores -inf.

    Args:
        token_scores: [S, H_kv, MB * block_size] from ``int_token_scores`` or
            ``partial_token_scores``.
        context_lens: [S] tokens before each row's own.
    """
    num_rows, num_heads, num_tokens = token_scores.shape
    positions = torch.arange(num_tokens, device=token_scores.device)
    in_context = positions[None, :] < context_lens.to(torch.int64)[:, None]  # [S, T]
    masked = token_scores.masked_fill(~in_context[:, None, :], _NEG_INF)
    return masked.view(num_rows, num_heads, -1, block_size).amax(dim=-1)


def bound_unit_scores(query: torch.Tensor, bounds: torch.Tensor, scales: torch.Tensor,
                      block_table: torch.Tensor, context_lens: torch.Tensor, *,
                      scale: float, block_size: int) -> torch.Tensor:
    """[S, H_kv, MB * BLOCK / U] float32 each unit's bound for each row: scale x
    the unit's scale x the max over the KV head's query group of q+ . max codes
    + q- . min codes - 2^(bits-1) x sum q (the CPU kernel's score, in torch);
    -inf past the row's complete units (context // U) and for padding rows.

    Args:
        query: [S, H_kv, G, D].
        bounds, scales: A layer's bound keys (``layer_state.py``).
        block_table: [S, MB] block ids of each row.
        context_lens: [S] tokens before each row's own (< 0: padding).
    """
    num_rows, num_heads, _, head_size = query.shape
    units_per_block = bounds.shape[2]
    bits = 8 * bounds.shape[-1] // head_size
    offset = float(1 << (bits - 1))
    table = block_table.to(torch.int64)
    rows = bounds[table].to(torch.int64)  # [S, MB, H, UPB, 2, R]
    if bits == 4:
        rows = torch.cat([rows & 15, rows >> 4], dim=-1)
    codes = rows.float()  # [S, MB, H, UPB, 2, D]
    unit_scales = scales[table].float()  # [S, MB, H, UPB]
    q = query.float()
    dots = (torch.einsum("shgd,smhud->shgmu", q.clamp(min=0), codes[..., 0, :])
            + torch.einsum("shgd,smhud->shgmu", q.clamp(max=0), codes[..., 1, :])
            - offset * q.sum(dim=-1)[..., None, None])
    best = dots.amax(dim=2) * unit_scales.permute(0, 2, 1, 3) * scale  # [S, H, MB, UPB]
    best = best.flatten(2)
    unit = block_size // units_per_block
    context = context_lens.to(torch.int64)
    complete = torch.where(context >= 0, context.clamp(min=0) // unit, 0)  # [S]
    index = torch.arange(best.shape[-1], device=best.device)
    return best.masked_fill(index[None, None, :] >= complete[:, None, None], _NEG_INF)


def unit_block_scores(unit_scores: torch.Tensor, units_per_block: int) -> torch.Tensor:
    """[S, H_kv, MB] each block's best unit (``bound_unit_scores``): -inf for a
    block without a complete unit."""
    rows, heads, units = unit_scores.shape
    return unit_scores.view(rows, heads, units // units_per_block, units_per_block).amax(dim=-1)


# -- counts and the rule on the device (a settings tensor)


def alpha_counts_reference(token_scores: torch.Tensor, context_lens: torch.Tensor,
                           settings: torch.Tensor) -> torch.Tensor:
    """``alpha_counts`` in torch: [S * H_kv] int32 encoded tokens of each (row,
    KV head) scoring above its best minus alpha (``settings[0]``)."""
    encoded = context_lens.to(torch.int64).clamp(min=0) // 16 * 16
    positions = torch.arange(token_scores.shape[-1], device=token_scores.device)
    scores = token_scores.masked_fill(positions[None, None, :] >= encoded[:, None, None],
                                      float("-inf"))
    floor = scores.amax(dim=-1, keepdim=True) - settings[0].to(torch.float32)
    return (scores > floor).sum(dim=-1).flatten().to(torch.int32)


def unit_alpha_counts(unit_scores: torch.Tensor, alpha: torch.Tensor, unit: int) -> torch.Tensor:
    """[S * H_kv] int32 tokens of the complete units scoring above their row and
    KV head's best minus ``alpha`` (a 0-dim tensor): the paper's count over
    units, each counting its ``unit`` tokens (``alpha_counts``' role)."""
    best = unit_scores.amax(dim=-1, keepdim=True)
    within = (unit_scores > best - alpha.to(torch.float32)).sum(dim=-1)
    return (within * unit).flatten().to(torch.int32)


def select_reference(block_scores, counts, context_lens, table, settings, *, block_size,
                     width, sink_blocks, recent_blocks):
    """``select`` in torch (a stable sort where the kernel searches a threshold)."""
    rows, heads, num_blocks = block_scores.shape
    context = context_lens.to(torch.int64)
    blocks = torch.where(context >= 0, context.clamp(min=0) // block_size + 1, 0)  # [S]
    mean = counts.view(rows, heads).to(torch.int64).sum(dim=1) // heads
    cap = torch.floor(context.to(torch.float64) * settings[1]).to(torch.int64)
    limit = settings[3].to(torch.int64)
    cap = torch.where(limit > 0, torch.minimum(cap, limit), cap).clamp(min=1)
    wanted = torch.minimum(mean, cap).clamp(min=1)
    forced_count = torch.clamp(blocks, max=sink_blocks + recent_blocks)
    chosen = torch.minimum((wanted + block_size - 1) // block_size + forced_count, blocks)
    below = context < settings[2].to(torch.int64)
    chosen = torch.where(below, blocks, chosen).clamp(max=width)  # [S]
    index = torch.arange(num_blocks, device=block_scores.device)[None, :]
    in_row = index < blocks[:, None]
    forced = in_row & ((index < sink_blocks) | (index >= blocks[:, None] - recent_blocks))
    ranked = block_scores.float().masked_fill(forced[:, None, :], float("inf"))
    ranked = ranked.masked_fill(~in_row[:, None, :], float("-inf"))
    # Beyond the row: below every score of it (the kernel's lowest key).
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(
        num_blocks, device=order.device).expand_as(order))
    keep = (rank < chosen[:, None, None]) & in_row[:, None, :]
    logical = torch.where(keep, index[None], _BIG).sort(dim=-1).values
    padded = torch.full((rows, heads, max(width - num_blocks, 0)), _BIG, dtype=torch.int64,
                        device=logical.device)
    logical = torch.cat([logical, padded], dim=-1)[..., :width]
    valid = logical < _BIG
    logical = torch.where(valid, logical, -1)
    physical = table.to(torch.int64).gather(1, logical.clamp(min=0).flatten(1)).view_as(logical)
    physical = torch.where(valid, physical, -1)
    partial = context.clamp(min=0) % block_size + 1
    seq_lens = torch.where(chosen > 0, (chosen - 1) * block_size + partial, 0)
    return logical, physical, seq_lens[:, None].expand(rows, heads).flatten().to(torch.int32)


# -- the rule on the host (the accuracy studies)


def alpha_token_caps(token_scores: torch.Tensor, context_lens: torch.Tensor, alpha: float,
                     token_caps: torch.Tensor) -> torch.Tensor:
    """[S] the paper's k capped by the budget: min(floor(mean over KV heads of
    the tokens scoring above best - alpha), ``token_caps``), at least 1.

    Pass the result as ``select_blocks``' ``token_caps`` to apply alpha
    (the count needs token scores; the blocks then round it up).
    """
    num_tokens = token_scores.shape[-1]
    positions = torch.arange(num_tokens, device=token_scores.device)
    in_context = positions[None, :] < context_lens.to(torch.int64)[:, None]
    scores = token_scores.masked_fill(~in_context[:, None, :], _NEG_INF)
    best = scores.amax(dim=-1, keepdim=True)
    counts = (scores > best - alpha).sum(dim=-1)  # [S, H_kv]
    mean = torch.floor(counts.to(torch.float64).mean(dim=-1)).to(torch.int64)
    return torch.clamp(torch.minimum(mean, token_caps.to(torch.int64)), min=1)


def _budget_blocks(token_caps: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S] the budget in tokens, rounded up to whole blocks."""
    return (token_caps.to(torch.int64) + block_size - 1) // block_size


def select_blocks(scores: torch.Tensor, context_lens: torch.Tensor, token_caps: torch.Tensor,
                  *, block_size: int, width: int, sink_blocks: int = 1,
                  recent_blocks: int = 1) -> BlockSelection:
    """InfiniGen's rule in blocks.

    Per row: ``ceil(token_caps / block_size)`` blocks by score, on top of the
    first ``sink_blocks`` and the last ``recent_blocks`` blocks (the row's own
    block is the last one: its own token is attended there), at most the
    row's blocks. Every KV head keeps the same number, chosen by its own scores.

    Args:
        scores: [S, H_kv, MB] from ``block_scores`` (MB >= the rows' blocks).
        context_lens: [S] tokens before each row's own.
        token_caps: [S] the budget in tokens (``worker.step_plan.token_budget``,
            or ``alpha_token_caps`` of it).
        width: Blocks per head in the result, from ``widths.step_width``.
        sink_blocks: First blocks always kept (attention sinks).
        recent_blocks: Last blocks always kept, >= 1.

    Raises:
        ValueError: If ``recent_blocks`` < 1 (the own block must be kept).
    """
    if recent_blocks < 1:
        raise ValueError(f"recent_blocks must be >= 1 (the row's own block), got {recent_blocks}")
    max_blocks = scores.shape[-1]
    blocks = num_row_blocks(context_lens, block_size)[:, None]  # [S, 1]
    index = torch.arange(max_blocks, device=scores.device)[None, :]  # [1, MB]
    in_row = index < blocks
    forced = in_row & ((index < sink_blocks) | (index >= blocks - recent_blocks))
    num_selected = torch.minimum(_budget_blocks(token_caps, block_size) + forced.sum(dim=1),
                                 blocks[:, 0])
    ranked = scores.float().masked_fill(~in_row[:, None, :], _NEG_INF)
    ranked = ranked.masked_fill(forced[:, None, :], _POS_INF)
    width = min(width, max_blocks)
    top = torch.topk(ranked, width, dim=-1, sorted=True).indices  # [S, H_kv, W]
    keep = torch.arange(width, device=scores.device) < num_selected[:, None, None]
    padding = torch.iinfo(torch.int64).max
    logical = torch.where(keep, top, padding).sort(dim=-1).values
    return BlockSelection(torch.where(logical == padding, -1, logical), num_selected)


def physical_block_ids(logical: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[S, H_kv, W] block ids of the selected blocks (-1 kept).

    Args:
        logical: [S, H_kv, W] from ``select_blocks``.
        block_table: [S, MB] block ids of each row.
    """
    num_rows = logical.shape[0]
    ids = torch.gather(block_table.to(torch.int64), 1,
                       logical.clamp(min=0).reshape(num_rows, -1)).view_as(logical)
    return torch.where(logical >= 0, ids, -1)
