# SPDX-License-Identifier: Apache-2.0
"""Prompts on the CUDA platform's data path, on CPU tensors: their blocks placed in
the device block cache before their write, attended there (no context staged back
from the pool), chunked prefill included; against the CPU platform over the same
tokens. Also: what the cache cannot hold is staged, the decode rows' selection in
flight is never evicted, and a prompt's first decode step finds its blocks cached."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_cuda_data_path import (
    BLOCK,
    DIM,
    HEADS,
    KV_HEADS,
    NUM_BLOCKS,
    UNIT_BYTES,
    _Case,
    _layer,
    _plan,
    _positions,
)
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.platforms.cuda import data_path as cuda_data_path
from vllm_infinigen.platforms.cuda import kernels, prompts, staged
from vllm_infinigen.worker.step_plan import build_plan

PROMPT_LEN = 16  # every request's prompt (the table holds 4 blocks of 4)
SCALES = (0.37, 2.5)


class _Prompts:
    """The CUDA path (``_Case``) and the CPU platform's, fed the same steps."""

    def __init__(self, slots_per_head: int = 16, kv_dtype: torch.dtype = torch.float32,
                 monkeypatch: pytest.MonkeyPatch | None = None):
        scales = SCALES if kv_dtype.itemsize == 1 else (1.0, 1.0)
        self.case = _Case(slots_per_head=slots_per_head, kv_dtype=kv_dtype, kv_scales=scales)
        self.cpu, self.reference = CpuDataPath("in-place"), _layer(kv_scales=scales)
        self.reference.skew = self.case.layer.skew
        self.cpu.allocate(self.reference, _plan(), NUM_BLOCKS, torch.float32, kv_dtype)
        self.staged, self.gathered = [], []
        if monkeypatch is not None:
            stage, gather = staged.stage, kernels.gather_units

            def stage_spy(layer, block_ids, device, counter=None):
                self.staged.append(block_ids.tolist())
                return stage(layer, block_ids, device, counter)

            def gather_spy(pool, cache, units, slots, count):
                self.gathered.append(sorted(unit for per_list, number in zip(
                    units.reshape(count.shape[0], -1).tolist(), count.tolist())
                    for unit in per_list[:number]))
                gather(pool, cache, units, slots, count)

            monkeypatch.setattr(staged, "stage", stage_spy)
            monkeypatch.setattr(cuda_data_path.kernels, "gather_units", gather_spy)
            monkeypatch.setattr(prompts.kernels, "gather_units", gather_spy)

    def plan(self, ends: list[int], decodes: int = 0):
        """The step's plan: request r (table row r) runs positions written[r] ..
        ends[r] - 1; the first ``decodes`` requests decode one token."""
        starts = [self.case.written[r] for r in range(len(ends))]
        query_start = torch.tensor([0] + list(torch.tensor(ends).sub(torch.tensor(starts))
                                              .cumsum(0).tolist()))
        metadata = SimpleNamespace(query_start_loc=query_start, seq_lens=torch.tensor(ends),
                                   block_table=self.case.table[: len(ends)])
        prompt_lens = torch.tensor([1] * decodes + [PROMPT_LEN] * (len(ends) - decodes))
        return build_plan(metadata, InfiniGenConfig(alpha=1.0, min_context=0), BLOCK,
                          lambda n: prompt_lens[:n])

    def step(self, ends: list[int], query: torch.Tensor, place: bool = True):
        """One prompt step of one layer on both paths: the placement (CUDA),
        the writes, the prompts' attention. Returns (CUDA's, CPU's) outputs."""
        plan = self.plan(ends)
        if place:
            self.case.path.place_prompts(self.case.layer, plan)
        self.write(ends)
        got, expected = torch.zeros_like(query), torch.zeros_like(query)
        self.case.path.attend_prompt(self.case.layer, plan, query, got, None)
        self.cpu.attend_prompt(self.reference, plan, query, expected, None)
        return got, expected

    def write(self, ends: list[int]) -> None:
        for row, end in enumerate(ends):
            start = self.case.written[row]
            slots = torch.tensor([self.case.slot(row, p) for p in range(start, end)])
            self.cpu.write(self.reference, self.case.keys[row, start:end],
                           self.case.values[row, start:end], slots, None)
            self.case.write(row, end)
        # The CPU kernels round FP8 toward zero (vLLM's CPU pages), the CUDA path to
        # nearest (its CUDA pages): the reference attends over the CUDA pool's values.
        self.reference.kv_pool.copy_(self.case.layer.kv_pool)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_chunked_prompt_attends_over_its_cached_blocks_without_staging(monkeypatch, kv_dtype):
    pair = _Prompts(kv_dtype=kv_dtype, monkeypatch=monkeypatch)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if kv_dtype.itemsize == 1 else {}
    # request 0's first chunk (10 tokens: blocks 0-2, the last one partial)
    got, expected = pair.step([10], torch.randn(10, HEADS, DIM))
    torch.testing.assert_close(got, expected, **tolerance)
    # its second chunk (block 2 completed, block 3) beside request 1's whole prompt
    got, expected = pair.step([16, 7], torch.randn(13, HEADS, DIM))
    torch.testing.assert_close(got, expected, **tolerance)
    assert got.abs().sum() > 0
    assert pair.staged == [] and pair.gathered == []  # nothing read back from the pool
    assert pair.case.path.take_stats() == {}  # and nothing counted as fetched
    cache = pair.case.path._cache
    for row, blocks in ((0, 4), (1, 2)):
        for block in pair.case.table[row, :blocks].tolist():
            assert (cache.slot_of[0, block * KV_HEADS:(block + 1) * KV_HEADS] >= 0).all()


