# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform (pure torch, any device): the references of the ops on pool units.

What ``units.py``'s wrappers and the cache's placement (``selection.place_lru``)
run off CUDA (in CI, and in the CPU self-test of the GPU benchmark), and what
the tests hold the Triton kernels to (``tests/unit/triton_interpreter_checks.py``,
in Triton's interpreter; ``tests/gpu/``)::

    gather_units_reference        gather_units
    write_pool                    write_tokens: the write-through into the pool,
      cached_token_slots,           and into the cached copies of their blocks
      write_cached_tokens
    write_int_keys                encode_groups (codes: ``int_key_codes``)
    write_bounds                  encode_bounds (codes: ``bound_key_codes``)
    attend_units_reference        attend_units
    attend_prompt_units_reference attend_prompt_units
    place_lru_reference           place_lru
    write_own_tokens              (tests and benchmarks: a row's own token into its unit)
    pool_rows                     a pool's K|V rows of new tokens (FP8: over the scales)

An FP8 pool (``--kv-cache-dtype fp8``) holds K / key_scale and V / value_scale
(vLLM's ``k_scale`` and ``v_scale``), rounded to nearest and saturating, as vLLM's
CUDA build writes its FP8 pages (the CPU kernels round toward zero, as its CPU build
does); the attention multiplies the scales back
(key_scale into the logits' scale, value_scale into the output).

The CPU build writes with its compiled kernels (``platforms/cpu/kernels/csrc/``);
the writes here are the same in torch, held to those kernels byte for byte
(``tests/unit/test_cuda_writes.py``, ``test_bounds.py``). They read and write
the host pool with torch indexing, which on a GPU would wait for the step's
K/V to reach the host: on CUDA the wrappers store and encode through the
pinned pool's UVA pointer on the compute stream instead (no host sync; the
gather stream waits for the compute stream before each gather:
``platforms/cuda/__init__.py``, invariant 1). The selection's references are
in ``block_rule.py``.
"""

from __future__ import annotations

import torch

from vllm_infinigen.layout import KEY_GROUP

_BIG = 1 << 62


# -- gather and attention


def gather_units_reference(pool: torch.Tensor, cache: torch.Tensor, fetch_units: torch.Tensor,
                           fetch_slots: torch.Tensor, num_fetch: torch.Tensor) -> None:
    """``gather_units`` in torch; entries past a list's count copy unit 0 to the scratch."""
    lists = num_fetch.shape[0]
    units = fetch_units.reshape(lists, -1).to(cache.device)
    live = torch.arange(units.shape[1], device=cache.device)[None, :] < num_fetch[:, None]
    source = torch.where(live, units, 0).flatten()
    destination = torch.where(live, fetch_slots.reshape(lists, -1).to(cache.device),
                              cache.shape[0] - 1).flatten()
    rows = pool.reshape(-1, cache.shape[1], cache.shape[2])
    cache[destination] = rows[source.to(pool.device)].to(cache.device)


def attend_units_reference(query: torch.Tensor, units: torch.Tensor, table: torch.Tensor,
                           seq_lens: torch.Tensor, *, num_kv_heads: int, scale: float,
                           key_scale: float = 1.0, value_scale: float = 1.0) -> torch.Tensor:
    """``attend_units`` in torch, float32 softmax; [S, H_q, D]."""
    num_sequences, width = table.shape
    block_size, head_size = units.shape[1], units.shape[2] // 2
    grouped = query.reshape(num_sequences, -1, head_size).float()  # [N, G, D]
    tokens = units[table.to(torch.int64).clamp(min=0)].reshape(
        num_sequences, width * block_size, -1).float()
    keys, values = tokens[..., :head_size], tokens[..., head_size:]
    scores = torch.einsum("ngd,ntd->ngt", grouped, keys) * (scale * key_scale)
    positions = torch.arange(width * block_size, device=query.device)
    live = positions[None, :] < seq_lens.to(torch.int64)[:, None].to(query.device)
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty sequence: 0
    out = torch.einsum("ngt,ntd->ngd", weights, values) * value_scale
    return out.reshape(query.shape).to(query.dtype)


def attend_prompt_units_reference(query: torch.Tensor, units: torch.Tensor,
                                  table: torch.Tensor, *, first: int, seq_len: int,
                                  scale: float, key_scale: float = 1.0,
                                  value_scale: float = 1.0,
                                  rows_per_chunk: int = 256) -> torch.Tensor:
    """``attend_prompt_units`` in torch, float32 softmax, ``rows_per_chunk`` rows at a time."""
    num_rows, num_heads, head_size = query.shape
    kv_heads = table.shape[0]
    group = num_heads // kv_heads
    kv = units[table.to(torch.int64)].reshape(kv_heads, -1, 2 * head_size)[:, :seq_len].float()
    keys, values = kv[..., :head_size], kv[..., head_size:]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    tokens = torch.arange(seq_len, device=query.device)
    for chunk in range(0, num_rows, rows_per_chunk):
        stop = min(chunk + rows_per_chunk, num_rows)
        rows = query[chunk:stop].float().view(-1, kv_heads, group, head_size)
        scores = torch.einsum("thgd,hld->thgl", rows, keys) * (scale * key_scale)
        position = first + torch.arange(chunk, stop, device=query.device)
        visible = tokens[None, :] <= position[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        attended = torch.einsum("thgl,hld->thgd", torch.softmax(scores, dim=-1),
                                values) * value_scale
        out[chunk:stop] = attended.reshape(stop - chunk, num_heads, head_size).to(out.dtype)
    return out


# -- the writes of a step's new tokens


def pool_rows(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype,
              key_scale: float = 1.0, value_scale: float = 1.0) -> torch.Tensor:
    """[T, H_kv, 2 * D] the K|V rows a pool (or cache) of ``dtype`` holds for
    ``key``, ``value`` [T, H_kv, D]: in FP8, K and V times the float32 inverses
    of their scales, saturated at the format's largest finite value and
    rounded to nearest even (vLLM's CUDA FP8 write); else K and V as
    ``dtype``."""
    if dtype.itemsize != 1:
        return torch.cat([key, value], dim=-1).to(dtype)
    limit = torch.finfo(dtype).max
    inverses = [torch.tensor(1.0 / s, dtype=torch.float32, device=key.device)
                for s in (key_scale, value_scale)]
    rows = torch.cat([key.float() * inverses[0], value.float() * inverses[1]], dim=-1)
    return rows.clamp(-limit, limit).to(dtype)


def write_pool(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor, key_scale: float = 1.0,
               value_scale: float = 1.0) -> None:
    """The host write-through: K|V rows of the new tokens into an uncapped pool.

    Args:
        kv_pool: [num_blocks, H_kv, block_size, 2 * D] (unit = block id).
        key, value: [T, H_kv, D] on any device (copied to the pool's).
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        key_scale, value_scale: An FP8 pool's (``pool_rows``).
    """
    block_size = kv_pool.shape[2]
    slots = slot_mapping.to(kv_pool.device, torch.int64)
    keep = slots >= 0
    rows = pool_rows(key, value, kv_pool.dtype, key_scale,
                     value_scale).to(kv_pool.device)[keep]
    kept = slots[keep]
    kv_pool[kept // block_size, :, kept % block_size] = rows


def cached_token_slots(slot_of: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                       num_kv_heads: int, slots_per_head: int) -> torch.Tensor:
    """[T, H_kv] flat cache slot holding each new token's block per head, -1
    where not cached (``slot_of``: a layer's [num_blocks * H_kv + 1])."""
    blocks = (slot_mapping.clamp(min=0) // block_size).to(torch.int64)
    heads = torch.arange(num_kv_heads, device=slot_of.device)[None, :]
    cached = slot_of[blocks[:, None] * num_kv_heads + heads].to(torch.int64)
    found = (slot_mapping[:, None] >= 0) & (cached >= 0)
    return torch.where(found, cached + heads * slots_per_head, -1)


def write_cached_tokens(units: torch.Tensor, flat_slots: torch.Tensor,
                        slot_mapping: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, key_scale: float = 1.0,
                        value_scale: float = 1.0) -> None:
    """The device write of new tokens into the cached copies of their blocks.

    Args:
        units: [H_kv * slots_per_head + 1, block_size, 2 * D] a layer's cache
            (the last unit is scratch).
        flat_slots: [T, H_kv] from ``DeviceBlockCache.cached_token_slots`` (-1: not cached).
        slot_mapping: [T] int64 slot ids of the dense group.
        key, value: [T, H_kv, D].
        key_scale, value_scale: An FP8 cache's (``pool_rows``).
    """
    block_size = units.shape[1]
    scratch = units.shape[0] - 1
    target = torch.where(flat_slots >= 0, flat_slots, scratch)  # [T, H]
    offset = (slot_mapping.clamp(min=0) % block_size)[:, None].expand_as(target)
    units[target, offset] = pool_rows(key, value, units.dtype, key_scale,
                                      value_scale).to(units.device)


def write_own_tokens(units: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor) -> None:
    """Writes each sequence's new K|V as its last token (position seq_len - 1).

    Args:
        units: [num_units, block_size, 2 * D].
        table, seq_lens: as for ``attend_units``.
        key, value: [N, D] the new token of each sequence (row-major over
            (row, KV head), as the table).
    """
    block_size = units.shape[1]
    last = seq_lens.to(torch.int64) - 1
    unit = table.to(torch.int64).gather(1, (last // block_size)[:, None])[:, 0]
    units[unit, last % block_size] = torch.cat([key, value], dim=-1).to(units.dtype)


def int_key_codes(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Int speculation keys of 16-token groups.

    Per channel and group: scale = max |k| / half (float16), half = (2^bits - 1) / 2,
    code = round(k / scale + half) clamped to [0, 2^bits - 1] (0 where scale is 0),
    token t's code at bits [bits * t, bits * (t + 1)) of a 16 x bits-bit word
    stored as 2 * bits bytes, least significant first.

    Args:
        keys: [N, H_kv, 16, D] the groups' keys.

    Returns:
        (codes [N, H_kv, D, 2 * bits] uint8, scales [N, H_kv, D] float16).
    """
    half = ((1 << bits) - 1) / 2
    values = keys.float()
    scales = (values.abs().amax(dim=2) / half).to(torch.float16)  # [N, H, D]
    step = scales.float()[:, :, None, :]  # [N, H, 1, D]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round(values / safe + half).clamp(0, (1 << bits) - 1)
    codes = torch.where(step > 0, codes, torch.zeros_like(codes)).to(torch.int64)
    shifts = bits * torch.arange(KEY_GROUP, device=keys.device)
    # word: [N, H, D], two's complement when bits * 16 = 64 (the bytes are the same)
    word = (codes << shifts[None, None, :, None]).sum(dim=2)
    byte_shifts = 8 * torch.arange(2 * bits, device=keys.device)
    packed = ((word[..., None] >> byte_shifts) & 0xFF).to(torch.uint8)
    return packed, scales


def write_int_keys(codes: torch.Tensor, scales: torch.Tensor, kv_pool: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Encodes each 16-token group whose last token ``slot_mapping`` writes, in place.

    Runs after ``write_pool`` of the same tokens: it reads the group's keys
    from the pool (host), encodes there, and copies the result to the codes'
    device.

    Args:
        codes: [num_blocks, H_kv, G, D, 2 * bits] uint8, G = block_size / 16.
        scales: [num_blocks, H_kv, G, D] float16.
        kv_pool: [num_blocks, H_kv, block_size, 2 * D] uncapped pool.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    bits = codes.shape[-1] // 2
    head_size = codes.shape[3]
    slots = slot_mapping.to(kv_pool.device, torch.int64)
    closing = slots[(slots >= 0) & (slots % KEY_GROUP == KEY_GROUP - 1)]
    first = closing - (KEY_GROUP - 1)  # [N] first slot of each closed group
    block_size = kv_pool.shape[2]
    blocks = first // block_size
    offsets = first % block_size
    token = offsets[:, None] + torch.arange(KEY_GROUP, device=kv_pool.device)  # [N, 16]
    # keys: [N, H_kv, 16, D]
    keys = kv_pool[blocks[:, None], :, token, :head_size].permute(0, 2, 1, 3)
    packed, group_scales = int_key_codes(keys, bits)
    target_blocks = blocks.to(codes.device)
    groups = (offsets // KEY_GROUP).to(codes.device)
    codes[target_blocks, :, groups] = packed.to(codes.device)
    scales[target_blocks, :, groups] = group_scales.to(scales.device)


def bound_key_codes(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound speculation keys of units, as the CPU kernel encodes them (``bounds.cpp``).

    Args:
        keys: [N, H_kv, U, D] the units' keys.

    Returns:
        (bounds [N, H_kv, 2, D * bits / 8] uint8, scales [N, H_kv] float16).
    """
    offset = 1 << (bits - 1)
    values = keys.float()
    high, low = values.amax(dim=2), values.amin(dim=2)  # [N, H, D]
    magnitude = torch.maximum(high.abs(), low.abs()).amax(dim=-1)  # [N, H]
    ideal = magnitude / (offset - 1)
    scales = ideal.to(torch.float16)
    up = torch.nextafter(scales, torch.full_like(scales, float("inf")))
    scales = torch.where(scales.float() < ideal, up, scales)
    step = scales.float()[..., None]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    top = 2 * offset - 1
    codes = torch.stack([torch.ceil(high / safe), torch.floor(low / safe)], dim=2) + offset
    codes = torch.where(step[..., None] > 0, codes.clamp(0, top), torch.full_like(codes, offset))
    codes = codes.to(torch.int64)  # [N, H, 2, D]
    if bits == 4:
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return codes.to(torch.uint8), scales


def write_bounds(bounds: torch.Tensor, scales: torch.Tensor, kv_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Encodes each unit whose last token ``slot_mapping`` writes, in place.

    Runs after ``write_pool`` of the same tokens: it reads the unit's keys
    from the pool (host), encodes there, and copies the result to the bounds'
    device.

    Args:
        bounds: [num_blocks, H_kv, block_size / U, 2, D * bits / 8] uint8.
        scales: [num_blocks, H_kv, block_size / U] float16.
        kv_pool: [num_blocks, H_kv, block_size, 2 * D] uncapped pool.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    block_size = kv_pool.shape[2]
    head_size = kv_pool.shape[-1] // 2
    unit = block_size // bounds.shape[2]
    bits = 8 * bounds.shape[-1] // head_size
    slots = slot_mapping.to(kv_pool.device, torch.int64)
    closing = slots[(slots >= 0) & (slots % unit == unit - 1)]
    first = closing - (unit - 1)
    blocks = first // block_size
    offsets = first % block_size
    token = offsets[:, None] + torch.arange(unit, device=kv_pool.device)  # [N, U]
    keys = kv_pool[blocks[:, None], :, token, :head_size].permute(0, 2, 1, 3)  # [N, H, U, D]
    codes, unit_scales = bound_key_codes(keys, bits)
    target_blocks = blocks.to(bounds.device)
    cells = (offsets // unit).to(bounds.device)
    bounds[target_blocks, :, cells] = codes.to(bounds.device)
    scales[target_blocks, :, cells] = unit_scales.to(scales.device)


# -- the cache's placement


def place_lru_reference(block_ids: torch.Tensor, slots: torch.Tensor, slot_of: torch.Tensor,
                        block_of: torch.Tensor, last_used: torch.Tensor, ticks: torch.Tensor,
                        fetch_units: torch.Tensor, fetch_slots: torch.Tensor,
                        num_fetch: torch.Tensor, counters: torch.Tensor, seq_lens: torch.Tensor,
                        context_lens: torch.Tensor, *, capacity: int) -> None:
    """One layer's selection placed in its cache, least recently used slots evicted
    (``place_lru``; like the kernel, it reads nothing back to the host).

    Args:
        block_ids: [S, H, W] selected block ids, -1 padded; a block repeated across
            rows (shared prefixes) is placed by its first entry, its copies hits.
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
    hit, miss = wanted & (cached >= 0), first_of_equals(ids) & (cached < 0)
    shared = wanted & (cached < 0) & ~miss  # a later copy of a miss: the first's slot
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
    old_entry = old.clamp(min=0) * num_heads + heads
    # Only where the old block's map names the victim (else the slot is a stale copy).
    names_victim = slot_of[old_entry].to(torch.int64) == victim
    unmap = torch.where(miss & (old >= 0) & names_victim, old_entry, scratch_entry)
    slot_of.index_fill_(0, unmap.flatten(), -1)
    mapped = torch.where(miss, entries, scratch_entry)
    slot_of.index_put_((mapped.flatten(),), victim.to(torch.int32).flatten())
    slot_of[scratch_entry] = -1
    block_of.scatter_(1, victim, torch.where(miss, ids, -1))
    last_used.scatter_(1, victim, tick.expand(-1, per_head))
    flat = heads * capacity
    placed = torch.where(hit, flat + cached, torch.where(miss, flat + victim, -1))
    placed = torch.where(shared, flat + slot_of[entries].to(torch.int64), placed)
    slots.copy_(placed.view(num_heads, num_rows, width).permute(1, 0, 2))
    listed = torch.where(miss, rank, per_head)  # misses to their rank, the rest to scratch
    for out, value in ((fetch_units, entries), (fetch_slots, flat + victim)):
        padded = torch.full((num_heads, per_head + 1), -1, dtype=torch.int64, device=device)
        out.copy_(padded.scatter_(1, listed, torch.where(miss, value, -1))[:, :per_head])
    num_fetch.copy_(num_miss)
    attended = (seq_lens.view(num_rows, num_heads).to(torch.int64) - 1).clamp(min=0).sum(dim=0)
    context = torch.where(heads[:, 0] == 0, context_lens.to(torch.int64).clamp(min=0).sum(), 0)
    counters += torch.stack([attended, context, (hit | shared).sum(dim=1), num_miss], dim=1)


def first_of_equals(ids: torch.Tensor) -> torch.Tensor:
    """[H, M] bool: entries >= 0 that are the first of their value in their row."""
    order = torch.sort(torch.where(ids >= 0, ids, _BIG), dim=1, stable=True)
    values = order.values
    first = (values < _BIG) & (values != torch.cat([values[:, :1] * 0 - 1, values[:, :-1]], 1))
    return torch.zeros_like(first).scatter_(1, order.indices, first)
