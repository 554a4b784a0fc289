# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the device-only selection of a sparse layer, dispatch and references.

InfiniGen's rule in whole blocks (``block_selection.py`` states it in torch)
as three kernels whose shapes depend only on the step's bounds, so that they
run without a host read and inside a CUDA graph::

    int_scores     [S, H_kv, T] token and [S, H_kv, MB] block scores (T =
                   MB x block_size: the table's width, not the rows' contexts)
    alpha_counts   [S * H_kv] tokens within alpha of each head's best
    select         [S, H_kv, W] logical and physical blocks, ascending, -1
                   padded, and [S * H_kv] the tokens each (row, KV head)
                   attends (its own token included): a ``DeviceSelection``

``settings`` is a float64 device tensor (``SETTINGS``: alpha, budget,
min_context) that a running engine updates in place. On CUDA each function
launches its Triton kernel (``triton_scoring.py``, ``triton_select.py``);
elsewhere it runs the torch reference below, which reads nothing back to the
host either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.platforms.cuda import block_selection, bound_selection

if TYPE_CHECKING:
    from vllm_infinigen.worker.step_plan import RowSet

# The order of the settings tensor's entries (budget_tokens: 0 for no cap).
SETTINGS = ("alpha", "budget", "min_context", "budget_tokens")
_BIG = 1 << 62


@dataclass(frozen=True)
class DeviceSelection:
    """One sparse layer's blocks for a step's rows, as ``select_ops.select`` makes them."""

    logical: torch.Tensor  # [S, H_kv, W] int64 block within the row, ascending, -1 padded
    physical: torch.Tensor  # [S, H_kv, W] int64 its block id, -1 padded
    seq_lens: torch.Tensor  # [S * H_kv] int32 tokens attended, the own one included


