# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's host pool: its layout, the huge-page buffer, the refusal without CUDA
(pinned and read by the gather on a GPU: tests/gpu/test_cuda_device.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_infinigen.platforms.cuda import host_pool


def test_one_kv_heads_block_is_one_contiguous_unit():
    pool = torch.arange(3 * 2 * 4 * 6).view(host_pool.pool_shape(3, 2, 4, 3))
    unit = pool[1, 1]  # block 1, head 1: 4 tokens x (K|V of 3 + 3)
    assert unit.is_contiguous()
    assert unit.flatten().tolist() == list(range(72, 96))  # flat unit 3 = block * H + head


def test_huge_page_buffer_is_aligned_writable_and_sized():
    _mapping, buffer = host_pool.huge_page_buffer(3 * host_pool.HUGE_PAGE + 5)
    assert buffer.data_ptr() % host_pool.HUGE_PAGE == 0
    assert buffer.numel() == 3 * host_pool.HUGE_PAGE + 5
    buffer[-1] = 7
    assert int(buffer.view(-1)[-1]) == 7
    view = buffer[: 4 * 1024].view(torch.bfloat16)
    assert view.numel() == 2048


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_allocation_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        host_pool.allocate_host_pool(4, 2, 16, 64, torch.bfloat16)
