# SPDX-License-Identifier: Apache-2.0
"""The speculation query's RoPE (``platforms/devices.py``'s ``rotate``, the CPU's line ``platforms/cpu/rope.py``):
the model's own rule, through vLLM's fused CPU kernel where the class keeps the base rule."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(params: dict):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(64, 4096, True, {"rope_theta": 500000.0, **params}, dtype=torch.float32)


@pytest.mark.parametrize("params", [{"rope_type": "default"}, LLAMA3], ids=["base", "llama3"])
def test_rotate_equals_the_modules_own_rule(params):
    from vllm_infinigen.platforms.devices import rotate

    with set_current_vllm_config(VllmConfig()):
        rope = _rope(params)
        positions = torch.tensor([0, 7, 3000])
        query = torch.randn(3, 4 * 64)
        expected = rope.forward_native(positions, query.clone(), None)[0]
        torch.testing.assert_close(rotate(rope, positions, query.clone()), expected,
                                   rtol=0, atol=1e-6)
        assert not torch.equal(expected, query)  # it rotates


def test_rotate_leaves_a_class_with_its_own_rule_to_the_module():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from vllm_infinigen.platforms.devices import rotate

    calls = []

    class OwnRule(RotaryEmbedding):
        def forward_native(self, positions, query, key=None):
            calls.append("native")
            return query * 2, key

    # As in the engine: vLLM's modules run their native form (custom ops off).
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    with set_current_vllm_config(config):
        rope = OwnRule(64, 64, 4096, 10000.0, True, torch.float32)
        query = torch.ones(1, 64)
        torch.testing.assert_close(rotate(rope, torch.tensor([1]), query), query * 2)
    assert calls == ["native"]


def test_a_device_without_a_line_calls_the_module_on_the_query_as_it_is(monkeypatch):
    """CUDA has no line in ``ROTATIONS``: vLLM's kernel rotates a strided qkv slice
    in place; the graph check of a device without a line answers False."""
    from vllm_infinigen.platforms import devices

    monkeypatch.setattr(devices, "ROTATIONS", {})
    seen = []

    def rope(positions, query, key):
        seen.append(query.is_contiguous())
        return query + 1, key

    qkv = torch.zeros(2, 12)
    assert torch.equal(devices.rotate(rope, torch.tensor([0, 1]), qkv[:, :8]),
                       torch.ones(2, 8))
    assert seen == [False]
    assert not devices.is_capturing(torch.device("cpu"))