def blocks_of_positions(positions: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                        width: int) -> torch.Tensor:
    """[S, H_kv, width] logical blocks holding ``positions``, and each row's own block.

    Ascending, each block once, -1 padded; the own block (``context_len //
    block_size``, the highest) is the last valid one.

    Args:
        positions: [S, H_kv, W] selected positions, -1 padded.
        context_lens: [S] tokens before each row's own.
        width: Bound of the distinct blocks (W + 1 at most).
    """
    num_rows, num_heads, _ = positions.shape
    own = (context_lens.to(positions.device, torch.int64) // block_size)[:, None, None]
    blocks = torch.where(positions >= 0, positions.to(torch.int64) // block_size, _BIG)
    keyed = torch.cat([blocks, own.expand(num_rows, num_heads, 1)], dim=-1).sort(dim=-1).values
    previous = torch.cat([torch.full_like(keyed[..., :1], -1), keyed[..., :-1]], dim=-1)
    distinct = torch.where(keyed != previous, keyed, _BIG).sort(dim=-1).values[..., :width]
    return torch.where(distinct < _BIG, distinct, -1)


def selection_of_blocks(logical: torch.Tensor, rows: RowSet, block_size: int) -> DeviceSelection:
    """The ``DeviceSelection`` of logical blocks [S, H_kv, W] (ascending, -1
    padded, each row's own block the last valid one), e.g. a recorded one."""
    context_lens = rows.context_lens.to(logical.device, torch.int64)
    physical = block_selection.physical_block_ids(logical, rows.block_table.to(logical.device))
    num_valid = (logical >= 0).sum(dim=-1)  # [S, H]
    seq_lens = (num_valid - 1) * block_size + (context_lens % block_size + 1)[:, None]
    return DeviceSelection(logical, physical, seq_lens.flatten().to(torch.int32))


def settings_tensor(alpha: float, budget: float, min_context: int,
                    device: torch.device | str, budget_tokens: int | None = None) -> torch.Tensor:
    """[4] float64 (``SETTINGS``) on ``device``."""
    return torch.tensor([alpha, budget, float(min_context), float(budget_tokens or 0)],
                        dtype=torch.float64, device=device)


def selection_width(table_blocks: int, block_size: int, *, budget: float, min_context: int,
                    sink_blocks: int, recent_blocks: int,
                    budget_tokens: int | None = None) -> int:
    """The static bound W of ``select``: the most blocks a row of the table selects.

    A row of ``table_blocks`` blocks has at most ``table_blocks * block_size
    - 1`` context tokens; it keeps ceil(budget tokens / block_size) blocks plus
    its windows' (``block_selection.selection_width``), the budget in tokens
    capped by ``budget_tokens``, or every block when its context is below
    ``min_context``.
    """
    longest = table_blocks * block_size - 1
    tokens = max(1, math.floor(budget * longest))
    if budget_tokens is not None:
        tokens = min(tokens, budget_tokens)
    by_budget = block_selection.selection_width(
        [longest], [tokens], block_size, sink_blocks=sink_blocks, recent_blocks=recent_blocks)
    dense = (max(min_context, 1) - 1) // block_size + 1
    return max(1, min(table_blocks, max(by_budget, dense)))


def int_scores(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               table: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
               settings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token scores [S, H_kv, MB * block_size], block scores [S, H_kv, MB]) float32.

    Args:
        query: [S, H_kv, G, D] (a view with unit strides within a row).
        codes, scales: a layer's int keys (``layer_state.py``).
        table: [S, MB] block ids of each row.
        context_lens: [S] tokens before each row's own (< 0: padding).
        settings: The selection's (``settings_tensor``), for ``alpha_counts``
            alone: given, on CUDA the token scores are written only while alpha
            is finite (off, the default, ``alpha_counts`` reads none: 4 bytes
            per token and KV head not written and not read back); their
            contents are undefined otherwise.
    """
    block_size = codes.shape[2] * 16
    if not codes.is_cuda:
        tokens = block_selection.int_token_scores(query, codes, scales, table, context_lens,
                                                  scale=scale)
        return tokens, block_selection.block_scores(tokens, context_lens, block_size)
    from vllm_infinigen.platforms.cuda import triton_scoring

    rows, heads, group, head_size = query.shape
    if query.stride(3) != 1 or query.stride(2) != head_size or query.stride(1) != group * head_size:
        query = query.contiguous()  # the kernel takes a row stride only
    num_blocks = table.shape[1]
    tokens = torch.empty((rows, heads, num_blocks * block_size), dtype=torch.float32,
                         device=codes.device)
    blocks = torch.empty((rows, heads, num_blocks), dtype=torch.float32, device=codes.device)
    triton_scoring.int_scores(query, codes, scales, table, context_lens, tokens, blocks,
                              scale=scale, settings=settings)
    return tokens, blocks


def bound_scores(query: torch.Tensor, bounds: torch.Tensor, scales: torch.Tensor,
                 table: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit scores [S, H_kv, MB * block_size / U], block scores [S, H_kv, MB]) float32:
    each unit's bound (-inf past a row's complete units) and each block's best
    unit (``bound_selection``), on CUDA one Triton launch (``triton_bounds``).

    Args:
        query: [S, H_kv, G, D]; bounds, scales: a layer's bound keys.
        table: [S, MB] block ids of each row; context_lens: [S] (< 0: padding).
    """
    units_per_block = bounds.shape[2]
    if not bounds.is_cuda:
        units = bound_selection.bound_unit_scores(query, bounds, scales, table, context_lens,
                                                  scale=scale, block_size=block_size)
        return units, bound_selection.unit_block_scores(units, units_per_block)
    from vllm_infinigen.platforms.cuda import triton_bounds

    rows, heads, group, head_size = query.shape
    if query.stride(3) != 1 or query.stride(2) != head_size or query.stride(1) != group * head_size:
        query = query.contiguous()  # the kernel takes a row stride only
    units = torch.empty((rows, heads, table.shape[1] * units_per_block), dtype=torch.float32,
                        device=bounds.device)
    blocks = torch.empty((rows, heads, table.shape[1]), dtype=torch.float32,
                         device=bounds.device)
    triton_bounds.bound_scores(query, bounds, scales, table, context_lens, units, blocks,
                               scale=scale, unit=block_size // units_per_block)
    return units, blocks


def unit_counts(unit_scores: torch.Tensor, settings: torch.Tensor, *, unit: int) -> torch.Tensor:
    """[S * H_kv] int32: the paper's alpha count over units (``bound_selection.
    unit_alpha_counts``), on CUDA one Triton launch."""
    if not unit_scores.is_cuda:
        return bound_selection.unit_alpha_counts(unit_scores, settings[0], unit)
    from vllm_infinigen.platforms.cuda import triton_bounds

    rows, heads = unit_scores.shape[:2]
    counts = torch.empty(rows * heads, dtype=torch.int32, device=unit_scores.device)
    triton_bounds.unit_counts(unit_scores, settings, counts, unit=unit)
    return counts


def partial_scores(query: torch.Tensor, partial_keys: torch.Tensor, table: torch.Tensor,
                   context_lens: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(token scores, block scores) from the partial keys (torch, any device), as
    ``int_scores`` gives them from the int keys."""
    tokens = block_selection.partial_token_scores(query, partial_keys, table, scale=scale)
    return tokens, block_selection.block_scores(tokens, context_lens, partial_keys.shape[-1])


def alpha_counts(token_scores: torch.Tensor, block_scores: torch.Tensor,
                 context_lens: torch.Tensor, settings: torch.Tensor, *,
                 block_size: int) -> torch.Tensor:
    """[S * H_kv] int32 encoded tokens of each (row, KV head) scoring above its
    best minus alpha (``settings[0]``): the paper's count, before the mean."""
    if token_scores.is_cuda:
        from vllm_infinigen.platforms.cuda import triton_select

        rows, heads = token_scores.shape[:2]
        counts = torch.empty(rows * heads, dtype=torch.int32, device=token_scores.device)
        triton_select.alpha_counts(token_scores, block_scores, context_lens, settings, counts,
                                   block_size=block_size)
        return counts
    encoded = context_lens.to(torch.int64).clamp(min=0) // 16 * 16
    positions = torch.arange(token_scores.shape[-1], device=token_scores.device)
    scores = token_scores.masked_fill(positions[None, None, :] >= encoded[:, None, None],
                                      float("-inf"))
    floor = scores.amax(dim=-1, keepdim=True) - settings[0].to(torch.float32)
    return (scores > floor).sum(dim=-1).flatten().to(torch.int32)


def select(block_scores: torch.Tensor, counts: torch.Tensor, context_lens: torch.Tensor,
           table: torch.Tensor, settings: torch.Tensor, *, block_size: int, width: int,
           sink_blocks: int, recent_blocks: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logical [S, H_kv, W] int64, physical [S, H_kv, W] int64, seq_lens [S * H_kv] int32).

    Per row: k = max(1, min(floor(mean over KV heads of ``counts``), the
    budget in tokens (``step_plan.token_budget``: max(1, min(floor(budget x
    context), budget_tokens))))); n = min(ceil(k / block_size) + the
    sink and recent blocks, the row's blocks), every block below min_context,
    at most ``width``. Each KV head keeps its n best blocks by score (the
    forced ones first; ties: the lower block), ascending, -1 after; a
    padding row (context < 0) none. ``seq_lens``: the tokens attended, the
    own block (the last) holding ``context % block_size + 1``.
    """
    if block_scores.is_cuda:
        from vllm_infinigen.platforms.cuda import triton_select

        rows, heads = block_scores.shape[:2]
        logical = torch.empty((rows, heads, width), dtype=torch.int64, device=table.device)
        physical = torch.empty_like(logical)
        seq_lens = torch.empty(rows * heads, dtype=torch.int32, device=table.device)
        triton_select.select_blocks(block_scores, counts, context_lens, table, settings, logical,
                                    physical, seq_lens, block_size=block_size,
                                    sink_blocks=sink_blocks, recent_blocks=recent_blocks)
        return logical, physical, seq_lens
    return select_reference(block_scores, counts, context_lens, table, settings,
                            block_size=block_size, width=width, sink_blocks=sink_blocks,
                            recent_blocks=recent_blocks)


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
