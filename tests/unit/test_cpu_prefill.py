# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's prompt rows over the pool by vLLM's own CPU attention kernel
(``platforms/cpu/prefill.py``: uncapped, and capped with each KV head's held entries)
equal ``kernels.attend_prefill``'s."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_kernels import BLOCK, DTYPES, Case, _assert_close
from vllm_infinigen.platforms.cpu import kernels, prefill

SEQ_LENS, NEW_ROWS = (50, 170, 90), (50, 40, 1)  # ``_step``'s requests


def _step(case: Case, query_dtype: torch.dtype):
    """Three requests: a first chunk, a later chunk (context before it), a decode row;
    the arguments both functions take, and the step's query."""
    gen = torch.Generator().manual_seed(15)
    query = torch.randn((91, case.num_kv_heads * case.group, case.head_size),
                        generator=gen).to(query_dtype)
    args = (case.block_table, torch.tensor([0, 50, 90, 91], dtype=torch.int64),
            torch.tensor([50, 170, 90], dtype=torch.int64),
            torch.tensor([0, 1], dtype=torch.int64))  # the decode row is not a prompt row
    return query, args


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_size"), [(2, 1, 32), (2, 4, 64),
                                                                  (1, 2, 128)])
@pytest.mark.parametrize("chunk_blocks", [prefill.CHUNK_BLOCKS, 2])
def test_vllms_kernel_equals_the_flash_attention_path(dtype, num_kv_heads, group, head_size,
                                                      chunk_blocks, monkeypatch):
    monkeypatch.setattr(prefill, "CHUNK_BLOCKS", chunk_blocks)  # 2: gathered in pieces
    case = Case(seed=14, dtype=dtype, num_kv_heads=num_kv_heads, group=group,
                head_size=head_size, context_lens=[49, 169, 89])
    query, args = _step(case, dtype)
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, want, case.kv_pool, *args, scale=case.scale)
    prefill.attend(query, got, case.kv_pool, *args, scale=case.scale)
    _assert_close(got[:90], want[:90], dtype)
    assert bool((got[90:] == 0).all())  # the decode row is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scratch_blocks", [None, 4])
def test_requests_sharing_blocks_gather_them_once(dtype, scratch_blocks, monkeypatch):
    """Two prompt requests on the same two full blocks (a prefix-cache hit), a decode
    row between their rows, the pool NaN wherever no request reads: the kernel over
    one scratch cache (or two, ``SCRATCH_BYTES`` of 4 blocks) equals the flash
    attention path, each shared block written once, no NaN read."""
    heads, group, head_size = 2, 2, 64
    gen = torch.Generator().manual_seed(21)
    pool = torch.randn((12, heads, BLOCK, 2 * head_size), generator=gen).to(dtype)
    # blocks 3 and 5 shared; 7 and 9 partial last blocks; block 1 the decode row's
    table = torch.tensor([[3, 5, 7, 0], [1, 0, 0, 0], [3, 5, 9, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([2 * BLOCK + 10, 5, 3 * BLOCK + 7])
    clean = pool.clone()
    for block, count in ((7, 10), (2, 7), (1, 5)):
        pool[block, :, count:] = float("nan")
    for block in (0, 4, 6, 8, 10, 11, 9):
        pool[block] = float("nan")
    clean[9] = pool[9] = torch.randn((heads, BLOCK, 2 * head_size), generator=gen).to(dtype)
    query_start = torch.tensor([0, 30, 31, 71])  # 30 rows, a decode row, 40 rows
    query = torch.randn((71, heads * group, head_size), generator=gen).to(dtype)
    args = (table, query_start, seq_lens, torch.tensor([0, 2]))
    if scratch_blocks:
        monkeypatch.setattr(prefill, "SCRATCH_BYTES",
                            scratch_blocks * heads * BLOCK * 2 * head_size * dtype.itemsize)
    writes = []
    write = prefill._Scratch.write
    monkeypatch.setattr(prefill._Scratch, "write", lambda self, tokens, slots: (
        writes.append(int((slots >= 0).sum())), write(self, tokens, slots)))
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, want, clean, *args, scale=0.125)
    empty = torch.empty  # the scratch cache NaN where nothing writes or zeroes it
    monkeypatch.setattr(prefill.torch, "empty", lambda *shape, **kwargs: empty(
        *shape, **kwargs).fill_(float("nan")))
    prefill.attend(query, got, pool, *args, scale=0.125)
    monkeypatch.undo()
    _assert_close(got[:30], want[:30], dtype)
    _assert_close(got[31:], want[31:], dtype)
    assert bool((got[30] == 0).all())
    together = 2 * BLOCK + 10 + BLOCK + 7  # the shared blocks once, the partial ones' own
    assert sum(writes) == (together if scratch_blocks is None else int(seq_lens[[0, 2]].sum()))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_pool_is_widened_and_its_scales_applied(fp8, query_dtype):
    case = Case(seed=3, dtype=query_dtype, num_kv_heads=2, group=2, head_size=64,
                context_lens=[49, 169, 89])
    case.kv_pool = case.kv_pool.to(fp8)
    query, args = _step(case, query_dtype)
    scales = {"key_scale": 0.5, "value_scale": 2.0}
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, want, case.kv_pool, *args, scale=case.scale, **scales)
    prefill.attend(query, got, case.kv_pool, *args, scale=case.scale, **scales)
    _assert_close(got[:90], want[:90], query_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_size"), [(2, 1, 32), (2, 4, 64),
                                                                  (4, 2, 128)])
