# SPDX-License-Identifier: Apache-2.0
"""Worker side: installs InfiniGen into a loaded vLLM model (attention impls, hooks, specs)."""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layer_state import LayerState
from vllm_infinigen.ops import capture_pre_hook
from vllm_infinigen.runtime import InfiniGenRuntime
from vllm_infinigen.spec import InfiniGenSparseSpec

logger = init_logger(__name__)


class InfiniGenImplMixin:
    """Mixed into a layer's attention impl class; runs InfiniGen around it.

    ``install`` adds the instance attributes ``infinigen_runtime`` and
    ``infinigen_layer``. Dense layers run the platform kernel; sparse layers
    never touch vLLM's cache (their KV-cache group has no blocks).
    """

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        state = self.infinigen_layer
        if not state.sparse:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        runtime = self.infinigen_runtime
        context = get_forward_context()
        slots = context.slot_mapping[runtime.reference_layer]
        runtime.begin_step(context.attn_metadata[runtime.reference_layer], slots)
        num_tokens = slots.shape[0]
        state.write(key[:num_tokens], value[:num_tokens], slots, runtime.row_map(state))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        runtime, state = self.infinigen_runtime, self.infinigen_layer
        block_size = kv_cache.shape[2]
        context = get_forward_context()
        dense_metadata = context.attn_metadata[runtime.reference_layer]
        runtime.begin_step(dense_metadata, context.slot_mapping[runtime.reference_layer])
        plan = runtime.plan_for(dense_metadata, block_size)
        speculates = bool(plan.sparse.numel()) and runtime.config.policy == "infinigen"
        # Evaluation mode: prompt rows select among this step's own tokens,
        # whose partial keys in the next layer do not exist before that layer
        # runs: the next layer runs this layer's speculation itself, after
        # writing them (same inputs, same result as in decode).
        deferred = speculates and plan.has_other_rows and runtime.config.eval_dense_prefix is not None
        if state.next is not None and speculates and not deferred:
            runtime.speculate(state, plan)
        if not (state.next is not None and deferred):
            state.captured_input = None
        if not state.sparse:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        if deferred:
            previous = runtime.layers[state.layer_idx - 1]
            runtime.speculate(previous, plan)
            previous.captured_input = None
        if plan.has_other_rows:
            runtime.attend_prompt(state, plan, query, output)
        if plan.num_decodes:
            runtime.attend_decode(state, plan, query, output)
        return output


def install(model: torch.nn.Module, vllm_config, config: InfiniGenConfig,
            skew: list[torch.Tensor], alpha: float, device: torch.device,
            query_weights: dict[int, torch.nn.Module] | None = None) -> InfiniGenRuntime:
    """Wraps the attention layers of ``model`` and hooks the speculating layers.

    Args:
        skew: Per layer [H_kv of this rank, D, R] skew slices.
        query_weights: {layer_idx: query projection} of the sparse layers
            (``query_weights.py``); a layer without one speculates through
            its whole ``qkv_proj``.
    """
    from vllm.model_executor.layers.attention import Attention

    attention = {
        name: module
        for name, module in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(module, Attention)
    }
    by_index = sorted((extract_layer_index(name), name) for name in attention)
    if [idx for idx, _ in by_index] != list(range(len(by_index))):
        raise ValueError("InfiniGen needs one attention layer per decoder layer")
    modules = dict(model.named_modules())
    layers = []
    for idx, name in by_index:
        self_attn = modules.get(name.rsplit(".", 1)[0])
        state = LayerState(idx, name, attention[name], self_attn,
                           sparse=idx >= config.dense_layers)
        state.skew = skew[idx].to(device=device, dtype=torch.float32).contiguous()
        if state.sparse and query_weights and idx in query_weights:
            state.query_proj = query_weights[idx]
        layers.append(state)
    runtime = InfiniGenRuntime(config, alpha, layers, device)
    runtime.reference_layer = by_index[0][1]  # layer 0 is always dense
    for idx, name in by_index:
        state = layers[idx]
        impl = attention[name].impl
        if state.sparse:
            attention[name].get_kv_cache_spec = _sparse_spec_getter(attention[name])
        if idx + 1 < len(layers) and layers[idx + 1].sparse:
            state.next = layers[idx + 1]
            if state.next.qkv_proj is None or state.qkv_proj is None:
                raise ValueError(f"InfiniGen: layer {name} has no qkv_proj to hook")
            state.qkv_proj.register_forward_pre_hook(capture_pre_hook(name))
        # A new impl of a subclass, with the same attributes: the layer looks
        # its impl up at every call, so the swap holds under torch.compile.
        base = type(impl)
        wrapped = object.__new__(type(f"InfiniGen{base.__name__}", (InfiniGenImplMixin, base), {}))
        wrapped.__dict__.update(impl.__dict__)
        wrapped.infinigen_runtime = runtime
        wrapped.infinigen_layer = state
        attention[name].impl = wrapped
    sparse = [s.layer_idx for s in layers if s.sparse]
    logger.info(
        "InfiniGen: %d layers, dense %s, sparse %s, alpha %.2f, budget %.2f, "
        "partial rank %d of %d, dense below %d context tokens; speculation through %s",
        len(layers), [s.layer_idx for s in layers if not s.sparse], sparse,
        alpha, config.budget, skew[0].shape[-1], layers[0].head_size, config.min_context,
        "the query slice of qkv_proj" if all(s.query_proj is not None for s in layers
                                             if s.sparse) else "the whole qkv_proj",
    )
    return runtime


def _sparse_spec_getter(attn: torch.nn.Module):
    """The layer's ``get_kv_cache_spec``, returning the pool-backed sparse spec."""
    original = attn.get_kv_cache_spec

    def get_kv_cache_spec(vllm_config):
        spec = original(vllm_config)
        return None if spec is None else InfiniGenSparseSpec.of(spec)

    return get_kv_cache_spec
