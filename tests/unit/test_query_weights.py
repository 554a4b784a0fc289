# SPDX-License-Identifier: Apache-2.0
"""The CPU speculation's copy of W_q (``platforms/cpu/query_weights.py``): a
float32 model's is kept in bfloat16 and returns float32; 16-bit models keep theirs."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: E402

from vllm_infinigen.platforms.cpu.query_weights import QueryProjection  # noqa: E402


def _prepacked(weight, bias):
    projection = QueryProjection(weight.clone(), None if bias is None else bias.clone())
    dispatch_cpu_unquantized_gemm(projection, True)  # as capture_query_weights does
    return projection


@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_model_reads_a_bfloat16_copy(with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=gen)
    bias = torch.randn(256, generator=gen) if with_bias else None
    projection = _prepacked(weight, bias)
    assert projection.weight.dtype == torch.bfloat16  # half the bytes read per step
    hidden = torch.randn(3, 128, generator=gen)
    query = projection(hidden)
    assert query.dtype == torch.float32
    expected = torch.nn.functional.linear(hidden, weight, bias)
    error = (query - expected).norm() / expected.norm()
    assert 0 < error < 1e-2  # rounded to bfloat16 (not the float32 product), and close to it


def test_bfloat16_model_keeps_its_dtype():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    projection = _prepacked(weight, None)
    assert projection.weight.dtype == torch.bfloat16
    hidden = torch.randn(2, 128, generator=gen).bfloat16()
    query = projection(hidden)
    assert query.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(hidden.float(), weight.float())
    assert (query.float() - expected).norm() / expected.norm() < 1e-2
