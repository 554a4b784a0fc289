# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's data path on CPU tensors: attention over cached blocks against
the oracle over the same blocks, the cache's hits and gathers, release, and the writes
(device speculation keys and host pool), against the CPU platform's compiled kernels."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.reference.sparse_attention import attend_gathered
from tests.unit.host_syncs import host_syncs
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.platforms.cuda import data_path as cuda_data_path
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath, blocks_of_positions
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.step_plan import RowSet, build_plan

BLOCK, HEADS, KV_HEADS, DIM, RANK, NUM_BLOCKS = 4, 4, 2, 8, 3, 12
UNIT_BYTES = BLOCK * 2 * DIM * 4  # one KV head's block, K and V, float32


def _layer(index: int = 2, int_keys: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0),
           speculation_keys: str = "int") -> LayerState:
    """A sparse layer; ``kv_scales``: vLLM's k_scale and v_scale (an FP8 pool's)."""
    impl = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM,
                           scale=1 / math.sqrt(DIM))
    skew = None if int_keys or speculation_keys != "int" else torch.randn(KV_HEADS, DIM, RANK)
    attn = SimpleNamespace(impl=impl, _k_scale_float=kv_scales[0], _v_scale_float=kv_scales[1])
    return LayerState(index, f"model.layers.{index}.self_attn.attn", attn, None, True,
                      skew=skew, speculation_keys=speculation_keys)


def _plan(num_blocks: int = NUM_BLOCKS) -> PoolPlan:
    slots = num_blocks * BLOCK
    return PoolPlan(num_rows=slots, num_slots=slots, block_size=BLOCK, num_bytes=0, sized_by="")


