# SPDX-License-Identifier: Apache-2.0
"""Worker side: how the selected KV entries reach a sparse layer's attention.

Layer i selects for layer i+1 and starts the transfer at once; layer i+1 waits
for its own transfer only, just before its attention::

    layer i    | select(i+1) | start(i+1) -> copy worker / side stream ...
               | attention(i), MLP(i)          ... gather into a staging buffer
    layer i+1  | select(i+2) | start(i+2)  | wait(i+1) | attention(i+1) over it

On the CPU platform host and device memory are one: ``InPlaceTransfer`` (the
default there) moves nothing, the attention kernel reads the selected rows
where they are in the pool. ``CopyTransfer`` stages them as the device path
would (a copy worker thread; on CUDA a side stream and a per-layer event),
kept selectable so that the overhead can be measured.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_infinigen.kernels.reference import entries_of


class InPlaceTransfer:
    """Attention reads the selected entries from the pool itself (CPU)."""

    name = "in-place"

    def start(self, layer_idx: int, kv_pool: torch.Tensor, block_table: torch.Tensor,
              positions: torch.Tensor, row_map: torch.Tensor | None) -> None:
        return None

    def wait(self, layer_idx: int) -> tuple[torch.Tensor | None, float]:
        """(None: read in place, seconds waited)."""
        return None, 0.0

    def shutdown(self) -> None:
        return None


class CopyTransfer:
    """Stages the selected entries in per-layer buffers, asynchronously.

    The gather runs on a copy worker thread (torch releases the GIL). With a
    CUDA device the staged entries then go host -> device on a side stream,
    and the waiting layer's stream waits on that transfer's event only.
    """

    name = "copy"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infinigen-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: dict[int, Future] = {}

    def start(self, layer_idx: int, kv_pool: torch.Tensor, block_table: torch.Tensor,
              positions: torch.Tensor, row_map: torch.Tensor | None) -> None:
        """Gathers ``positions`` [S, H_kv, K] of ``kv_pool`` into [S, H_kv, K, 2D]."""

        def copy():
            staged = entries_of(kv_pool, block_table, positions, row_map)
            if self._stream is None:
                return staged, None
            with torch.cuda.stream(self._stream):
                on_device = staged.pin_memory().to(self._device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return on_device, event

        self._pending[layer_idx] = self._executor.submit(copy)

    def wait(self, layer_idx: int) -> tuple[torch.Tensor, float]:
        """Waits for this layer's transfer only; returns (staged entries, seconds)."""
        start = time.perf_counter()
        staged, event = self._pending.pop(layer_idx).result()
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return staged, time.perf_counter() - start

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
