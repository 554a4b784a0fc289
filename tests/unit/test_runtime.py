# SPDX-License-Identifier: Apache-2.0
"""The worker-side step logic, driven directly: a runtime over hand-built layers,
one decode step, and the exact positions each policy selects."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.reference.runtime_step import BLOCK, CONTEXT, DIM, IMPORTANT, build_step
from tests.reference.runtime_step import attend_layer2 as _attend_layer2
from tests.reference.runtime_step import attention_over as _attention_over
from tests.reference.runtime_step import layer_source as _source
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.worker.runtime import InfiniGenRuntime


@pytest.fixture(params=["partial", "int"])
def step(request):
    """``build_step`` on the CPU platform's data path."""
    return build_step(request.param, lambda config: CpuDataPath(config.transfer))


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


def test_alpha_none_at_run_time_turns_the_rule_off(step):
    """``set_infinigen_selection(alpha=None)``: off, resolved as at start-up (infinity:
    the kernels take a number), and the next step selects (it kept the previous alpha
    before 2026-11-30, then handed the kernels None until 2026-12-01)."""
    runtime, metadata, new_slot = step
    runtime.update_selection(alpha=5)
    assert runtime.config.alpha == 5.0 and isinstance(runtime.config.alpha, float)
    runtime.update_selection(alpha=None)
    assert runtime.config.alpha == math.inf
    runtime.update_selection(budget=0.5)  # alpha not named: kept
    assert runtime.config.alpha == math.inf and runtime.config.budget == 0.5
    speculating = runtime.layers[1]
    speculating.capture(torch.tensor([[10.0, 0.0, 0.0, 0.0]]))
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    selected = [p for p in runtime.layers[2].selection[0, 0].tolist() if p >= 0]
    assert set(IMPORTANT) <= set(selected) and len(selected) <= CONTEXT // 2  # the budget
    with pytest.raises(ValueError, match=r"\['partial_ratio'\]: only \[.*\] can change at "
                       "run time; start the engine with the others' flags"):
        runtime.update_selection(partial_ratio=0.5)


def test_a_policy_that_fails_to_start_changes_nothing(step, monkeypatch):
    """A run-time switch whose policy cannot allocate (a torch policy on an FP8 pool,
    say) raises and leaves the running selection as it was."""
    runtime, _, _ = step
    before = runtime.config

    def fails(name):
        raise NotImplementedError("min_values_cpu not implemented for 'Float8_e4m3fn'")

    monkeypatch.setattr(runtime.policies, "get", fails)
    with pytest.raises(NotImplementedError):
        runtime.update_selection(policy="quest", budget=0.5)
    assert runtime.config is before and runtime.config.policy == "infinigen"


def test_the_worker_refuses_a_torch_policy_over_fp8_kv():
    """The start-up refusal (``frontend/checks.py``), again for a run-time switch."""
    from types import SimpleNamespace

    from vllm_infinigen.worker.base import InfiniGenWorkerMixin

    worker = object.__new__(InfiniGenWorkerMixin)
    worker.infinigen = SimpleNamespace(kv_dtype_bytes=1)
    for policy in ("quest", "h2o"):
        with pytest.raises(ValueError, match=f"--infinigen-policy {policy} reads the pool "
                           "with torch.*--kv-cache-dtype"):
            worker.set_infinigen_selection(policy=policy)


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


def test_the_token_rule_is_the_data_paths_selector_and_follows_its_settings(step):
    """InfiniGen's rule in tokens is the CPU data path's (``LayerState.selector``,
    as the block rule is CUDA's), with the settings of its ``configure``: a
    change in the running engine (here a recent window over the whole
    context) changes what the next selection keeps."""
    runtime, metadata, new_slot = step
    layer, speculating = runtime.layers[2], runtime.layers[1]
    assert layer.selector.func == runtime.data_path.select and layer.selector.args == (layer,)
    runtime.update_selection(recent_tokens=CONTEXT)
    speculating.capture(torch.tensor([[10.0, 0.0, 0.0, 0.0]]))
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    selected = sorted(p for p in layer.selection[0, 0].tolist() if p >= 0)
    assert selected != IMPORTANT and CONTEXT - 1 in selected
    with pytest.raises(RuntimeError, match="configure was not called"):
        CpuDataPath("auto").select(layer, None, None, None)


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
    from vllm_infinigen.platforms.cpu import kernels

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


def test_a_steps_prompts_are_placed_before_their_write_over_the_pool_only():
    """The data path places a step's prompt rows (CUDA: into its device block
    cache) before the layer's write; not in a decode-only step, not while resident."""
    calls = []

    class Recording(CpuDataPath):
        def place_prompts(self, layer, plan):
            calls.append(("place", layer.layer_idx, plan.prompt_requests.tolist()))

        def write(self, layer, key, value, slots, row_map, closes_group=True):
            calls.append(("write", layer.layer_idx))

    runtime, decode, new_slot = build_step("int", lambda config: Recording(config.transfer))
    calls.clear()
    layer, one, four = runtime.layers[2], torch.zeros(1, 1, DIM), torch.zeros(4, 1, DIM)
    runtime.write(layer, one, one, new_slot, decode)
    slots = torch.tensor([CONTEXT, 3 * BLOCK, 3 * BLOCK + 1, 3 * BLOCK + 2])
    for resident in (False, True):
        runtime.set_resident(resident)
        prompt = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 4]),
                                 seq_lens=torch.tensor([CONTEXT + 1, 3]),
                                 block_table=torch.tensor([[0, 1, 2], [3, 0, 0]],
                                                          dtype=torch.int32))
        runtime.write(layer, four, four, slots, prompt)
    assert calls == [("write", 2), ("place", 2, [1]), ("write", 2), ("write", 2)]


def test_a_layer_reads_vllms_kv_scales_for_an_fp8_pool_only():
    """``--kv-cache-dtype fp8``: the pool holds K / k_scale, V / v_scale, read
    from vLLM's layer at each call; any other pool holds K and V (1.0)."""
    from vllm_infinigen.worker.layer_state import LayerState

    attn = SimpleNamespace(impl=SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=32,
                                                scale=0.1),
                           _k_scale_float=2.0, _v_scale_float=0.5)
    state = LayerState(2, "l2", attn, None, sparse=True, skew=None)
    state.kv_pool = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    assert dict(state.kv_scales()) == {"key_scale": 1.0, "value_scale": 1.0}
    state.kv_pool = state.kv_pool.to(torch.float8_e4m3fn)
    assert state.kv_scales() == {"key_scale": 2.0, "value_scale": 0.5}
    attn._k_scale_float = 3.0  # vLLM sets them at the first forward (--calculate-kv-scales)
    assert state.kv_scales()["key_scale"] == 3.0
