# SPDX-License-Identifier: Apache-2.0
"""Arguments of the CUDA platform's kernels, shared by their torch references' tests
(``tests/unit/test_cuda_kernels.py``) and their Triton kernels' in the interpreter
(``tests/unit/triton_interpreter_checks.py``) and on a GPU (``tests/gpu/``): a fetch
of pool units into cache slots, attention over units listed in a block table, and the
bound keys' unit scores a selection counts."""

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


def unit_score_case(context_lens: list[int], *, table_blocks: int, unit: int, ids: int,
                    heads: int = 2, units_per_block: int = 2):
    """(unit scores [S, heads, table_blocks x units_per_block] float32, each block's best
    unit, a table [S, table_blocks] int32 of distinct ids below ``ids``, ``past``): the
    scores small integers (ties), -inf where ``past``, past each row's complete units
    of ``unit`` tokens and for padding (a negative context), as ``bound_unit_scores``
    leaves them."""
    from vllm_infinigen.platforms.cuda.kernels import block_rule

    gen = torch.Generator().manual_seed(3)
    rows = len(context_lens)
    context = torch.tensor(context_lens)
    scores = (torch.randn(rows, heads, table_blocks * units_per_block, generator=gen) * 2).round()
    complete = torch.where(context >= 0, context.clamp(min=0) // unit, 0)
    past = torch.arange(scores.shape[-1])[None, None, :] >= complete[:, None, None]
    scores = scores.masked_fill(past, float("-inf"))
    table = torch.stack([torch.randperm(ids, generator=gen)[:table_blocks] for _ in range(rows)])
    return (scores, block_rule.unit_block_scores(scores, units_per_block), table.int(), past)
