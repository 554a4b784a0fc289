# SPDX-License-Identifier: Apache-2.0
"""CPU worker: the query slice of each sparse layer's ``qkv_proj``, kept for speculation.

Layer i speculates with layer i+1's query projection; only its query rows are
needed (the key and value rows are 2/3 of an MHA layer's projection). On CPU
vLLM prepacks every linear weight after loading and drops ``weight``
(``model_executor/layers/utils.py``: ``dispatch_cpu_unquantized_gemm``), so
the slice is copied while the model loads: ``capture_query_weights`` wraps
that function for the duration of the InfiniGen worker's ``load_model`` only
(listed in the patch index of ``vllm_infinigen/patch``), after vLLM has
loaded, sharded (tensor parallel) and cast the weight, so the copy is exactly
what the model's own projection multiplies by; the copy then goes through the
same dispatch, so it is prepacked like the model's projections (an unpacked
``F.linear`` measured slower than the whole prepacked qkv_proj). Cost: one
prepacked copy of W_q (and its bias) per sparse layer in host memory.

A float32 model's copy is kept in bfloat16 (``SPECULATION_WEIGHT_DTYPE``):
the projection multiplies one row per request by W_q every step, so it
reads the whole weight each time, and half the bytes is half the time
(14 prepacked [1024, 512] copies, one row, one thread, on the AVX-512 host
of 2026-11-27: 1.46 ms per step in float32, 0.79 in bfloat16; with oneDNN
held to AVX2 2.0 against 1.0 ms). Only the speculation reads this query:
it scores the int keys, quantized to 4 bits (2 in a 16-bit cache), or the
partial keys, so bfloat16's 8-bit mantissa is far inside what the scores
already round; the attention's own query still comes from the model's
float32 ``qkv_proj``. The input row is rounded to bfloat16 for the GEMM and
the output returned in float32; a bias is added in float32 afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch
from vllm.model_executor.models.utils import extract_layer_index


# The dtype a float32 model's W_q copy is kept in for speculation (see above);
# 16-bit models keep their own.
SPECULATION_WEIGHT_DTYPE = {torch.float32: torch.bfloat16}


class QueryProjection(torch.nn.Module):
    """The query rows of one layer's ``qkv_proj``: weight [q_size, hidden] (in
    ``SPECULATION_WEIGHT_DTYPE`` of the model's dtype), bias [q_size] (the model's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_dtype = weight.dtype
        self.weight = torch.nn.Parameter(
            weight.to(SPECULATION_WEIGHT_DTYPE.get(weight.dtype, weight.dtype)),
            requires_grad=False)
        self.query_bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, q_size] in the model's dtype, through vLLM's CPU GEMM
        (set by its dispatch)."""
        query = self.cpu_linear(hidden.to(self.weight.dtype), self.weight, None)
        query = query.to(self.out_dtype)
        return query if self.query_bias is None else query + self.query_bias


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
                query = QueryProjection(layer.weight.detach()[:q_size].clone(),
                                        None if bias is None else bias.detach()[:q_size].clone())
                original(query, True)  # vLLM's own CPU GEMM choice and prepacking
                captured[idx] = query
        return original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield captured
    finally:
        utils.dispatch_cpu_unquantized_gemm = original
