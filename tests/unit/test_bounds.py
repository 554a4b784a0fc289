# SPDX-License-Identifier: Apache-2.0
"""Bound speculation keys: the compiled summary and selection against the pure-torch
reference (``tests/reference/bounds.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.reference import bounds as reference
from tests.reference.bound_pools import BLOCK, BoundPool
from tests.reference.layouts import present_of
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.platforms.cuda.kernels import block_rule
from vllm_infinigen.platforms.cuda.kernels import reference as cuda_reference
from vllm_infinigen.worker.step_plan import token_budget

@pytest.mark.parametrize("unit", [16, 32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capped", [False, True])
def test_units_encode_as_the_reference_once_their_last_token_is_written(unit, bits, dtype,
                                                                        capped):
    pool = BoundPool(seed=3, unit=unit, bits=bits, dtype=dtype, num_kv_heads=2, head_size=40,
                     context_lens=[150, 31, 64], capped=capped)
    for row, n in enumerate(pool.context_lens.tolist()):
        # The row's own token is written too: units up to n + 1 tokens are complete.
        complete = (n + 1) // unit
        want_codes, want_scales = reference.unit_codes(
            pool.kv_pool, pool.block_table[row:row + 1], n + 1, unit, bits, pool.row_map)
        for u in range(complete + 1):
            codes, scales = pool.codes_at(row, u)
            if u < complete:
                assert torch.equal(scales, want_scales[0, u]), (row, u)
                assert torch.equal(codes, want_codes[0, u]), (row, u)
            elif (u * unit) % BLOCK:  # the open unit of a written block: not encoded
                assert bool((scales == 0).all()), (row, u)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_codes_bound_every_key_of_their_unit(bits):
    """Decoded, the maxima are at or above and the minima at or below each key of
    the unit, in every channel, whatever the channels' magnitudes."""
    unit = 16
    pool = BoundPool(seed=11, unit=unit, bits=bits, dtype=torch.float32, num_kv_heads=2,
                     head_size=64, context_lens=[127])
    offset = 1 << (bits - 1)
    head_size = 64
    for u in range(128 // unit):
        codes, scales = pool.codes_at(0, u)
        positions = torch.arange(u * unit, (u + 1) * unit)
        block = int(pool.block_table[0, u * unit // BLOCK])
        keys = pool.kv_pool[block, :, positions % BLOCK, :head_size].float()  # [H, 16, D]
        high = (codes[:, 0] - offset).float() * scales.float()[:, None]
        low = (codes[:, 1] - offset).float() * scales.float()[:, None]
        assert bool((keys <= high[:, None]).all()) and bool((keys >= low[:, None]).all())
        # ... and not loosely: within one step of the true extremes.
        step = scales.float()[:, None]
        assert bool((high - keys.amax(dim=1) <= step).all())
        assert bool((keys.amin(dim=1) - low <= step).all())


@pytest.mark.parametrize("unit", [16, 32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize(("alpha", "budget"), [(2.0, 0.2), (float("inf"), 0.2),
                                             (float("inf"), 0.05), (0.5, 1.0)])
@pytest.mark.parametrize(("head_size", "group"), [(40, 3), (128, 4), (34, 1), (64, 6)])
def test_selection_equals_the_reference(unit, bits, dtype, capped, alpha, budget, head_size,
                                        group):
    pool = BoundPool(seed=5, unit=unit, bits=bits, dtype=dtype, num_kv_heads=2,
                     head_size=head_size, context_lens=[230, 16, 7, 64, 129], capped=capped)
    gen = torch.Generator().manual_seed(9)
    num_rows = len(pool.context_lens)
    query = torch.randint(-3, 4, (num_rows, 2, group, head_size), generator=gen).float()
    caps = token_budget(pool.context_lens, budget)
    positions, num_selected = kernels.select_bounds(
        query, pool.bounds, pool.scales, pool.kv_pool, pool.block_table, pool.context_lens,
        caps, scale=0.25, alpha=alpha, sink_tokens=1, recent_tokens=2, row_map=pool.row_map)
    width = int(pool.context_lens.max())
    codes, scales = reference.unit_codes(pool.kv_pool, pool.block_table, width, unit, bits,
                                         pool.row_map)
    present = None if pool.row_map is None else present_of(pool.row_map, pool.block_table,
                                                           width)
    want = reference.select(query, codes, scales, pool.context_lens, caps, unit=unit,
                            bits=bits, scale=0.25, alpha=alpha, sink_tokens=1,
                            recent_tokens=2, present=present)
    assert positions.dtype == torch.int32
    for b in range(num_rows):
        for h in range(2):
            got = positions[b, h][positions[b, h] >= 0].tolist()
            assert got == want[b][h], (b, h)
            assert bool((positions[b, h, len(got):] == -1).all())
        assert int(num_selected[b]) == max(len(kept) for kept in want[b])


def test_a_needle_unit_wins_by_its_bound_and_the_open_unit_is_always_kept():
    """One token whose key points along the query lifts its unit's bound above every
    other unit's, though the unit's mean would not; the row's own (open) unit is
    kept whatever it scores."""
    head_size, unit = 32, 16
    kv_pool = torch.zeros((1, 1, BLOCK, 2 * head_size))
    bounds = torch.zeros((1, 1, BLOCK // unit, 2, head_size), dtype=torch.uint8)
    scales = torch.zeros((1, 1, BLOCK // unit), dtype=torch.float16)
    keys = torch.zeros((BLOCK, 1, head_size))
    keys[:, 0, 5] = 1.0
    keys[:16, 0, 3] = 0.4  # unit 0: a higher mean along the query, no outlier
    keys[20, 0, 3] = 4.0  # the needle, in unit 1 (mean 0.25)
    kernels.write_pool(kv_pool, keys, keys, torch.arange(BLOCK), None)
    context = 50  # units 0-2 complete, unit 3 open (48, 49)
    kernels.write_bounds(bounds, scales, kv_pool, torch.arange(context), None)
    assert float(scales[0, 0, 3]) == 0.0
    query = torch.zeros((1, 1, 1, head_size))
    query[0, 0, 0, 3] = 1.0
    positions, _ = kernels.select_bounds(
        query, bounds, scales, kv_pool, torch.zeros((1, 1), dtype=torch.int32),
        torch.tensor([context]), torch.tensor([unit + 2]), scale=1.0, alpha=float("inf"))
    assert positions[0, 0].tolist() == list(range(16, 32)) + [48, 49]


@pytest.mark.parametrize("bits", [8, 4])
def test_short_path_writes_the_bounds_as_the_write_kernel(bits):
    gen = torch.Generator().manual_seed(1)
    head_size, heads, unit = 32, 2, 16
    keys = torch.randn((40, heads, head_size), generator=gen)
    query = torch.randn((40, 2 * heads, head_size), generator=gen)
    pools = [torch.zeros((2, heads, BLOCK, 2 * head_size)) for _ in range(2)]
    shape = (2, heads, BLOCK // unit, 2, head_size * bits // 8)
    bounds = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(shape[:3], dtype=torch.float16) for _ in range(2)]
    slots = torch.arange(40) + BLOCK
    table = torch.tensor([[1]], dtype=torch.int32)
    kernels.decode_short(query, keys, keys, pools[0], slots, table, torch.tensor([0]),
                         scale=0.1, bounds=bounds[0], bound_scales=scales[0])
    kernels.write_pool(pools[1], keys, keys, slots, None)
    kernels.write_bounds(bounds[1], scales[1], pools[1], slots, None)
    assert torch.equal(pools[0], pools[1])
    assert torch.equal(bounds[0], bounds[1]) and torch.equal(scales[0], scales[1])
    assert bool((scales[0][1, :, :2] != 0).all()) and bool((scales[0][1, :, 2:] == 0).all())
    with pytest.raises(RuntimeError, match="one form of speculation keys"):
        kernels.decode_short(query, keys, keys, pools[0], slots, table, torch.tensor([0]),
                             scale=0.1, bounds=bounds[0], bound_scales=scales[0],
                             partial_keys=pools[0], skew=torch.zeros((heads, head_size, 1)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("unit", [16, 32])
def test_cuda_torch_forms_equal_the_cpu_kernels(bits, unit):
    """The CUDA platform's torch encoding (``kernels.reference.write_bounds``) writes
    the CPU kernel's bytes, and its unit scores (``block_rule.bound_unit_scores``)
    are the CPU kernel's, -inf past each row's complete units and for padding."""
    pool = BoundPool(seed=7, unit=unit, bits=bits, dtype=torch.bfloat16, num_kv_heads=2,
                     head_size=40, context_lens=[230, 16, 7, 64])
    bounds, scales = torch.zeros_like(pool.bounds), torch.zeros_like(pool.scales)
    for row in range(len(pool.context_lens)):
        slots = pool.slots_of(row)
        cuda_reference.write_bounds(bounds, scales, pool.kv_pool, slots)
    assert torch.equal(bounds, pool.bounds) and torch.equal(scales, pool.scales)
    gen = torch.Generator().manual_seed(2)
    query = torch.randint(-3, 4, (5, 2, 3, 40), generator=gen).float()
    context = torch.cat([pool.context_lens, torch.tensor([-1])])  # a padding row
    table = torch.cat([pool.block_table, pool.block_table[:1]])
    got = block_rule.bound_unit_scores(query, pool.bounds, pool.scales, table, context,
                                       scale=0.25, block_size=BLOCK)
    codes, unit_scales = reference.unit_codes(pool.kv_pool, table, int(context.max()), unit,
                                              bits)
    for row in range(5):
        n = int(context[row])
        complete = max(n, 0) // unit
        if complete:
            want = reference.unit_scores(query[row], codes[row, :complete],
                                         unit_scales[row, :complete], bits, 0.25)
            torch.testing.assert_close(got[row, :, :complete], want, rtol=1e-6, atol=0)
        assert bool((got[row, :, complete:] == float("-inf")).all())
    blocks = block_rule.unit_block_scores(got, BLOCK // unit)
    assert torch.equal(blocks, got.view(5, 2, -1, BLOCK // unit).amax(dim=-1))
    counts = block_rule.unit_alpha_counts(got[:4], torch.tensor(float("inf")), unit)
    assert counts.tolist() == [n // unit * unit for n in pool.context_lens.tolist()
                               for _ in range(2)]
