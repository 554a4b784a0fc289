# SPDX-License-Identifier: Apache-2.0
"""``--infinigen-residency device-first`` on the CUDA build, what the CPU build can
check: the sparse groups keep vLLM's metadata while declaring the CUDA-graph
support of the moved step; the worker captures the full graphs of both
residencies and puts the moved set in place at the move, once.
(In a real engine, with the CUDA data path on CPU tensors:
``tests/e2e/test_residency.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from tests.reference.device_step import DecodeStep, config
from tests.unit.test_cuda_graphs import _resolve
from vllm_infinigen.platforms.cuda.residency import ResidencyGraphs, full_graph_wrappers
from vllm_infinigen.worker.attention import resident_backend, sparse_backend


@pytest.mark.parametrize("backend,declared", [
    (TritonAttentionBackend, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),  # stock: ALWAYS
    (CPUAttentionBackend, AttentionCGSupport.NEVER),  # never more than the stock kernel's
])
def test_resident_groups_build_stock_metadata_and_declare_the_moved_steps_support(
        backend, declared):
    stock = backend.get_builder_cls()
    builder = resident_backend(backend).get_builder_cls()
    assert issubclass(builder, stock)
    assert builder.build is stock.build  # a resident layer runs the stock kernel over it
    assert builder.build_for_cudagraph_capture is stock.build_for_cudagraph_capture
    assert builder.get_cudagraph_support(None, None) is declared
    assert builder.get_varlen_cudagraph_max_query_len(None, None) is None
    assert resident_backend(backend) is resident_backend(backend)  # one group per backend


@pytest.mark.parametrize("mode,expected", [
    ("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
    ("FULL", "FULL_AND_PIECEWISE"),
    ("PIECEWISE", "PIECEWISE"),
    ("FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
])
def test_vllm_resolves_resident_groups_as_it_does_the_pools(mode, expected):
    """The modes vLLM resolves are the pool mode's: full graphs of decode steps only."""
    resolved = _resolve(CUDAGraphMode[mode], resident_backend(TritonAttentionBackend))
    assert resolved == CUDAGraphMode[expected]
    assert resolved == _resolve(CUDAGraphMode[mode], sparse_backend(TritonAttentionBackend))


def _wrapper(runnable, mode: CUDAGraphMode):
    """A vLLM ``CUDAGraphWrapper`` without a graph pool (the CPU build has none)."""
    wrapper = object.__new__(CUDAGraphWrapper)
    wrapper.__dict__.update(runnable=runnable, runtime_mode=mode,
                            concrete_cudagraph_entries={})
    return wrapper


class _Runner:
    """A model runner whose ``capture_model`` records, per wrapper and batch
    size, which path a capture ran (the runtime's residency then)."""

    def __init__(self, runtime, model):
        self.runtime, self.model, self.captures = runtime, model, 0

    def capture_model(self) -> int:
        self.captures += 1
        path = "resident" if self.runtime.resident else "moved"
        for wrapper in full_graph_wrappers(self.model):
            for size in (1, 2, 4):
                wrapper.concrete_cudagraph_entries.setdefault(size, f"{path} x{size}")
        return 10


@pytest.fixture
def engine():
    step = DecodeStep(config(residency="device-first"))
    piecewise = _wrapper(object(), CUDAGraphMode.PIECEWISE)
    full = _wrapper(piecewise, CUDAGraphMode.FULL)
    runner = _Runner(step.runtime, full)
    graphs = ResidencyGraphs(step.runtime, lambda: runner.model)
    return SimpleNamespace(runtime=step.runtime, runner=runner, graphs=graphs, full=full,
                           piecewise=piecewise)


def test_only_the_full_graph_wrappers_are_found(engine):
    assert full_graph_wrappers(engine.full) == [engine.full]
    assert full_graph_wrappers(engine.piecewise) == []


def test_both_residencies_are_captured_and_the_resident_set_replays_first(engine):
    taken = engine.graphs.capture_both(engine.runner.capture_model)
    assert engine.runner.captures == 2 and taken == 20
    assert engine.runtime.resident
    assert engine.full.concrete_cudagraph_entries == {s: f"resident x{s}" for s in (1, 2, 4)}


