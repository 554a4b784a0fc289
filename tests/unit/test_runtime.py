# SPDX-License-Identifier: Apache-2.0
"""The worker-side step logic, driven directly: a runtime over hand-built layers,
one decode step, and the exact positions each policy selects."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.worker.data_path import DataPath
from vllm_infinigen.worker.layer_state import LayerSource
from vllm_infinigen.worker.runtime import InfiniGenRuntime

DIM, BLOCK, CONTEXT = 4, 16, 32
IMPORTANT = [5, 17, 30]  # the context tokens whose keys match the query


class _QKV(torch.nn.Module):
    """q = k = v = the attention input (one head of ``DIM`` channels)."""

    def forward(self, hidden: torch.Tensor):
        return torch.cat([hidden, hidden, hidden], dim=-1), None


def _source(index: int, keys: str = "partial") -> LayerSource:
    """Layer ``index``; ``keys``: partial keys over an identity skew, or the int keys."""
    impl = SimpleNamespace(num_heads=1, num_kv_heads=1, head_size=DIM,
                           scale=1 / math.sqrt(DIM))
    self_attn = torch.nn.Module()
    self_attn.qkv_proj = _QKV()
    return LayerSource(index, f"model.layers.{index}.self_attn.attn",
                       SimpleNamespace(impl=impl), self_attn,
                       skew=torch.eye(DIM)[None].contiguous() if keys == "partial" else None,
                       query_proj=None)


def build_step(keys: str, make_data_path: Callable[[InfiniGenConfig], DataPath]):
    """A runtime (layer 0 dense, 1 and 2 sparse) holding one request's 32
    context tokens in layer 2, and the dense metadata of its next decode step;
    ``keys``: either form of speculation keys; the platform's data path."""
    config = InfiniGenConfig(alpha=1.0, budget=1.0, dense_layers=1, min_context=0,
                             speculation_keys=keys)
    layout = ModelLayout("llama", num_layers=3, num_heads=1, num_kv_heads=1, head_dim=DIM,
                         dense_layers=1, partial_ratio=1.0)
    runtime = InfiniGenRuntime(config, [_source(i, keys) for i in range(3)],
                               torch.device("cpu"), make_data_path(config), layout=layout)
    assert runtime.layers[2].int_keys == (keys == "int")
    runtime.allocate_pool(PoolPlan(num_rows=4 * BLOCK, num_slots=4 * BLOCK, block_size=BLOCK,
                                   num_bytes=0, sized_by=""), num_blocks=4, dtype=torch.float32)
    context_keys = torch.zeros(CONTEXT, 1, DIM)
    context_keys[IMPORTANT, 0, 0] = 1.0
    values = torch.arange(CONTEXT, dtype=torch.float32).view(CONTEXT, 1, 1).repeat(1, 1, DIM)
    runtime.write(runtime.layers[2], context_keys, values, torch.arange(CONTEXT))
    metadata = SimpleNamespace(query_start_loc=torch.tensor([0, 1]),
                               seq_lens=torch.tensor([CONTEXT + 1]),
                               block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32))
    return runtime, metadata, torch.tensor([CONTEXT])  # the new token's slot


@pytest.fixture(params=["partial", "int"])
def step(request):
    """``build_step`` on the CPU platform's data path."""
    return build_step(request.param, lambda config: CpuDataPath(config.transfer))


def _attend_layer2(runtime, metadata, new_slot, query: torch.Tensor) -> torch.Tensor:
    """Layer 2's attention in the step: writes its new K/V, attends; [1, 1, DIM]."""
    layer = runtime.layers[2]
    runtime.write(layer, query, query, new_slot)
    plan = runtime.begin_layer(layer, metadata, new_slot, block_size=BLOCK)
    output = torch.zeros(1, 1, DIM)
    runtime.attend(layer, plan, query, output)
    return output


def _attention_over(positions: list[int], query: torch.Tensor) -> torch.Tensor:
    """Reference: the new token attends to ``positions`` and itself."""
    keys = torch.zeros(CONTEXT + 1, DIM)
    keys[IMPORTANT, 0] = 1.0
    keys[CONTEXT] = query.view(DIM)
    values = torch.arange(CONTEXT + 1, dtype=torch.float32)[:, None].repeat(1, DIM)
    values[CONTEXT] = query.view(DIM)
    chosen = positions + [CONTEXT]
    probs = torch.softmax(keys[chosen] @ query.view(DIM) / math.sqrt(DIM), dim=0)
    return (probs @ values[chosen]).view(1, 1, DIM)


