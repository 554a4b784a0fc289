# SPDX-License-Identifier: Apache-2.0
"""A pool of K/V and bound speculation keys written through the CPU kernels, the input of
the bounds' tests on both platforms (``tests/unit/test_bounds.py``, the Triton kernels'
in ``tests/unit/triton_interpreter_checks.py``): requests in shuffled 64-token blocks."""

from __future__ import annotations

import torch

from tests.reference import bounds as reference
from tests.reference.int_key_pools import capped_row_map
from vllm_infinigen.platforms.cpu import kernels

BLOCK = 64




class BoundPool:
    """Requests in shuffled 64-token blocks, written through the kernels in two calls
    per row (a unit completes across calls); small integer queries, so that every
    unit's score is exact up to its last two float32 products, as the reference's."""

    def __init__(self, *, seed: int, unit: int, bits: int, dtype: torch.dtype,
                 num_kv_heads: int, head_size: int, context_lens: list[int],
                 capped: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.unit, self.bits = unit, bits
        self.context_lens = torch.tensor(context_lens, dtype=torch.int64)
        blocks_per_row = max(n // BLOCK + 1 for n in context_lens)
        num_rows = len(context_lens)
        self.num_blocks = num_rows * blocks_per_row + 2
        order = torch.randperm(self.num_blocks, generator=gen)[: num_rows * blocks_per_row]
        self.block_table = order.view(num_rows, blocks_per_row).to(torch.int32)
        self.kv_pool = torch.zeros((self.num_blocks, num_kv_heads, BLOCK, 2 * head_size),
                                   dtype=dtype)
        units = BLOCK // unit
        self.bounds = torch.zeros((self.num_blocks, num_kv_heads, units, 2,
                                   head_size * bits // 8), dtype=torch.uint8)
        self.scales = torch.zeros((self.num_blocks, num_kv_heads, units), dtype=torch.float16)
        self.row_map = capped_row_map(gen, self.num_blocks, num_kv_heads, BLOCK) if capped else None
        for row, n in enumerate(context_lens):
            positions = torch.arange(n + 1)
            # Channels of unlike magnitudes, both signs.
            spread = torch.pow(2.0, torch.randint(-3, 4, (1, 1, head_size), generator=gen))
            keys = (torch.randn((n + 1, num_kv_heads, head_size), generator=gen) * spread)
            keys = keys.to(dtype)
            value = torch.randn(keys.shape, generator=gen).to(dtype)
            blocks = self.block_table[row, positions // BLOCK].to(torch.int64)
            slots = blocks * BLOCK + positions % BLOCK
            for part in (slice(0, (n + 1) // 2), slice((n + 1) // 2, n + 1)):
                kernels.write_pool(self.kv_pool, keys[part], value[part], slots[part],
                                   self.row_map)
                kernels.write_bounds(self.bounds, self.scales, self.kv_pool, slots[part],
                                     self.row_map)

    def slots_of(self, row: int) -> torch.Tensor:
        """[context + 1] slot ids of a row's tokens, its own included."""
        positions = torch.arange(int(self.context_lens[row]) + 1)
        return (self.block_table[row, positions // BLOCK].to(torch.int64) * BLOCK
                + positions % BLOCK)

    def codes_at(self, row: int, unit_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [H, 2, D], scales [H]) the kernel stored for a row's unit."""
        block = int(self.block_table[row, unit_index * self.unit // BLOCK])
        cell = (unit_index * self.unit % BLOCK) // self.unit
        return (reference.unpack(self.bounds[block, :, cell], self.bits),
                self.scales[block, :, cell])
