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
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch
from vllm.model_executor.models.utils import extract_layer_index


class QueryProjection(torch.nn.Module):
    """The query rows of one layer's ``qkv_proj``: weight [q_size, hidden], bias [q_size]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, q_size], through vLLM's CPU GEMM (set by its dispatch)."""
        return self.cpu_linear(hidden, self.weight, self.bias)


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