def test_previous_layer_selects_exactly_the_matching_tokens(step):
    runtime, metadata, new_slot = step
    speculating = runtime.layers[1]
    hidden = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    speculating.capture(hidden)
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    selection = runtime.layers[2].selection  # [S, H_kv, W]
    assert selection.shape[:2] == (1, 1)
    assert [p for p in selection[0, 0].tolist() if p >= 0] == IMPORTANT
    assert speculating.captured_input is None  # used once, dropped

    query = hidden.view(1, 1, DIM)
    output = _attend_layer2(runtime, metadata, new_slot, query)
    torch.testing.assert_close(output, _attention_over(IMPORTANT, query))
    counters = runtime.take_counters()
    assert counters["selected_tokens.2"] == len(IMPORTANT)
    assert counters["candidate_tokens.2"] == CONTEXT


def test_same_layer_speculation_selects_with_the_layers_own_query(step):
    runtime, metadata, new_slot = step
    runtime.update_selection(speculation="same-layer")
    speculating = runtime.layers[1]
    speculating.capture(torch.tensor([[0.0, 10.0, 0.0, 0.0]]))  # would select nothing useful
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    assert runtime.layers[2].selection is None  # nothing selected ahead
    assert speculating.captured_input is None
    query = torch.tensor([10.0, 0.0, 0.0, 0.0]).view(1, 1, DIM)
    output = _attend_layer2(runtime, metadata, new_slot, query)
    torch.testing.assert_close(output, _attention_over(IMPORTANT, query))
    assert runtime.take_counters()["selected_tokens.2"] == len(IMPORTANT)


def test_a_layer_without_a_selection_fails_naming_the_layer(step):
    runtime, metadata, new_slot = step
    with pytest.raises(RuntimeError, match="sparse layer 2 has no selection"):
        _attend_layer2(runtime, metadata, new_slot, torch.ones(1, 1, DIM))


def test_streaming_selects_sinks_and_recent_tokens_in_the_layer(step):
    runtime, metadata, new_slot = step
    runtime.update_selection(policy="streaming", budget=0.25)  # 8 of 32 tokens
    query = torch.tensor([0.0, 1.0, 0.0, 0.0]).view(1, 1, DIM)
    output = _attend_layer2(runtime, metadata, new_slot, query)
    expected = [0, 1, 2, 3, 28, 29, 30, 31]
    torch.testing.assert_close(output, _attention_over(expected, query))
    assert runtime.take_counters()["selected_tokens.2"] == len(expected)


def test_shutdown_stops_the_copy_worker():
    config = InfiniGenConfig(alpha=1.0, dense_layers=1, transfer="copy")
    layout = ModelLayout("llama", num_layers=3, num_heads=1, num_kv_heads=1, head_dim=DIM,
                         dense_layers=1, partial_ratio=1.0)
    runtime = InfiniGenRuntime(config, [_source(i) for i in range(3)], torch.device("cpu"),
                               CpuDataPath(config.transfer), layout=layout)
    runtime.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        runtime.data_path.transfer._executor.submit(lambda: None)


def test_sliding_window_layers_take_no_part():
    """Gemma 3's layout (windowed 0, 2, 4, 6): the dense/sparse split and the
    speculation run over the full-attention layers 1, 3, 5, 7 alone."""
    config = InfiniGenConfig(alpha=1.0, budget=1.0, dense_layers=2, min_context=0)
    layout = ModelLayout("gemma3_text", num_layers=8, num_heads=1, num_kv_heads=1,
                         head_dim=DIM, dense_layers=2, partial_ratio=1.0,
                         window_layers=(0, 2, 4, 6))
    runtime = InfiniGenRuntime(config, [_source(i) for i in range(8)], torch.device("cpu"),
                               CpuDataPath(config.transfer), layout=layout)
    layers = runtime.layers
    assert [s.layer_idx for s in runtime.sparse_layers] == [5, 7]
    assert [s.layer_idx for s in layers if s.windowed] == [0, 2, 4, 6]
    assert {s.layer_idx: s.next.layer_idx for s in layers if s.next is not None} == {3: 5, 5: 7}
    assert [s.pool_layer for s in runtime.sparse_layers] == [0, 1]
    # The first dense full-attention layer's metadata and slots index the pool.
    assert runtime.reference_layer == "model.layers.1.self_attn.attn"
    assert runtime._speculator == {5: layers[3], 7: layers[5]}


