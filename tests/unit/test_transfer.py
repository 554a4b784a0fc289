# SPDX-License-Identifier: Apache-2.0
"""The in-place and copy transfers deliver the same selected entries."""

from __future__ import annotations

import pytest
import torch

from vllm_infinigen.transfer import CopyTransfer, InPlaceTransfer, gather_selected, make_transfer


@pytest.fixture
def pool():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(64, 2, 8, generator=gen)
    values = torch.randn(64, 2, 8, generator=gen)
    return keys, values


def _slots(seed: int, num_slots: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (3, 2, num_slots), generator=gen)  # [B, H_kv, K]


def test_gather_selected_per_head(pool):
    keys, values = pool
    slots = _slots(1)
    got_keys, got_values = gather_selected(keys, values, slots)
    assert got_keys.shape == (3, 2, 5, 8)
    for b in range(3):
        for h in range(2):
            for j in range(5):
                assert torch.equal(got_keys[b, h, j], keys[slots[b, h, j], h])
                assert torch.equal(got_values[b, h, j], values[slots[b, h, j], h])


@pytest.mark.parametrize("make", [InPlaceTransfer, lambda: CopyTransfer(torch.device("cpu"))])
def test_transfers_deliver_each_layer_its_own_entries(pool, make):
    keys, values = pool
    transfer = make()
    # Layers 2 and 3 in flight at once (both buffers), then layer 4 reuses
    # layer 2's buffer after layer 2 was consumed.
    transfer.start(2, keys, values, _slots(2))
    transfer.start(3, keys, values, _slots(3, num_slots=7))
    got2 = transfer.wait(2)
    expected2 = gather_selected(keys, values, _slots(2))
    assert torch.equal(got2[0], expected2[0]) and torch.equal(got2[1], expected2[1])
    got2 = (got2[0].clone(), got2[1].clone())
    transfer.start(4, keys, values, _slots(4))
    got3, got4 = transfer.wait(3), transfer.wait(4)
    for got, seed, size in ((got3, 3, 7), (got4, 4, 5)):
        expected = gather_selected(keys, values, _slots(seed, num_slots=size))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[2] >= 0.0
    transfer.shutdown()


def test_make_transfer():
    assert make_transfer("auto", torch.device("cpu")).name == "in-place"
    assert make_transfer("copy", torch.device("cpu")).name == "copy"
    with pytest.raises(ValueError, match="--infinigen-transfer"):
        make_transfer("in-place", torch.device("meta"))
