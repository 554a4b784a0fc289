# SPDX-License-Identifier: Apache-2.0
"""Integer speculation keys: the compiled encoding and selection against the
pure-torch reference (``tests/reference/int_keys.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.reference import int_keys as reference
from tests.reference.int_key_pools import BLOCK, GROUPS, Pool
from tests.reference.selector import select_tokens as select_reference
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.worker.step_plan import token_budget


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_encode_as_the_reference_once_their_last_token_is_written(bits, dtype):
    gen = torch.Generator().manual_seed(3)
    head_size, heads = 32, 2
    keys = torch.randn((BLOCK, heads, head_size), generator=gen).to(dtype)
    kv_pool = torch.zeros((2, heads, BLOCK, 2 * head_size), dtype=dtype)
    codes = torch.zeros((2, heads, GROUPS, head_size, 2 * bits), dtype=torch.uint8)
    scales = torch.zeros((2, heads, GROUPS, head_size), dtype=torch.float16)
    slots = BLOCK + torch.arange(BLOCK - 1)  # block 1, all but the last token
    kernels.write_pool(kv_pool, keys[:-1], keys[:-1], slots, None)
    kernels.write_int_keys(codes, scales, kv_pool, slots, None)
    assert bool((codes[1, :, 1] == 0).all()) and bool((scales[1, :, 1] == 0).all())  # open
    last = torch.tensor([2 * BLOCK - 1])
    kernels.write_pool(kv_pool, keys[-1:], keys[-1:], last, None)
    kernels.write_int_keys(codes, scales, kv_pool, last, None)
    for group in range(GROUPS):
        for head in range(heads):
            want_codes, want_scales = reference.encode_group(
                keys[16 * group:16 * (group + 1), head], bits)
            assert torch.equal(scales[1, head, group], want_scales)
            assert torch.equal(codes[1, head, group], reference.pack(want_codes, bits))
            assert torch.equal(reference.unpack(codes[1, head, group], bits), want_codes)
    assert bool((codes[0] == 0).all())  # block 0 untouched


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize(("alpha", "budget"), [(2.0, 0.2), (1e4, 0.1), (0.5, 1.0),
                                             (float("inf"), 0.2)])
@pytest.mark.parametrize("group", [2, 7])  # 7 query heads per KV head: blocks of 4, 2 and 1
def test_selection_equals_the_reference(bits, dtype, capped, alpha, budget, group):
    _check_selection(bits, dtype, capped, alpha, budget, group, head_size=32)


# The product's shape (head 128, 4 query heads per KV head) and odd ones, every
# bit width: each vectorized unpack (whole 16-byte loads, the masked last rows,
# query heads taken 4, 2 and 1 at a time) against the reference.
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize(("head_size", "group", "dtype"), [(128, 4, torch.float32),
                                                            (128, 4, torch.bfloat16),
                                                            (13, 3, torch.float32),
                                                            (5, 5, torch.float16)])
@pytest.mark.parametrize("budget", [0.1, 0.4])
def test_selection_equals_the_reference_at_every_width(bits, head_size, group, dtype, budget):
    _check_selection(bits, dtype, False, float("inf"), budget, group, head_size=head_size)


def _check_selection(bits, dtype, capped, alpha, budget, group, *, head_size):
    pool = Pool(seed=5, bits=bits, dtype=dtype, num_kv_heads=2, head_size=head_size,
                context_lens=[95, 16, 7, 64], capped=capped)
    gen = torch.Generator().manual_seed(9)
    num_rows = 4
    query = torch.randint(-3, 4, (num_rows, 2, group, head_size), generator=gen).float()
    caps = token_budget(pool.context_lens, budget)
    positions, num_selected = kernels.select_tokens_int(
        query, pool.codes, pool.scales, pool.kv_pool, pool.block_table, pool.context_lens,
        caps, scale=0.25, alpha=alpha, sink_tokens=1, recent_tokens=2, row_map=pool.row_map)
    keys = reference.keys_for_scoring(pool.kv_pool, pool.codes, pool.scales, pool.block_table,
                                      pool.context_lens, pool.row_map)
    width = int(pool.context_lens.max())
    present = None
    if pool.row_map is not None:
        from tests.reference.layouts import present_of

        present = present_of(pool.row_map, pool.block_table, width)
    want = select_reference(query.reshape(num_rows, -1, head_size), keys, pool.context_lens,
                            scale=0.25, alpha=alpha, budget=budget, width=width,
                            sink_tokens=1, recent_tokens=2, present=present)
    assert num_selected.tolist() == want.num_selected.tolist()
    # Exact scores tie often: the kept sets must hold the same scores (ties may
    # be broken in another order), and the window must be kept.
    scores = torch.einsum("bhgd,bnhd->bhgn", query, keys).amax(dim=2) * 0.25  # [B, H, N]
    for b in range(num_rows):
        n = int(pool.context_lens[b])
        for h in range(2):
            got = positions[b, h][positions[b, h] >= 0]
            kept = want.positions[b, h][want.valid[b, h]]
            assert got.tolist() == sorted(got.tolist())
            assert sorted(scores[b, h, got].tolist()) == sorted(scores[b, h, kept].tolist())
            window = {0, n - 2, n - 1} & set(range(n))
            if present is not None:
                window = {t for t in window if bool(present[b, t, h])}
            assert window <= set(got.tolist()), (b, h)


def test_the_open_group_is_scored_from_the_full_keys():
    """A token whose key is large in one channel wins while its group is open;
    once encoded it keeps winning only through its code."""
    head_size, bits = 32, 2
    kv_pool = torch.zeros((1, 1, BLOCK, 2 * head_size))
    codes = torch.zeros((1, 1, GROUPS, head_size, 2 * bits), dtype=torch.uint8)
    scales = torch.zeros((1, 1, GROUPS, head_size), dtype=torch.float16)
    keys = torch.zeros((BLOCK, 1, head_size))
    keys[20, 0, 3] = 8.0  # the needle, in the second group
    keys[:, 0, 5] = 1.0
    kernels.write_pool(kv_pool, keys, keys, torch.arange(BLOCK), None)
    query = torch.zeros((1, 1, 1, head_size))
    query[0, 0, 0, 3] = 1.0
    table = torch.zeros((1, 1), dtype=torch.int32)
    for context, encoded in ((25, False), (32, True)):
        kernels.write_int_keys(codes, scales, kv_pool, torch.arange(context), None)
        lens = torch.tensor([context])
        positions, _ = kernels.select_tokens_int(
            query, codes, scales, kv_pool, table, lens, torch.tensor([1]), scale=1.0,
            alpha=1.0, row_map=None)
        assert positions.tolist() == [[[20]]], context
        assert bool((codes[0, 0, 1] != 0).any()) == encoded
