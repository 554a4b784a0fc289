# SPDX-License-Identifier: Apache-2.0
"""The torch-only harness behind the frontier (``benchmarks/accuracy/sparse_llama.py``):
its dense pass is the Hugging Face model's forward, its fused causal attention the
masked one, and a sparse pass that selects every token gives the dense logits."""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy.sparse_llama import SparseLlama


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


def test_the_fused_causal_attention_is_the_masked_one(model):
    sparse = SparseLlama(model, dense_layers=2)
    torch.manual_seed(1)
    num_tokens, dim = 40, sparse.head_dim
    q = torch.randn(sparse.num_heads, num_tokens, dim)
    keys, values = (torch.randn(sparse.num_kv_heads, num_tokens, dim) for _ in range(2))
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()[None]
    torch.testing.assert_close(sparse.attend_causal(q, keys, values),
                               sparse.attend(q, keys, values, causal), rtol=1e-5, atol=1e-5)


def test_the_dense_pass_is_the_models_forward_and_select_all_keeps_it(model):
    sparse = SparseLlama(model, dense_layers=2)
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(2))
    prefix = sparse.dense_pass(ids)
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    torch.testing.assert_close(prefix.logits, expected, rtol=1e-4, atol=1e-4)

    def every_token(layer, query, keys, positions):
        return torch.arange(keys.shape[1])[None, None, :] < positions[None, :, None]

    first = 45
    logits = sparse.sparse_pass(prefix, first, every_token)
    torch.testing.assert_close(logits, prefix.logits[first:], rtol=1e-4, atol=1e-4)
    # A selection of nothing but the row's own token changes the sparse layers' output.
    nothing = sparse.sparse_pass(prefix, first, lambda *args: torch.zeros(
        sparse.num_kv_heads, 50 - first, 50, dtype=torch.bool))
    assert (nothing - prefix.logits[first:]).abs().max() > 1e-2