def test_each_move_puts_the_other_set_in_place_once(engine):
    """To the pool and back, twice: each residency replays its own graphs."""
    engine.graphs.capture_both(engine.runner.capture_model)
    engine.runtime.set_resident(True)  # a resident step changes nothing
    assert engine.full.concrete_cudagraph_entries[1] == "resident x1"
    for _ in range(2):
        engine.runtime.set_resident(False)
        assert not engine.runtime.resident
        assert engine.full.concrete_cudagraph_entries == {s: f"moved x{s}" for s in (1, 2, 4)}
        engine.runtime.set_resident(False)  # the steps after it
        assert engine.full.concrete_cudagraph_entries[4] == "moved x4"
        engine.runtime.set_resident(True)  # back: every pool request has finished
        assert engine.runtime.resident
        assert engine.full.concrete_cudagraph_entries == {s: f"resident x{s}"
                                                          for s in (1, 2, 4)}


def test_without_full_graphs_vllm_captures_once(engine):
    engine.runner.model = engine.piecewise
    assert engine.graphs.capture_both(engine.runner.capture_model) == 10
    assert engine.runner.captures == 1 and engine.runtime.resident
    engine.runtime.set_resident(False)  # nothing to swap


def test_a_failed_capture_leaves_the_engine_resident(engine):
    def fails():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        engine.graphs.capture_both(fails)
    assert engine.runtime.resident


def test_a_resident_engine_reads_no_counters_back_from_the_device(engine, monkeypatch):
    """Nothing selects while resident, and on a GPU each read would wait for
    the step: the counters are not drained until the move."""
    runtime = engine.runtime

    def read_back(*args):
        raise AssertionError("a resident step read the device counters")

    with monkeypatch.context() as patched:
        patched.setattr(runtime.data_path, "add_counts", read_back)
        patched.setattr(runtime.data_path, "take_stats", read_back)
        patched.setattr(runtime.stats, "tolist", read_back, raising=False)
        assert runtime.take_counters() == {}
    runtime.stats[2, 1] = 70  # a moved step's counts
    runtime.set_resident(False)
    assert runtime.take_counters()["candidate_tokens.2"] == 70 * 2 / 2


def test_back_in_the_device_blocks_the_pools_last_counts_are_drained_once(engine):
    """The counts of the last steps over the pool reach the host at the first
    resident step (read in full), and no resident step reads again."""
    runtime = engine.runtime
    runtime.set_resident(False)
    runtime.stats[2, 1] = 30
    runtime.set_resident(True)
    assert runtime.take_counters()["candidate_tokens.2"] == 30 * 2 / 2
    runtime.stats[2, 1] = 5  # (nothing selects while resident: not read)
    assert runtime.take_counters() == {}


@pytest.mark.parametrize("residency", ["device-first", "pool"])
def test_the_warm_ups_counts_are_dropped(engine, monkeypatch, residency):
    """vLLM's warm-up and graph captures run the layers on dummy rows; the worker
    drops their counts, or the first stats (after the first move, under
    device-first) would report them."""
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_infinigen.platforms.cuda.worker import InfiniGenCUDAWorker

    runtime = engine.runtime

    def warm_up(worker):
        runtime.stats[2, 1] = 40  # what the dummy rows counted
        if residency == "device-first":
            engine.runner.capture_model()  # (the residencies' captures)
        return "warmed"

    monkeypatch.setattr(Worker, "compile_or_warm_up_model", warm_up)
    worker = object.__new__(InfiniGenCUDAWorker)
    worker.infinigen = SimpleNamespace(
        config=SimpleNamespace(device_first=residency == "device-first"),
        layout=SimpleNamespace(num_sparse=1))
    worker.infinigen_runtime, worker.model_runner = runtime, engine.runner
    assert worker.compile_or_warm_up_model() == "warmed"
    runtime.set_resident(False)
    assert "candidate_tokens.2" not in runtime.take_counters()
