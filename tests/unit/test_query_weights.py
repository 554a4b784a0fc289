# SPDX-License-Identifier: Apache-2.0
"""The CPU speculation's copy of W_q (``platforms/cpu/query_weights.py``) and its
op (``kernels.speculation_query``): a float32 model's copy is kept in bfloat16,
16-bit models keep theirs; the product sums in float32, and with the rotary
cache the op applies RoPE as vLLM's module does."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

from vllm_infinigen.platforms.cpu import kernels  # noqa: E402
from vllm_infinigen.platforms.cpu.query_weights import QueryProjection  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


def _product(hidden, weight, bias):
    """The op's reference: the inputs as the op reads them, the sums in float64."""
    out = hidden.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512, 1024), (3, 100, 37), (5, 64, 8)],
                         ids=["gqa128", "tails", "narrow"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_equals_the_reference(weight_dtype, shape, with_bias):
    """Every tail: K not a multiple of the vector width, N not of the rows per pass."""
    tokens, in_features, out_features = shape
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    hidden = torch.randn(tokens, in_features, generator=gen).to(weight_dtype)
    query = kernels.speculation_query(hidden, weight, bias)
    assert query.dtype == torch.float32 and query.shape == (tokens, out_features)
    torch.testing.assert_close(query.double(), _product(hidden, weight, bias),
                               rtol=1e-5, atol=1e-4)


def _rope(head_size: int, rotary_dim: int, neox: bool, params: dict):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head_size, 4096, neox, {"rope_theta": 10000.0, **params,
                                            "partial_rotary_factor": rotary_dim / head_size},
                    dtype=torch.float32)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["whole-head", "partial"])
@pytest.mark.parametrize("params", [{"rope_type": "default"}, LLAMA3], ids=["base", "llama3"])
def test_rotated_equals_the_projection_then_the_modules_rope(neox, rotary_dim, params):
    with set_current_vllm_config(VllmConfig()):
        rope = _rope(64, rotary_dim, neox, params)
        assert rope.rotary_dim == rotary_dim
        gen = torch.Generator().manual_seed(rotary_dim)
        weight = torch.randn(4 * 64, 96, generator=gen)
        bias = torch.randn(4 * 64, generator=gen)
        projection = QueryProjection(weight, bias)
        hidden = torch.randn(3, 96, generator=gen)
        positions = torch.tensor([0, 9, 3001])
        unrotated = projection(hidden)
        expected = rope.forward_native(positions, unrotated.clone(), None)[0]
        rotated = projection.rotated(hidden, positions, rope)
        assert rotated.dtype == torch.float32
        torch.testing.assert_close(rotated, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(rotated, unrotated)  # it rotates


def test_rotated_declines_a_rotary_class_with_its_own_rule():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class OwnRule(RotaryEmbedding):
        def forward_native(self, positions, query, key=None):
            return query * 2, key

    with set_current_vllm_config(VllmConfig()):
        rope = OwnRule(64, 64, 4096, 10000.0, True, torch.float32)
        projection = QueryProjection(torch.randn(64, 32), None)
        assert projection.rotated(torch.randn(1, 32), torch.tensor([1]), rope) is None


@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_model_reads_a_bfloat16_copy(with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=gen)
    bias = torch.randn(256, generator=gen) if with_bias else None
    projection = QueryProjection(weight.clone(), None if bias is None else bias.clone())
    assert projection.weight.dtype == torch.bfloat16  # half the bytes read per step
    hidden = torch.randn(3, 128, generator=gen)
    query = projection(hidden)
    assert query.dtype == torch.float32
    expected = torch.nn.functional.linear(hidden, weight, bias)
    error = (query - expected).norm() / expected.norm()
    assert 0 < error < 1e-2  # W_q rounded to bfloat16 (not the float32 product), and close


def test_bfloat16_model_keeps_its_dtype():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    projection = QueryProjection(weight, None)
    assert projection.weight.dtype == torch.bfloat16
    hidden = torch.randn(2, 128, generator=gen).bfloat16()
    query = projection(hidden)
    assert query.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(hidden.float(), weight.float())
    assert (query.float() - expected).norm() / expected.norm() < 1e-2


def test_the_op_refuses_a_cache_it_would_copy_at_every_call():
    with pytest.raises(RuntimeError, match="float32"):
        kernels.speculation_query(torch.randn(1, 8), torch.randn(8, 8), None,
                                  torch.randn(16, 4).bfloat16(), torch.tensor([0]),
                                  head_size=4)
