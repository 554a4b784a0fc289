# SPDX-License-Identifier: Apache-2.0
"""Worker side: who picks a sparse layer's tokens, per ``--infinigen-policy``.

- ``infinigen``: layer i speculates for layer i+1 (``speculate``): layer
  i+1's query from layer i's attention input, skewed, scored against layer
  i+1's partial keys by the compiled ``select_tokens`` kernel.
- ``streaming``, ``h2o``, ``quest``: the layer selects for itself from its own
  query and state (``select_in_layer``; rules in ``baselines.py``).

Every policy leaves ``state.selection``: [S, H_kv, K] int32 ascending
positions, -1 padded, for the step's sparse rows.
"""

from __future__ import annotations

import torch

from vllm_infinigen import baselines, kernels
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.kernels.reference import block_coordinates, entries_of
from vllm_infinigen.layer_state import LayerState
from vllm_infinigen.selector import Selection, max_selected
from vllm_infinigen.step_plan import StepPlan


def partial_query(target: LayerState, hidden: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """[S, H_kv, G, R] skewed partial query of ``target`` from attention inputs [S, hidden]."""
    q_size = target.num_heads * target.head_size
    projection = target.query_proj
    if projection is not None:  # only the query rows, prepacked as vLLM's own
        query = projection.cpu_linear(hidden, projection.weight, projection.bias)
    else:
        qkv, _ = target.qkv_proj.forward(hidden)  # not __call__: skip its capture hook
        query = qkv[:, :q_size]
    if target.rotary_emb is not None:
        query, _ = target.rotary_emb(positions, query.contiguous(), None)
    group = target.num_heads // target.num_kv_heads
    # query: [S, H_kv, G, D] x skew [H_kv, D, R] -> [S, H_kv, G, R]
    query = query.float().view(-1, target.num_kv_heads, group, target.head_size)
    return torch.einsum("bhgd,hdr->bhgr", query, target.skew).contiguous()


def speculate(state: LayerState, plan: StepPlan, config: InfiniGenConfig, alpha: float,
              row_map: torch.Tensor | None) -> None:
    """Layer ``state`` selects the tokens of ``state.next`` for the step's sparse rows."""
    target = state.next
    if state.captured_input is None:
        raise RuntimeError(
            f"InfiniGen: layer {state.layer_idx} has no captured attention "
            "input; the qkv_proj pre-hook did not run"
        )
    rows = plan.sparse_rows
    query = partial_query(target, state.captured_input[rows.tokens], rows.context_lens)
    target.selection, _ = kernels.select_tokens(
        query, target.partial_keys, rows.block_table, rows.context_lens,
        scale=target.scale, alpha=alpha, budget=config.budget,
        sink_tokens=config.sink_tokens, recent_tokens=config.recent_tokens, row_map=row_map)


def _as_positions(selection: Selection) -> torch.Tensor:
    """[B, H_kv, K] int32 ascending positions, -1 padded, of a baseline's selection."""
    positions = selection.positions.masked_fill(~selection.valid, -1)
    order = torch.where(positions < 0, torch.iinfo(torch.int64).max, positions)
    return positions.gather(-1, order.argsort(dim=-1)).to(torch.int32).contiguous()


def select_in_layer(state: LayerState, plan: StepPlan, config: InfiniGenConfig,
                    query: torch.Tensor) -> None:
    """A baseline policy selects for ``state`` from its own state and query [T, H_q, D]."""
    policy, budget = config.policy, config.budget
    rows = plan.sparse
    context_lens = plan.context_lens[rows]
    context_host = [plan.context_host[i] for i in rows.tolist()]
    slots = plan.context_slots[rows]  # [S, N]
    num_tokens = slots.shape[1]
    if policy == "streaming":
        selection = baselines.streaming_select(
            context_lens, budget, state.num_kv_heads, num_tokens,
            max_selected(context_host, budget, 0))
    elif policy == "h2o":
        selection = baselines.h2o_select(
            state.h2o_accumulated[slots].permute(0, 2, 1),
            state.h2o_alive[slots].permute(0, 2, 1),
            context_lens, budget, max_selected(context_host, budget, 0))
        # Permanent eviction: whatever was not kept is gone for this request.
        kept = torch.zeros((slots.shape[0], state.num_kv_heads, num_tokens), dtype=torch.bool)
        kept.scatter_(-1, selection.positions, selection.valid)
        in_context = torch.arange(num_tokens)[None] < context_lens[:, None]
        heads = torch.arange(state.num_kv_heads)[None, None, :]
        drop = (~kept.permute(0, 2, 1)) & in_context[..., None]
        state.h2o_alive[slots[..., None].expand_as(drop)[drop],
                        heads.expand_as(drop)[drop]] = False
    else:
        page = baselines.QUEST_PAGE_SIZE
        starts = torch.arange(0, num_tokens, page)
        page_ids = slots[:, starts] // page  # [S, P]
        page_min, page_max = state.quest_min[page_ids], state.quest_max[page_ids]
        if config.eval_dense_prefix is not None and plan.has_other_rows:
            _quest_bounds_as_in_decode(state, plan, page_min, page_max)
        selection = baselines.quest_select(
            query[plan.tokens[rows]], page_min, page_max,
            context_lens, budget, baselines.quest_num_slots(context_host, budget))
    state.selection = _as_positions(selection)


def accumulate_h2o(state: LayerState, plan: StepPlan, positions: torch.Tensor,
                   probs: torch.Tensor) -> None:
    """Adds the attention each selected token received: positions, probs [S, H_kv, K]."""
    positions = positions.to(torch.int64)
    valid = positions >= 0
    slots = torch.gather(plan.context_slots[plan.sparse], 1,
                         positions.clamp(min=0).flatten(1)).view_as(positions)
    heads = torch.arange(state.num_kv_heads)[None, :, None].expand_as(positions)
    state.h2o_accumulated.index_put_((slots[valid], heads[valid]), probs[valid],
                                     accumulate=True)


def _quest_bounds_as_in_decode(state: LayerState, plan: StepPlan, page_min: torch.Tensor,
                               page_max: torch.Tensor) -> None:
    """Evaluation mode: each row's last page bounds the keys up to the row only.

    The page bounds hold every key this step wrote, later prompt rows
    included; a decode step at position p bounds positions page_start..p.
    page_min, page_max: [S, P, H_kv, D], changed in place.
    """
    page = baselines.QUEST_PAGE_SIZE
    context_lens = plan.context_lens[plan.sparse]
    last = context_lens // page  # [S] page of each row's own position
    positions = last[:, None] * page + torch.arange(page)
    upto = positions <= context_lens[:, None]  # [S, page]
    clamped = torch.minimum(positions, context_lens[:, None])
    block_ids = torch.gather(plan.block_table[plan.sparse].to(torch.int64), 1,
                             clamped // plan.block_size)
    slots = block_ids * plan.block_size + clamped % plan.block_size
    keys = state.keys_at(slots).to(page_min.dtype)  # [S, page, H_kv, D]
    hidden = ~upto[..., None, None]
    low = keys.masked_fill(hidden, float("inf")).amin(dim=1)  # [S, H_kv, D]
    high = keys.masked_fill(hidden, float("-inf")).amax(dim=1)
    rows = torch.nonzero(last < page_min.shape[1]).flatten()
    page_min[rows, last[rows]] = low[rows]
    page_max[rows, last[rows]] = high[rows]


def attend_prompt_h2o(state: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> None:
    """H2O's prompt rows: causal attention that also accumulates the attention
    each token receives (H2O scores prefill too). Pure torch, per request.

    query, output: [T, H_q, D], written in place.
    """
    group = state.num_heads // state.num_kv_heads
    for request in plan.prompt_requests.tolist():
        start, end = int(plan.query_start[request]), int(plan.query_start[request + 1])
        seq_len = int(plan.seq_lens[request])
        table = plan.all_block_table[request : request + 1]
        everything = torch.arange(seq_len).expand(1, state.num_kv_heads, seq_len).contiguous()
        entries = entries_of(state.kv_pool, table, everything, row_map)[0].float()  # [H_kv, L, 2D]
        keys = entries[..., : state.head_size].repeat_interleave(group, 0)
        values = entries[..., state.head_size :].repeat_interleave(group, 0)
        first = seq_len - (end - start)  # position of the first query row
        causal = (torch.arange(seq_len)[None, :]
                  <= first + torch.arange(end - start)[:, None])  # [rows, L]
        queries = query[start:end].transpose(0, 1).float()  # [H_q, rows, D]
        logits = torch.einsum("hqd,hkd->hqk", queries, keys) * state.scale
        probs = torch.softmax(logits.masked_fill(~causal[None], float("-inf")), dim=-1)
        output[start:end] = torch.einsum("hqk,hkd->hqd", probs, values).transpose(0, 1).to(
            output.dtype)
        received = probs.sum(dim=1).view(state.num_kv_heads, group, -1).sum(dim=1)  # [H_kv, L]
        block_ids, offsets = block_coordinates(torch.arange(seq_len)[None], table,
                                               plan.block_size)
        slots = (block_ids * plan.block_size + offsets)[0]
        state.h2o_accumulated[slots] += received.t()
