# SPDX-License-Identifier: Apache-2.0
"""Baseline selection policies, on InfiniGen's machinery (``--infinigen-policy``).

Each picks, for the decode rows of one sparse layer, the context tokens that
the layer attends to, at the same budget as InfiniGen (``floor(budget x
context)`` tokens per request, at least 1; the current token is always
attended on top). Only the rule differs: the pool, the gather and the
attention are InfiniGen's. Unlike InfiniGen, these select in the layer itself,
from that layer's own state (no speculation one layer ahead).

- ``streaming``: StreamingLLM (Xiao et al., "Efficient Streaming Language
  Models with Attention Sinks", ICLR 2024): the first 4 tokens (attention
  sinks) and the most recent ones.
- ``h2o``: H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
  Generative Inference of Large Language Models", NeurIPS 2023): half the
  budget for the most recent tokens, half for the tokens with the largest
  attention accumulated so far (prefill included), per KV head; a token left
  out once is evicted for good.
- ``quest``: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient
  Long-Context LLM Inference", ICML 2024): the context is cut into pages of 16
  tokens, each keeping the element-wise min and max of its keys; a page's
  score is sum_d max(q_d min_d, q_d max_d), an upper bound of q.k over the
  page; the best ``budget / 16`` pages are attended, per KV head (the best
  query head of its group).

All functions are pure torch on the device, with host-side bounds for K.
"""

from __future__ import annotations

import torch

from vllm_infinigen.selector import Selection, token_caps
STREAMING_SINK_TOKENS = 4
QUEST_PAGE_SIZE = 16


def _from_position_mask(chosen: torch.Tensor, num_slots: int) -> Selection:
    """A selection from a mask over positions. chosen: [B, H_kv, N] bool."""
    num_reqs, num_heads, num_tokens = chosen.shape
    num_slots = max(1, min(num_slots, num_tokens))
    # Chosen positions first (in position order), then padding.
    order = chosen.to(torch.int64) * (2 * num_tokens) - torch.arange(num_tokens,
                                                                      device=chosen.device)
    top = torch.topk(order, num_slots, dim=-1).indices
    valid = torch.gather(chosen, -1, top)
    return Selection(positions=top, valid=valid, num_selected=valid[:, 0].sum(dim=-1))


def streaming_select(context_lens: torch.Tensor, budget: float, num_heads: int,
                     num_tokens: int, num_slots: int) -> Selection:
    """Sinks and the most recent tokens: [B] context lengths -> [B, H_kv, K]."""
    caps = token_caps(context_lens, budget)[:, None]  # [B, 1]
    lens = context_lens.to(torch.int64)[:, None]
    sinks = torch.clamp(caps, max=STREAMING_SINK_TOKENS)
    positions = torch.arange(num_tokens, device=context_lens.device)[None]
    chosen = (positions < sinks) | (positions >= lens - (caps - sinks))
    chosen &= positions < lens
    return _from_position_mask(chosen[:, None].expand(-1, num_heads, -1), num_slots)


def h2o_select(accumulated: torch.Tensor, alive: torch.Tensor, context_lens: torch.Tensor,
               budget: float, num_slots: int) -> Selection:
    """Heavy hitters and recent tokens among those not evicted yet.

    Args:
        accumulated: [B, H_kv, N] attention each token has received so far.
        alive: [B, H_kv, N] tokens not evicted (and within the context).
        context_lens: [B].

    Returns:
        The kept tokens; everything else alive in the context is evicted by
        the caller.
    """
    num_tokens = accumulated.shape[-1]
    caps = token_caps(context_lens, budget)[:, None, None]  # [B, 1, 1]
    lens = context_lens.to(torch.int64)[:, None, None]
    positions = torch.arange(num_tokens, device=accumulated.device)[None, None]
    alive = alive & (positions < lens)
    recent = (positions >= lens - caps // 2) & alive
    num_heavy = caps - recent.sum(dim=-1, keepdim=True)
    candidates = accumulated.float().masked_fill(~alive | recent, float("-inf"))
    rank = torch.argsort(torch.argsort(candidates, dim=-1, descending=True), dim=-1)
    heavy = (rank < num_heavy) & (candidates > float("-inf"))
    return _from_position_mask(recent | heavy, num_slots)


def quest_select(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                 context_lens: torch.Tensor, budget: float, num_slots: int) -> Selection:
    """Query-aware page selection.

    Args:
        query: [B, H_q, D] the layer's own queries.
        page_min, page_max: [B, P, H_kv, D] key bounds of each context page.
        context_lens: [B].
        num_slots: Bound of K (a multiple of the page size).

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
    wanted = torch.clamp(token_caps(context_lens, budget) // QUEST_PAGE_SIZE, min=1)
    rank = torch.argsort(torch.argsort(scores, dim=-1, descending=True), dim=-1)
    chosen_pages = (rank < wanted[:, None, None]) & (scores > float("-inf"))
    chosen = chosen_pages.repeat_interleave(QUEST_PAGE_SIZE, dim=-1)  # [B, H_kv, P * page]
    positions = torch.arange(chosen.shape[-1], device=query.device)
    chosen &= positions[None, None] < lens[:, None, None]
    return _from_position_mask(chosen, num_slots)


def quest_num_slots(context_lens: list[int], budget: float) -> int:
    """Host-side bound of K for ``quest_select`` in one step."""
    pages = max((max(1, max(1, int(n * budget)) // QUEST_PAGE_SIZE) for n in context_lens),
                default=1)
    return pages * QUEST_PAGE_SIZE
