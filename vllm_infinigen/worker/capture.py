# SPDX-License-Identifier: Apache-2.0
"""The custom op through which a layer's attention input reaches InfiniGen.

A forward pre-hook on ``self_attn.qkv_proj`` of a speculating layer calls this
op, which copies the post-norm hidden states into that layer's capture buffer
(``LayerState.capture``) and returns a copy that the projection consumes. The
returned copy is what keeps the op: an opaque op whose result nothing reads
would be dropped under torch.compile, and an op's output may not alias its
input. Being consumed by ``qkv_proj``, it also runs before the layer's attention.

CUDA graphs. The op is no splitting op: under piecewise graphs it sits inside
a captured piece, and in a full decode graph everything does. A replay runs the
recorded copy kernel and none of this Python, so

- the copy goes into a persistent buffer (``capture_buffers.CaptureBuffers``: allocated before
  any capture, never moved), which the speculation reads
  (``LayerState.captured_input``) where the replayed copy wrote;
- off the CPU the op copies at every call, whatever the step: a condition read
  on the host would be frozen at capture (vLLM captures piecewise graphs with no
  attention metadata). On the CPU build, where nothing is captured, a step that
  does not speculate (``runtime.speculates``) skips the copy.
"""

from __future__ import annotations

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.utils.torch_utils import direct_register_custom_op

_LIBRARY = Library("vllm_infinigen", "FRAGMENT")


def capture_attention_input(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Copies ``hidden_states`` ([T, hidden]) into the capture buffer of the
    attention layer ``layer_name``; returns a copy for ``qkv_proj``."""
    if is_forward_context_available():
        context = get_forward_context()
        impl = getattr(context.no_compile_layers.get(layer_name), "impl", None)
        state = getattr(impl, "infinigen_layer", None)
        if state is not None and (
                impl.infinigen_runtime.data_path.plans_on_device  # may be captured: always
                or (context.attn_metadata is not None
                    and impl.infinigen_runtime.speculates(context.attn_metadata))):
            state.capture(hidden_states)
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
