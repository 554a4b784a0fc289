# SPDX-License-Identifier: Apache-2.0
"""The short path in one op (``kernels.decode_short``): bit for bit the kernels
the step would call one by one (``write_pool``, then ``write_int_keys`` or
``write_partial_keys``, then ``attend_decode`` over every position), and the
runtime's choice of it (``InfiniGenRuntime.fuses_short``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.reference.runtime_step import BLOCK as STEP_BLOCK
from tests.reference.runtime_step import CONTEXT, DIM, build_step
from vllm_infinigen.layout import int_key_bits
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen import block_layout

BLOCK = 32  # two 16-token groups per block
HEADS, GROUP, HEAD_SIZE, RANK = 2, 3, 32, 6
# Contexts of the step's rows: 47 = 2 * 16 + 15 puts a row's new token last in its
# 16-token group (the step encodes a group); 46 closes none.
CLOSING, OPEN = [47, 5, 100], [46, 5, 100]


class Step:
    """A pool with requests in shuffled blocks and the state of one sparse layer
    (int or partial keys), and one decode step: a new token per request plus a
    padding token (slot -1, its query row past the requests')."""

    def __init__(self, *, dtype: torch.dtype, keys: str, capped: bool,
                 context_lens: list[int], seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        num_rows = len(context_lens)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int64)
        blocks_per_row = max(n // BLOCK + 1 for n in context_lens)
        num_blocks = num_rows * blocks_per_row + 2
        order = torch.randperm(num_blocks, generator=gen)[: num_rows * blocks_per_row]
        self.block_table = order.view(num_rows, blocks_per_row).to(torch.int32)
        self.kv_pool = torch.randn((num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE),
                                   generator=gen).to(dtype)
        self.row_map = None
        if capped:  # each head's rows a permutation, some evicted; the new tokens held
            rows = torch.stack([torch.randperm(num_blocks * BLOCK, generator=gen)
                                for _ in range(HEADS)]).to(torch.int32)
            rows = rows.view(HEADS, num_blocks, BLOCK).permute(1, 0, 2)
            evicted = torch.rand(rows.shape, generator=gen) < 0.3
            block_ids, offsets = block_layout.block_coordinates(
                self.context_lens[:, None], self.block_table, BLOCK)
            evicted[block_ids[:, 0], :, offsets[:, 0]] = False
            self.row_map = rows.masked_fill(evicted, -1).contiguous()
        self.state: dict[str, torch.Tensor | None] = {
            "key_codes": None, "key_scales": None, "partial_keys": None, "skew": None}
        if keys == "int":
            bits = int_key_bits(torch.tensor([], dtype=dtype).element_size())
            self.state["key_codes"] = torch.randint(
                0, 255, (num_blocks, HEADS, BLOCK // 16, HEAD_SIZE, 2 * bits),
                generator=gen).to(torch.uint8)
            self.state["key_scales"] = torch.rand(
                (num_blocks, HEADS, BLOCK // 16, HEAD_SIZE), generator=gen).half()
        else:
            self.state["partial_keys"] = torch.randn((num_blocks, HEADS, RANK, BLOCK),
                                                     generator=gen).to(dtype)
            self.state["skew"] = torch.randn((HEADS, HEAD_SIZE, RANK), generator=gen)
        self.stats = torch.tensor([3.0, 7.0], dtype=torch.float64)  # earlier counts
        tokens = num_rows + 1
        self.query = torch.randn((tokens, HEADS * GROUP, HEAD_SIZE), generator=gen).to(dtype)
        self.key = torch.randn((tokens, HEADS, HEAD_SIZE), generator=gen).to(dtype)
        self.value = torch.randn((tokens, HEADS, HEAD_SIZE), generator=gen).to(dtype)
        block_ids, offsets = block_layout.block_coordinates(
            self.context_lens[:, None], self.block_table, BLOCK)
        own = block_ids[:, 0].to(torch.int64) * BLOCK + offsets[:, 0]
        self.slots = torch.cat([own, torch.tensor([-1])])
        self.scale = HEAD_SIZE ** -0.5

    def copy(self) -> dict[str, torch.Tensor | None]:
        """The mutable state, cloned: the pool, speculation keys, counters."""
        return {"kv_pool": self.kv_pool.clone(), "stats": self.stats.clone(),
                **{name: None if t is None or name == "skew" else t.clone()
                   for name, t in self.state.items()}}


def _one_by_one(step: Step, state: dict) -> torch.Tensor:
    """The present short path's kernels (``CpuDataPath.write`` + ``attend_dense``)."""
    kernels.write_pool(state["kv_pool"], step.key, step.value, step.slots, step.row_map)
    if state["key_codes"] is not None:
        kernels.write_int_keys(state["key_codes"], state["key_scales"], state["kv_pool"],
                               step.slots, step.row_map)
    else:
        kernels.write_partial_keys(state["partial_keys"], step.key, step.state["skew"],
                                   step.slots)
    rows = len(step.context_lens)
    return kernels.attend_decode(step.query[:rows].clone(), state["kv_pool"], step.block_table,
                                 step.context_lens, None, scale=step.scale,
                                 row_map=step.row_map, stats=state["stats"])


def _fused(step: Step, state: dict, out: torch.Tensor | None) -> torch.Tensor:
    return kernels.decode_short(
        step.query, step.key, step.value, state["kv_pool"], step.slots, step.block_table,
        step.context_lens, scale=step.scale, row_map=step.row_map,
        key_codes=state["key_codes"], key_scales=state["key_scales"],
        partial_keys=state["partial_keys"], skew=step.state["skew"], stats=state["stats"],
        out=out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", ["int", "partial"])
@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("context_lens", [CLOSING, OPEN], ids=["closes-a-group", "open"])
def test_the_fused_op_equals_the_kernels_one_by_one(dtype, keys, capped, context_lens):
    step = Step(dtype=dtype, keys=keys, capped=capped, context_lens=context_lens)
    want_state, got_state = step.copy(), step.copy()
    want = _one_by_one(step, want_state)
    out = torch.full_like(step.query, 7.0)
    got = _fused(step, got_state, out)
    rows = len(context_lens)
    assert got.dtype == dtype and got.shape == (rows, HEADS * GROUP, HEAD_SIZE)
    assert torch.equal(got, want)
    assert torch.equal(out[:rows], want)
    assert out[rows:].eq(7.0).all()  # the padding row's output is not touched
    for name, tensor in want_state.items():
        if tensor is not None:
            assert torch.equal(got_state[name], tensor), name
    # The counts of attend_decode, added to the earlier ones.
    assert got_state["stats"][1] == 7.0 + sum(context_lens)
    if keys == "int":  # the step encodes a group only when a token closes one
        changed = not torch.equal(want_state["key_codes"], step.state["key_codes"])
        assert changed == (context_lens == CLOSING)
    # Without ``out`` the op only returns the rows' output.
    assert torch.equal(_fused(step, step.copy(), None), want)


def test_the_fused_op_checks_its_speculation_keys():
    step = Step(dtype=torch.float32, keys="int", capped=False, context_lens=OPEN)
    state = step.copy()
    state["key_scales"] = None
    with pytest.raises(RuntimeError, match="key_codes and key_scales go together"):
        _fused(step, state, None)


# -- the runtime's choice ----------------------------------------------------------

def _short_step(keys: str, data_path=None):
    """``build_step``'s runtime with its row below min_context for a few steps (short)."""
    runtime, metadata, new_slot = build_step(
        keys, data_path or (lambda config: CpuDataPath(config.transfer)))
    runtime.update_selection(min_context=CONTEXT + 16)
    return runtime, metadata, new_slot


@pytest.mark.parametrize("keys", ["int", "partial"])
def test_the_runtime_fuses_a_short_step_with_the_same_results_and_counters(keys):
    """``decode_short`` leaves the pool, the speculation keys, the output and the
    counters as ``write`` + ``attend_decode`` do, step after step (a padding
    token beside the row's, one step closing a 16-token group)."""
    fused, metadata, _ = _short_step(keys)
    present, _, _ = _short_step(keys)
    assert fused.fuses_short(metadata)
    gen = torch.Generator().manual_seed(4)
    for token in range(CONTEXT + 13, CONTEXT + 16):  # slot 47 closes a 16-token group
        step = SimpleNamespace(query_start_loc=torch.tensor([0, 1]),
                               seq_lens=torch.tensor([token + 1]),
                               block_table=metadata.block_table)
        slots = torch.tensor([token, -1])
        query, key, value = (torch.randn((2, 1, DIM), generator=gen) for _ in range(3))
        outputs = []
        for runtime in (fused, present):
            output = torch.full((2, 1, DIM), 7.0)
            layer = runtime.layers[2]
            if runtime is fused:
                assert runtime.fuses_short(step)
                runtime.decode_short(layer, step, slots, query, key, value, output)
            else:
                runtime.begin_step(step, slots)
                runtime.write(layer, key, value, slots)
                runtime.attend_decode(layer, runtime.plan_for(step, STEP_BLOCK), query, output)
            outputs.append(output)
        assert torch.equal(outputs[0], outputs[1])
        assert outputs[0][1].eq(7.0).all()
        layers = fused.layers[2], present.layers[2]
        assert torch.equal(layers[0].kv_pool, layers[1].kv_pool)
        for name in ("key_codes", "key_scales", "partial_keys"):
            if getattr(layers[1], name) is not None:
                assert torch.equal(getattr(layers[0], name), getattr(layers[1], name)), name
        assert fused.take_counters() == present.take_counters()


def test_no_fused_step_where_a_policy_keeps_state_of_the_writes():
    runtime, metadata, _ = _short_step("int")
    assert runtime.fuses_short(metadata)
    runtime.update_selection(policy="quest")  # per-page bounds of every write
    assert not runtime.fuses_short(metadata)
    runtime.update_selection(policy="infinigen")  # quest's state is kept up to date
    assert not runtime.fuses_short(metadata)


def test_no_fused_step_where_a_row_selects_or_the_data_path_lacks_the_op():
    runtime, metadata, _ = _short_step("int")
    runtime.update_selection(min_context=CONTEXT)  # the row selects: not short
    assert not runtime.fuses_short(metadata)

    class Unfused(CpuDataPath):  # a data path without the fused op (CUDA's)
        has_fused_short = False

    runtime, metadata, _ = _short_step("int", lambda config: Unfused(config.transfer))
    assert runtime.plan_for(metadata, STEP_BLOCK).short_decode_only
    assert not runtime.fuses_short(metadata)
    runtime, metadata, _ = _short_step("int")
    runtime.resident = True  # device-first, before the move: vLLM's blocks
    assert not runtime.fuses_short(metadata)


# -- the attention impl's wiring -------------------------------------------------------

class _StockImpl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        raise AssertionError("a sparse layer's write reached the stock impl")

    def forward(self, *args, **kwargs):
        raise AssertionError("a sparse layer reached the stock kernel")


@pytest.mark.parametrize("keys", ["int", "partial"])
def test_the_sparse_layer_writes_nothing_in_its_kv_update_and_all_in_its_forward(keys):
    """In a short step the wrapped impl's KV update returns at once and its
    forward makes the one call; on a data path without the op (the fallback)
    the update writes and the forward attends; where vLLM makes no update call
    (the backend says the forward writes) the forward writes, fused or not:
    the same output and pool."""
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_infinigen.worker.attention import SPARSE_METADATA, InfiniGenImplMixin

    class Unfused(CpuDataPath):
        has_fused_short = False

    gen = torch.Generator().manual_seed(6)
    query, key, value = (torch.randn((2, 1, DIM), generator=gen) for _ in range(3))
    slots = torch.tensor([CONTEXT, -1])
    # The vLLM layer whose backend says its forward writes (``sparse_backend`` on
    # the CPU): vLLM makes no KV-update call, the forward writes.
    writing = SimpleNamespace(attn_backend=SimpleNamespace(forward_includes_kv_cache_update=True))
    results = []
    for data_path, vllm_layer in ((None, None), (lambda config: Unfused(config.transfer), None),
                                  (None, writing),
                                  (lambda config: Unfused(config.transfer), writing)):
        runtime, metadata, _ = _short_step(keys, data_path)
        layer = runtime.layers[2]
        impl = InfiniGenImplMixin.wrap(_StockImpl(), runtime, layer)
        output = torch.full((2, 1, DIM), 7.0)
        with override_forward_context(ForwardContext(
                no_compile_layers={},
                attn_metadata={runtime.reference_layer: metadata,
                               layer.layer_name: SPARSE_METADATA},
                slot_mapping={runtime.reference_layer: slots, layer.layer_name: slots})):
            before = layer.kv_pool.clone()
            if vllm_layer is None:
                impl.do_kv_cache_update(None, key, value, None, slots)
                assert torch.equal(layer.kv_pool, before) == (data_path is None)
            assert impl.forward(vllm_layer, query, key, value, None, SPARSE_METADATA,
                                output) is output
            assert not torch.equal(layer.kv_pool, before)  # written exactly once (below)
        results.append((output, layer.kv_pool, runtime.take_counters()))
    fused_out, fused_pool, fused_counts = results[0]
    for out, pool, counts in results[1:]:
        assert torch.equal(fused_out, out) and out[1].eq(7.0).all()
        assert torch.equal(fused_pool, pool)
        assert fused_counts == counts and counts["selected_tokens.2"] == CONTEXT


# -- vLLM's per-step slot mappings of the sparse groups ---------------------------------

def test_the_sparse_groups_compute_no_slot_mapping_with_pool_residency():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode

    from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec
    from vllm_infinigen.worker.base import skip_sparse_slot_mappings

    dense = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=DIM, dtype=torch.float32)
    specs = [dense, InfiniGenSparseSpec.of(dense), InfiniGenSparseSpec.of(dense),
             InfiniGenSparseSpec.of(dense, device_first=True)]
    tables = MultiGroupBlockTable(max_num_reqs=2, max_num_batched_tokens=8, pin_memory=False,
                                  device=torch.device("cpu"), block_sizes=[16] * 4,
                                  max_num_blocks=[4] * 4)
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=tables))
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
    assert skip_sparse_slot_mappings(runner, groups) == [1, 2]
    modes = [table.slot_mapping_mode for table in tables.block_tables]
    assert modes == [SlotMappingMode.TOKEN_TO_KV_SLOT, SlotMappingMode.NONE,
                     SlotMappingMode.NONE, SlotMappingMode.TOKEN_TO_KV_SLOT]
    tables[1].slot_mapping.cpu.fill_(5)
    tables[1].compute_slot_mapping(1, torch.tensor([0, 1], dtype=torch.int32),
                                   torch.tensor([3]))
    assert tables[1].slot_mapping.cpu.eq(5).all()  # returned at once
