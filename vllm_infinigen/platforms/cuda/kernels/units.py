# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the wrappers of the ops on pool units (gather, writes).

    gather_units        the missing blocks of a layer, host pool -> device cache
                        slots: one Triton kernel reading the pinned pool through
                        its UVA pointer, on a grid of 32-64 CTAs (with a full grid
                        the gather stalls the compute beside it; confined, it
                        still reaches 49-50 GB/s on an H100, GPU_DATA_PATH.md),
                        one fetch list per KV head, counts on the device
                        (bytes: FP8 units move as they are)
    write_tokens        the write-through of new K|V into the pinned pool and
                        into the cached copies of their blocks: one launch
    write_cached_tokens the cached copies alone (the same kernel without the pool)
    write_partial_keys  the skewed partial keys of new keys (torch on every
                        device: a matrix product and a scatter)
    encode_groups       the int keys of the groups new tokens close, from the pool
    encode_bounds       the bounds of the units new tokens close, from the pool
    read_bytes          a kernel's read of pinned host memory (``host_pool``'s check)

A call on CUDA tensors launches the Triton kernel (``triton_units.py``,
``triton_bounds.py``, imported then); on any other device it runs the torch
reference (``reference.py``), so the CPU build never touches CUDA or Triton.
Nothing here synchronises with the host. The attention over units is in
``attention.py``.

