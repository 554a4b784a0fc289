# SPDX-License-Identifier: Apache-2.0
"""CPU worker: the query slice of each sparse layer's ``qkv_proj``, kept for speculation.

Layer i speculates with layer i+1's query projection; only its query rows are
needed (the key and value rows are 2/3 of an MHA layer's projection). On CPU
vLLM prepacks every linear weight after loading and drops ``weight``
(``model_executor/layers/utils.py``: ``dispatch_cpu_unquantized_gemm``), so
the slice is copied while the model loads: ``capture_query_weights`` wraps
that function for the duration of the InfiniGen worker's ``load_model`` only
(listed in the patch index of ``vllm_infinigen/patch``), after vLLM has
loaded, sharded (tensor parallel) and cast the weight, so the copy holds what
the model's own projection multiplies by. Cost: one copy of W_q (and its
bias) per sparse layer in host memory.

The projection is one op of the CPU kernels (``kernels.speculation_query``,
``csrc/query.cpp``), which also applies the layer's RoPE where its rotary
module keeps the base rule (``rotated``; ``rope.base_rule``): a decode row
multiplies by the whole W_q every step, a GEMV whose time is the weight's
bytes, and the one op replaces four (GEMM, the casts, vLLM's rotary op,
which alone cost ~25 us per layer on one thread and ~100 with its second
thread busy). On the AVX2 host of 2026-11-29, vLLM's bfloat16 GEMM fell back
to torch's (no oneDNN primitive): 135 us per [1024, 512] layer in cache,
slower than float32's 83.

A float32 model's copy is kept in bfloat16 (``SPECULATION_WEIGHT_DTYPE``):
half the bytes per step. Only the speculation reads this query: it scores
the bounds, the int keys or the partial keys, which round far more than
bfloat16's 8-bit mantissa; the attention's own query still comes from the
model's float32 ``qkv_proj``. The op sums in float32 and returns float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch
from vllm.model_executor.models.utils import extract_layer_index

from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.platforms.cpu.rope import base_rule, float32_cache


# The dtype a float32 model's W_q copy is kept in for speculation (see above);
# 16-bit models keep their own.
SPECULATION_WEIGHT_DTYPE = {torch.float32: torch.bfloat16}


class QueryProjection(torch.nn.Module):
    """The query rows of one layer's ``qkv_proj``: weight [q_size, hidden] (in
    ``SPECULATION_WEIGHT_DTYPE`` of the model's dtype), bias [q_size] (float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_dtype = weight.dtype
        self.weight = torch.nn.Parameter(
            weight.to(SPECULATION_WEIGHT_DTYPE.get(weight.dtype, weight.dtype)).contiguous(),
            requires_grad=False)
        self.query_bias = (None if bias is None
                           else torch.nn.Parameter(bias.float(), requires_grad=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, q_size] in the model's dtype."""
        return kernels.speculation_query(hidden, self.weight, self.query_bias).to(self.out_dtype)

    def rotated(self, hidden: torch.Tensor, positions: torch.Tensor,
                rope: torch.nn.Module) -> torch.Tensor | None:
        """[T, hidden] -> [T, q_size] float32 after ``rope`` at ``positions``
        [T], in one op; None where ``rope`` does not keep the base rule (the
        caller rotates through the module)."""
        if not base_rule(rope):
            return None
        return kernels.speculation_query(
            hidden, self.weight, self.query_bias, float32_cache(rope),
            positions.to(torch.int64), head_size=rope.head_size,
            is_neox_style=rope.is_neox_style)


@contextlib.contextmanager
def capture_query_weights(layers: Collection[int]) -> Iterator[dict[int, torch.nn.Module]]:
    """Yields {layer_idx: module} computing x W_q^T + b_q.

    Filled while the model loads, for the ``qkv_proj`` of ``layers`` (the sparse ones).
    """
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import QKVParallelLinear

    captured: dict[int, torch.nn.Module] = {}
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if isinstance(layer, QKVParallelLinear) and layer.weight.ndim == 2 \
                and not layer.weight.is_meta:
            idx = extract_layer_index(layer.prefix)
            if idx in layers:
                q_size = layer.num_heads * layer.head_size  # this rank's query rows
                bias = getattr(layer, "bias", None)
                captured[idx] = QueryProjection(
                    layer.weight.detach()[:q_size].clone(),
                    None if bias is None else bias.detach()[:q_size].clone())
        return original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield captured
    finally:
        utils.dispatch_cpu_unquantized_gemm = original
