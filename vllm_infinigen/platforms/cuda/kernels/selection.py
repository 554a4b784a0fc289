# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the wrappers of a sparse layer's device-only selection and placement.

InfiniGen's rule in whole blocks (``block_rule.py`` states it in torch) as
kernels whose shapes depend only on the step's bounds (``widths.py``), so that
they run without a host read and inside a CUDA graph::

    int_scores     [S, H_kv, T] token and [S, H_kv, MB] block scores (T =
                   MB x block_size: the table's width, not the rows' contexts)
    bound_scores   [S, H_kv, MB x units] unit and [S, H_kv, MB] block scores
                   from the bound keys (the default)
    partial_scores the same as int_scores from the partial keys (torch on
                   every device)
    alpha_counts   [S * H_kv] tokens within alpha of each head's best (over the
                   bound keys' units ``select`` counts them itself)
    select         [S, H_kv, W] logical and physical blocks, ascending, -1
                   padded, and [S * H_kv] the tokens each (row, KV head)
                   attends (its own token included): a ``DeviceSelection``
    place_lru      the selection placed in the layer's device block cache:
                   hits, least recently used victims, the fetch list

``settings`` is a float64 device tensor (``SETTINGS``: alpha, budget,
min_context, budget_tokens) that a running engine updates in place. On CUDA
each function launches its Triton kernel (``triton_scoring.py``,
``triton_bounds.py``, ``triton_select.py``); elsewhere it runs the torch
reference (``block_rule.py``, ``reference.py``), which reads nothing back to
the host either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.platforms.cuda.kernels import block_rule, reference

if TYPE_CHECKING:
    from vllm_infinigen.worker.step_plan import RowSet

# The order of the settings tensor's entries (budget_tokens: 0 for no cap).
SETTINGS = ("alpha", "budget", "min_context", "budget_tokens")
_BIG = 1 << 62


@dataclass(frozen=True)
class DeviceSelection:
    """One sparse layer's blocks for a step's rows, as ``select`` makes them."""

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
    physical = block_rule.physical_block_ids(logical, rows.block_table.to(logical.device))
    num_valid = (logical >= 0).sum(dim=-1)  # [S, H]
    seq_lens = (num_valid - 1) * block_size + (context_lens % block_size + 1)[:, None]
    return DeviceSelection(logical, physical, seq_lens.flatten().to(torch.int32))


def settings_tensor(alpha: float, budget: float, min_context: int,
                    device: torch.device | str, budget_tokens: int | None = None) -> torch.Tensor:
    """[4] float64 (``SETTINGS``) on ``device``."""
    return torch.tensor([alpha, budget, float(min_context), float(budget_tokens or 0)],
                        dtype=torch.float64, device=device)


