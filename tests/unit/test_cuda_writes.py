# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's torch writes against the CPU platform's compiled kernels: the host
write-through, the partial keys and the int keys, padding included."""

from __future__ import annotations

import pytest
import torch

from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.layout import int_key_bits
from vllm_infinigen.platforms.cuda import kernels as cuda_kernels
from vllm_infinigen.platforms.cuda.kernels import reference as cuda_reference

BLOCK, KV_HEADS, DIM, RANK, NUM_BLOCKS = 32, 2, 8, 3, 6


def _tokens(count: int):
    torch.manual_seed(0)
    key, value = torch.randn(count, KV_HEADS, DIM), torch.randn(count, KV_HEADS, DIM)
    # slots in blocks 4 and 1 (out of order), one padding row
    slots = torch.cat([torch.arange(4 * BLOCK, 5 * BLOCK), torch.arange(BLOCK, 2 * BLOCK)])
    slots = torch.cat([slots[: count - 1], torch.tensor([-1])])
    return key, value, slots


def _pool(dtype=torch.float32):
    return torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * DIM, dtype=dtype)


def test_write_pool_equals_the_compiled_write_and_skips_padding():
    key, value, slots = _tokens(50)
    got, expected = _pool(), _pool()
    cuda_reference.write_pool(got, key, value, slots)
    kernels.write_pool(expected, key, value, slots)
    assert torch.equal(got, expected)
    assert got[4].abs().sum() > 0 and got[[0, 2, 3, 5]].abs().sum() == 0


def test_write_partial_keys_equals_the_compiled_write_and_padding_lands_in_scratch():
    key, _, slots = _tokens(50)
    skew = torch.randn(KV_HEADS, DIM, RANK)
    got = cuda_kernels.with_scratch_block((NUM_BLOCKS, KV_HEADS, RANK, BLOCK), torch.float32,
                                          torch.device("cpu"))
    expected = torch.zeros(NUM_BLOCKS, KV_HEADS, RANK, BLOCK)
    cuda_kernels.write_partial_keys(got, key, skew, slots)
    kernels.write_partial_keys(expected, key, skew, slots)
    torch.testing.assert_close(got, expected)
    assert got.shape == expected.shape
    assert cuda_kernels.scratch_of(got)[NUM_BLOCKS].abs().sum() > 0  # the padding row went there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_int_keys_encodes_each_closed_group_as_the_compiled_write(dtype):
    key, value, slots = _tokens(50)  # closes groups 0, 1 of block 4 and group 0 of block 1
    pool = _pool(dtype)
    kernels.write_pool(pool, key.to(dtype), value.to(dtype), slots)
    bits, groups = int_key_bits(dtype.itemsize), BLOCK // 16
    got = (torch.zeros(NUM_BLOCKS, KV_HEADS, groups, DIM, 2 * bits, dtype=torch.uint8),
           torch.zeros(NUM_BLOCKS, KV_HEADS, groups, DIM, dtype=torch.float16))
    expected = (got[0].clone(), got[1].clone())
    cuda_reference.write_int_keys(*got, pool, slots)
    kernels.write_int_keys(*expected, pool, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    closed = (got[1].abs().sum(dim=(1, 3)) > 0).nonzero().tolist()
    assert closed == [[1, 0], [4, 0], [4, 1]]  # block 1's open group 1 stays empty