@pytest.mark.parametrize("chunk_blocks", [prefill.CHUNK_BLOCKS, 1])
def test_a_capped_pool_by_vllms_kernel_equals_the_flash_attention_path(
        dtype, num_kv_heads, group, head_size, chunk_blocks, monkeypatch):
    """Each KV head over the entries it holds (a third evicted, differently per head)."""
    monkeypatch.setattr(prefill, "CHUNK_BLOCKS", chunk_blocks)  # 1: gathered in pieces
    case = Case(seed=14, dtype=dtype, num_kv_heads=num_kv_heads, group=group,
                head_size=head_size, context_lens=[49, 169, 89], evict_fraction=0.35)
    case.hold_step_rows(SEQ_LENS, NEW_ROWS)
    held = (case.row_map[case.block_table[1, :2].long()] >= 0).sum(dim=(0, 2))
    assert len(set(held.tolist())) > 1  # the heads hold different counts
    query, args = _step(case, dtype)
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, want, case.kv_pool, *args, scale=case.scale,
                           row_map=case.row_map)
    prefill.attend_capped(query, got, case.kv_pool, case.row_map, *args, scale=case.scale)
    _assert_close(got[:90], want[:90], dtype)
    assert bool((got[90:] == 0).all())
    uncapped = torch.zeros_like(query)  # (the evictions change the result)
    prefill.attend(query, uncapped, case.kv_pool, *args, scale=case.scale)
    assert not torch.allclose(uncapped[50:90].float(), want[50:90].float(), atol=1e-2)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_capped_fp8_pool_is_widened_and_its_scales_applied(fp8):
    case = Case(seed=3, dtype=torch.bfloat16, num_kv_heads=2, group=2, head_size=64,
                context_lens=[49, 169, 89], evict_fraction=0.3)
    case.kv_pool = case.kv_pool.to(fp8)
    case.hold_step_rows(SEQ_LENS, NEW_ROWS)
    query, args = _step(case, torch.bfloat16)
    scales = {"key_scale": 0.5, "value_scale": 2.0}
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, want, case.kv_pool, *args, scale=case.scale,
                           row_map=case.row_map, **scales)
    prefill.attend_capped(query, got, case.kv_pool, case.row_map, *args, scale=case.scale,
                          **scales)
    _assert_close(got[:90], want[:90], torch.bfloat16)


def test_a_capped_pool_missing_a_token_of_the_step_is_an_error():
    case = Case(seed=5, dtype=torch.float32, num_kv_heads=2, group=2, head_size=64,
                context_lens=[49, 169, 89], evict_fraction=0.3)
    case.hold_step_rows(SEQ_LENS, NEW_ROWS)
    block, offset = divmod(160, BLOCK)  # request 1's rows are positions 130..169
    case.row_map[case.block_table[1, block], 1, offset] = -1
    query, args = _step(case, torch.float32)
    with pytest.raises(RuntimeError, match="a token of this step is not in the pool"):
        prefill.attend_capped(query, torch.zeros_like(query), case.kv_pool, case.row_map,
                              *args, scale=case.scale)


def test_head_sizes_vllms_kernel_lacks_keep_the_flash_attention_path():
    assert prefill.supports(128) and prefill.supports(32)
    assert not prefill.supports(8)
