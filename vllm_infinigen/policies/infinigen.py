# SPDX-License-Identifier: Apache-2.0
"""InfiniGen's own policy: layer i speculates which tokens layer i+1 attends to.

In layer i, before its attention: layer i+1's query, computed from layer i's
attention input (captured by the ``qkv_proj`` pre-hook, ``ops.py``) through
layer i+1's query projection and rotary embedding, is skewed to the partial
channels and scored against layer i+1's partial keys by the compiled
``select_tokens`` kernel (alpha count capped by the budget, per-head top-k,
sink/recent window). No per-slot state besides the partial keys, which every
sparse layer keeps (``layer_state.py``).
"""

from __future__ import annotations

import torch

from vllm_infinigen import kernels
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layer_state import LayerState
from vllm_infinigen.policies.base import SelectionPolicy
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


class InfiniGenPolicy(SelectionPolicy):
    name = "infinigen"
    selects_ahead = True
    supports_capped_pool = True

    def select_ahead(self, source: LayerState, plan: StepPlan, settings: InfiniGenConfig,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        target = source.next
        hidden = source.captured_input
        if hidden is None:
            raise RuntimeError(
                f"InfiniGen: layer {source.layer_idx} has no captured attention "
                "input; the qkv_proj pre-hook did not run"
            )
        rows = plan.sparse_rows
        query = partial_query(target, hidden[rows.tokens], rows.context_lens)
        selection, _ = kernels.select_tokens(
            query, target.partial_keys, rows.block_table, rows.context_lens,
            scale=target.scale, alpha=settings.alpha, budget=settings.budget,
            sink_tokens=settings.sink_tokens, recent_tokens=settings.recent_tokens,
            row_map=row_map)
        return selection
