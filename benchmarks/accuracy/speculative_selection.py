# SPDX-License-Identifier: Apache-2.0
"""InfiniGen's selection rule over any key form, as a ``sparse_llama.Selector`` (pure torch).

Mirrors ``vllm_infinigen/platforms/cpu/kernels/csrc/select.cpp`` for rows without a
sink/recent window: per KV head the score is scale x the max over its query
group; each head counts the tokens within ``alpha`` of its best; a row keeps
k = min(floor(mean count over KV heads), max(1, floor(budget x context)))
tokens, each KV head its own top-k; ``token_cap`` bounds the cap in tokens as
``--infinigen-budget-tokens`` does, and ``floor`` f > 0 raises the count to
at least floor(f x context) (still under the cap: a floor on the kept
fraction). ``rerank`` m > 0 adds a second pass: the
form's top min(m x k, context) candidates are re-scored with the full keys and
the best k of them kept (k from the first pass). ``block_size`` > 0 selects
whole blocks instead, as a device block cache would
(``vllm_infinigen.platforms.cuda.kernels.block_rule``): a block scores its best
token, k rounds up to blocks, and the first block and the row's own are kept.
``recent_tokens`` r > 0 keeps each row's last r context tokens on top of its k,
as ``--infinigen-recent-tokens`` does (``recent_window``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks.accuracy.key_forms import KeyForm

CAP_BINDING_ALPHA = 1000.0  # every finite score within reach: k is the budget


@dataclass
class SelectionCounts:
    """Selected and candidate entries over sparse layers, rows and KV heads."""

    selected: float = 0.0
    context: float = 0.0
    reranked: float = 0.0  # candidates re-scored with full keys (two-pass forms)
    per_layer: dict[int, list[float]] = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.selected / self.context if self.context else float("nan")

    def add(self, layer_idx: int, selected: float, context: float) -> None:
        """One selection's kept and context entries."""
        self.selected += selected
        self.context += context
        tally = self.per_layer.setdefault(layer_idx, [0.0, 0.0])
        tally[0] += selected
        tally[1] += context

    @property
    def rerank_density(self) -> float:
        return self.reranked / self.context if self.context else 0.0


def topk_mask(scores: torch.Tensor, num_chosen: torch.Tensor, width: int) -> torch.Tensor:
    """[H, n, T] bool: per head and row, the ``num_chosen[row]`` best of ``scores``."""
    top = scores.topk(width, dim=-1).indices  # [H, n, width]
    keep = torch.arange(width)[None, None, :] < num_chosen[None, :, None]
    mask = torch.zeros(scores.shape, dtype=torch.bool)
    return mask.scatter_(-1, top, keep.expand_as(top))


