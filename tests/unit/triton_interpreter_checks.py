# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels of the CUDA platform against their torch references, on CPU tensors.

Runs only in a process started with TRITON_INTERPRET=1 (Triton decides when it is
first imported whether ``@triton.jit`` compiles or interprets), so pytest does
not collect this file by name: ``test_cuda_kernels.py`` starts such a process on
it. The kernels see the same arguments as on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit.test_cuda_kernels import _attention_case, _fetch_case
from vllm_infinigen.platforms.cuda import kernels

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 from the start of the process "
                       "(tests/unit/test_cuda_kernels.py does)")


@pytest.fixture(scope="module")
def triton_kernels():
    from vllm_infinigen.platforms.cuda import triton_kernels

    return triton_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctas", [1, 3])
def test_gather_equals_the_reference(triton_kernels, dtype, ctas):
    pool, cache, units, slots, count = _fetch_case(dtype)
    expected = cache.clone()
    kernels.gather_units_reference(pool, expected, units, slots, count)
    words, chunk = kernels.unit_words(4, 8, dtype)
    triton_kernels.gather_units(pool.view(torch.int32), cache.view(torch.int32), units, slots,
                                count, num_ctas=ctas, unit_words=words, chunk_words=chunk,
                                per_step=2)
    assert torch.equal(cache, expected)


def test_gather_copies_units_in_chunks(triton_kernels):
    """A unit of 40 words copied 8 at a time (``unit_words``' chunk for D = 10)."""
    pool, cache, units, slots, count = _fetch_case(torch.bfloat16, head_size=10)
    expected = cache.clone()
    kernels.gather_units_reference(pool, expected, units, slots, count)
    words, chunk = kernels.unit_words(4, 10, torch.bfloat16)
    assert (words, chunk) == (40, 8)
    triton_kernels.gather_units(pool.view(torch.int32), cache.view(torch.int32), units, slots,
                                count, num_ctas=2, unit_words=words, chunk_words=chunk,
                                per_step=2)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("group,head_size", [(3, 8), (4, 16), (2, 12)])
def test_attention_equals_the_reference(triton_kernels, splits, group, head_size):
    query, units, table, seq_lens = _attention_case(group, head_size)
    per_split = -(-table.shape[1] // splits)
    partial = torch.empty(3, splits, group, head_size)
    maxima, sums = torch.empty(3, splits, group), torch.empty(3, splits, group)
    triton_kernels.attend_units(query, units, table, seq_lens, partial, maxima, sums, scale=0.3,
                                blocks_per_split=per_split, num_splits=splits)
    got = kernels.merge_splits(partial, maxima, sums)
    expected = kernels.attend_units_reference(query, units, table, seq_lens, scale=0.3)
    assert torch.allclose(got, expected, atol=1e-5)


def test_attention_reads_bfloat16_units(triton_kernels):
    query, units, table, seq_lens = _attention_case()
    units = units.to(torch.bfloat16)
    partial = torch.empty(3, 2, 3, 8)
    maxima, sums = torch.empty(3, 2, 3), torch.empty(3, 2, 3)
    triton_kernels.attend_units(query, units, table, seq_lens, partial, maxima, sums, scale=0.3,
                                blocks_per_split=2, num_splits=2)
    expected = kernels.attend_units_reference(query, units, table, seq_lens, scale=0.3)
    assert torch.allclose(kernels.merge_splits(partial, maxima, sums), expected, atol=1e-5)


def _write_case(dtype: torch.dtype):
    """Tokens of two requests in shuffled blocks (32 tokens each, head_size 24: a
    padded D), one padding row; the second call closes groups opened by the first."""
    gen = torch.Generator().manual_seed(11)
    heads, head_size, block = 2, 24, 32
    pool = torch.zeros(6, heads, block, 2 * head_size, dtype=dtype)
    key = torch.randn(50, heads, head_size, generator=gen)
    key[:16, 0] = torch.randint(-7, 8, (16, head_size), generator=gen).float()
    key[:16, 0, 0] = 7.5  # scale 1: integer keys round at x.5, to the even code
    slots = torch.cat([torch.arange(4 * block, 4 * block + 40), torch.arange(block, block + 9),
                       torch.tensor([-1])])
    return pool, key.to(dtype), torch.randn(50, heads, head_size, generator=gen).to(dtype), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows_equals_the_reference_write_through(triton_kernels, dtype):
    from vllm_infinigen.platforms.cuda import writes

    pool, key, value, slots = _write_case(dtype)
    expected = pool.clone()
    writes.write_pool(expected, key, value, slots)
    rows = torch.cat([key, value], dim=-1).contiguous()
    triton_kernels.store_rows(pool, rows, slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 4), (torch.bfloat16, 2),
                                        (torch.float32, 1)])
def test_encode_groups_equals_the_reference_byte_for_byte(triton_kernels, dtype, bits):
    """Over two calls (a group opened in the first closes in the second), with
    round-half-to-even ties: the codes and scales of writes.write_int_keys (itself
    held to the CPU kernel, test_cuda_writes.py)."""
    from vllm_infinigen.platforms.cuda import writes

    pool, key, value, slots = _write_case(dtype)
    groups, head_size = pool.shape[2] // 16, key.shape[-1]
    got = (torch.zeros(6, 2, groups, head_size, 2 * bits, dtype=torch.uint8),
           torch.zeros(6, 2, groups, head_size, dtype=torch.float16))
    expected = (got[0].clone(), got[1].clone())
    for part in (slice(0, 20), slice(20, 50)):
        writes.write_pool(pool, key[part], value[part], slots[part])
        writes.write_int_keys(*expected, pool, slots[part])
        triton_kernels.encode_groups(pool, *got, slots[part])
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0], expected[0])
    assert (expected[1] != 0).sum() > 0


@pytest.mark.parametrize("bits,dtype,head_size", [(4, torch.float32, 32),
                                                  (2, torch.bfloat16, 24)])
@pytest.mark.parametrize("tile", [16, 64])
def test_int_token_scores_equal_the_torch_form(triton_kernels, bits, dtype, head_size, tile):
    """The int keys read in place: the torch form's scores (it dequantizes every
    block), open groups -inf, 3 query heads per KV head, a padded head size."""
    from tests.unit.test_int_keys import Pool
    from vllm_infinigen.platforms.cuda import block_selection

    pool = Pool(seed=7, bits=bits, dtype=dtype, num_kv_heads=2, head_size=head_size,
                context_lens=[95, 16, 7, 64])
    query = torch.randn(4, 2, 3, head_size, generator=torch.Generator().manual_seed(8))
    expected = block_selection.int_token_scores(query, pool.codes, pool.scales,
                                                pool.block_table, pool.context_lens, scale=0.25)
    got = torch.empty_like(expected)
    table = pool.block_table if tile == 16 else pool.block_table.long()  # either index dtype
    triton_kernels.int_token_scores(query, pool.codes, pool.scales, table,
                                    pool.context_lens, got, scale=0.25, tile=tile)
    assert torch.equal(got == float("-inf"), expected == float("-inf"))
    finite = expected > float("-inf")
    assert finite.sum() > 0
    assert torch.allclose(got[finite], expected[finite], atol=1e-5, rtol=1e-5)
