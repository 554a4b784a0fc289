# SPDX-License-Identifier: Apache-2.0
"""InfiniGen under vLLM's CUDA graphs, what the CPU build can check: the sparse
layers' backend declares full graphs for uniform single-token decode batches
only, which vLLM's own resolution turns into FULL_AND_PIECEWISE; the attention
input is copied into a persistent buffer that the speculation reads where a
replayed copy writes; a dummy run (a graph capture) writes nothing to the pool.
What the CUDA platform refuses: ``test_platform_refusals.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_infinigen.platforms.cuda.refusals import ATTENTION_OP, KV_CACHE_UPDATE_OP
from vllm_infinigen.worker.attention import SPARSE_METADATA, InfiniGenImplMixin, sparse_backend
from vllm_infinigen.worker import capture
from vllm_infinigen.worker.capture import capture_pre_hook
from vllm_infinigen.worker.layer_state import LayerState

HIDDEN = 8
NAME = "model.layers.{}.self_attn.attn"

# ---------------------------------------------------------------------------
# The backend's declared support and vLLM's resolution


@pytest.mark.parametrize("backend", [CPUAttentionBackend, TritonAttentionBackend])
def test_the_sparse_builder_declares_full_graphs_for_single_token_decode(backend):
    """Whatever the stock builder declares (CPU: NEVER, Triton: ALWAYS through
    its own get_cudagraph_support), and its capture build (Triton's edits the
    metadata it built) returns the marker."""
    builder_cls = sparse_backend(backend).get_builder_cls()
    assert (builder_cls.get_cudagraph_support(None, None)
            is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert builder_cls.get_varlen_cudagraph_max_query_len(None, None) is None
    builder = object.__new__(builder_cls)
    assert builder.build_for_cudagraph_capture(object()) is SPARSE_METADATA


def _resolve(mode: CUDAGraphMode, sparse: type, **compilation) -> CUDAGraphMode:
    """vLLM's resolution as its GPU runner runs it: the least support over the
    KV-cache groups (a dense group on Triton, a sparse group on ``sparse``),
    then ``resolve_cudagraph_mode_and_sizes``; the mode its dispatcher gets."""
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
                               **compilation)
    config.set_splitting_ops_for_v1("naive")
    dispatched = []
    runner = SimpleNamespace(
        compilation_config=config, vllm_config=None, uniform_decode_query_len=1,
        kv_cache_config=None, max_num_reqs=8, speculative_config=None,
        cudagraph_dispatcher=SimpleNamespace(
            initialize_cudagraph_keys=lambda mode, query_len: dispatched.append(mode)))
    groups = [SimpleNamespace(kv_cache_spec=None)] * 2
    GPUModelRunner._check_and_update_cudagraph_mode(
        runner, [{TritonAttentionBackend}, {sparse}], groups)
    assert config.cudagraph_mode == dispatched[-1]
    return dispatched[-1]


@pytest.mark.parametrize("mode,expected", [
    ("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),  # vLLM's default on CUDA
    ("FULL", "FULL_AND_PIECEWISE"),  # no full graph of a step with prompt rows
    ("PIECEWISE", "PIECEWISE"),
    ("FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
    ("NONE", "NONE"),
])
def test_vllm_resolves_the_modes_to_full_decode_graphs_and_piecewise(mode, expected):
    sparse = sparse_backend(TritonAttentionBackend)
    assert _resolve(CUDAGraphMode[mode], sparse) == CUDAGraphMode[expected]
    # The stock declaration would capture full graphs of mixed steps.
    if mode == "FULL":
        assert _resolve(CUDAGraphMode.FULL, TritonAttentionBackend) == CUDAGraphMode.FULL


def test_piecewise_graphs_leave_the_attention_and_the_kv_write_eager():
    """vLLM's default splitting ops: both ops run between the pieces; with none
    left, FULL_AND_PIECEWISE becomes full decode graphs only."""
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.set_splitting_ops_for_v1("naive")
    assert {ATTENTION_OP, KV_CACHE_UPDATE_OP} <= set(config.splitting_ops)
    assert (_resolve(CUDAGraphMode.FULL_AND_PIECEWISE, sparse_backend(TritonAttentionBackend),
                     splitting_ops=[]) == CUDAGraphMode.FULL_DECODE_ONLY)


# ---------------------------------------------------------------------------
# The attention-input capture


def _state(index: int, *, next: LayerState | None = None, sparse: bool = False,
           pool_layer: int = -1) -> LayerState:
    impl = SimpleNamespace(num_heads=1, num_kv_heads=1, head_size=HIDDEN,
                           scale=1 / math.sqrt(HIDDEN))
    return LayerState(index, NAME.format(index), SimpleNamespace(impl=impl), None, sparse,
                      skew=None, next=next, pool_layer=pool_layer)


def _chain(length: int) -> list[LayerState]:
    """Layer 0 dense, then ``length - 1`` sparse layers, each speculating for the next."""
    states: list[LayerState] = []
    for index in reversed(range(length)):
        states.insert(0, _state(index, next=states[0] if states else None,
                                sparse=index > 0, pool_layer=index - 1))
    return states


class _Runtime:
    def __init__(self, speculates: bool | None, plans_on_device: bool = False):
        self._speculates = speculates
        # False (the CPU's): the op asks ``speculates``; True (CUDA's): it copies always.
        self.data_path = SimpleNamespace(plans_on_device=plans_on_device)

    def speculates(self, attn_metadata) -> bool:
        if self._speculates is None:
            raise AssertionError("the op asked the host whether the step speculates")
        return self._speculates


def _context(states, *, speculates: bool | None = True, metadata=True,
             graphs: CUDAGraphMode = CUDAGraphMode.NONE, tokens: int | None = None,
             plans_on_device: bool = False):
    layers = {state.layer_name: SimpleNamespace(impl=SimpleNamespace(
        infinigen_layer=state, infinigen_runtime=_Runtime(speculates, plans_on_device)))
        for state in states}
    return override_forward_context(ForwardContext(
        no_compile_layers=layers, attn_metadata={"any": object()} if metadata else None,
        slot_mapping={}, cudagraph_runtime_mode=graphs,
        batch_descriptor=None if tokens is None else BatchDescriptor(num_tokens=tokens)))


def _op(hidden: torch.Tensor, state: LayerState) -> torch.Tensor:
    return torch.ops.vllm_infinigen.capture_attention_input(hidden, state.layer_name)


def test_the_op_copies_into_a_buffer_that_keeps_its_place_across_steps():
    state = _chain(2)[0]
    first = torch.randn(4, HIDDEN)
    with _context([state]):
        out = _op(first, state)
    torch.testing.assert_close(out, first)
    buffer = state.capture_buffer
    assert out.data_ptr() not in (first.data_ptr(), buffer.data_ptr())  # the op's own result
    torch.testing.assert_close(state.captured_input, first)
    assert state.captured_input.data_ptr() == buffer.data_ptr()
    first.add_(1.0)  # a copy, not a reference to the input
    assert not torch.equal(state.captured_input, first)
    state.capture(None)  # the runtime's, once used: nothing captured in an eager step
    assert state.captured_input is None

    second = torch.randn(2, HIDDEN)
    with _context([state]):
        _op(second, state)
    assert state.capture_buffer is buffer  # the replayed copy writes where this reads
    assert state.captured_input.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(state.captured_input, second)


def test_a_cpu_step_that_does_not_speculate_copies_nothing():
    state = _chain(2)[0]
    for kwargs in ({"speculates": False}, {"metadata": False}):
        with _context([state], **kwargs):
            _op(torch.randn(3, HIDDEN), state)
        assert state.captured_input is None and state.capture_buffer is None


def test_where_the_data_path_plans_on_the_device_the_op_copies_at_every_call():
    """A condition read on the host would be frozen at a graph capture (vLLM
    captures piecewise graphs with no attention metadata): where the data path
    plans on the device (CUDA's), the op copies whatever the step, without
    asking the runtime."""
    state = _chain(2)[0]
    hidden = torch.randn(5, HIDDEN)
    with _context([state], speculates=None, metadata=False, plans_on_device=True):
        capture.capture_attention_input(hidden, state.layer_name)
    torch.testing.assert_close(state.captured_input, hidden)


def test_under_cuda_graphs_the_speculation_reads_what_a_replay_wrote():
    """A replay runs the recorded copy and none of the op's Python: the
    speculation reads the buffer's first T rows, T the forward's tokens."""
    state = _chain(2)[0]
    with _context([state], graphs=CUDAGraphMode.PIECEWISE, tokens=4):
        _op(torch.randn(4, HIDDEN), state)  # the capture: the Python runs once
    state.capture(None)
    replayed = torch.randn(4, HIDDEN)
    state.capture_buffer[:4].copy_(replayed)  # what the replayed copy kernel does
    with _context([state], graphs=CUDAGraphMode.PIECEWISE, tokens=4):
        torch.testing.assert_close(state.captured_input, replayed)
    with _context([state], graphs=CUDAGraphMode.FULL, tokens=2):
        assert state.captured_input.shape == (2, HIDDEN)
    assert state.captured_input is None  # an eager step that captured nothing


def test_a_chain_of_speculating_layers_takes_two_buffers_in_turn():
    """Layer i's input survives the next layer's copy (evaluation mode reads it
    in the next layer's attention); the layer after that reuses its buffer."""
    states = _chain(4)  # 0 -> 1 -> 2 -> 3
    inputs = [torch.full((3, HIDDEN), float(i)) for i in range(3)]
    with _context(states):
        _op(inputs[0], states[0])
        _op(inputs[1], states[1])
        torch.testing.assert_close(states[0].captured_input, inputs[0])
        torch.testing.assert_close(states[1].captured_input, inputs[1])
        _op(inputs[2], states[2])
    pointers = [state.capture_buffer.data_ptr() for state in states[:3]]
    assert pointers[0] == pointers[2] != pointers[1]
    torch.testing.assert_close(states[2].captured_input, inputs[2])


def test_the_op_stays_in_a_compiled_graph():
    """Under torch.compile (fullgraph, as vLLM compiles) the hooked op is kept
    and still copies."""
    state = _chain(2)[0]
    qkv_proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
    qkv_proj.register_forward_pre_hook(capture_pre_hook(state.layer_name))
    compiled = torch.compile(qkv_proj, backend="aot_eager", fullgraph=True)
    hidden = torch.randn(3, HIDDEN)
    with _context([state]), torch.no_grad():
        out = compiled(hidden)
    torch.testing.assert_close(out, hidden @ qkv_proj.weight.detach().T)
    torch.testing.assert_close(state.captured_input, hidden)


# ---------------------------------------------------------------------------
# Forwards InfiniGen takes no part in


class _Impl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        raise AssertionError("a sparse layer's write reached the stock impl")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        return "stock"


def _wrapped(sparse: bool, block_size: int):
    """A layer's wrapped impl over a runtime that fails if it is asked anything
    (``block_size`` 0: the pool is not allocated yet)."""
    state = _state(1, sparse=sparse, pool_layer=0 if sparse else -1)
    runtime = SimpleNamespace(reference_layer=NAME.format(0), block_size=block_size,
                              resident=False)
    return InfiniGenImplMixin.wrap(_Impl(), runtime, state), state


@pytest.mark.parametrize("metadata,block_size", [(False, 16), (True, 0)],
                         ids=["no-metadata", "no-pool-yet"])
def test_a_dummy_run_writes_nothing_to_the_pool(metadata, block_size):
    """After the KV cache exists vLLM runs dummy forwards with slot mappings
    (all PAD_SLOT_ID) and no attention metadata (its piecewise graph capture,
    its sampler warm-up); with graphs on, its CUDA-graph memory profile warms
    up and captures before the pool exists. The sparse layer's write returns."""
    impl, state = _wrapped(sparse=True, block_size=block_size)
    slots = torch.full((4,), -1, dtype=torch.int64)
    with override_forward_context(ForwardContext(
            no_compile_layers={}, attn_metadata={"any": object()} if metadata else None,
            slot_mapping={NAME.format(0): slots, state.layer_name: slots})):
        impl.do_kv_cache_update(None, torch.zeros(4, 1, HIDDEN), torch.zeros(4, 1, HIDDEN),
                                None, slots)


def test_before_the_pool_exists_a_layer_runs_as_in_a_dummy_run():
    """vLLM's CUDA-graph memory profile, with attention metadata and no pool:
    a sparse layer leaves its output as it is (its metadata is the marker),
    a dense layer runs the stock kernel; the runtime is not asked."""
    output = torch.full((2, 1, HIDDEN), 7.0)
    for sparse, expected in ((True, output), (False, "stock")):
        impl, _ = _wrapped(sparse=sparse, block_size=0)
        with override_forward_context(ForwardContext(
                no_compile_layers={}, attn_metadata={"any": object()}, slot_mapping={})):
            got = impl.forward(None, torch.zeros(2, 1, HIDDEN), None, None, None,
                               SPARSE_METADATA if sparse else object(), output)
        assert got is expected
