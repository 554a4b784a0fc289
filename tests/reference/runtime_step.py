# SPDX-License-Identifier: Apache-2.0
"""One decode step of a runtime over hand-built layers, shared by the runtime's tests
on the CPU platform's data path (``tests/unit/test_runtime.py``) and on the CUDA
platform's (``tests/unit/test_cuda_runtime.py``): three layers of one head of
``DIM`` channels (q = k = v = the attention input; layer 0 dense), one request
whose ``CONTEXT`` tokens sit in layer 2 with the ``IMPORTANT`` ones' keys
matching the query, and the new token attending to chosen positions
(``attention_over``, the reference)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.worker.data_path import DataPath
from vllm_infinigen.worker.layer_state import LayerSource
from vllm_infinigen.worker.runtime import InfiniGenRuntime

DIM, BLOCK, CONTEXT = 4, 16, 32
IMPORTANT = [5, 17, 30]  # the context tokens whose keys match the query


class _QKV(torch.nn.Module):
    """q = k = v = the attention input (one head of ``DIM`` channels)."""

    def forward(self, hidden: torch.Tensor):
        return torch.cat([hidden, hidden, hidden], dim=-1), None


def layer_source(index: int, keys: str = "partial") -> LayerSource:
    """Layer ``index``; ``keys``: partial keys over an identity skew, or the int keys."""
    impl = SimpleNamespace(num_heads=1, num_kv_heads=1, head_size=DIM,
                           scale=1 / math.sqrt(DIM))
    self_attn = torch.nn.Module()
    self_attn.qkv_proj = _QKV()
    return LayerSource(index, f"model.layers.{index}.self_attn.attn",
                       SimpleNamespace(impl=impl), self_attn,
                       skew=torch.eye(DIM)[None].contiguous() if keys == "partial" else None,
                       query_proj=None)


def build_step(keys: str, make_data_path: Callable[[InfiniGenConfig], DataPath]):
    """A runtime (layer 0 dense, 1 and 2 sparse) holding one request's 32
    context tokens in layer 2, and the dense metadata of its next decode step;
    ``keys``: either form of speculation keys; the platform's data path. No
    recent window: the selection is the alpha rule's tokens alone."""
    config = InfiniGenConfig(alpha=1.0, budget=1.0, dense_layers=1, min_context=0,
                             recent_tokens=0, speculation_keys=keys)
    layout = ModelLayout("llama", num_layers=3, num_heads=1, num_kv_heads=1, head_dim=DIM,
                         dense_layers=1, partial_ratio=1.0)
    runtime = InfiniGenRuntime(config, [layer_source(i, keys) for i in range(3)],
                               torch.device("cpu"), make_data_path(config), layout=layout)
    assert runtime.layers[2].int_keys == (keys == "int")
    runtime.allocate_pool(PoolPlan(num_rows=4 * BLOCK, num_slots=4 * BLOCK, block_size=BLOCK,
                                   num_bytes=0, sized_by=""), num_blocks=4, dtype=torch.float32)
    context_keys = torch.zeros(CONTEXT, 1, DIM)
    context_keys[IMPORTANT, 0, 0] = 1.0
    values = torch.arange(CONTEXT, dtype=torch.float32).view(CONTEXT, 1, 1).repeat(1, 1, DIM)
    runtime.write(runtime.layers[2], context_keys, values, torch.arange(CONTEXT))
    metadata = SimpleNamespace(query_start_loc=torch.tensor([0, 1]),
                               seq_lens=torch.tensor([CONTEXT + 1]),
                               block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32))
    return runtime, metadata, torch.tensor([CONTEXT])  # the new token's slot


def attend_layer2(runtime, metadata, new_slot, query: torch.Tensor) -> torch.Tensor:
    """Layer 2's attention in the step: writes its new K/V, attends; [1, 1, DIM]."""
    layer = runtime.layers[2]
    runtime.write(layer, query, query, new_slot)
    plan = runtime.begin_layer(layer, metadata, new_slot, block_size=BLOCK)
    output = torch.zeros(1, 1, DIM)
    runtime.attend(layer, plan, query, output)
    return output


def attention_over(positions: list[int], query: torch.Tensor) -> torch.Tensor:
    """Reference: the new token attends to ``positions`` and itself."""
    keys = torch.zeros(CONTEXT + 1, DIM)
    keys[IMPORTANT, 0] = 1.0
    keys[CONTEXT] = query.view(DIM)
    values = torch.arange(CONTEXT + 1, dtype=torch.float32)[:, None].repeat(1, DIM)
    values[CONTEXT] = query.view(DIM)
    chosen = positions + [CONTEXT]
    probs = torch.softmax(keys[chosen] @ query.view(DIM) / math.sqrt(DIM), dim=0)
    return (probs @ values[chosen]).view(1, 1, DIM)
