# SPDX-License-Identifier: Apache-2.0
"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", NeurIPS 2023) as a selection policy.

Half the budget goes to the most recent tokens, half to the tokens with the
largest attention accumulated so far (prompt rows included), per KV head; a
token left out once is evicted for good. State per sparse layer, by slot id
(the last row takes padding)::

    accumulated  [num_slots + 1, H_kv] float32  attention received so far
    alive        [num_slots + 1, H_kv] bool     not evicted yet
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.policies.base import (
    Selection,
    SelectionPolicy,
    as_positions,
    from_position_mask,
    sparse_slots,
)
from vllm_infinigen.block_layout import block_coordinates, entries_of, widest

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.step_plan import StepPlan


def h2o_select(accumulated: torch.Tensor, alive: torch.Tensor, context_lens: torch.Tensor,
               token_caps: torch.Tensor, width: int) -> Selection:
    """Heavy hitters and recent tokens among those not evicted yet.

    Args:
        accumulated: [B, H_kv, N] attention each token has received so far.
        alive: [B, H_kv, N] tokens not evicted (and within the context).
        context_lens: [B].
        token_caps: [B] the budget in tokens (``step_plan.token_budget``).

    Returns:
        The kept tokens; everything else alive in the context is evicted by
        the caller.
    """
    num_tokens = accumulated.shape[-1]
    caps = token_caps[:, None, None]  # [B, 1, 1]
    lens = context_lens.to(torch.int64)[:, None, None]
    positions = torch.arange(num_tokens, device=accumulated.device)[None, None]
    alive = alive & (positions < lens)
    recent = (positions >= lens - caps // 2) & alive
    num_heavy = caps - recent.sum(dim=-1, keepdim=True)
    candidates = accumulated.float().masked_fill(~alive | recent, float("-inf"))
    rank = torch.argsort(torch.argsort(candidates, dim=-1, descending=True), dim=-1)
    heavy = (rank < num_heavy) & (candidates > float("-inf"))
    return from_position_mask(recent | heavy, width)


@dataclass
class _Scores:
    accumulated: torch.Tensor  # [num_slots + 1, H_kv] float32
    alive: torch.Tensor  # [num_slots + 1, H_kv] bool


class H2OPolicy(SelectionPolicy):
    name = "h2o"
    records_attention = True

    def __init__(self) -> None:
        self._scores: dict[int, _Scores] = {}  # by layer index

    def allocate(self, layer: LayerState) -> None:
        if layer.layer_idx in self._scores:
            return
        shape, device = (layer.num_slots + 1, layer.num_kv_heads), layer.kv_pool.device
        self._scores[layer.layer_idx] = _Scores(
            accumulated=torch.zeros(shape, dtype=torch.float32, device=device),
            alive=torch.ones(shape, dtype=torch.bool, device=device))

    def on_write(self, layer: LayerState, key: torch.Tensor, slots: torch.Tensor) -> None:
        scores = self._scores[layer.layer_idx]
        slots = torch.where(slots < 0, layer.num_slots, slots)
        scores.accumulated[slots] = 0
        scores.alive[slots] = True

    def select(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
               settings: InfiniGenConfig, row_map: torch.Tensor | None) -> torch.Tensor:
        scores = self._scores[layer.layer_idx]
        rows = plan.sparse_rows
        slots, context_lens = sparse_slots(plan), rows.context_lens  # slots: [S, N]
        selection = h2o_select(
            scores.accumulated[slots].permute(0, 2, 1), scores.alive[slots].permute(0, 2, 1),
            context_lens, rows.token_caps, widest(rows.context_host, rows.caps_host))
        # Permanent eviction: whatever was not kept is gone for this request.
        num_tokens = slots.shape[1]
        device = slots.device
        kept = torch.zeros((slots.shape[0], layer.num_kv_heads, num_tokens), dtype=torch.bool,
                           device=device)
        kept.scatter_(-1, selection.positions, selection.valid)
        in_context = torch.arange(num_tokens, device=device)[None] < context_lens[:, None]
        heads = torch.arange(layer.num_kv_heads, device=device)[None, None, :]
        drop = (~kept.permute(0, 2, 1)) & in_context[..., None]
        scores.alive[slots[..., None].expand_as(drop)[drop], heads.expand_as(drop)[drop]] = False
        return as_positions(selection)

    def on_attend(self, layer: LayerState, plan: StepPlan, positions: torch.Tensor,
                  probs: torch.Tensor) -> None:
        positions = positions.to(torch.int64)
        valid = positions >= 0
        slots = torch.gather(sparse_slots(plan), 1,
                             positions.clamp(min=0).flatten(1)).view_as(positions)
        heads = torch.arange(layer.num_kv_heads, device=positions.device)[None, :, None].expand_as(
            positions)
        self._scores[layer.layer_idx].accumulated.index_put_(
            (slots[valid], heads[valid]), probs[valid], accumulate=True)

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> bool:
        """Causal attention that also accumulates the attention each token
        receives (H2O scores the prompt too). Pure torch, per request.

        query, output: [T, H_q, D], written in place.
        """
        accumulated = self._scores[layer.layer_idx].accumulated
        group = layer.num_heads // layer.num_kv_heads
        pool_device, device = layer.kv_pool.device, query.device
        for request in plan.prompt_requests.tolist():
            start, end = int(plan.query_start[request]), int(plan.query_start[request + 1])
            seq_len = int(plan.seq_lens[request])
            table = plan.all_block_table[request : request + 1]
            everything = torch.arange(seq_len, device=pool_device).expand(
                1, layer.num_kv_heads, seq_len).contiguous()
            entries = entries_of(layer.kv_pool, table.to(pool_device), everything,
                                 row_map)[0].to(device=device, dtype=torch.float32)
            keys = entries[..., : layer.head_size].repeat_interleave(group, 0)  # [H_q, L, D]
            values = entries[..., layer.head_size :].repeat_interleave(group, 0)
            first = seq_len - (end - start)  # position of the first query row
            causal = (torch.arange(seq_len, device=device)[None, :]
                      <= first + torch.arange(end - start, device=device)[:, None])  # [rows, L]
            queries = query[start:end].transpose(0, 1).float()  # [H_q, rows, D]
            logits = torch.einsum("hqd,hkd->hqk", queries, keys) * layer.scale
            probs = torch.softmax(logits.masked_fill(~causal[None], float("-inf")), dim=-1)
            output[start:end] = torch.einsum("hqk,hkd->hqd", probs, values).transpose(0, 1).to(
                output.dtype)
            received = probs.sum(dim=1).view(layer.num_kv_heads, group, -1).sum(dim=1)
            block_ids, offsets = block_coordinates(torch.arange(seq_len, device=device)[None],
                                                   table, plan.block_size)
            accumulated[(block_ids * plan.block_size + offsets)[0]] += received.t()
        return True
