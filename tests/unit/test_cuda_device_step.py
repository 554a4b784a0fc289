# SPDX-License-Identifier: Apache-2.0
"""The CUDA data path's decode step, planned on the device, on CPU tensors: no host read
of step data, a fixed count of ops per sparse layer (each platform kernel one), the same
shapes whatever the selection, and the step's output against dense attention where
every block is selected. Each watch is shown to catch what it guards against (a planted
sync, an extra op, a data-dependent shape).

The step is driven as vLLM's attention impl drives it (``worker/attention.py``): per
layer the capture of its attention input, ``do_kv_cache_update`` (begin_step, write),
then ``forward`` (plan, begin_layer, attend)."""

from __future__ import annotations

import pytest
import torch

from tests.reference.device_step import BLOCK, DIM, HEADS, KV_HEADS
from tests.reference.device_step import DecodeStep as _Step
from tests.reference.device_step import config as _config
from tests.reference.step_watch import HostRead, StepWatch, watching
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath

# The ops a sparse layer dispatches in a decode step (a platform kernel counts one):
# a speculating layer's copy of its attention input into the capture buffer, the
# next layer's query projection (a matmul; a model with RoPE adds its rotary op),
# selection (2 kernels: the bound scores, the rule with their alpha counts),
# placement (1) and gather (1); every sparse layer's write
# (2: write-through, bounds), its cached copies once the gather landed (1) and
# attention (1, into the output).
EXPECTED_OPS = {"layer1": 10, "layer2": 10, "layer3": 4}
MOST_OPS_PER_LAYER = 12  # issue 31's budget of launches InfiniGen adds per sparse layer


def test_a_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    step = _Step(_config())
    with watching(StepWatch(), monkeypatch) as watch:
        step.run(watch)
        step.run(watch, seed=2)
    assert watch.ops  # it did watch the layers


def test_the_guard_catches_a_planted_sync(monkeypatch):
    step = _Step(_config())
    original = CudaDataPath.start_fetch

    def syncing(self, layer, rows, selection, row_map):
        int(selection.seq_lens.max())  # a host read of step data
        return original(self, layer, rows, selection, row_map)

    monkeypatch.setattr(CudaDataPath, "start_fetch", syncing)
    with pytest.raises(HostRead, match="_local_scalar_dense in layer"):
        with watching(StepWatch(), monkeypatch) as watch:
            step.run(watch)


def _ops(step: _Step, monkeypatch) -> dict[str, list[str]]:
    step.run()  # the plan's once-per-step work and first-use allocations aside
    with watching(StepWatch(), monkeypatch) as watch:
        step.run(watch, seed=2)
    return watch.ops


def test_each_sparse_layer_dispatches_a_fixed_handful_of_ops(monkeypatch):
    ops = _ops(_Step(_config()), monkeypatch)
    counts = {name: len(ops.get(name, [])) for name in EXPECTED_OPS}
    assert counts == EXPECTED_OPS, ops
    assert max(counts.values()) <= MOST_OPS_PER_LAYER
    kernels = [op for op in ops["layer1"] if op.startswith("kernel:")]
    assert kernels == ["kernel:write_tokens", "kernel:encode_bounds",  # its own tokens
                       "kernel:bound_scores", "kernel:select",
                       "kernel:place", "kernel:gather_units",  # for layer 2
                       "kernel:write_cached_tokens", "kernel:attend_units"]


def test_the_op_count_catches_an_extra_op(monkeypatch):
    step = _Step(_config())
    original = CudaDataPath.write

    def heavier(self, layer, key, value, slots, row_map, closes_group=True):
        key = key.add(0.0)  # one more launch per layer
        return original(self, layer, key, value, slots, row_map, closes_group)

    monkeypatch.setattr(CudaDataPath, "write", heavier)
    counts = {name: len(ops) for name, ops in _ops(step, monkeypatch).items()
              if name in EXPECTED_OPS}
    assert counts == {name: count + 1 for name, count in EXPECTED_OPS.items()}


def _shapes(step: _Step, monkeypatch, seeds=(2, 3)) -> list[list]:
    step.run()
    shapes = []
    for seed in seeds:
        with watching(StepWatch(forbid_host_reads=False), monkeypatch) as watch:
            step.run(watch, seed=seed)
        shapes.append(watch.shapes)
    return shapes


def test_steps_with_other_selections_allocate_the_same_shapes(monkeypatch):
    """The contexts grow by a token a step (row 0 crosses into block 5 at 80);
    different queries select different blocks."""
    step = _Step(_config(), context_lens=(78, 45))
    first, second = _shapes(step, monkeypatch)
    assert first == second
    assert len(first) > 20


def test_the_shape_watch_catches_a_data_dependent_shape(monkeypatch):
    step = _Step(_config(), context_lens=(78, 45))
    original = CudaDataPath.attend_selected

    def compacting(self, layer, rows, query, selection, row_map, probs, out=None):
        torch.unique(selection.physical).sum()  # sized by how much the heads overlap
        return original(self, layer, rows, query, selection, row_map, probs, out)

    monkeypatch.setattr(CudaDataPath, "attend_selected", compacting)
    first, second = _shapes(step, monkeypatch, seeds=(1, 9))
    assert first != second


def _dense_reference(step: _Step, state, query: torch.Tensor) -> torch.Tensor:
    """Every context token and the own one, from the pool, per (row, KV head)."""
    out = torch.zeros(3, HEADS, DIM)
    group = HEADS // KV_HEADS
    for row, context in enumerate(step.context):
        slots = step._slots(row, range(context))  # the own token was written at context - 1
        kv = state.kv_pool[slots // BLOCK, :, slots % BLOCK]  # [T, H_kv, 2D]
        for head in range(HEADS):
            keys, values = kv[:, head // group, :DIM], kv[:, head // group, DIM:]
            probs = torch.softmax(keys @ query[row, head] * state.scale, dim=0)
            out[row, head] = probs @ values
    return out


def test_selecting_every_block_equals_dense_attention_and_padding_rows_give_zero():
    step = _Step(_config(budget=1.0, alpha=1e9))
    runtime = step.runtime
    last = runtime.layers[-1]
    captured = {}
    original = runtime.attend

    def keep(state, plan, query, output):
        original(state, plan, query, output)
        captured[state.layer_idx] = (query.clone(), output.clone())

    runtime.attend = keep
    for _ in range(2):  # the second step hits the blocks the first one fetched
        step.run()
        query, output = captured[last.layer_idx]
        torch.testing.assert_close(output, _dense_reference(step, last, query))
        assert output[2].abs().sum() == 0
    counters = runtime.take_counters()
    # every context token of both rows, each step, in every sparse layer
    assert counters["selected_tokens.3"] == (70 + 71) + (45 + 46)
    assert counters["cache_hits.3"] > 0 and counters["cache_misses.3"] > 0
