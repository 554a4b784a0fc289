# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the bounds of a selection's width, one name for each meaning.

A selection's shapes need, before it runs, the most entries a row keeps. There
are three such bounds, at two granularities and two times::

    block_layout.widest  tokens per row, of one step: the most any of its rows
                      keeps, min(context, budget in tokens + window), from
                      the step's host lists (``worker/step_plan.py``; the
                      token-granular policies' W, on the CPU build)
    step_width        blocks per row and KV head, of one step: the most any
                      of its rows keeps, min(the row's blocks, ceil(budget
                      in tokens / block_size) + the sink and recent blocks),
                      from the step's host lists (``block_rule.select_blocks``'
                      W: the host-side rule of the accuracy studies)
    static_width      blocks per row and KV head, of every step: ``step_width``
                      of the longest row a block table holds at the start-up
                      settings, or every block of a row below min_context;
                      no host list (``selection.select``' W: the device-only
                      step's fixed shape, which a CUDA graph replays, and the
                      device block cache's size, ``memory.cache_slots_per_head``)

How they relate: a row's budget in tokens and its blocks grow with its
context, so ``static_width`` bounds ``step_width`` of any step at the
start-up settings (a running engine may not raise them:
``CudaDataPath.configure``). A token selection of ``widest`` W positions
spans at most W + 1 blocks with the row's own (``CudaDataPath.start_fetch``
turns one into blocks, ``selection.blocks_of_positions``). Both block bounds
take the windows in blocks from ``window_blocks``.
"""

from __future__ import annotations

import math


def window_blocks(sink_tokens: int, recent_tokens: int, block_size: int) -> tuple[int, int]:
    """(sink blocks, recent blocks) always kept: the first block and the row's
    own block at least (the rule measured in
    ``benchmarks/results/granularity_block16.md``), more where the token
    windows reach further (the first ``sink_tokens`` context tokens; the last
    ``recent_tokens`` before the row's own token)."""
    return max(1, -(-sink_tokens // block_size)), 1 + -(-recent_tokens // block_size)


def step_width(context_host: list[int], caps_host: list[int], block_size: int, *,
               sink_blocks: int, recent_blocks: int) -> int:
    """Host-side bound of a step's blocks per KV head, >= 1 (``block_rule.BlockSelection``'s W).

    Args:
        context_host, caps_host: Each row's context and budget in tokens.
    """
    width = 1
    for context, cap in zip(context_host, caps_host):
        blocks = context // block_size + 1
        forced = min(blocks, sink_blocks + recent_blocks)
        width = max(width, min(blocks, -(-cap // block_size) + forced))
    return width


def static_width(table_blocks: int, block_size: int, *, budget: float, min_context: int,
                 sink_blocks: int, recent_blocks: int, budget_tokens: int | None = None) -> int:
    """The static bound W of ``selection.select``: the most blocks a row of the table selects.

    A row of ``table_blocks`` blocks has at most ``table_blocks * block_size
    - 1`` context tokens; it keeps ceil(budget tokens / block_size) blocks plus
    its windows' (``step_width``), the budget in tokens capped by
    ``budget_tokens``, or every block when its context is below ``min_context``.
    """
    longest = table_blocks * block_size - 1
    tokens = max(1, math.floor(budget * longest))
    if budget_tokens is not None:
        tokens = min(tokens, budget_tokens)
    by_budget = step_width([longest], [tokens], block_size, sink_blocks=sink_blocks,
                           recent_blocks=recent_blocks)
    dense = (max(min_context, 1) - 1) // block_size + 1
    return max(1, min(table_blocks, max(by_budget, dense)))
