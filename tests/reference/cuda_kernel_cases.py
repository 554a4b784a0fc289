# SPDX-License-Identifier: Apache-2.0
"""Arguments of the CUDA platform's kernels, shared by their torch references' tests
(``tests/unit/test_cuda_kernels.py``) and their Triton kernels' in the interpreter
(``tests/unit/triton_interpreter_checks.py``): a fetch of pool units into cache
slots, and attention over units listed in a block table."""

from __future__ import annotations

import torch


def fetch_case(dtype, head_size=8):
    torch.manual_seed(0)
    pool = torch.randn(6, 2, 4, 2 * head_size).to(dtype)  # [units, H, block, 2D]: 12 pool units
    cache = torch.zeros(10, 4, 2 * head_size, dtype=dtype)  # the last: scratch
    units = torch.tensor([1, 4, 7, 10, 11, -1, -1])
    slots = torch.tensor([3, 0, 5, 2, 8, -1, -1])
    return pool, cache, units, slots, torch.tensor([4])  # the 5th listed is not fetched


def attention_case(group=3, head_size=8, block=4):
    torch.manual_seed(1)
    query = torch.randn(3, group, head_size)
    units = torch.randn(10, block, 2 * head_size)
    table = torch.tensor([[4, 0, 9, 2], [7, 7, 1, 0], [3, 0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([4 * block, block + 1, 1], dtype=torch.int32)
    return query, units, table, seq_lens
