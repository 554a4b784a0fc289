# SPDX-License-Identifier: Apache-2.0
"""Moving the selected KV entries from the pool to the attention (worker side).

Layer i selects for layer i+1 and starts the transfer at once; layer i+1 waits
for its own transfer only, just before its attention::

    layer i    | select(i+1) | start(i+1) -> copy worker / side stream ...
               | attention(i), MLP(i)          ... gather + copy into buffer[(i+1) % 2]
    layer i+1  | select(i+2) | start(i+2)  | wait(i+1) | attention(i+1) over buffer[(i+1) % 2]

Two staging buffers shared by all layers (double buffering): the transfer for
layer i+2 fills the buffer that layer i has finished with.

On the CPU platform host and device memory are one: a copy only adds work,
because attention can read the selected entries where they are. ``InPlace``
does that (the default on CPU); ``Copy`` stages them as the device path would
and is kept selectable so that the overhead can be measured.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_infinigen.sparse_attention import gather_selected


class InPlaceTransfer:
    """Attention reads the selected entries from the pool itself (CPU)."""

    name = "in-place"

    def __init__(self) -> None:
        self._pending: dict[int, tuple] = {}

    def start(self, layer_idx: int, key_store, value_store, slots) -> None:
        self._pending[layer_idx] = (key_store, value_store, slots)

    def wait(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Returns (keys, values, seconds waited)."""
        return (*gather_selected(*self._pending.pop(layer_idx)), 0.0)

    def shutdown(self) -> None:
        self._pending.clear()


class CopyTransfer:
    """Stages the selected entries in two shared buffers, asynchronously.

    The gather runs on a copy worker thread (torch releases the GIL). With a
    CUDA device the staged entries then go host -> device on a side stream,
    and the waiting layer's stream waits on that transfer's event only.
    """

    name = "copy"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infinigen-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._pending: dict[int, Future] = {}

    def _buffer(self, parity: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = like.shape  # [B, H_kv, K, D]
        buffer = self._buffers[parity]
        if buffer is None or buffer[0].numel() < like.numel():
            make = lambda: torch.empty(like.numel(), dtype=like.dtype, device=self._device)
            buffer = (make(), make())
            self._buffers[parity] = buffer
        count = like.numel()
        return buffer[0][:count].view(shape), buffer[1][:count].view(shape)

    def start(self, layer_idx: int, key_store, value_store, slots) -> None:
        def copy():
            keys, values = gather_selected(key_store, value_store, slots.to(key_store.device))
            staged = self._buffer(layer_idx % 2, keys)
            if self._stream is None:
                staged[0].copy_(keys)
                staged[1].copy_(values)
                return staged, None
            with torch.cuda.stream(self._stream):
                staged[0].copy_(keys.pin_memory(), non_blocking=True)
                staged[1].copy_(values.pin_memory(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return staged, event

        self._pending[layer_idx] = self._executor.submit(copy)

    def wait(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Waits for this layer's transfer only; returns (keys, values, seconds)."""
        start = time.perf_counter()
        (keys, values), event = self._pending.pop(layer_idx).result()
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return keys, values, time.perf_counter() - start

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def make_transfer(name: str, device: torch.device):
    """``auto``: in place on CPU (one memory), copies on a device with its own."""
    if name == "auto":
        name = "in-place" if device.type == "cpu" else "copy"
    if name == "in-place":
        if device.type != "cpu":
            raise ValueError("--infinigen-transfer in-place needs the CPU platform")
        return InPlaceTransfer()
    return CopyTransfer(device)
