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
    """An FP8 pool holds K / k_scale and V / v_scale (as vLLM's FP8 pages do): in the
    model's dtype with scales of 1.0 (exact), and on CUDA."""
    pool = torch.randn(3, H, B, 2 * D).to(dtype)
    expected = pool[2].float().permute(1, 0, 2)  # [B, H, 2D]
    key, value = restore.pool_entries(_state(pool), torch.tensor([2]), torch.bfloat16,
                                      torch.device("cpu"))
    assert key.dtype == value.dtype == torch.bfloat16
    assert torch.equal(key.float(), expected[..., :D])
    assert torch.equal(value.float(), expected[..., D:])
    key, value = restore.pool_entries(_state(pool, 2.0, 0.5), torch.tensor([2]),
                                      torch.bfloat16, torch.device("meta"))
    assert key.dtype == value.dtype == torch.bfloat16  # (CUDA's: the device's type only)


def _every_code(fmt: torch.dtype) -> torch.Tensor:
    """[3, H, B, 2D] pool units holding each finite code of ``fmt`` (and more)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    codes = codes[codes.float().isfinite()]
    return codes.repeat(-(-3 * H * B * 2 * D // codes.numel()))[:3 * H * B * 2 * D].view(
        3, H, B, 2 * D)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", [(0.37, 2.5), (0.0123, 1.0), (3.1, 0.71)])
def test_an_fp8_pool_comes_back_to_its_codes_through_a_write_toward_zero(fmt, scales):
    """vLLM's CPU FP8 write divides the scale out and rounds toward zero: the entries
    (float32, a hair away from zero) land on every code the pool held, where
    bfloat16 products would lose one code in about half of them."""
    from benchmarks.harness.fp8_attention import toward_zero

    pool = _every_code(fmt)
    key, value = restore.pool_entries(_state(pool, *scales), torch.tensor([0, 1, 2]),
                                      torch.bfloat16, torch.device("cpu"))
    assert key.dtype == value.dtype == torch.float32
    held = pool.permute(0, 2, 1, 3).flatten(0, 1)
    for got, scale, codes in ((key, scales[0], held[..., :D]), (value, scales[1], held[..., D:])):
        back = toward_zero(got * torch.tensor(1.0 / scale, dtype=torch.float32), fmt)
        assert torch.equal(back.float(), codes.float()), scale
    products = held[..., :D].to(torch.bfloat16) * scales[0]  # the model's dtype, as before
    lost = toward_zero(products.float() / scales[0], fmt).float() != held[..., :D].float()
    assert scales[0] == 3.1 or lost.any()  # (the test would see the old loss)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_an_fp8_pool_comes_back_to_its_codes_through_vllms_own_write(fmt):
    """vLLM's CPU FP8 cache write itself (AVX-512 / AMX hosts), bfloat16 model."""
    from benchmarks.harness import fp8_attention
    from tests.unit.test_kernels_fp8 import _vllm_page_bytes

    if not fp8_attention.native():
        pytest.skip("this host's vLLM has no CPU FP8 kernel (it needs AVX-512 or AMX): "
                    "the return is checked against toward_zero only")
    pool = _every_code(fp8_attention.FORMATS[fmt])
    key, _ = restore.pool_entries(_state(pool, 0.37, 1.0), torch.tensor([0, 1, 2]),
                                  torch.bfloat16, torch.device("cpu"))
    rows = key.reshape(-1, 1, 64)
    written = _vllm_page_bytes(rows, fmt, 0.37, 64).reshape(key.shape)
    held = pool.permute(0, 2, 1, 3).flatten(0, 1)[..., :D]
    assert torch.equal(written.float(), held.float())


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


def test_clear_rows_waits_for_the_last_steps_copy_of_the_block_table():
    """Under async scheduling the last step's copy of the pinned block table to the
    device may still be running: the rows are cleared after vLLM's event for it."""
    order: list[str] = []
    table = _Table(1)
    table.clear_row = lambda row: order.append("cleared")
    runner = SimpleNamespace(
        requests={"a": SimpleNamespace(block_ids=([1], [7]))},
        input_batch=SimpleNamespace(req_id_to_index={"a": 0}, block_table=[_Table(1), table]),
        prepare_inputs_event=SimpleNamespace(synchronize=lambda: order.append("waited")))
    restore.clear_rows(runner, {1}, ["a"])
    assert order == ["waited", "cleared"]


