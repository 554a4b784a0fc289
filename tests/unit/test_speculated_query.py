# SPDX-License-Identifier: Apache-2.0
"""The speculated query through the next layer's own ``qkv_proj`` (where the
platform keeps no copy of its query rows: CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_infinigen.policies.infinigen import partial_query


class _LoRAWrapper(torch.nn.Module):
    """vLLM's LoRA layers wrap the linear as ``base_layer``; their kernels read
    the step's token-to-adapter map, every token's, so rows gathered from the
    step's tokens must not go through them."""

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.base_layer = base

    def forward(self, hidden):
        raise AssertionError("the LoRA kernels ran on the selecting rows alone")


class _Linear(torch.nn.Module):
    """vLLM's linear layers return (output, bias)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, hidden):
        return hidden @ self.weight.T, None


def test_lora_speculates_through_the_base_layer():
    heads, kv_heads, dim, hidden_size = 2, 1, 4, 6
    weight = torch.randn((heads + 2 * kv_heads) * dim, hidden_size)
    hidden = torch.randn(3, hidden_size)
    target = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=dim,
                             query_proj=None, q_norm=None, rotary_emb=None, every_channel=True,
                             qkv_proj=_LoRAWrapper(_Linear(weight)))
    query = partial_query(target, hidden, torch.arange(3))
    expected = (hidden @ weight[: heads * dim].T).reshape(3, kv_heads, heads // kv_heads, dim)
    torch.testing.assert_close(query, expected)
    target.qkv_proj = _Linear(weight)  # without LoRA: the layer itself
    torch.testing.assert_close(partial_query(target, hidden, torch.arange(3)), expected)