# -- scores and counts


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
        tokens = block_rule.int_token_scores(query, codes, scales, table, context_lens,
                                             scale=scale)
        return tokens, block_rule.block_scores(tokens, context_lens, block_size)
    from vllm_infinigen.platforms.cuda.kernels import triton_scoring

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
    unit (``block_rule``), on CUDA one Triton launch (``triton_bounds``): on the
    tensor cores for a bfloat16 or float16 query (``benchmarks/gpu/sass_mix.py``:
    a third of the float32 sums' instructions per byte, no conversion instruction).

    Args:
        query: [S, H_kv, G, D]; bounds, scales: a layer's bound keys.
        table: [S, MB] block ids of each row; context_lens: [S] (< 0: padding).
    """
    units_per_block = bounds.shape[2]
    if not bounds.is_cuda:
        units = block_rule.bound_unit_scores(query, bounds, scales, table, context_lens,
                                             scale=scale, block_size=block_size)
        return units, block_rule.unit_block_scores(units, units_per_block)
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    rows, heads, group, head_size = query.shape
    if query.stride(3) != 1 or query.stride(2) != head_size or query.stride(1) != group * head_size:
        query = query.contiguous()  # the kernel takes a row stride only
    units = torch.empty((rows, heads, table.shape[1] * units_per_block), dtype=torch.float32,
                        device=bounds.device)
    blocks = torch.empty((rows, heads, table.shape[1]), dtype=torch.float32,
                         device=bounds.device)
    # The tensor-core form for a 16-bit query (float16 operands: the codes less their offset
    # exact, the query within float16's normal range), the float32 sums elsewhere.
    dot = query.dtype in (torch.float16, torch.bfloat16) and head_size >= 32
    triton_bounds.bound_scores(query, bounds, scales, table, context_lens, units, blocks,
                               scale=scale, unit=block_size // units_per_block,
                               method="dot" if dot else "sums", tile=64 if dot else 32)
    return units, blocks


def partial_scores(query: torch.Tensor, partial_keys: torch.Tensor, table: torch.Tensor,
                   context_lens: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(token scores, block scores) from the partial keys (torch, any device), as
    ``int_scores`` gives them from the int keys."""
    tokens = block_rule.partial_token_scores(query, partial_keys, table, scale=scale)
    return tokens, block_rule.block_scores(tokens, context_lens, partial_keys.shape[-1])


def alpha_counts(token_scores: torch.Tensor, block_scores: torch.Tensor,
                 context_lens: torch.Tensor, settings: torch.Tensor, *,
                 block_size: int) -> torch.Tensor:
    """[S * H_kv] int32 encoded tokens of each (row, KV head) scoring above its
    best minus alpha (``settings[0]``): the paper's count, before the mean."""
    if token_scores.is_cuda:
        from vllm_infinigen.platforms.cuda.kernels import triton_select

        rows, heads = token_scores.shape[:2]
        counts = torch.empty(rows * heads, dtype=torch.int32, device=token_scores.device)
        triton_select.alpha_counts(token_scores, block_scores, context_lens, settings, counts,
                                   block_size=block_size)
        return counts
    return block_rule.alpha_counts_reference(token_scores, context_lens, settings)


# -- the rule, and the placement in the cache


def select(block_scores: torch.Tensor, counts: torch.Tensor, context_lens: torch.Tensor,
           table: torch.Tensor, settings: torch.Tensor, *, block_size: int, width: int,
           sink_blocks: int, recent_blocks: int, unit: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logical [S, H_kv, W] int64, physical [S, H_kv, W] int64, seq_lens [S * H_kv] int32).

    ``counts``: [S * H_kv] int32 alpha counts (``alpha_counts``); or, with
    ``unit`` (tokens per unit), the bound keys' unit scores [S, H_kv, N], whose
    alpha counts (``block_rule.unit_alpha_counts``) the same launch takes on
    CUDA: alpha off, the default, every complete unit counts and none is read.

    Per row: k = max(1, min(floor(mean over KV heads of the counts), the
    budget in tokens (``step_plan.token_budget``: max(1, min(floor(budget x
    context), budget_tokens))))); n = min(ceil(k / block_size) + the
    sink and recent blocks, the row's blocks), every block below min_context,
    at most ``width``. Each KV head keeps its n best blocks by score (the
    forced ones first; ties: the lower block), ascending, -1 after; a
    padding row (context < 0) none. ``seq_lens``: the tokens attended, the
    own block (the last) holding ``context % block_size + 1``.
    """
    if block_scores.is_cuda:
        from vllm_infinigen.platforms.cuda.kernels import triton_select

        rows, heads = block_scores.shape[:2]
        logical = torch.empty((rows, heads, width), dtype=torch.int64, device=table.device)
        physical = torch.empty_like(logical)
        seq_lens = torch.empty(rows * heads, dtype=torch.int32, device=table.device)
        triton_select.select_blocks(block_scores, counts, context_lens, table, settings, logical,
                                    physical, seq_lens, block_size=block_size,
                                    sink_blocks=sink_blocks, recent_blocks=recent_blocks,
                                    unit=unit)
        return logical, physical, seq_lens
    if unit:
        counts = block_rule.unit_alpha_counts(counts, settings[0], unit)
    return block_rule.select_reference(block_scores, counts, context_lens, table, settings,
                                       block_size=block_size, width=width,
                                       sink_blocks=sink_blocks, recent_blocks=recent_blocks)


def place_lru(block_ids: torch.Tensor, slots: torch.Tensor, slot_of: torch.Tensor,
              block_of: torch.Tensor, last_used: torch.Tensor, ticks: torch.Tensor,
              fetch_units: torch.Tensor, fetch_slots: torch.Tensor, num_fetch: torch.Tensor,
              counters: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor, *,
              capacity: int) -> None:
    """One layer's selection placed in its cache, least recently used slots
    evicted (``DeviceBlockCache.place``; arguments: ``reference.place_lru_reference``).

    On CUDA one Triton launch, a program per KV head (``triton_lru.lookup_lru``);
    elsewhere the reference. Neither reads anything back to the host.
    """
    if not slot_of.is_cuda:
        reference.place_lru_reference(block_ids, slots, slot_of, block_of, last_used, ticks,
                                      fetch_units, fetch_slots, num_fetch, counters, seq_lens,
                                      context_lens, capacity=capacity)
        return
    from vllm_infinigen.platforms.cuda.kernels import triton_lru

    triton_lru.lookup_lru(block_ids, slots, slot_of, block_of, last_used, ticks,
                          torch.empty_like(fetch_units), fetch_units, fetch_slots, num_fetch,
                          counters, seq_lens, context_lens, capacity=capacity)
