# SPDX-License-Identifier: Apache-2.0
"""InfiniGen's speculative token selection rule (worker side, pure torch).

Layer i speculates for layer i+1: the partial query of layer i+1 (computed from
layer i's attention input) is scored against layer i+1's partial key cache, and
the tokens whose score is within ``alpha`` of the best one are counted. The
count, averaged over KV heads, is capped by the budget; each KV head then keeps
its own top-k tokens. Everything here stays on the device: no ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    """Tokens that a sparse layer attends to, for the decode rows of a step.

    ``positions[b, h, j]`` is a token position in request b's context, valid
    where ``valid[b, h, j]``; the valid entries come first. Every head of a
    request keeps ``num_selected[b]`` tokens, or fewer where a capped pool no
    longer holds enough of them.
    """

    positions: torch.Tensor  # [B, H_kv, K] int64
    valid: torch.Tensor  # [B, H_kv, K] bool
    num_selected: torch.Tensor  # [B] int64


def token_caps(context_lens: torch.Tensor, budget: float) -> torch.Tensor:
    """The budget in tokens per request: floor(budget * context), at least 1.

    Args:
        context_lens: [B] tokens in each request's context (the current token
            excluded).
    """
    caps = torch.floor(context_lens.to(torch.float64) * budget).to(torch.int64)
    return torch.clamp(caps, min=1)


def max_selected(context_lens: list[int], budget: float, num_window: int) -> int:
    """Static upper bound of ``Selection.num_selected`` for a step (host side)."""
    return max(
        (min(n, max(1, int(n * budget)) + num_window) for n in context_lens),
        default=1,
    )


def select_tokens(
    partial_query: torch.Tensor,
    partial_keys: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    alpha: float,
    budget: float,
    width: int,
    sink_tokens: int = 0,
    recent_tokens: int = 0,
    present: torch.Tensor | None = None,
) -> Selection:
    """Applies the paper's rule to one layer's decode rows.

    Args:
        partial_query: [B, H_q, R] skewed partial query of the target layer.
        partial_keys: [B, N, H_kv, R] skewed partial keys of each request's
            context, padded to N tokens.
        context_lens: [B] valid tokens of each row of ``partial_keys``.
        scale: The attention scale, so that ``alpha`` is in logit units.
        alpha: The paper's alpha.
        budget: Cap on selected tokens as a fraction of the context.
        width: Selected entries per head in the result (K), from
            ``max_selected`` (host side).
        sink_tokens: First tokens always kept (on top of the budget).
        recent_tokens: Last tokens always kept (on top of the budget).
        present: [B, N, H_kv] whether the pool still holds each entry (None:
            all); absent entries are never selected, forced ones included.

    Returns:
        The selection, per KV head.
    """
    num_reqs, num_heads, rank = partial_query.shape
    num_tokens, num_kv_heads = partial_keys.shape[1], partial_keys.shape[2]
    group = num_heads // num_kv_heads
    query = partial_query.float().view(num_reqs, num_kv_heads, group, rank)
    # scores: [B, H_kv, G, N] -> per KV head: the best query head of the group.
    scores = torch.einsum("bhgr,bnhr->bhgn", query, partial_keys.float())
    scores = scores.amax(dim=2) * scale
    positions = torch.arange(num_tokens, device=scores.device)
    lens = context_lens.to(torch.int64)[:, None]  # [B, 1]
    in_context = positions[None, :] < lens  # [B, N]
    scores = scores.masked_fill(~in_context[:, None, :], float("-inf"))
    if present is not None:
        scores = scores.masked_fill(~present.permute(0, 2, 1), float("-inf"))

    best = scores.amax(dim=-1, keepdim=True)
    counts = (scores > best - alpha).sum(dim=-1)  # [B, H_kv]
    mean_count = torch.floor(counts.to(torch.float64).mean(dim=-1)).to(torch.int64)
    num_chosen = torch.minimum(mean_count, token_caps(context_lens, budget))

    window = (positions[None, :] < sink_tokens) | (
        positions[None, :] >= lens - recent_tokens
    )
    window &= in_context  # [B, N]
    num_window = window.sum(dim=-1)
    forced = window[:, None, :] if present is None else window[:, None, :] & (scores > float("-inf"))
    scores = scores.masked_fill(forced, float("inf"))
    num_selected = torch.minimum(num_chosen + num_window, lens[:, 0])

    width = min(width, num_tokens)
    top_scores, top = torch.topk(scores, width, dim=-1, sorted=True)
    valid = torch.arange(width, device=scores.device) < num_selected[:, None, None]
    valid = valid.expand(num_reqs, num_kv_heads, width)
    if present is not None:
        valid = valid & (top_scores > float("-inf"))
    return Selection(positions=top, valid=valid, num_selected=num_selected)
