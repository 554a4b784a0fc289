# SPDX-License-Identifier: Apache-2.0
"""Worker side, CPU platform: RoPE of the speculation query through vLLM's fused CPU kernel."""

from __future__ import annotations

import weakref

import torch

# rotary module -> its cos/sin cache in float32 (``float32_cache``).
_FLOAT32_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def base_rule(rope: torch.nn.Module) -> bool:
    """Whether ``rope`` is vLLM's ``RotaryEmbedding`` computing the base rule,
    differing from it at most in its cos/sin cache (Llama 3, linear or YaRN
    scaling): whatever computes that rule over the same cache computes the
    model's RoPE."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kind = type(rope)
    return (isinstance(rope, RotaryEmbedding)
            and kind.forward_native is RotaryEmbedding.forward_native
            and kind.forward_cpu is RotaryEmbedding.forward_cpu)


def float32_cache(rope: torch.nn.Module) -> torch.Tensor:
    """``rope``'s cos/sin cache [positions, rotary_dim] in float32, converted
    once per module (the layers of a model share theirs)."""
    cache = _FLOAT32_CACHES.get(rope)
    if cache is None:
        cache = _FLOAT32_CACHES[rope] = rope.cos_sin_cache.float().contiguous()
    return cache


def rotate(rope: torch.nn.Module, positions: torch.Tensor,
           query: torch.Tensor) -> torch.Tensor:
    """``query`` [S, H_q * D] after RoPE, as the model's ``rotary_emb`` computes it
    (``query`` is made contiguous, then may be overwritten).

    Called eagerly, vLLM's module runs its torch-native form op by op (the
    model runs it compiled): ~0.1 ms per layer on the CPU. Where the class
    keeps the base rule (``base_rule``), vLLM's fused CPU kernel computes the
    same from the same cache, in place. (The speculation's own projection
    rotates in its op, ``query_weights.QueryProjection.rotated``.)
    """
    query = query.contiguous()
    if base_rule(rope):
        return rope.forward_cpu(positions, query, None)[0]
    return rope(positions, query, None)[0]
