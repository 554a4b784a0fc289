# SPDX-License-Identifier: Apache-2.0
"""``worker/restore.py``: a request over the pool back in the device blocks
(``--infinigen-residency device-first``). Its K/V read from the pool by its dense
block ids, unscaled from FP8, in the layout vLLM's KV update takes; the runner's
rows of the sparse groups emptied before the new blocks fill them. End to end
(tokens equal to stock vLLM across the return): ``tests/e2e/test_residency.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_infinigen.worker import restore

H, B, D = 2, 4, 8  # KV heads, block size, head size


def _state(pool: torch.Tensor, key_scale: float = 1.0, value_scale: float = 1.0):
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    return SimpleNamespace(kv_pool=pool, head_size=D, kv_scales=lambda: scales)


def test_pool_entries_are_the_blocks_tokens_in_order_with_their_heads():
    pool = torch.randn(6, H, B, 2 * D)
    key, value = restore.pool_entries(_state(pool), torch.tensor([4, 1]), torch.float32,
                                      torch.device("cpu"))
    assert key.shape == value.shape == (2 * B, H, D)
    for token in range(2 * B):
        block = (4, 1)[token // B]
        assert torch.equal(key[token], pool[block, :, token % B, :D])
        assert torch.equal(value[token], pool[block, :, token % B, D:])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_pools_entries_come_back_times_their_scales(dtype):
    """An FP8 pool holds K / k_scale and V / v_scale (as vLLM's FP8 pages do)."""
    pool = torch.randn(3, H, B, 2 * D).to(dtype)
    key, value = restore.pool_entries(_state(pool, 2.0, 0.5), torch.tensor([2]),
                                      torch.bfloat16, torch.device("cpu"))
    assert key.dtype == value.dtype == torch.bfloat16
    expected = pool[2].float().permute(1, 0, 2)  # [B, H, 2D]
    assert torch.equal(key.float(), (expected[..., :D] * 2.0).bfloat16().float())
    assert torch.equal(value.float(), (expected[..., D:] * 0.5).bfloat16().float())


class _Table:
    def __init__(self, rows: int):
        self.cleared: list[int] = []
        self.num_blocks_per_row = np.full(rows, 3)

    def clear_row(self, row: int) -> None:
        self.cleared.append(row)
        self.num_blocks_per_row[row] = 0


def test_clear_rows_empties_the_sparse_groups_only_of_the_requests_named():
    """The runner still names the blocks freed at the move: the restored request's
    sparse rows are emptied (in its state and in the persistent batch, where it is),
    the dense group's and other requests' left as they are."""
    tables = [_Table(2) for _ in range(3)]  # group 0 dense, 1 and 2 sparse
    requests = {name: SimpleNamespace(block_ids=([1, 2], [7, 8], [9, 10]))
                for name in ("a", "b", "gone")}
    runner = SimpleNamespace(requests=requests, input_batch=SimpleNamespace(
        req_id_to_index={"a": 1, "b": 0}, block_table=tables))
    restore.clear_rows(runner, {1, 2}, ["a", "gone", "unknown"])
    assert requests["a"].block_ids == ([1, 2], [], [])
    assert requests["gone"].block_ids == ([1, 2], [], [])  # not in the batch: its state
    assert requests["b"].block_ids == ([1, 2], [7, 8], [9, 10])
    assert [t.cleared for t in tables] == [[], [1], [1]]