The device-side buffers of the partial keys carry one scratch block past
``num_blocks`` (``with_scratch_block``): padding tokens (slot < 0) write
there, so the device writes need no data-dependent shape and no host sync.
"""

from __future__ import annotations

import torch

from vllm_infinigen.platforms.cuda.kernels import reference

# The gather's grid: 32-64 CTAs on a lower-priority stream (GPU_DATA_PATH.md).
MIN_GATHER_CTAS, MAX_GATHER_CTAS = 32, 64
_MAX_CHUNK_WORDS = 2048  # 8 KiB per row of the copy tile
_GATHER_UNITS_PER_STEP = 2  # units in flight per CTA and loop step


def num_sms(device: torch.device) -> int | None:
    """The device's SMs (None off CUDA): the grids of the gather and the attention."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def gather_ctas(num_sms: int | None) -> int:
    """CTAs of the gather grid: half the SMs, within 32..64."""
    if num_sms is None:
        return MIN_GATHER_CTAS
    return max(MIN_GATHER_CTAS, min(MAX_GATHER_CTAS, num_sms // 2))


def unit_words(block_size: int, head_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(32-bit words per unit, words per copy chunk: the largest power of two
    dividing the unit, at most 2048).

    Raises:
        ValueError: If a unit is not a whole number of 32-bit words.
    """
    unit_bytes = block_size * 2 * head_size * dtype.itemsize
    if unit_bytes % 4:
        raise ValueError(f"a block of {unit_bytes} bytes is not a whole number of 32-bit words")
    words = unit_bytes // 4
    return words, min(words & -words, _MAX_CHUNK_WORDS)


# -- gather


def gather_units(pool: torch.Tensor, cache: torch.Tensor, fetch_units: torch.Tensor,
                 fetch_slots: torch.Tensor, num_fetch: torch.Tensor, *,
                 num_ctas: int | None = None) -> None:
    """Copies the listed pool units into cache slots, on the current stream.

    Args:
        pool: [units, H_kv, block_size, 2 * D] one layer's host pool (pinned,
            for the kernel) or any tensor of that shape; unit u is
            ``pool.view(-1, block_size, 2 * D)[u]``, i.e. block u // H_kv, head u % H_kv.
        cache: [N, block_size, 2 * D] device units (a cache, a staging
            buffer), the last one scratch.
        fetch_units, fetch_slots: [L, M] (or [M]) int64 lists (``CacheLookup``):
            the first ``num_fetch[l]`` of list l are copied, pool unit -> cache slot.
        num_fetch: [L] int64 on the cache's device.
        num_ctas: Grid size (default ``gather_ctas`` of the device).
    """
    if cache.is_cuda:
        from vllm_infinigen.platforms.cuda.kernels import triton_units

        block_size, width = cache.shape[1], cache.shape[2]
        words, chunk = unit_words(block_size, width // 2, cache.dtype)
        triton_units.gather_units(
            pool.view(torch.int32), cache.view(torch.int32), fetch_units, fetch_slots, num_fetch,
            num_ctas=num_ctas or gather_ctas(num_sms(cache.device)), unit_words=words,
            chunk_words=chunk, per_step=_GATHER_UNITS_PER_STEP)
        return
    reference.gather_units_reference(pool, cache, fetch_units, fetch_slots, num_fetch)


# -- the writes of a step's new tokens


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


def write_tokens(pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, units: torch.Tensor | None = None,
                 slot_of: torch.Tensor | None = None, slots_per_head: int = 0, *,
                 key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """The write-through of new K|V into an uncapped pool and, given a cache,
    into the cached copies of their blocks, on the current stream.

    On CUDA one Triton kernel stores through the pinned pool's UVA pointer
    (no host sync; a later gather on another stream is ordered after it by
    ``CudaDataPath.fetch_blocks``' wait on this stream); elsewhere
    ``reference.write_pool`` and ``reference.write_cached_tokens``.

    Args:
        pool: [num_blocks, H_kv, block_size, 2 * D] (unit = block id).
        key, value: [T, H_kv, D] (unit strides within a token).
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        units: [H_kv * slots_per_head + 1, block_size, 2 * D] a layer's
            cache (the last unit scratch), or None.
        slot_of: [num_blocks * H_kv + 1] int32 its slot of each (block, head).
        key_scale, value_scale: An FP8 pool's: it holds K / key_scale and V /
            value_scale, rounded to nearest and saturating (``reference.pool_rows``).
    """
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    if not key.is_cuda:
        reference.write_pool(pool, key, value, slot_mapping, **scales)
        if units is not None:
            cached = reference.cached_token_slots(slot_of, slot_mapping, pool.shape[2],
                                                  pool.shape[1], slots_per_head)
            reference.write_cached_tokens(units, cached, slot_mapping, key, value, **scales)
        return
    from vllm_infinigen.platforms.cuda.kernels import triton_units

    triton_units.write_tokens(pool, units, slot_of, key, value,
                              slot_mapping.to(key.device, torch.int64), capacity=slots_per_head,
                              **scales)


def write_cached_tokens(units: torch.Tensor, slot_of: torch.Tensor, slots_per_head: int,
                        key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
                        key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """The new K|V into the cached copies of their blocks alone (the pool written
    before, by ``write_tokens`` without a cache), on the current stream: the
    same bytes as the pool's (arguments: ``write_tokens``'). One launch on
    CUDA (``triton_units.write_tokens`` without the pool); elsewhere
    ``reference.write_cached_tokens``."""
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    if not key.is_cuda:
        cached = reference.cached_token_slots(slot_of, slot_mapping, units.shape[1],
                                              key.shape[1], slots_per_head)
        reference.write_cached_tokens(units, cached, slot_mapping, key, value, **scales)
        return
    from vllm_infinigen.platforms.cuda.kernels import triton_units

    triton_units.write_tokens(None, units, slot_of, key, value,
                              slot_mapping.to(key.device, torch.int64),
                              capacity=slots_per_head, **scales)


def encode_groups(codes: torch.Tensor, scales: torch.Tensor, pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """The int speculation keys of every 16-token group ``slot_mapping`` closes,
    read from the pool after ``write_tokens`` of the same tokens (same stream).

    On CUDA one Triton kernel reads the groups through the pinned pool's UVA
    pointer and writes codes and scales on the device; elsewhere
    ``reference.write_int_keys``. Byte for byte the CPU kernels' encoding.

    Args:
        codes: [num_blocks, H_kv, block_size / 16, D, 2 * bits] uint8.
        scales: [num_blocks, H_kv, block_size / 16, D] float16.
        pool: [num_blocks, H_kv, block_size, 2 * D].
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    if not codes.is_cuda:
        reference.write_int_keys(codes, scales, pool, slot_mapping)
        return
    from vllm_infinigen.platforms.cuda.kernels import triton_units

    triton_units.encode_groups(pool, codes, scales, slot_mapping.to(codes.device, torch.int64))


def encode_bounds(bounds: torch.Tensor, scales: torch.Tensor, pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """The bound speculation keys of every unit ``slot_mapping`` closes, read from
    the pool after ``write_tokens`` of the same tokens (same stream).

    On CUDA one Triton kernel reads the units through the pinned pool's UVA
    pointer and writes codes and scales on the device; elsewhere
    ``reference.write_bounds``. Byte for byte the CPU kernels' encoding.

    Args:
        bounds: [num_blocks, H_kv, block_size / U, 2, D * bits / 8] uint8.
        scales: [num_blocks, H_kv, block_size / U] float16.
        pool: [num_blocks, H_kv, block_size, 2 * D].
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    if not bounds.is_cuda:
        reference.write_bounds(bounds, scales, pool, slot_mapping)
        return
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    triton_bounds.encode_bounds(pool, bounds, scales, slot_mapping.to(bounds.device, torch.int64),
                                unit=pool.shape[2] // bounds.shape[2])


def read_bytes(source_bytes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``source_bytes[offsets]`` (uint8; offsets a power of two of int64 on the
    GPU) read by a kernel: whether the GPU addresses ``source_bytes`` (pinned
    host memory, ``host_pool.unreadable_by_kernels``). CUDA only; Triton's
    launcher raises ValueError where the GPU cannot address it."""
    from vllm_infinigen.platforms.cuda.kernels import triton_units

    return triton_units.read_bytes(source_bytes, offsets)