def _layer(name: str, pool: torch.Tensor, calls: list):
    impl = SimpleNamespace(write_restored=lambda layer, key, value, slots:
                           calls.append((name, key.clone(), value.clone(), slots.tolist())))
    return SimpleNamespace(layer_name=name, kv_pool=pool, head_size=D,
                           kv_scales=lambda: {"key_scale": 1.0, "value_scale": 1.0},
                           attention=SimpleNamespace(impl=impl))


def test_copy_from_pool_writes_each_layers_blocks_at_the_new_ids_after_the_device_waits(
        monkeypatch):
    """Per sparse layer, the requests' dense blocks of the pool go to their blocks of
    the layer's group (slot = block x block size + offset), a chunk at a time, once
    the device has finished (``devices.synchronize``: the pool's last writes)."""
    calls: list = []
    monkeypatch.setattr(restore.devices, "synchronize", lambda device: calls.append("wait"))
    monkeypatch.setattr(restore, "CHUNK_BLOCKS", 2)
    pools = {name: torch.randn(8, H, B, 2 * D) for name in ("l2", "l3")}
    layers = [_layer(name, pool, calls) for name, pool in pools.items()]
    # groups: 0 dense, 1 holds l2, 2 holds l3
    requests = {"a": SimpleNamespace(block_ids=([5, 1, 6], [2, 3, 4], [7, 0, 2])),
                "b": SimpleNamespace(block_ids=([3], [6], [5]))}
    runner = SimpleNamespace(requests=requests)
    copied = restore.copy_from_pool(layers, runner, 0, {"l2": 1, "l3": 2}, ["a", "b"],
                                    torch.float32, torch.device("cpu"))
    assert copied == 4 and calls[0] == "wait"
    writes = calls[1:]
    assert [name for name, *_ in writes] == ["l2", "l2", "l3", "l3"]  # 4 blocks, 2 a chunk
    for name, group in (("l2", 1), ("l3", 2)):
        sources = requests["a"].block_ids[0] + requests["b"].block_ids[0]
        targets = requests["a"].block_ids[group] + requests["b"].block_ids[group]
        slots = [s for n, _, _, chunk in writes if n == name for s in chunk]
        assert slots == [t * B + o for t in targets for o in range(B)]
        key = torch.cat([k for n, k, _, _ in writes if n == name])
        value = torch.cat([v for n, _, v, _ in writes if n == name])
        expected = pools[name][sources].permute(0, 2, 1, 3).flatten(0, 1)
        assert torch.equal(key, expected[..., :D]) and torch.equal(value, expected[..., D:])


def test_a_prefix_hit_fills_only_its_uncached_blocks(monkeypatch):
    """``spans``: each request's blocks of its hit that the sparse groups had not
    cached (the dense ones the cached blocks of the hit, the sparse ones fresh)."""
    calls: list = []
    monkeypatch.setattr(restore.devices, "synchronize", lambda device: None)
    pool = torch.randn(8, H, B, 2 * D)
    requests = {"a": SimpleNamespace(block_ids=([5, 1, 6], [2, 3, 4])),
                "b": SimpleNamespace(block_ids=([3, 7], [6, 0]))}
    copied = restore.copy_from_pool([_layer("l2", pool, calls)], SimpleNamespace(
        requests=requests), 0, {"l2": 1}, ["a", "b"], torch.float32, torch.device("cpu"),
        spans=[(1, 3), (0, 1)])
    assert copied == 3
    (_, key, value, slots), = calls
    assert slots == [t * B + o for t in (3, 4, 6) for o in range(B)]
    expected = pool[[1, 6, 3]].permute(0, 2, 1, 3).flatten(0, 1)
    assert torch.equal(key, expected[..., :D]) and torch.equal(value, expected[..., D:])


def test_copy_from_pool_refuses_a_request_whose_rows_were_not_emptied():
    """Its sparse list longer than its dense one: the rows still name the blocks of
    the move (``clear_rows`` was skipped); copying would write to blocks it does not
    hold."""
    layer = _layer("l2", torch.zeros(8, H, B, 2 * D), [])
    runner = SimpleNamespace(requests={"a": SimpleNamespace(block_ids=([5, 1], [2, 3, 4, 6]))})
    with pytest.raises(RuntimeError, match="4 blocks in KV-cache group 1 for its 2"):
        restore.copy_from_pool([layer], runner, 0, {"l2": 1}, ["a"], torch.float32,
                               torch.device("cpu"))


def test_only_a_device_with_a_line_waits():
    from vllm_infinigen.platforms import devices

    assert devices._load(devices.SYNCHRONIZERS["cuda"]) is torch.cuda.synchronize
    devices.synchronize(torch.device("cpu"))  # no line: nothing to wait for, no error