class _Case:
    """Two requests' contexts written through one layer; rows decode their next token."""

    def __init__(self, slots_per_head: int = 16, int_keys: bool = False,
                 kv_dtype: torch.dtype = torch.float32, **layer_settings):
        torch.manual_seed(0)
        self.path = CudaDataPath("cpu", slots_per_head)
        self.layer = _layer(int_keys=int_keys, **layer_settings)
        self.path.allocate(self.layer, _plan(), NUM_BLOCKS, torch.float32, kv_dtype)
        self.path.configure(InfiniGenConfig(alpha=1.0, min_context=0))
        self.table = torch.tensor([[3, 7, 1, 9], [0, 5, 11, 2]], dtype=torch.int32)
        self.keys = torch.randn(2, 4 * BLOCK, KV_HEADS, DIM)  # [row, position, H, D]
        self.values = torch.randn(2, 4 * BLOCK, KV_HEADS, DIM)
        self.written = [0, 0]

    def slot(self, row: int, position: int) -> int:
        return int(self.table[row, position // BLOCK]) * BLOCK + position % BLOCK

    def write(self, row: int, upto: int) -> None:
        """Writes the row's positions ``written .. upto - 1``."""
        positions = list(range(self.written[row], upto))
        slots = torch.tensor([self.slot(row, p) for p in positions] + [-1])  # and padding
        pad = torch.zeros(1, KV_HEADS, DIM)
        self.path.write(self.layer, torch.cat([self.keys[row, positions], pad]),
                        torch.cat([self.values[row, positions], pad]), slots, None)
        self.written[row] = upto

    def rows(self, context_lens: list[int]) -> RowSet:
        lens = torch.tensor(context_lens)
        return RowSet(tokens=torch.arange(len(context_lens)), context_lens=lens,
                      block_table=self.table[: len(context_lens)].contiguous(),
                      token_caps=lens.clamp(min=1), caps_host=context_lens,
                      context_host=context_lens)

    def oracle(self, query: torch.Tensor, context_lens: list[int],
               blocks: list[list[list[int]]], return_probs: bool = False):
        """Dense attention of each row over every context token of the given
        logical blocks [row][head] and its own token (tests/reference)."""
        width = max(len(b) * BLOCK for per_row in blocks for b in per_row)
        shape = (len(context_lens), KV_HEADS, width)
        positions, valid = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=bool)
        for row, context in enumerate(context_lens):
            for head in range(KV_HEADS):
                tokens = [b * BLOCK + o for b in blocks[row][head] for o in range(BLOCK)
                          if b * BLOCK + o < context]
                positions[row, head, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
                valid[row, head, : len(tokens)] = True
        heads = torch.arange(KV_HEADS)[None, :, None]
        rows = torch.arange(len(context_lens))[:, None, None]
        own = torch.tensor(context_lens)
        current = (self.keys[torch.arange(len(context_lens)), own],
                   self.values[torch.arange(len(context_lens)), own])
        return attend_gathered(query, self.keys[rows, positions, heads],
                               self.values[rows, positions, heads], valid, *current,
                               1 / math.sqrt(DIM), return_probs=return_probs)


def _positions(per_row_head: list[list[list[int]]]) -> torch.Tensor:
    width = max(len(p) for per_row in per_row_head for p in per_row)
    return torch.tensor([[p + [-1] * (width - len(p)) for p in per_row]
                         for per_row in per_row_head], dtype=torch.int32)


def _decode(case: _Case, positions: torch.Tensor, context_lens: list[int]) -> torch.Tensor:
    """One decode step of the rows: the fetch (the layer before), then the
    layer's write of its own tokens, then its attention."""
    rows = case.rows(context_lens)
    case.path.start_fetch(case.layer, rows, positions, None)
    for row, context in enumerate(context_lens):
        case.write(row, context + 1)
    query = torch.randn(len(context_lens), HEADS, DIM)
    out, waited = case.path.attend_selected(case.layer, rows, query, positions, None, None)
    assert waited == 0.0
    return query, out


def test_the_calls_around_a_step_make_no_host_sync():
    """vLLM asks for the counters right after it queues a step's forward, and the
    worker frees finished requests' blocks before it queues the next: a host sync
    there waits for the forward, and with async scheduling (vLLM's CUDA default)
    the next step's preparation with it. The device is meta (no values):
    ``host_syncs`` sees what would sync on a GPU."""
    path = CudaDataPath("meta", 16)
    path.allocate(_layer(), _plan(), NUM_BLOCKS, torch.float32, torch.float32)
    path.configure(InfiniGenConfig(alpha=1.0, min_context=0))
    stats = torch.zeros(3, 2, dtype=torch.float64, device="meta")
    with host_syncs() as syncs:
        path.add_counts(stats)
        path.release_blocks([1, 2])
        path.release_blocks([])
    assert syncs == []


def test_host_syncs_sees_each_kind_of_sync():
    on_device = torch.zeros(2, device="meta")
    with host_syncs() as syncs:
        torch.tensor([1, 2], device="meta")
        torch.ones(2).to("meta")
        on_device.copy_(torch.ones(2))
        with pytest.raises(NotImplementedError):  # (meta holds no values)
            on_device.cpu()
        on_device.new_tensor([1, 2])
        torch.ones(2).to("meta", non_blocking=True)  # (CUDA: pinned memory too)
        torch.ones(2).to("meta", torch.float64, True)  # the same, non_blocking in place
        torch.tensor([1, 2]).to(torch.float64)  # on the host
    assert len(syncs) == 5, syncs


def test_blocks_of_positions_lists_each_block_once_with_the_own_block_last():
    positions = _positions([[[9, 1, 2, -1], [4, 5, 6, 7]]])
    got = blocks_of_positions(positions, torch.tensor([13]), BLOCK, width=4)
    assert got.tolist() == [[[0, 2, 3, -1], [1, 3, -1, -1]]]


def test_attend_selected_equals_dense_attention_over_the_selected_blocks():
    case = _Case()
    for row, context in enumerate([13, 9]):
        case.write(row, context)
    positions = _positions([[[1, 9], [5]], [[2], [4, 6, 8]]])
    query, out = _decode(case, positions, [13, 9])
    blocks = [[[0, 2, 3], [1, 3]], [[0, 2], [1, 2]]]  # each position's block and the own block
    torch.testing.assert_close(out, case.oracle(query, [13, 9], blocks))
    # entries attended besides the own, over (row, KV head): 0-3, 8-12 | 4-7, 12 |
    # 0-3, 8 | 4-8; and the rows' context tokens, counted on the device
    stats = torch.zeros(3, 2, dtype=torch.float64)
    case.path.add_counts(stats)
    assert stats[2].tolist() == [9 + 5 + 5 + 5, 13 + 9]
    case.path.add_counts(stats)  # drained
    assert stats[2].tolist() == [9 + 5 + 5 + 5, 13 + 9]


def test_the_attention_each_entry_received_is_not_reported():
    """Policies that record it (H2O) run on the CPU build only."""
    case = _Case()
    case.write(0, 13)
    positions = _positions([[[1, 9], [5]]])
    rows = case.rows([13])
    case.path.start_fetch(case.layer, rows, positions, None)
    with pytest.raises(ValueError, match="attention each selected entry"):
        case.path.attend_selected(case.layer, rows, torch.randn(1, HEADS, DIM), positions,
                                  None, torch.zeros(positions.shape))


def test_select_all_equals_dense_attention():
    case = _Case()
    for row, context in enumerate([13, 9]):
        case.write(row, context)
    everything = _positions([[list(range(13))] * 2, [list(range(9)) + [-1] * 4] * 2])
    query, out = _decode(case, everything, [13, 9])
    dense = case.path.attend_dense(case.layer, case.rows([13, 9]), query, None)
    torch.testing.assert_close(out, dense)
    every_block = [[list(range(4))] * 2, [list(range(3))] * 2]
    torch.testing.assert_close(dense, case.oracle(query, [13, 9], every_block))


def test_a_repeated_selection_hits_the_cache_and_only_missing_blocks_are_gathered(monkeypatch):
    gathered = []
    original = kernels.gather_units

    def spy(pool, cache, units, slots, count):
        gathered.append(sorted(unit for per_head, number in zip(units.tolist(), count.tolist())
                               for unit in per_head[:number]))
        original(pool, cache, units, slots, count)

    monkeypatch.setattr(cuda_data_path.kernels, "gather_units", spy)
    case = _Case()
    case.write(0, 13)
    positions = _positions([[[1, 9], [5]]])  # blocks 0, 2 | 1; own block 3
    _decode(case, positions, [13])
    # pool unit = block id * H_kv + head; row 0's blocks 0..3 are ids 3, 7, 1, 9
    assert gathered == [[2, 6, 15, 18, 19]]  # head 0: ids 1, 3, 9; head 1: ids 7, 9
    assert case.path.take_stats() == {"cache_hits.2": 0, "cache_misses.2": 5,
                                      "pcie_bytes.2": 5 * UNIT_BYTES}
    query, out = _decode(case, positions, [13])  # the same selection again
    assert gathered[1:] == [[]]
    assert case.path.take_stats() == {"cache_hits.2": 5, "cache_misses.2": 0,
                                      "pcie_bytes.2": 0}
    torch.testing.assert_close(out, case.oracle(query, [13], [[[0, 2, 3], [1, 3]]]))
    query, out = _decode(case, _positions([[[1, 9], [5, 2]]]), [13])  # head 1 adds block 0
    assert gathered[2:] == [[7]]  # id 3, head 1
    assert case.path.take_stats()["cache_misses.2"] == 1
    torch.testing.assert_close(out, case.oracle(query, [13], [[[0, 2, 3], [0, 1, 3]]]))


def test_a_token_written_after_its_block_was_fetched_reaches_the_cached_copy():
    """Layer i fetches layer i+1's blocks before layer i+1 writes the step's token:
    a hit on the own block must still see the new token."""
    case = _Case()
    case.write(0, 9)
    positions = _positions([[[1], [5]]])
    _decode(case, positions, [9])  # own block 2 now cached, holding token 9 only
    query, out = _decode(case, positions, [10])  # a hit: token 10 arrives after the fetch
    assert case.path.take_stats()["cache_hits.2"] == 4
    torch.testing.assert_close(out, case.oracle(query, [10], [[[0, 2], [1, 2]]]))


def test_the_write_leaves_the_gather_in_flight_and_the_attention_reads_no_stale_token(
        monkeypatch):
    """The overlap's order (a gather issued in the layer before): the layer's write
    waits for nothing, so the next layer's selection and gather follow at once; the
    new token reaches its block's cached copy after the gather has landed and
    before the attention reads it (events recorded as a CUDA stream would see them)."""
    events = []

    class Stream:
        def wait_event(self, event):
            events.append(("wait", event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    write_cached = cuda_data_path.kernels.write_cached_tokens

    def spy(*args, **kwargs):
        events.append(("cached write",))
        write_cached(*args, **kwargs)

    monkeypatch.setattr(cuda_data_path.kernels, "write_cached_tokens", spy)
    case = _Case()
    case.write(0, 9)
    positions = _positions([[[1], [5]]])
    _decode(case, positions, [9])  # the own block (id 1) cached, holding token 9 only
    entry, cache = case.path._layers[case.layer.layer_idx], case.path._cache
    rows = case.rows([10])
    case.path.start_fetch(case.layer, rows, positions, None)
    entry.ready = "gathered"  # the side stream's event
    events.clear()
    case.write(0, 11)  # token 10: block 2 (id 1), offset 2
    assert events == []  # no wait, nothing written into the cache yet
    copy = entry.units[int(cache.slot_of[0, 1 * KV_HEADS])]
    assert not torch.equal(copy[2, :DIM], case.keys[0, 10, 0])
    assert torch.equal(case.layer.kv_pool[1, 0, 2, :DIM], case.keys[0, 10, 0])  # the pool has it
    query = torch.randn(1, HEADS, DIM)
    out, _ = case.path.attend_selected(case.layer, rows, query, positions, None, None)
    assert events == [("wait", "gathered"), ("cached write",)]
    assert torch.equal(copy[2, :DIM], case.keys[0, 10, 0])
    torch.testing.assert_close(out, case.oracle(query, [10], [[[0, 2], [1, 2]]]))


def test_release_drops_a_finished_requests_blocks_and_they_are_fetched_again():
    case = _Case()
    case.write(0, 13)
    positions = _positions([[[1, 9], [5]]])
    _decode(case, positions, [13])
    case.path.take_stats()
    case.path.release_blocks(case.table[0].tolist())
    cache = case.path._cache
    assert (cache.block_of == -1).all() and (cache.slot_of == -1).all()
    _decode(case, positions, [13])
    assert case.path.take_stats()["cache_misses.2"] == 5


def test_a_step_wider_than_the_cache_is_refused():
    case = _Case(slots_per_head=3)
    case.write(0, 13)
    with pytest.raises(ValueError, match="slots per head"):
        case.path.start_fetch(case.layer, case.rows([13]), _positions([[[1, 5, 9], [0]]]),
                              None)


def test_writes_land_in_the_host_pool_and_the_device_speculation_keys():
    """Against the CPU platform's compiled kernels, written from the same tokens
    (the int keys need 16-token groups: test_cuda_writes.py)."""
    case, cpu, reference = _Case(), CpuDataPath("in-place"), _layer()
    reference.skew = case.layer.skew
    cpu.allocate(reference, _plan(), NUM_BLOCKS, torch.float32, torch.float32)
    for row, upto in ((0, 13), (1, 16)):
        case.write(row, upto)
        slots = torch.tensor([case.slot(row, p) for p in range(upto)])
        cpu.write(reference, case.keys[row, :upto], case.values[row, :upto], slots, None)
    assert torch.equal(case.layer.kv_pool, reference.kv_pool)
    assert case.layer.kv_pool.abs().sum() > 0
    torch.testing.assert_close(case.layer.partial_keys, reference.partial_keys)
    assert case.layer.partial_keys.abs().sum() > 0


def test_prompt_rows_attend_as_the_cpu_platform():
    case, cpu, reference = _Case(), CpuDataPath("in-place"), _layer()
    cpu.allocate(reference, _plan(), NUM_BLOCKS, torch.float32, torch.float32)
    config = InfiniGenConfig(alpha=1.0, min_context=0)
    # request 0 decodes at position 6; request 1's prompt chunk is positions 3..9
    metadata = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 8]),
                               seq_lens=torch.tensor([7, 10]), block_table=case.table)
    plan = build_plan(metadata, config, BLOCK, lambda n: torch.tensor([3, 10]))
    for row, upto in ((0, 7), (1, 10)):
        case.write(row, upto)
        slots = torch.tensor([case.slot(row, p) for p in range(upto)])
        cpu.write(reference, case.keys[row, :upto], case.values[row, :upto], slots, None)
    query = torch.randn(8, HEADS, DIM)
    got, expected = torch.zeros_like(query), torch.zeros_like(query)
    case.path.attend_prompt(case.layer, plan, query, got, None)
    cpu.attend_prompt(reference, plan, query, expected, None)
    torch.testing.assert_close(got, expected)
    assert got[1:].abs().sum() > 0 and got[0].abs().sum() == 0  # the decode row untouched


def test_a_capped_pool_cannot_reach_the_cuda_data_path():
    """The front end refuses --infinigen-cpu-pool-gib on CUDA and its pool plan never
    caps (``infinigen_pool_cappable``): a capped plan here is a bug, not a setting."""
    path = CudaDataPath("cpu", 4)
    capped = PoolPlan(num_rows=8, num_slots=NUM_BLOCKS * BLOCK, block_size=BLOCK,
                      num_bytes=0, sized_by="")
    with pytest.raises(RuntimeError, match="got a capped one"):
        path.allocate(_layer(), capped, NUM_BLOCKS, torch.float32, torch.float32)


def test_settings_change_in_place_and_widening_changes_are_refused():
    """A captured graph reads the settings tensor: a change lands in it, not in a
    new one; a change the start-up width cannot hold is refused, naming the flag."""
    case = _Case()
    settings = case.path.settings
    pointer = settings.data_ptr()
    case.path.configure(InfiniGenConfig(alpha=2.0, budget=0.1, min_context=0))
    assert case.path.settings.data_ptr() == pointer
    assert case.path.settings.tolist() == [2.0, 0.1, 0.0, 0.0]
    for change, flag in (({"budget": 0.5}, "--infinigen-budget"),
                         ({"min_context": 64}, "--infinigen-min-context"),
                         ({"sink_tokens": 4}, "--infinigen-sink-tokens"),
                         ({"speculation": "same-layer"}, "--infinigen-speculation"),
                         ({"eval_dense_prefix": 8}, "--infinigen-eval-dense-prefix")):
        with pytest.raises(ValueError, match=flag):
            case.path.configure(InfiniGenConfig(**{"alpha": 1.0, "min_context": 0, **change}))
    # A baseline policy: refused as CUDA refuses it at start-up, not "restart with it".
    with pytest.raises(ValueError, match="on CUDA, --infinigen-policy h2o is not supported "
                       r"\(the baselines run on the CPU build\); keep infinigen"):
        case.path.configure(InfiniGenConfig(alpha=1.0, min_context=0, policy="h2o"))
    capped = CudaDataPath("cpu", 16)
    capped.allocate(_layer(3), _plan(), NUM_BLOCKS, torch.float32, torch.float32)
    capped.configure(InfiniGenConfig(alpha=1.0, min_context=0, budget_tokens=8))
    capped.configure(InfiniGenConfig(alpha=1.0, min_context=0, budget_tokens=4))
    for cap in (None, 9):
        with pytest.raises(ValueError, match="--infinigen-budget-tokens"):
            capped.configure(InfiniGenConfig(alpha=1.0, min_context=0, budget_tokens=cap))
    # the cap bounds every selection's width: 8 tokens = 2 blocks + sink + own +
    # the 16 recent tokens' 4 blocks (the default --infinigen-recent-tokens)
    assert capped.width(NUM_BLOCKS, BLOCK) == 2 + 1 + 1 + 16 // BLOCK


@pytest.mark.parametrize("keys", ["bounds", "int"])
def test_the_block_rule_keeps_a_needles_block_at_a_small_budget(keys):
    """Each KV head's needle (a key along the query) in a different middle block of
    a 160-token context: at budget 0.1 (16 tokens: one block besides the sink and
    recent windows: the first block, the row's own and the one before it, the
    default 16 recent tokens) each head keeps its needle's block and no other
    middle block."""
    block, context, needles = 16, 160, (37, 101)
    impl = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=32,
                           scale=1 / math.sqrt(32))
    layer = LayerState(2, "model.layers.2.self_attn.attn", SimpleNamespace(impl=impl), None,
                       True, skew=None, speculation_keys=keys)
    path = CudaDataPath("cpu", 16)
    num_blocks = 12
    path.allocate(layer, PoolPlan(num_rows=num_blocks * block, num_slots=num_blocks * block,
                                  block_size=block, num_bytes=0, sized_by=""),
                  num_blocks, torch.float32, torch.float32)
    path.configure(InfiniGenConfig(alpha=math.inf, budget=0.1, min_context=0))
    gen = torch.Generator().manual_seed(4)
    direction = torch.randn(KV_HEADS, 32, generator=gen)
    keys_ = 0.1 * torch.randn(context + 1, KV_HEADS, 32, generator=gen)
    for head, needle in enumerate(needles):
        keys_[needle, head] = 4 * direction[head]
    table = torch.tensor([[5, 0, 9, 2, 11, 7, 1, 3, 10, 4, 6]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // block]) * block + p % block
                          for p in range(context + 1)])
    path.write(layer, keys_, torch.randn(context + 1, KV_HEADS, 32, generator=gen), slots, None)
    query = direction[None, :, None, :].expand(1, KV_HEADS, HEADS // KV_HEADS, 32)
    rows = RowSet(tokens=torch.arange(1), context_lens=torch.tensor([context]),
                  block_table=table, token_caps=torch.tensor([context // 10]),
                  caps_host=[context // 10], context_host=[context])
    selection = path.select(layer, rows, query.contiguous())
    for head, needle in enumerate(needles):
        kept = [int(b) for b in selection.logical[0, head] if b >= 0]
        assert {0, context // block - 1, context // block} <= set(kept), (keys, head, kept)
        middle = [b for b in kept if 0 < b < context // block - 1]
        assert middle == [needle // block], (keys, head, kept)


def test_decode_short_writes_then_attends_densely():
    """CUDA's ``decode_short`` (no fused op: ``has_fused_short`` False) equals a
    ``write`` of the rows' tokens, then ``attend_dense`` into the first rows of out."""
    assert not CudaDataPath.has_fused_short
    fused, unfused = _Case(), _Case()
    for case in (fused, unfused):
        for row, context in enumerate([13, 9]):
            case.write(row, context)
    rows = fused.rows([13, 9])
    slots = torch.tensor([fused.slot(0, 13), fused.slot(1, 9)])
    key = torch.stack([fused.keys[0, 13], fused.keys[1, 9]])
    value = torch.stack([fused.values[0, 13], fused.values[1, 9]])
    query = torch.randn(2, HEADS, DIM)
    out = torch.zeros(3, HEADS, DIM)  # a padded tail stays untouched
    fused.path.decode_short(fused.layer, rows, query, key, value, slots, None, out)
    unfused.path.write(unfused.layer, key, value, slots, None)
    expected = unfused.path.attend_dense(unfused.layer, unfused.rows([13, 9]), query, None)
    torch.testing.assert_close(out[:2], expected)
    assert out[2].abs().sum() == 0
    assert torch.equal(fused.layer.kv_pool, unfused.layer.kv_pool)