def test_a_step_below_min_context_attends_densely_without_speculating(step):
    runtime, metadata, new_slot = step
    runtime.update_selection(min_context=CONTEXT + 1)
    plan = runtime.plan_for(metadata, BLOCK)
    assert plan.short_decode_only
    assert not runtime.speculates({runtime.reference_layer: metadata})
    layer = runtime.layers[2]
    query = torch.tensor([10.0, 0.0, 0.0, 0.0]).view(1, 1, DIM)
    runtime.write(layer, query, query, new_slot)
    output = torch.full((2, 1, DIM), 7.0)  # a padding row after the step's one row
    runtime.attend_decode(layer, plan, query.expand(2, 1, DIM), output)
    torch.testing.assert_close(output[:1], _attention_over(list(range(CONTEXT)), query))
    assert output[1].eq(7.0).all()  # rows past the step's are not touched
    assert runtime.take_counters()["selected_tokens.2"] == CONTEXT  # dense counts all

    runtime.update_selection(min_context=CONTEXT)  # the row now selects
    assert not runtime.plan_for(metadata, BLOCK).short_decode_only
    assert runtime.speculates({runtime.reference_layer: metadata})


def test_a_step_with_prompt_rows_is_not_short_decode_only(step):
    runtime, _, _ = step
    runtime.update_selection(min_context=10**6)
    prefill = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 5]),
                              seq_lens=torch.tensor([CONTEXT + 1, 4]),
                              block_table=torch.tensor([[0, 1, 2], [3, 0, 0]],
                                                       dtype=torch.int32))
    assert not runtime.plan_for(prefill, BLOCK).short_decode_only


def test_int_keys_encode_only_in_steps_that_close_a_group(monkeypatch):
    """Token by token, one step each as in decode: the codes equal those of one
    write of the whole context, and the encoding kernel runs only in the steps
    whose token is the 16th of its group (none encodes otherwise)."""
    from vllm_infinigen import kernels

    def runtime_with_keys():
        runtime, _, _ = build_step("int", lambda config: CpuDataPath(config.transfer))
        return runtime, runtime.layers[2]

    torch.manual_seed(0)
    keys, values = torch.randn(CONTEXT, 1, DIM), torch.randn(CONTEXT, 1, DIM)
    whole, whole_layer = runtime_with_keys()
    whole.write(whole_layer, keys, values, torch.arange(CONTEXT))

    calls = []
    encode = kernels.write_int_keys
    monkeypatch.setattr(kernels, "write_int_keys",
                        lambda *args: calls.append(int(args[3].max())) or encode(*args))
    stepped, layer = runtime_with_keys()  # its context written whole: now rewritten
    calls.clear()
    layer.key_codes.zero_()
    layer.key_scales.zero_()
    for token in range(CONTEXT):
        slot = torch.tensor([token, -1])  # a padding slot beside the step's token
        stepped.begin_step(SimpleNamespace(step=token), slot)
        for _ in range(2):  # two layers' writes of one step: one check
            stepped.write(layer, keys[token:token + 1].expand(2, 1, DIM),
                          values[token:token + 1].expand(2, 1, DIM), slot)
    assert calls == [15, 15, 31, 31]
    assert torch.equal(layer.key_codes, whole_layer.key_codes)
    assert torch.equal(layer.key_scales, whole_layer.key_scales)


def test_device_slots_are_not_checked_on_the_host():
    """A device slot tensor (here on ``meta``, which cannot be read) is not
    checked for closed groups: that would sync every step; the data path
    encodes whatever its kernel finds closed."""
    seen = []

    class Recording(CpuDataPath):
        def write(self, layer, key, value, slots, row_map, closes_group=True):
            seen.append((slots.device.type, closes_group))

    runtime, _, _ = build_step("int", lambda config: Recording(config.transfer))
    seen.clear()
    on_device = torch.empty(2, 1, DIM, device="meta")
    runtime.write(runtime.layers[2], on_device, on_device,
                  torch.tensor([3, 4], device="meta"))
    runtime.write(runtime.layers[2], torch.zeros(2, 1, DIM), torch.zeros(2, 1, DIM),
                  torch.tensor([3, 4]))  # on the host: checked, closes none
    assert seen == [("meta", True), ("cpu", False)]
