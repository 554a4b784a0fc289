# SPDX-License-Identifier: Apache-2.0
"""A pool of K/V and int speculation keys written through the CPU kernels, the input of
the int keys' tests on both platforms (``tests/unit/test_int_keys.py``, the CUDA
block rule's and its Triton kernel's): requests in shuffled 32-token blocks,
keys that the codes hold exactly (every score exact in float32)."""

from __future__ import annotations

import torch

from tests.reference import int_keys as reference
from vllm_infinigen.platforms.cpu import kernels

BLOCK = 32  # two 16-token groups per block
GROUPS = BLOCK // reference.GROUP


def _exact_keys(gen: torch.Generator, num_groups: int, num_heads: int, head_size: int,
                bits: int) -> torch.Tensor:
    """[num_groups * 16, H, D] keys that ``bits``-bit codes hold exactly: per channel
    of each group (code - half) * 2^e, the top code present (so the scale is 2^e):
    every score is then exact in float32, whatever the order of the sums."""
    half = reference.half_range(bits)
    codes = torch.randint(0, 1 << bits, (num_groups, 16, num_heads, head_size),
                          generator=gen).float()
    codes[:, 0] = (1 << bits) - 1
    exponent = torch.randint(-2, 3, (num_groups, 1, num_heads, head_size), generator=gen)
    return ((codes - half) * torch.pow(2.0, exponent.float())).reshape(-1, num_heads, head_size)


def capped_row_map(gen: torch.Generator, num_blocks: int, num_kv_heads: int,
                   block: int) -> torch.Tensor:
    """[num_blocks, H_kv, block] int32 rows of a capped pool: a per-head permutation,
    a fifth evicted (-1)."""
    rows = torch.stack([torch.randperm(num_blocks * block, generator=gen)
                        for _ in range(num_kv_heads)]).to(torch.int32)
    rows = rows.view(num_kv_heads, num_blocks, block).permute(1, 0, 2)
    return rows.masked_fill(torch.rand(rows.shape, generator=gen) < 0.2, -1).contiguous()


class Pool:
    """A pool whose requests sit in shuffled blocks, written through the kernels."""

    def __init__(self, *, seed: int, bits: int, dtype: torch.dtype, num_kv_heads: int,
                 head_size: int, context_lens: list[int], capped: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.bits, self.dtype, self.num_kv_heads, self.head_size = bits, dtype, num_kv_heads, head_size
        self.context_lens = torch.tensor(context_lens, dtype=torch.int64)
        blocks_per_row = max(n // BLOCK + 1 for n in context_lens)
        num_rows = len(context_lens)
        self.num_blocks = num_rows * blocks_per_row + 2
        order = torch.randperm(self.num_blocks, generator=gen)[: num_rows * blocks_per_row]
        self.block_table = order.view(num_rows, blocks_per_row).to(torch.int32)
        self.kv_pool = torch.zeros((self.num_blocks, num_kv_heads, BLOCK, 2 * head_size),
                                   dtype=dtype)
        self.codes = torch.zeros((self.num_blocks, num_kv_heads, GROUPS, head_size, 2 * bits),
                                 dtype=torch.uint8)
        self.scales = torch.zeros((self.num_blocks, num_kv_heads, GROUPS, head_size),
                                  dtype=torch.float16)
        self.row_map = capped_row_map(gen, self.num_blocks, num_kv_heads, BLOCK) if capped else None
        # Every context token (and each row's own) written, in two calls per row
        # so that a group completes across calls.
        for row, n in enumerate(context_lens):
            positions = torch.arange(n + 1)
            keys = _exact_keys(gen, n // 16 + 1, num_kv_heads, head_size, bits)[: n + 1]
            keys = keys.to(dtype)
            value = torch.randn(keys.shape, generator=gen).to(dtype)
            blocks = self.block_table[row, positions // BLOCK].to(torch.int64)
            slots = blocks * BLOCK + positions % BLOCK
            for part in (slice(0, (n + 1) // 2), slice((n + 1) // 2, n + 1)):
                kernels.write_pool(self.kv_pool, keys[part], value[part], slots[part],
                                   self.row_map)
                kernels.write_int_keys(self.codes, self.scales, self.kv_pool, slots[part],
                                       self.row_map)
