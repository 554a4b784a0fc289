# SPDX-License-Identifier: Apache-2.0
"""attend_selected and slots_of_positions against dense attention written in plain torch."""

from __future__ import annotations

import pytest
import torch

from tests.reference.sparse_attention import attend_selected, slots_of_positions

BLOCK_SIZE = 4
NUM_BLOCKS = 10
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 4, 16
SCALE = HEAD_SIZE**-0.5
CONTEXT_LENS = [9, 5]
# Request 0 owns blocks 7, 2, 5; request 1 owns 4, 0 (then a padding entry).
BLOCK_TABLE = torch.tensor([[7, 2, 5], [4, 0, 9]], dtype=torch.int32)


def slot_of(b: int, position: int) -> int:
    block_id = int(BLOCK_TABLE[b, position // BLOCK_SIZE])
    return block_id * BLOCK_SIZE + position % BLOCK_SIZE


def make_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_reqs, num_slots = len(CONTEXT_LENS), NUM_BLOCKS * BLOCK_SIZE
    query = torch.randn(num_reqs, NUM_HEADS, HEAD_SIZE, generator=gen)
    key_store = torch.randn(num_slots, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    value_store = torch.randn(num_slots, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    current_key = torch.randn(num_reqs, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    current_value = torch.randn(num_reqs, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    return query, key_store, value_store, current_key, current_value


def dense_reference(query, key_store, value_store, current_key, current_value, kept):
    """Softmax attention, one (request, query head) at a time, in float64.

    ``kept[b][h]`` lists the context positions KV head h attends to; the
    current token is always attended.
    """
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(query.shape[0]):
        for head in range(NUM_HEADS):
            kv_head = head // group
            slots = [slot_of(b, t) for t in kept[b][kv_head]]
            keys = torch.cat([key_store[slots, kv_head], current_key[b, kv_head][None]])
            values = torch.cat([value_store[slots, kv_head], current_value[b, kv_head][None]])
            logits = (keys.double() @ query[b, head].double()) * SCALE
            weights = torch.exp(logits - logits.max())
            weights = weights / weights.sum()
            out[b, head] = weights @ values.double()
    return out


def pack(kept, num_slots):
    """Positions/valid tensors [B, H_kv, K] from per-(request, head) lists."""
    num_reqs = len(kept)
    positions = torch.zeros(num_reqs, NUM_KV_HEADS, num_slots, dtype=torch.int64)
    valid = torch.zeros(num_reqs, NUM_KV_HEADS, num_slots, dtype=torch.bool)
    for b in range(num_reqs):
        for h in range(NUM_KV_HEADS):
            chosen = list(kept[b][h])
            positions[b, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
            valid[b, h, : len(chosen)] = True
    return positions, valid


def run(inputs, positions, valid):
    query, key_store, value_store, current_key, current_value = inputs
    slots = slots_of_positions(positions, BLOCK_TABLE, BLOCK_SIZE)
    return attend_selected(query, key_store, value_store, slots, valid, current_key,
                           current_value, SCALE)


def test_slots_of_positions_exact():
    positions = torch.tensor([[0, 3, 4, 9], [1, 8, 11, 5]])
    slots = slots_of_positions(positions, BLOCK_TABLE, BLOCK_SIZE)
    # request 0: blocks 7, 7, 2, 5; request 1: blocks 4, 9, 9, 0
    assert slots.tolist() == [[28, 31, 8, 21], [17, 36, 39, 1]]
    assert slots.dtype == torch.int64


def test_slots_of_positions_keeps_shape():
    positions = torch.tensor([[[0, 1], [4, 11]], [[2, 3], [7, 4]]])  # [B, H_kv, K]
    slots = slots_of_positions(positions, BLOCK_TABLE, BLOCK_SIZE)
    assert slots.shape == (2, 2, 2)
    assert slots.tolist() == [[[28, 29], [8, 23]], [[18, 19], [3, 0]]]


def test_every_token_selected_equals_dense():
    inputs = make_inputs(seed=0)
    gen = torch.Generator().manual_seed(1)
    # Every context position, in a different order per head.
    kept = [[torch.randperm(n, generator=gen).tolist() for _ in range(NUM_KV_HEADS)]
            for n in CONTEXT_LENS]
    positions, valid = pack(kept, max(CONTEXT_LENS))
    out = run(inputs, positions, valid)
    assert out.shape == (len(CONTEXT_LENS), NUM_HEADS, HEAD_SIZE)
    assert out.dtype == torch.float32
    expected = dense_reference(*inputs, kept)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_subset_equals_dense_on_subset():
    inputs = make_inputs(seed=2)
    gen = torch.Generator().manual_seed(3)
    num_slots = 4
    kept = []
    for n in CONTEXT_LENS:
        per_head = []
        for h in range(NUM_KV_HEADS):
            size = 1 + h % min(num_slots, n)  # heads keep 1..4 tokens
            per_head.append(torch.randperm(n, generator=gen)[:size].tolist())
        kept.append(per_head)
    positions, valid = pack(kept, num_slots)
    out = run(inputs, positions, valid)
    expected = dense_reference(*inputs, kept)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # Not trivially equal to attending to everything.
    everything = [[list(range(n))] * NUM_KV_HEADS for n in CONTEXT_LENS]
    assert not torch.allclose(out.double(), dense_reference(*inputs, everything), atol=1e-3)


def test_nothing_selected_attends_current_token_only():
    inputs = make_inputs(seed=4)
    _, _, _, _, current_value = inputs
    positions = torch.zeros(len(CONTEXT_LENS), NUM_KV_HEADS, 3, dtype=torch.int64)
    valid = torch.zeros_like(positions, dtype=torch.bool)
    out = run(inputs, positions, valid)
    expected = current_value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    torch.testing.assert_close(out, expected)


def test_invalid_entries_have_no_effect():
    inputs = make_inputs(seed=5)
    query, key_store, value_store, current_key, current_value = inputs
    kept = [[[0, 3], [8], [1, 2, 5], [7]], [[4], [0, 1], [2], [3, 4]]]
    positions, valid = pack(kept, 3)
    compact = run(inputs, positions, valid)

    # The same selection, padded with invalid entries that point at real slots
    # holding extreme keys and values (they would dominate if attended).
    num_extra = 5
    gen = torch.Generator().manual_seed(6)
    extra = torch.randint(0, 5, (len(kept), NUM_KV_HEADS, num_extra), generator=gen)
    padded_positions = torch.cat([positions, extra], dim=2)
    padded_valid = torch.cat([valid, torch.zeros_like(extra, dtype=torch.bool)], dim=2)
    invalid_slots = slots_of_positions(padded_positions, BLOCK_TABLE, BLOCK_SIZE)[
        ~padded_valid
    ]
    key_store, value_store = key_store.clone(), value_store.clone()
    used = slots_of_positions(positions, BLOCK_TABLE, BLOCK_SIZE)[valid]
    junk = invalid_slots[~torch.isin(invalid_slots, used)]
    assert junk.numel() > 0
    key_store[junk] = 1e3 * query[0, 0]
    value_store[junk] = 1e4
    slots = slots_of_positions(padded_positions, BLOCK_TABLE, BLOCK_SIZE)
    padded = attend_selected(query, key_store, value_store, slots, padded_valid,
                             current_key, current_value, SCALE)
    torch.testing.assert_close(padded, compact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(padded.double(), dense_reference(*inputs, kept),
                               atol=1e-5, rtol=1e-5)


def test_output_keeps_query_dtype():
    inputs = make_inputs(seed=7)
    kept = [[list(range(n))] * NUM_KV_HEADS for n in CONTEXT_LENS]
    positions, valid = pack(kept, max(CONTEXT_LENS))
    reference = run(inputs, positions, valid)
    half = [x.to(torch.bfloat16) for x in inputs]
    out = run(half, positions, valid)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_heads", [4, 8])
def test_group_maps_query_head_to_kv_head(num_heads):
    """Query head q reads KV head q // (H_q / H_kv), as in vLLM."""
    gen = torch.Generator().manual_seed(8)
    query = torch.randn(1, num_heads, HEAD_SIZE, generator=gen)
    key_store = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    value_store = torch.zeros_like(key_store)
    current_key = torch.zeros(1, NUM_KV_HEADS, HEAD_SIZE)
    # Each KV head's current value is its index: the output names the KV head.
    current_value = torch.arange(NUM_KV_HEADS, dtype=torch.float32)[None, :, None].expand(
        1, NUM_KV_HEADS, HEAD_SIZE
    )
    slots = torch.zeros(1, NUM_KV_HEADS, 1, dtype=torch.int64)
    valid = torch.zeros(1, NUM_KV_HEADS, 1, dtype=torch.bool)
    out = attend_selected(query, key_store, value_store, slots, valid, current_key,
                          current_value, SCALE)
    group = num_heads // NUM_KV_HEADS
    assert out[0, :, 0].tolist() == [float(q // group) for q in range(num_heads)]