def test_a_prompts_one_token_last_chunk_attends_its_whole_prompt():
    """A one-token chunk (a prefill's remainder, or all but the last token a
    prefix-cache hit) is a prompt row: it attends the whole prompt, as on the CPU
    (the CUDA worker plans such a step on the host: ``cuda/worker.py``)."""
    pair = _Prompts()
    pair.step([15], torch.randn(15, HEADS, DIM))
    assert pair.plan([16]).prompt_requests.tolist() == [0]
    got, expected = pair.step([16], torch.randn(1, HEADS, DIM))
    torch.testing.assert_close(got, expected)
    assert got.abs().sum() > 0


def test_the_cached_copies_hold_the_pools_bytes():
    """The write stores the prompt's tokens into the blocks placed for it: every
    cached copy equals its pool unit (FP8 bytes included)."""
    pair = _Prompts(kv_dtype=torch.float8_e5m2)
    pair.step([10], torch.randn(10, HEADS, DIM))
    pair.step([16], torch.randn(6, HEADS, DIM))
    entry = pair.case.path._layers[pair.case.layer.layer_idx]
    cache, pool = pair.case.path._cache, pair.case.layer.kv_pool
    for block in pair.case.table[0].tolist():
        for head in range(KV_HEADS):
            slot = int(cache.slot_of[0, block * KV_HEADS + head])
            unit = entry.units[head * cache.slots_per_head + slot]
            assert torch.equal(unit.view(torch.uint8), pool[block, head].view(torch.uint8))


def test_earlier_chunks_missing_from_the_cache_are_gathered_and_new_blocks_are_not(
        monkeypatch):
    pair = _Prompts(monkeypatch=monkeypatch)
    pair.step([10], torch.randn(10, HEADS, DIM))
    pair.case.path.release_blocks(pair.case.table[0].tolist())  # as if evicted
    got, expected = pair.step([16], torch.randn(6, HEADS, DIM))
    torch.testing.assert_close(got, expected)
    # blocks 0-2 (ids 3, 7, 1) hold tokens 0-9: pool units id * 2 + head; block 3 (id 9) not
    assert pair.gathered == [[2, 3, 6, 7, 14, 15]] and pair.staged == []
    assert pair.case.path.take_stats() == {"cache_hits.2": 0, "cache_misses.2": 6,
                                           "pcie_bytes.2": 6 * UNIT_BYTES}


def test_a_prompt_the_cache_cannot_hold_is_staged_and_the_cache_left_as_it_was(monkeypatch):
    pair = _Prompts(slots_per_head=3, monkeypatch=monkeypatch)
    got, expected = pair.step([16, 7], torch.randn(23, HEADS, DIM))
    torch.testing.assert_close(got, expected)
    cache = pair.case.path._cache
    # request 0's 4 blocks do not fit in 3 slots: staged; request 1's 2 blocks do
    assert pair.staged == [pair.case.table[0].tolist()]
    assert sorted(cache.block_of[0, :, :3].flatten().tolist()) == [-1, -1, 0, 0, 5, 5]
    # the staged units crossed PCIe: 4 blocks x 2 KV heads
    assert pair.case.path.take_stats() == {"cache_hits.2": 0, "cache_misses.2": 0,
                                           "pcie_bytes.2": 8 * UNIT_BYTES}


def test_a_later_prompt_never_evicts_an_earlier_ones_blocks(monkeypatch):
    """Two prompts in one step, 5 slots per head: request 0 takes 4; request 1
    needs 2, and the one slot left is not enough: it is staged, and request
    0's blocks stay for its attention."""
    pair = _Prompts(slots_per_head=5, monkeypatch=monkeypatch)
    got, expected = pair.step([16, 8], torch.randn(24, HEADS, DIM))
    torch.testing.assert_close(got, expected)
    assert pair.staged == [pair.case.table[1, :2].tolist()]


