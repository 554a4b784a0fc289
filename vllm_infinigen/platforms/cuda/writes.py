# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform (pure torch, any device): the writes of a step's new tokens.

The CPU build writes with its compiled kernels (``platforms/cpu/kernels/csrc/``); these
are the same writes in torch, so that they run on a GPU and on the CPU
in CI, held to the compiled kernels there (``tests/unit/test_cuda_writes.py``)::

    write_partial_keys  device: the skewed partial keys of the new keys
    write_pool          host write-through of K|V into the pool
    write_int_keys      the int speculation keys of each 16-token group that
                        a new token closes, encoded from the pool's keys
    write_bounds        the bound speculation keys of each unit a new token
                        closes, likewise

The device-side buffers carry one scratch block past ``num_blocks``
(``with_scratch_block``): padding tokens (slot < 0) write there, so the
device writes need no data-dependent shape and no host sync.

The write-through and the int-key encoding read and write the host pool with
torch indexing, which on a GPU would wait for the step's K/V to reach the
host: they are the references of ``kernels.store_rows`` and
``kernels.encode_groups``, which on CUDA store and encode through the pinned
pool's UVA pointer on the compute stream (no host sync; the gather stream
waits for the compute stream before each gather: ``platforms/cuda/__init__.py``,
invariant 1), and what runs in their place elsewhere.
"""

from __future__ import annotations

import torch

from vllm_infinigen.layout import KEY_GROUP


def with_scratch_block(shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``shape`` (first dim: block ids) backed by one more
    block, the scratch that padding writes land in (``scratch_of``)."""
    storage = torch.zeros((shape[0] + 1, *shape[1:]), dtype=dtype, device=device)
    return storage[: shape[0]]


def scratch_of(view: torch.Tensor) -> torch.Tensor:
    """The full tensor behind ``with_scratch_block``'s view, scratch block last."""
    return view.as_strided((view.shape[0] + 1, *view.shape[1:]), view.stride(),
                           view.storage_offset())


def _block_coordinates(slots: torch.Tensor, block_size: int,
                       scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of ``slots`` [T]; padding -> (scratch, 0)."""
    valid = slots >= 0
    blocks = torch.where(valid, slots // block_size, scratch)
    return blocks, torch.where(valid, slots % block_size, 0)


def write_partial_keys(partial_keys: torch.Tensor, key: torch.Tensor, skew: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """The skewed partial keys of new keys, in place, on ``partial_keys``' device.

    Args:
        partial_keys: [num_blocks, H_kv, R, block_size] (``with_scratch_block``).
        key: [T, H_kv, D] new keys.
        skew: [H_kv, D, R] float32 skew columns of the layer.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    full = scratch_of(partial_keys)
    block_size = partial_keys.shape[-1]
    slots = slot_mapping.to(full.device, torch.int64)
    blocks, offsets = _block_coordinates(slots, block_size, partial_keys.shape[0])
    # partial: [T, H_kv, R]
    partial = torch.einsum("thd,hdr->thr", key.to(full.device).float(), skew.to(full.device))
    heads = torch.arange(full.shape[1], device=full.device)
    full[blocks[:, None], heads[None, :], :, offsets[:, None]] = partial.to(full.dtype)


def write_pool(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """The host write-through: K|V rows of the new tokens into an uncapped pool.

    Args:
        kv_pool: [num_blocks, H_kv, block_size, 2 * D] (unit = block id).
        key, value: [T, H_kv, D] on any device (copied to the pool's).
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    block_size = kv_pool.shape[2]
    slots = slot_mapping.to(kv_pool.device, torch.int64)
    keep = slots >= 0
    rows = torch.cat([key, value], dim=-1).to(kv_pool.device, kv_pool.dtype)[keep]
    kept = slots[keep]
    kv_pool[kept // block_size, :, kept % block_size] = rows


def encode_groups(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    packed, group_scales = encode_groups(keys, bits)
    target_blocks = blocks.to(codes.device)
    groups = (offsets // KEY_GROUP).to(codes.device)
    codes[target_blocks, :, groups] = packed.to(codes.device)
    scales[target_blocks, :, groups] = group_scales.to(scales.device)


def encode_bounds(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    codes, unit_scales = encode_bounds(keys, bits)
    target_blocks = blocks.to(bounds.device)
    cells = (offsets // unit).to(bounds.device)
    bounds[target_blocks, :, cells] = codes.to(bounds.device)
    scales[target_blocks, :, cells] = unit_scales.to(scales.device)
