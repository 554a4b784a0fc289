# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform (pure torch, any device): the reference of the cache's LRU placement.

``DeviceBlockCache.place`` runs ``triton_select.lookup_lru`` on CUDA and this
elsewhere (CI); the interpreter tests hold the kernel to it. Like the kernel,
it reads nothing back to the host.
"""

from __future__ import annotations

import torch

_BIG = 1 << 62


def place_reference(block_ids: torch.Tensor, slots: torch.Tensor, slot_of: torch.Tensor,
                    block_of: torch.Tensor, last_used: torch.Tensor, ticks: torch.Tensor,
                    fetch_units: torch.Tensor, fetch_slots: torch.Tensor,
                    num_fetch: torch.Tensor, counters: torch.Tensor, seq_lens: torch.Tensor,
                    context_lens: torch.Tensor, *, capacity: int) -> None:
    """One layer's selection placed in its cache, least recently used slots evicted.

    Args:
        block_ids: [S, H, W] selected block ids, -1 padded, distinct per head.
        slots: [S, H, W] int64 out: flat cache slot of each entry (-1: none).
        slot_of: [num_blocks * H + 1] int32 the layer's slot of (block, head), -1.
        block_of, last_used: [H, capacity + 1] int64 the layer's slot owners
            and last-use ticks (the last column is scratch).
        ticks: [H] int64 lookups so far, advanced by one.
        fetch_units, fetch_slots: [H, S * W] int64 out: each head's misses in
            entry order (pool unit, flat slot); -1 past ``num_fetch``.
        num_fetch: [H] int64 out: misses per head.
        counters: [H, 4] int64 += (attended besides the own entries, context
            tokens on head 0, hits, misses) (``block_cache.COUNTS``).
        seq_lens: [S * H] tokens each (row, head) attends, its own included.
        context_lens: [S] tokens before each row's own (< 0: padding).
    """
    num_rows, num_heads, width = block_ids.shape
    per_head = num_rows * width
    device = block_ids.device
    heads = torch.arange(num_heads, device=device)[:, None]  # [H, 1]
    scratch_entry = slot_of.shape[0] - 1
    ids = block_ids.permute(1, 0, 2).reshape(num_heads, per_head).to(torch.int64)  # [H, M]
    wanted = ids >= 0
    entries = ids.clamp(min=0) * num_heads + heads
    cached = torch.where(wanted, slot_of[entries].to(torch.int64), -1)
    hit, miss = wanted & (cached >= 0), wanted & (cached < 0)
    ticks += 1
    tick = ticks[:, None]  # [H, 1]
    last_used.scatter_(1, torch.where(hit, cached, capacity), tick.expand(-1, per_head))
    # Victims: the misses' count of lowest (tick, slot) among the slots not hit now,
    # handed out in slot order to the misses in entry order.
    keys = last_used[:, :capacity]
    eligible = keys != tick
    num_miss = miss.sum(dim=1)  # [H]
    order = torch.sort(torch.where(eligible, keys, _BIG), dim=1, stable=True).indices
    position = torch.arange(capacity, device=device).expand(num_heads, -1)
    chosen = torch.zeros_like(eligible).scatter_(1, order, position < num_miss[:, None])
    in_slot_order = torch.where(chosen, position, _BIG).sort(dim=1).values[:, :per_head]
    rank = miss.cumsum(dim=1) - 1
    victim = torch.where(miss, in_slot_order.gather(1, rank.clamp(min=0)), capacity)
    old = block_of.gather(1, victim)
    unmap = torch.where(miss & (old >= 0), old.clamp(min=0) * num_heads + heads, scratch_entry)
    slot_of.index_fill_(0, unmap.flatten(), -1)
    mapped = torch.where(miss, entries, scratch_entry)
    slot_of.index_put_((mapped.flatten(),), victim.to(torch.int32).flatten())
    slot_of[scratch_entry] = -1
    block_of.scatter_(1, victim, torch.where(miss, ids, -1))
    last_used.scatter_(1, victim, tick.expand(-1, per_head))
    flat = heads * capacity
    placed = torch.where(hit, flat + cached, torch.where(miss, flat + victim, -1))
    slots.copy_(placed.view(num_heads, num_rows, width).permute(1, 0, 2))
    listed = torch.where(miss, rank, per_head)  # misses to their rank, the rest to scratch
    for out, value in ((fetch_units, entries), (fetch_slots, flat + victim)):
        padded = torch.full((num_heads, per_head + 1), -1, dtype=torch.int64, device=device)
        out.copy_(padded.scatter_(1, listed, torch.where(miss, value, -1))[:, :per_head])
    num_fetch.copy_(num_miss)
    attended = (seq_lens.view(num_rows, num_heads).to(torch.int64) - 1).clamp(min=0).sum(dim=0)
    context = torch.where(heads[:, 0] == 0, context_lens.to(torch.int64).clamp(min=0).sum(), 0)
    counters += torch.stack([attended, context, hit.sum(dim=1), num_miss], dim=1)
