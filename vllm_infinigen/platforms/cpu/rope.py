# SPDX-License-Identifier: Apache-2.0
"""Worker side, CPU platform: RoPE of the speculation query through vLLM's fused CPU kernel."""

from __future__ import annotations

import torch


def rotate(rope: torch.nn.Module, positions: torch.Tensor,
           query: torch.Tensor) -> torch.Tensor:
    """``query`` [S, H_q * D] after RoPE, as the model's ``rotary_emb`` computes it
    (``query`` is made contiguous, then may be overwritten).

    Called eagerly, vLLM's module runs its torch-native form op by op (the
    model runs it compiled): ~0.1 ms per layer on the CPU. Where the class
    keeps the base rule and differs only in its cos/sin cache (Llama 3,
    linear or YaRN scaling), vLLM's fused CPU kernel computes the same from
    the same cache, in place.
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    query = query.contiguous()
    kind = type(rope)
    if (isinstance(rope, RotaryEmbedding)
            and kind.forward_native is RotaryEmbedding.forward_native
            and kind.forward_cpu is RotaryEmbedding.forward_cpu):
        return rope.forward_cpu(positions, query, None)[0]
    return rope(positions, query, None)[0]
