# SPDX-License-Identifier: Apache-2.0
"""InfiniGen's own policy: which tokens a sparse layer attends to, from its
query scored against its speculation keys (``--infinigen-speculation-keys``:
every key channel in a few bits, or the paper's skewed partial keys).

``--infinigen-speculation previous-layer`` (default, the paper): in layer i,
before its attention, layer i+1's query, computed from layer i's attention
input (captured by the ``qkv_proj`` pre-hook, ``worker/capture.py``) through layer i+1's
query projection and rotary embedding, selects for layer i+1, so the entries
can be on their way before layer i+1 runs. ``same-layer``: each sparse layer
selects with its own query, in its own attention (no prefetch; where host and
device memory are one, as on the CPU build, nothing is lost by waiting).
Either way the query is the policy's and the rule runs where the data path
keeps the keys, at its granularity (``LayerState.selector``): the CPU
platform's compiled kernels select tokens (alpha count capped by the budget,
per-head top-k, sink/recent window), the CUDA platform's Triton kernels
select whole blocks on the device. No per-slot state besides the speculation
keys, which every sparse layer keeps (``worker/layer_state.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import vllm_infinigen.platforms.devices as devices
from vllm_infinigen.policies.base import SelectionPolicy

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.step_plan import StepPlan


def partial_query(target: LayerState, hidden: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """[S, H_kv, G, R] skewed partial query of ``target`` from attention inputs [S, hidden].

    The query is what ``target``'s own attention would compute from ``hidden``,
    through the target layer's own modules, in the model's order: projection,
    per-head ``q_norm`` when the model has one (Qwen3: RMSNorm over each
    head's D channels, before RoPE), then ``rotary_emb`` (vLLM's object, so
    rope scaling such as Llama 3's is applied as in the model). A platform's
    query projection (``target.query_proj``) may apply the rotary module's
    rule itself (``rotated``: None where it cannot), when no norm comes between.
    """
    num_heads, head_size = target.num_heads, target.head_size
    projection = target.query_proj
    if projection is not None and target.q_norm is None and target.rotary_emb is not None:
        # The platform's projection and RoPE in one op, where it can.
        query = projection.rotated(hidden, positions, target.rotary_emb)
        if query is not None:
            return skewed(target, query)
    if projection is not None:  # only the query rows (a platform's copy)
        query = projection(hidden)
    else:
        # vLLM's LoRA wraps qkv_proj (its kernels index the step's every token, not
        # these rows): the base weights, as the CPU build's copy (README, Limits)
        module = getattr(target.qkv_proj, "base_layer", target.qkv_proj)
        qkv, _ = module.forward(hidden)  # not __call__: skip its capture hook
        query = qkv[:, :num_heads * head_size]
    if target.q_norm is not None:
        # query: [S, H_q * D] -> per head [S, H_q, D], as vLLM's Qwen3Attention.
        query = target.q_norm(query.reshape(-1, num_heads, head_size)).reshape(
            -1, num_heads * head_size)
    if target.rotary_emb is not None:
        query = devices.rotate(target.rotary_emb, positions, query)
    return skewed(target, query)


def skewed(layer: LayerState, query: torch.Tensor) -> torch.Tensor:
    """[S, H_kv, G, R] query the speculation scores, from queries [S, H_q, D]: the
    partial query (skewed, R channels, float32), or every channel for the
    bounds and int keys (a view in the query's dtype: the selection converts
    what it reads)."""
    group = layer.num_heads // layer.num_kv_heads
    query = query.reshape(-1, layer.num_kv_heads, group, layer.head_size)
    if layer.every_channel:
        return query
    return torch.einsum("bhgd,hdr->bhgr", query.float(), layer.skew).contiguous()


class InfiniGenPolicy(SelectionPolicy):
    name = "infinigen"

    def selects_ahead(self, settings: InfiniGenConfig) -> bool:
        return settings.speculation == "previous-layer"

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
        query = partial_query(target, hidden[rows.tokens], rows.rope_positions)
        return _select(target, plan, query, row_map)

    def select(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
               settings: InfiniGenConfig, row_map: torch.Tensor | None) -> torch.Tensor:
        return _select(layer, plan, skewed(layer, query[plan.sparse_rows.tokens]), row_map)


def _select(layer: LayerState, plan: StepPlan, query: torch.Tensor,
            row_map: torch.Tensor | None) -> object:
    """The selection of ``layer``'s sparse rows for a query [S, H_kv, G, R]
    (``skewed``), by the data path's ``selector`` at its own granularity."""
    if layer.selector is None:
        raise RuntimeError(f"layer {layer.layer_idx} has no selector: its data path's "
                           "allocate did not run")
    return layer.selector(plan.sparse_rows, query, row_map)
