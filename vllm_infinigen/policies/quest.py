# SPDX-License-Identifier: Apache-2.0
"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference", ICML 2024) as a selection policy.

The context is cut into pages of 16 tokens, each keeping the element-wise min
and max of its keys; a page's score is sum_d max(q_d min_d, q_d max_d), an
upper bound of q.k over the page; the best ``budget / 16`` pages are attended,
per KV head (the best query head of its group). State per sparse layer, by
page of slot ids (the last row takes padding)::

    page_min, page_max  [num_slots / 16 + 1, H_kv, D]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.policies import POLICY_TRAITS
from vllm_infinigen.policies.base import (
    Selection,
    SelectionPolicy,
    as_positions,
    from_position_mask,
    sparse_slots,
)

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.step_plan import StepPlan

QUEST_PAGE_SIZE = POLICY_TRAITS["quest"].page_tokens  # 16, declared in the registry


def quest_select(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                 context_lens: torch.Tensor, token_caps: torch.Tensor, width: int) -> Selection:
    """Query-aware page selection.

    Args:
        query: [B, H_q, D] the layer's own queries.
        page_min, page_max: [B, P, H_kv, D] key bounds of each context page.
        context_lens: [B].
        token_caps: [B] the budget in tokens (``step_plan.token_budget``).
        width: Bound of the selection (``quest_width``).

    Returns:
        Every context token of the chosen pages, per KV head.
    """
    num_reqs, num_heads, head_size = query.shape
    num_pages, num_kv_heads = page_min.shape[1], page_min.shape[2]
    group = num_heads // num_kv_heads
    grouped = query.float().view(num_reqs, num_kv_heads, group, head_size)
    # [B, H_kv, G, P, D] -> upper bound of q.k over each page, best head of the group.
    low = torch.einsum("bhgd,bphd->bhgpd", grouped, page_min.float())
    high = torch.einsum("bhgd,bphd->bhgpd", grouped, page_max.float())
    scores = torch.maximum(low, high).sum(dim=-1).amax(dim=2)  # [B, H_kv, P]
    lens = context_lens.to(torch.int64)
    pages_in_context = (lens + QUEST_PAGE_SIZE - 1) // QUEST_PAGE_SIZE
    page_ids = torch.arange(num_pages, device=query.device)
    scores = scores.masked_fill(page_ids[None, None] >= pages_in_context[:, None, None],
                                float("-inf"))
    wanted = torch.clamp(token_caps // QUEST_PAGE_SIZE, min=1)
    rank = torch.argsort(torch.argsort(scores, dim=-1, descending=True), dim=-1)
    chosen_pages = (rank < wanted[:, None, None]) & (scores > float("-inf"))
    chosen = chosen_pages.repeat_interleave(QUEST_PAGE_SIZE, dim=-1)  # [B, H_kv, P * page]
    positions = torch.arange(chosen.shape[-1], device=query.device)
    chosen &= positions[None, None] < lens[:, None, None]
    return from_position_mask(chosen, width)


def quest_width(caps_host: list[int]) -> int:
    """Host-side bound of the width of ``quest_select`` in one step, from the
    rows' budgets in tokens."""
    pages = max((max(1, cap // QUEST_PAGE_SIZE) for cap in caps_host), default=1)
    return pages * QUEST_PAGE_SIZE


@dataclass
class _Pages:
    low: torch.Tensor  # [num_slots / page + 1, H_kv, D]
    high: torch.Tensor


class QuestPolicy(SelectionPolicy):
    name = "quest"

    def __init__(self) -> None:
        self._pages: dict[int, _Pages] = {}  # by layer index

    def allocate(self, layer: LayerState) -> None:
        """Page bounds from what the pool holds (a policy switched on in a
        running engine bounds whatever its slots hold, stale keys included)."""
        if layer.layer_idx in self._pages:
            return
        device = layer.kv_pool.device
        keys = layer.keys_at(torch.arange(layer.num_slots, device=layer.kv_pool.device)).to(
            device)
        pages = keys.view(-1, QUEST_PAGE_SIZE, layer.num_kv_heads, layer.head_size)
        pad = torch.zeros((1, layer.num_kv_heads, layer.head_size), dtype=keys.dtype,
                          device=device)
        self._pages[layer.layer_idx] = _Pages(low=torch.cat([pages.amin(dim=1), pad]),
                                              high=torch.cat([pages.amax(dim=1), pad]))

    def bounds(self, layer: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of the keys of each page of ``layer``'s slots."""
        pages = self._pages[layer.layer_idx]
        return pages.low, pages.high

    def on_write(self, layer: LayerState, key: torch.Tensor, slots: torch.Tensor) -> None:
        """Folds new keys into their pages' min/max; a page restarts at its first slot."""
        bounds = self._pages[layer.layer_idx]
        slots = torch.where(slots < 0, layer.num_slots, slots)
        pages = slots // QUEST_PAGE_SIZE
        first = pages[slots % QUEST_PAGE_SIZE == 0]
        bounds.low[first] = float("inf")
        bounds.high[first] = float("-inf")
        index = pages[:, None, None].expand_as(key)
        bounds.low.scatter_reduce_(0, index, key.to(bounds.low.dtype), "amin")
        bounds.high.scatter_reduce_(0, index, key.to(bounds.high.dtype), "amax")

    def select(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
               settings: InfiniGenConfig, row_map: torch.Tensor | None) -> torch.Tensor:
        bounds = self._pages[layer.layer_idx]
        rows = plan.sparse_rows
        slots = sparse_slots(plan)  # [S, N]
        starts = torch.arange(0, slots.shape[1], QUEST_PAGE_SIZE, device=slots.device)
        page_ids = slots[:, starts] // QUEST_PAGE_SIZE  # [S, P]
        page_min, page_max = bounds.low[page_ids], bounds.high[page_ids]
        if settings.eval_dense_prefix is not None and plan.has_other_rows:
            _bounds_as_in_decode(layer, plan, page_min, page_max)
        selection = quest_select(query[plan.tokens[plan.sparse]], page_min, page_max,
                                 rows.context_lens, rows.token_caps, quest_width(rows.caps_host))
        return as_positions(selection)


def _bounds_as_in_decode(layer: LayerState, plan: StepPlan, page_min: torch.Tensor,
                         page_max: torch.Tensor) -> None:
    """Evaluation mode: each row's last page bounds the keys up to the row only.

    The page bounds hold every key this step wrote, later prompt rows
    included; a decode step at position p bounds positions page_start..p.
    page_min, page_max: [S, P, H_kv, D], changed in place.
    """
    context_lens = plan.context_lens[plan.sparse]
    last = context_lens // QUEST_PAGE_SIZE  # [S] page of each row's own position
    positions = last[:, None] * QUEST_PAGE_SIZE + torch.arange(QUEST_PAGE_SIZE,
                                                               device=last.device)
    upto = positions <= context_lens[:, None]  # [S, page]
    clamped = torch.minimum(positions, context_lens[:, None])
    block_ids = torch.gather(plan.block_table[plan.sparse].to(torch.int64), 1,
                             clamped // plan.block_size)
    slots = block_ids * plan.block_size + clamped % plan.block_size
    # keys: [S, page, H_kv, D]
    keys = layer.keys_at(slots).to(device=page_min.device, dtype=page_min.dtype)
    hidden = ~upto[..., None, None]
    low = keys.masked_fill(hidden, float("inf")).amin(dim=1)  # [S, H_kv, D]
    high = keys.masked_fill(hidden, float("-inf")).amax(dim=1)
    rows = torch.nonzero(last < page_min.shape[1]).flatten()
    page_min[rows, last[rows]] = low[rows]
    page_max[rows, last[rows]] = high[rows]
