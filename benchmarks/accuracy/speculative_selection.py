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
(``vllm_infinigen.platforms.cuda.block_selection``): a block scores its best
token, k rounds up to blocks, and the first block and the row's own are kept.
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
    from vllm_infinigen.platforms.cuda import block_selection

    num_heads, num_rows, num_tokens = scores.shape
    padded = -(-num_tokens // block_size) * block_size + block_size  # room for the own block
    token_scores = torch.full((num_rows, num_heads, padded), float("-inf"))
    token_scores[..., :num_tokens] = scores.permute(1, 0, 2)
    blocks = block_selection.block_scores(token_scores, positions, block_size)
    chosen = block_selection.select_blocks(blocks, positions, num_chosen,
                                           block_size=block_size, width=blocks.shape[-1])
    kept = torch.zeros((num_rows, num_heads, blocks.shape[-1] + 1), dtype=torch.bool)
    kept.scatter_(-1, chosen.logical.clamp(min=-1) % (blocks.shape[-1] + 1),
                  chosen.logical >= 0)
    tokens = kept[..., :-1].repeat_interleave(block_size, dim=-1)[..., :num_tokens]
    in_context = torch.arange(num_tokens)[None, :] < positions[:, None]
    return (tokens & in_context[:, None, :]).permute(1, 0, 2)


def make_selector(form: KeyForm, *, scale: float, alpha: float, budget: float,
                  rerank: int = 0, block_size: int = 0, token_cap: int | None = None,
                  floor: float = 0.0, counts: SelectionCounts | None = None):
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
        if counts is not None:
            selected = float(chosen.sum())
            context = float(positions.sum()) * num_kv_heads
            counts.selected += selected
            counts.context += context
            tally = counts.per_layer.setdefault(layer_idx, [0.0, 0.0])
            tally[0] += selected
            tally[1] += context
        return chosen

    return select