def test_without_the_placement_every_prompt_is_staged(monkeypatch):
    """A step whose runtime placed nothing (the plan differs) reads the pool, as before."""
    pair = _Prompts(monkeypatch=monkeypatch)
    got, expected = pair.step([10, 7], torch.randn(17, HEADS, DIM), place=False)
    torch.testing.assert_close(got, expected)
    assert len(pair.staged) == 2
    assert pair.case.path.take_stats()["pcie_bytes.2"] == (3 + 2) * KV_HEADS * UNIT_BYTES


def test_the_decode_rows_selection_in_flight_is_never_evicted(monkeypatch):
    """A step of request 0 decoding (its selection fetched in the layer before)
    and request 1's prompt: the prompt takes only the slots the selection
    leaves, or is staged; both attend correctly."""
    pair = _Prompts(slots_per_head=5, monkeypatch=monkeypatch)
    case = pair.case
    case.write(0, 13)
    pair.cpu.write(pair.reference, case.keys[0, :13], case.values[0, :13],
                   torch.tensor([case.slot(0, p) for p in range(13)]), None)
    for prompt_end, fits in ((16, False), (8, True)):
        case.written[1] = 0
        context = case.written[0]
        plan = pair.plan([context + 1, prompt_end], decodes=1)
        positions = _positions([[[1, 9], [5]]])  # blocks 0, 2 | 1, and the own block
        case.path.start_fetch(case.layer, case.rows([context]), positions, None)
        held = case.path._layers[case.layer.layer_idx].slots.clone()
        pair.staged.clear()
        case.path.place_prompts(case.layer, plan)
        pair.write([context + 1, prompt_end])
        query = torch.randn(1 + prompt_end, HEADS, DIM)
        got, expected = torch.zeros_like(query), torch.zeros_like(query)
        case.path.attend_prompt(case.layer, plan, query, got, None)
        pair.cpu.attend_prompt(pair.reference, plan, query, expected, None)
        torch.testing.assert_close(got[1:], expected[1:])
        assert (pair.staged == []) == fits
        out, _ = case.path.attend_selected(case.layer, case.rows([context]), query[:1],
                                           positions, None, None)
        blocks = [[0, 2, 3], [1, 3]] if context == 13 else [[0, 2, 3, 4], [1, 3, 4]]
        torch.testing.assert_close(out, case.oracle(query[:1], [context], [blocks]))
        # the selection's slots still hold its blocks
        cache = case.path._cache
        for head in range(KV_HEADS):
            for slot in held[0, head][held[0, head] >= 0].tolist():
                assert int(cache.block_of[0, head, slot - head * 5]) >= 0


def test_a_prompts_first_decode_step_finds_its_blocks_cached(monkeypatch):
    pair = _Prompts(monkeypatch=monkeypatch)
    pair.step([13], torch.randn(13, HEADS, DIM))
    case = pair.case
    positions = _positions([[[1, 9], [5]]])
    case.path.start_fetch(case.layer, case.rows([13]), positions, None)
    case.write(0, 14)
    case.path.attend_selected(case.layer, case.rows([13]), torch.randn(1, HEADS, DIM),
                              positions, None, None)
    assert case.path.take_stats() == {"cache_hits.2": 5, "cache_misses.2": 0,
                                      "pcie_bytes.2": 0}
    assert pair.gathered == [[]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("units_dtype,scales", [(None, (1.0, 1.0)),
                                               (torch.float8_e4m3fn, SCALES)])
@pytest.mark.parametrize("first,rows", [(0, 21), (13, 8)])
def test_a_16_bit_prompt_attends_through_sdpa_as_the_reference(dtype, units_dtype, scales,
                                                               first, rows):
    """16-bit queries take torch's SDPA (FlashAttention on CUDA) over the units in
    position order, the mask aligned to the chunk's last row; FP8 units widened,
    the scales applied: as the float32 reference."""
    torch.manual_seed(1)
    seq_len, blocks = first + rows, -(-(first + rows) // BLOCK)
    units = torch.randn(blocks * KV_HEADS + 3, BLOCK, 2 * DIM).to(units_dtype or dtype)
    table = torch.randperm(blocks * KV_HEADS)[: blocks * KV_HEADS].view(KV_HEADS, blocks)
    query = torch.randn(rows, HEADS, DIM).to(dtype)
    settings = {"first": first, "seq_len": seq_len, "scale": DIM ** -0.5,
                "key_scale": scales[0], "value_scale": scales[1]}
    got = kernels.attend_prompt_units(query, units, table, **settings)
    expected = kernels.reference.attend_prompt_units_reference(query, units, table, **settings)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2 * scales[1],
                               rtol=2e-2)
    # the mask: the chunk's first row sees positions 0 .. first only
    alone = kernels.reference.attend_prompt_units_reference(
        query[:1], units, table, **{**settings, "seq_len": first + 1})
    torch.testing.assert_close(got[:1].float(), alone.float(), atol=2e-2 * scales[1],
                               rtol=2e-2)
