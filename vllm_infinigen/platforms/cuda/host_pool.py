# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the pinned host pool of one sparse layer's K/V.

Layout (as on the CPU build, ``block_layout.py``)::

    kv_pool [units, H_kv, block_size, 2 * D]   a token's K | V side by side

so one KV head's block, the unit the gather moves, is one contiguous run of
``block_size * 2 * D`` elements (8 KiB in bf16 at D = 128, block_size 16).

Pinning: ``cudaHostRegister`` on anonymous memory advised for transparent
huge pages pinned 4 GiB in 0.12 s on an H100 host, where ``pin_memory``
(cudaHostAlloc) took 2.7 s, with the same bandwidth afterwards
(shared/docs/GPU_DATA_PATH.md). If registering fails, the pool falls back
to ``pin_memory`` and says so in the log; so it does where a GPU kernel
cannot read the registered memory (``unreadable_by_kernels``: a one-kernel
probe of its first and last bytes), and a pool no kernel can read is an
error. Without CUDA, allocation refuses.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
import weakref
from dataclasses import dataclass, field

import torch

# vllm_infinigen.* records reach vLLM's logger once register() has run
# (vllm_infinigen/__init__.py); the GPU benchmark imports this without vLLM.
logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def pool_shape(num_units: int, num_kv_heads: int, block_size: int,
               head_size: int) -> tuple[int, int, int, int]:
    """[units, H_kv, block_size, 2 * D]: one (unit, head) block is contiguous."""
    return (num_units, num_kv_heads, block_size, 2 * head_size)


def huge_page_buffer(num_bytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous memory advised for huge pages, as a [num_bytes] uint8 tensor
    starting on a 2 MiB boundary (the mapping stays alive with the tensor)."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE)
    address = _address_of(mapping)
    offset = -address % HUGE_PAGE
    length = (num_bytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = min(length, len(mapping) - offset)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=offset)
    return mapping, buffer


def _address_of(mapping: mmap.mmap) -> int:
    import ctypes

    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # release the export, so that frombuffer owns the only one
    return address


@dataclass
class HostPool:
    """A pinned pool and how it was pinned. Keep it alive while ``tensor`` is
    used: ``close()`` (or collecting it) unregisters the memory."""

    tensor: torch.Tensor  # [units, H_kv, block_size, 2 * D]
    pinned_by: str  # "cudaHostRegister" or "pin_memory"
    seconds: float  # to allocate and pin
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def allocate_host_pool(num_units: int, num_kv_heads: int, block_size: int, head_size: int,
                       dtype: torch.dtype, *, register: bool = True) -> HostPool:
    """A pinned host pool readable by GPU kernels through its UVA pointer.

    Args:
        register: Try ``cudaHostRegister`` on huge-page memory first (False:
            ``pin_memory`` directly).

    Raises:
        RuntimeError: Without CUDA (the CPU build keeps its pool in
            ``platforms/cpu``).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the pinned host pool needs CUDA (torch.cuda.is_available() is "
                           "False); the CPU build allocates its pool in platforms/cpu")
    shape = pool_shape(num_units, num_kv_heads, block_size, head_size)
    num_bytes = math.prod(shape) * dtype.itemsize
    start = time.perf_counter()
    if register:
        try:
            pool = _registered_pool(shape, dtype, num_bytes)
        except (RuntimeError, OSError, ValueError) as error:
            logger.info("InfiniGen: cudaHostRegister of a %.2f GiB pool failed (%s); "
                        "pinning with pin_memory instead (slower to allocate)",
                        num_bytes / 2**30, error)
        else:
            problem = unreadable_by_kernels(pool.tensor)
            if problem is None:
                pool.seconds = time.perf_counter() - start
                return pool
            pool.close()
            del pool  # its pages (all resident once registered) go before pin_memory's
            logger.warning("InfiniGen: a %.2f GiB pool registered with cudaHostRegister is "
                           "not readable by the GPU's kernels (%s); pinning with pin_memory "
                           "instead (slower to allocate)", num_bytes / 2**30, problem)
    tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
    problem = unreadable_by_kernels(tensor)
    if problem is not None:
        raise RuntimeError(f"InfiniGen: the pinned host pool ({num_bytes / 2**30:.2f} GiB, "
                           f"pin_memory) is not readable by the GPU's kernels: {problem}")
    return HostPool(tensor, "pin_memory", time.perf_counter() - start)


def unreadable_by_kernels(tensor: torch.Tensor) -> str | None:
    """None when a GPU kernel reads ``tensor``'s first and last bytes as they
    are in host memory (its pointer resolves to a device address); else why not."""
    from vllm_infinigen.platforms.cuda import kernels

    flat = tensor.view(-1).view(torch.uint8)
    ends = torch.tensor([0, flat.numel() - 1], dtype=torch.int64)
    flat[ends] = torch.tensor([0x5A, 0xA5], dtype=torch.uint8)
    try:
        got = kernels.read_bytes(flat, ends.to("cuda")).cpu()
    except (ValueError, RuntimeError) as error:
        return str(error)
    if got.tolist() != [0x5A, 0xA5]:
        return f"a kernel read {got.tolist()} where the host wrote [90, 165]"
    return None


def _registered_pool(shape: tuple[int, ...], dtype: torch.dtype, num_bytes: int) -> HostPool:
    mapping, buffer = huge_page_buffer(num_bytes)
    address = buffer.data_ptr()
    cudart = torch.cuda.cudart()
    status = int(cudart.cudaHostRegister(address, num_bytes, _REGISTER_FLAGS))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister returned error {status}")
    tensor = buffer.view(dtype).view(shape)
    finalizer = weakref.finalize(tensor, _unregister, address, mapping)
    return HostPool(tensor, "cudaHostRegister", 0.0, finalizer)


def _unregister(address: int, mapping: mmap.mmap) -> None:
    """Unpins (the mapping is unmapped when the last tensor over it is gone)."""
    del mapping
    torch.cuda.cudart().cudaHostUnregister(address)
