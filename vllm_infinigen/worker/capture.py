# SPDX-License-Identifier: Apache-2.0
"""The custom op through which a layer's attention input reaches InfiniGen.

A forward pre-hook on ``self_attn.qkv_proj`` of a speculating layer calls this
op, which hands the post-norm hidden states to that layer's InfiniGen state and
returns a copy that the projection consumes. Being an opaque op with a data
dependency, it stays in place and in order under torch.compile.
"""

from __future__ import annotations

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.utils.torch_utils import direct_register_custom_op

_LIBRARY = Library("vllm_infinigen", "FRAGMENT")


def capture_attention_input(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Stores ``hidden_states`` ([T, hidden]) for the attention layer ``layer_name``."""
    if is_forward_context_available():
        context = get_forward_context()
        impl = getattr(context.no_compile_layers.get(layer_name), "impl", None)
        state = getattr(impl, "infinigen_layer", None)
        if (state is not None and context.attn_metadata is not None
                and impl.infinigen_runtime.speculates(context.attn_metadata)):
            # A private copy: the compiler may reuse the input's buffer
            # before the attention op of this layer runs.
            state.capture(hidden_states.clone())
    return hidden_states.clone()


def _capture_attention_input_fake(
    hidden_states: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op(
    op_name="capture_attention_input",
    op_func=capture_attention_input,
    fake_impl=_capture_attention_input_fake,
    target_lib=_LIBRARY,
)


def capture_pre_hook(layer_name: str):
    """A forward pre-hook for a ``qkv_proj`` module, routed through the op."""

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        captured = torch.ops.vllm_infinigen.capture_attention_input(args[0], layer_name)
        return (captured, *args[1:])

    return hook
