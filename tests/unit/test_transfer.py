# SPDX-License-Identifier: Apache-2.0
"""The copy transfer stages each layer its own selected entries; in place moves nothing."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from vllm_infinigen.platforms.cpu import transfer as transfer_module
from vllm_infinigen.platforms.cpu.transfer import CopyTransfer, InPlaceTransfer, make_transfer
from vllm_infinigen.block_layout import entries_of

BLOCK = 16


@pytest.fixture
def pool():
    gen = torch.Generator().manual_seed(0)
    kv_pool = torch.randn(8, 2, BLOCK, 16, generator=gen)  # [units, H_kv, block, 2D]
    block_table = torch.tensor([[3, 1, 6], [0, 7, 2], [5, 4, 2]], dtype=torch.int32)
    return kv_pool, block_table


def _positions(seed: int, width: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 3 * BLOCK, (3, 2, width), generator=gen)  # [B, H_kv, K]
    positions[0, 1, -2:] = -1  # padding
    return positions.to(torch.int32)


def test_entries_of_reads_each_heads_rows(pool):
    kv_pool, block_table = pool
    positions = _positions(1)
    got = entries_of(kv_pool, block_table, positions)
    assert got.shape == (3, 2, 5, 16)
    for b in range(3):
        for h in range(2):
            for j in range(5):
                p = int(positions[b, h, j])
                want = (torch.zeros(16) if p < 0
                        else kv_pool[block_table[b, p // BLOCK], h, p % BLOCK])
                assert torch.equal(got[b, h, j], want)


def test_copy_transfer_delivers_each_layer_its_own_entries(pool):
    kv_pool, block_table = pool
    transfer = CopyTransfer(torch.device("cpu"))
    # Layers 2 and 3 in flight at once, then layer 4 after layer 2 was consumed.
    transfer.start(2, kv_pool, block_table, _positions(2), None)
    transfer.start(3, kv_pool, block_table, _positions(3, width=7), None)
    before = time.perf_counter()
    got2, waited = transfer.wait(2)
    elapsed = time.perf_counter() - before
    assert torch.equal(got2, entries_of(kv_pool, block_table, _positions(2)))
    assert 0.0 <= waited <= elapsed  # the wait itself, not the time since start()
    transfer.start(4, kv_pool, block_table, _positions(4), None)
    for layer, seed, width in ((3, 3, 7), (4, 4, 5)):
        got, _ = transfer.wait(layer)
        assert torch.equal(got, entries_of(kv_pool, block_table, _positions(seed, width)))
    transfer.shutdown()


def test_copy_transfer_reports_the_time_the_layer_waited(pool, monkeypatch):
    """The gather finishes 0.2 s after the layer began to wait: it waited that long."""
    kv_pool, block_table = pool
    waiting = threading.Event()

    def clock() -> float:  # wait()'s first reading of the clock: it is waiting now
        now = time.perf_counter()
        waiting.set()
        return now

    def slow_entries_of(*args):
        assert waiting.wait(timeout=60)
        time.sleep(0.2)
        return entries_of(*args)

    monkeypatch.setattr(transfer_module, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(transfer_module, "entries_of", slow_entries_of)
    transfer = CopyTransfer(torch.device("cpu"))
    transfer.start(2, kv_pool, block_table, _positions(2), None)
    before = time.perf_counter()
    got, waited = transfer.wait(2)
    elapsed = time.perf_counter() - before
    transfer.shutdown()
    assert torch.equal(got, entries_of(kv_pool, block_table, _positions(2)))
    assert 0.2 <= waited <= elapsed


def test_in_place_transfer_moves_nothing(pool):
    kv_pool, block_table = pool
    transfer = InPlaceTransfer()
    transfer.start(2, kv_pool, block_table, _positions(2), None)
    assert transfer.wait(2) == (None, 0.0)


def test_make_transfer():
    assert make_transfer("auto", torch.device("cpu")).name == "in-place"
    assert make_transfer("copy", torch.device("cpu")).name == "copy"
    with pytest.raises(ValueError, match="--infinigen-transfer"):
        make_transfer("in-place", torch.device("meta"))