def block_mask(scores: torch.Tensor, positions: torch.Tensor, num_chosen: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """[H, n, T] bool: the context tokens of the blocks the block-granular rule keeps
    (scores [H, n, T]; ``num_chosen`` [n] the rule's k in tokens)."""
    from vllm_infinigen.platforms.cuda.kernels import block_rule

    num_heads, num_rows, num_tokens = scores.shape
    padded = -(-num_tokens // block_size) * block_size + block_size  # room for the own block
    token_scores = torch.full((num_rows, num_heads, padded), float("-inf"))
    token_scores[..., :num_tokens] = scores.permute(1, 0, 2)
    blocks = block_rule.block_scores(token_scores, positions, block_size)
    chosen = block_rule.select_blocks(blocks, positions, num_chosen,
                                      block_size=block_size, width=blocks.shape[-1])
    kept = torch.zeros((num_rows, num_heads, blocks.shape[-1] + 1), dtype=torch.bool)
    kept.scatter_(-1, chosen.logical.clamp(min=-1) % (blocks.shape[-1] + 1),
                  chosen.logical >= 0)
    tokens = kept[..., :-1].repeat_interleave(block_size, dim=-1)[..., :num_tokens]
    in_context = torch.arange(num_tokens)[None, :] < positions[:, None]
    return (tokens & in_context[:, None, :]).permute(1, 0, 2)


def recent_window(chosen: torch.Tensor, positions: torch.Tensor,
                  recent_tokens: int) -> torch.Tensor:
    """[H, n, T] ``chosen`` with each row's last ``recent_tokens`` context tokens
    added (the product's recent window: on top of the rule's k)."""
    if not recent_tokens:
        return chosen
    token_ids = torch.arange(chosen.shape[-1])[None, :]
    window = (token_ids >= (positions - recent_tokens)[:, None]) & (token_ids < positions[:, None])
    return chosen | window[None]


def make_selector(form: KeyForm, *, scale: float, alpha: float, budget: float,
                  rerank: int = 0, block_size: int = 0, token_cap: int | None = None,
                  floor: float = 0.0, recent_tokens: int = 0,
                  counts: SelectionCounts | None = None):
    """A ``Selector`` applying the rule with ``form``'s scores; tallies into ``counts``."""

    def select(layer_idx: int, query: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        num_kv_heads, num_tokens = keys.shape[0], keys.shape[1]
        in_context = torch.arange(num_tokens)[None, :] < positions[:, None]  # [n, T]
        scores = form.scores(layer_idx, query, keys, positions).amax(dim=1) * scale
        scores = scores.masked_fill(~in_context[None], float("-inf"))  # [H_kv, n, T]
        best = scores.amax(dim=-1, keepdim=True)
        within = (scores > best - alpha).sum(dim=-1)  # [H_kv, n]
        mean_count = torch.floor(within.double().mean(dim=0)).long()
        caps = torch.floor(positions.double() * budget).long().clamp(min=1)
        if token_cap is not None:
            caps = caps.clamp(max=token_cap)
        if floor:
            mean_count = torch.maximum(mean_count,
                                       torch.floor(positions.double() * floor).long())
        num_chosen = torch.minimum(mean_count, caps)  # [n]
        if rerank:
            num_candidates = torch.minimum(num_chosen * rerank, positions)
            candidates = topk_mask(scores, num_candidates, int(num_candidates.max()))
            grouped = query.float().view(num_kv_heads, -1, query.shape[1], query.shape[2])
            exact = torch.einsum("hgnd,htd->hgnt", grouped, keys.float()).amax(dim=1) * scale
            scores = exact.masked_fill(~candidates, float("-inf"))
            if counts is not None:
                counts.reranked += float(num_candidates.sum()) * num_kv_heads
        if block_size:
            chosen = block_mask(scores, positions, num_chosen, block_size)
        else:
            chosen = topk_mask(scores, num_chosen, int(num_chosen.max()))
        chosen = recent_window(chosen, positions, recent_tokens)
        if counts is not None:
            counts.add(layer_idx, float(chosen.sum()), float(positions.sum()) * num_kv_heads)
        return chosen

    return select


UNIT_SUMMARIES = ("bound", "mean")


def outward(high: torch.Tensor, low: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``high``/``low`` [..., D] as ``bits``-bit signed integers times one scale per
    row (absmax / (2^(bits-1) - 1), float16), rounded outwards (high up, low down):
    the bound stays a bound."""
    top = (1 << (bits - 1)) - 1
    scale = (torch.maximum(high.abs(), low.abs()).amax(dim=-1, keepdim=True) / top)
    scale = scale.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    up = torch.ceil(high / safe).clamp(-top - 1, top) * scale
    down = torch.floor(low / safe).clamp(-top - 1, top) * scale
    # A rounded scale may fall short of absmax / top by a float16 step: clamp keeps
    # the codes in range, and the few values past the last code lose their margin.
    return up, down


def unit_summary_scores(query: torch.Tensor, keys: torch.Tensor, unit: int,
                        summary: str, bits: int = 16) -> torch.Tensor:
    """[H_kv, n, U] each complete ``unit``-token unit's score for each row: the max over the
    KV head's query group of, for ``bound``, sum_c max(q_c min_c, q_c max_c) (Quest's upper
    bound from the unit's per-channel min and max, stored in float16), for ``mean``, q . the
    unit's mean key (a float16 landmark). Raw dot products (not scaled). ``bits`` < 16:
    the bound's min and max in ``bits``-bit integers with a float16 scale per unit and
    KV head (``outward``).

    Args:
        query: [H_q, n, D]; keys: [H_kv, T, D] (units past T // unit are absent).
    """
    num_kv_heads, num_tokens, head_dim = keys.shape
    num_units = num_tokens // unit
    units = keys[:, : num_units * unit].float().view(num_kv_heads, num_units, unit, head_dim)
    grouped = query.float().view(num_kv_heads, -1, query.shape[1], head_dim)  # [H, G, n, D]
    if summary == "bound":
        high = units.amax(dim=2).half().float()  # [H, U, D]
        low = units.amin(dim=2).half().float()
        if bits < 16:
            high, low = outward(units.amax(dim=2), units.amin(dim=2), bits)
        scores = (torch.einsum("hgnd,hud->hgnu", grouped.clamp(min=0), high)
                  + torch.einsum("hgnd,hud->hgnu", grouped.clamp(max=0), low))
    elif summary == "mean":
        scores = torch.einsum("hgnd,hud->hgnu", grouped, units.mean(dim=2).half().float())
    else:
        raise ValueError(f"summary must be one of {UNIT_SUMMARIES}, got {summary!r}")
    return scores.amax(dim=1)


def summary_bytes(head_dim: int, unit: int, summary: str, bits: int = 16) -> float:
    """Bytes per context token and KV head of a unit summary (float16 values, or
    ``bits``-bit integers and a float16 scale per unit)."""
    values = 2 if summary == "bound" else 1
    if bits >= 16:
        return head_dim * 2 * values / unit
    return (head_dim * values * bits / 8 + 2) / unit


def coarse_candidates(query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                      caps: torch.Tensor, *, unit: int, coarse: int, over: float,
                      bits: int, summary: str = "bound") -> torch.Tensor:
    """[H_kv, n, U] bool: the ``unit``-token units a two-level selection lets the fine
    level score. Each complete ``coarse``-token super-unit is scored by its
    ``summary`` (``unit_summary_scores``): ``bound``, the bound of its channels' max and
    min over its tokens in ``bits``-bit codes (at least every unit's bound inside it);
    ``mean``, q . its mean key in float16 (a landmark, not a bound). Each KV head keeps its
    ceil(``over`` x cap / coarse) best complete super-units, and the row's last,
    incomplete super-unit (the most recent tokens, no summary yet) always.

    Args:
        caps: [n] the tokens each row keeps from its complete units (k').
    """
    if coarse % unit:
        raise ValueError(f"a super-unit of {coarse} tokens is not whole units of {unit}")
    num_units = keys.shape[1] // unit
    supers = unit_summary_scores(query, keys, coarse, summary, bits)  # [H, n, S]
    complete = (torch.arange(supers.shape[-1])[None, :] + 1) * coarse <= positions[:, None]
    supers = supers.masked_fill(~complete[None], float("-inf"))
    chosen = torch.minimum(torch.ceil(caps.double() * over / coarse).long(),
                           complete.sum(dim=-1))
    width = max(1, int(chosen.max())) if supers.shape[-1] else 0
    kept = (topk_mask(supers, chosen, width) if width
            else torch.zeros_like(supers, dtype=torch.bool))
    per_unit = coarse // unit
    candidates = torch.zeros((keys.shape[0], positions.shape[0], num_units), dtype=torch.bool)
    spread = kept.repeat_interleave(per_unit, dim=-1)[..., :num_units]
    candidates[..., : spread.shape[-1]] = spread
    start = (positions // coarse * coarse)[:, None]  # the row's incomplete super-unit
    last_super = (torch.arange(num_units)[None, :] * unit) >= start
    return candidates | last_super[None]


def make_unit_selector(form: KeyForm | None, *, scale: float, budget: float, unit: int,
                       summary: str = "bound", fine: float = 0.0, bits: int = 16,
                       exact: bool = True, token_cap: int | None = None,
                       recent_tokens: int = 0, coarse: int = 0, over: float = 0.0,
                       coarse_summary: str = "bound", counts: SelectionCounts | None = None):
    """A ``Selector`` over unit summaries: coarse, then (``fine`` > 0) fine.

    A row keeps k = min(floor(budget x context), token_cap) tokens (at least 1),
    as the budget binding does. Its own unit (the one its context ends in,
    incomplete: no summary yet) is always kept, its tokens counted in k; the
    complete units share the rest, k'. Coarse only (``fine`` 0): each
    KV head keeps its ceil(k' / unit) best complete units by ``summary``.
    Coarse then fine: each KV head's ceil(fine x k' / unit) best units are the
    candidates, whose tokens ``form`` scores; the head keeps its k' best of them.
    ``exact`` (coarse only): k' tokens exactly, as the product keeps them (whole
    units, then the first tokens of the next); False: whole units, rounded up.
    ``counts.reranked`` tallies the candidates' tokens (the fine pass's reads).
    ``recent_tokens``: the last context tokens kept on top (``recent_window``).
    ``coarse`` > 0 (coarse only): the units are first narrowed to those of each KV
    head's best ``coarse``-token super-units by ``coarse_summary``, ``over`` x k'
    tokens of them (``coarse_candidates``); ``counts.reranked`` tallies their tokens
    (the units the fine level reads).
    """

    if coarse and fine:
        raise ValueError("two-level bounds (coarse) and a fine pass over the int keys "
                         "(fine) are two rules: give one")

    def select(layer_idx: int, query: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        num_kv_heads, num_tokens = keys.shape[0], keys.shape[1]
        token_ids = torch.arange(num_tokens)
        in_context = token_ids[None, :] < positions[:, None]  # [n, T]
        own_unit = (token_ids[None, :] // unit) == (positions[:, None] // unit)  # [n, T]
        caps = torch.floor(positions.double() * budget).long().clamp(min=1)
        if token_cap is not None:
            caps = caps.clamp(max=token_cap)
        # The own unit's tokens count against k (its most recent k when k is
        # smaller, as the product keeps them); the complete units share the rest.
        own_kept = torch.minimum(positions % unit, caps)
        caps = caps - own_kept
        own_unit &= token_ids[None, :] >= (positions - own_kept)[:, None]
        units = unit_summary_scores(query, keys, unit, summary, bits)  # [H, n, U]
        num_units = units.shape[-1]
        complete = (torch.arange(num_units)[None, :] + 1) * unit <= positions[:, None]  # [n, U]
        units = units.masked_fill(~complete[None], float("-inf"))
        if coarse:
            allowed = coarse_candidates(query, keys, positions, caps, unit=unit,
                                        coarse=coarse, over=over, bits=bits,
                                        summary=coarse_summary)
            units = units.masked_fill(~allowed, float("-inf"))
            if counts is not None:
                counts.reranked += float((allowed & complete[None]).sum()) * unit
        chosen_units = torch.ceil(caps.double() * max(fine, 1.0) / unit).long()
        chosen_units = torch.minimum(chosen_units, complete.sum(dim=-1))
        width = max(1, int(chosen_units.max())) if num_units else 0
        kept_units = (topk_mask(units, chosen_units, width) if width
                      else torch.zeros_like(units, dtype=torch.bool))
        tokens = torch.zeros((num_kv_heads, positions.shape[0], num_tokens), dtype=torch.bool)
        tokens[..., : num_units * unit] = kept_units.repeat_interleave(unit, dim=-1)
        if not fine and exact and num_units:
            # k' tokens exactly: the token rule over tokens scored by their unit
            # (the product's): whole units, then the first tokens of the next.
            scores = units.repeat_interleave(unit, dim=-1)
            order = torch.arange(num_units * unit, dtype=torch.float64)
            ranked = scores.double() - order * 1e-12 * scores.double().abs().clamp(min=1)
            ranked = ranked.masked_fill(~torch.isfinite(scores), float("-inf"))  # not NaN
            top = topk_mask(ranked, caps, max(1, int(caps.max())))
            tokens[..., : num_units * unit] = top & torch.isfinite(scores)
        if fine:
            candidates = tokens & in_context[None]
            scores = form.scores(layer_idx, query, keys, positions).amax(dim=1) * scale
            scores = scores.masked_fill(~candidates, float("-inf"))
            chosen = topk_mask(scores, caps, max(1, int(caps.max()))) & candidates
            if counts is not None:
                counts.reranked += float(candidates.sum())
            tokens = chosen
        chosen = recent_window((tokens | own_unit[None]) & in_context[None], positions,
                               recent_tokens)
        if counts is not None:
            counts.add(layer_idx, float(chosen.sum()), float(positions.sum()) * num_kv_heads)
        return chosen

    return select
