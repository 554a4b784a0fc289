# SPDX-License-Identifier: Apache-2.0
"""CPU worker: how the selected KV entries reach a sparse layer's attention.

Layer i selects for layer i+1 and starts the transfer at once; layer i+1 waits
for its own transfer only, just before its attention::

    layer i    | select(i+1) | start(i+1) -> copy worker ...
               | attention(i), MLP(i)          ... gather into a staging buffer
    layer i+1  | select(i+2) | start(i+2)  | wait(i+1) | attention(i+1) over it

On the CPU platform host and device memory are one: ``InPlaceTransfer`` (the
default) moves nothing, the attention kernel reads the selected rows where
they are in the pool. ``CopyTransfer`` (``--infinigen-transfer copy``) stages
them as a device with its own memory would, on a copy worker thread, kept
selectable so that the overhead of staging can be measured.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_infinigen.block_layout import entries_of


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

    The gather runs on a copy worker thread (torch releases the GIL); the
    waiting layer waits for its own transfer only.
    """

    name = "copy"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the CPU copy transfer stages in host memory, not on {device}")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infinigen-copy")
        self._pending: dict[int, Future] = {}

    def start(self, layer_idx: int, kv_pool: torch.Tensor, block_table: torch.Tensor,
              positions: torch.Tensor, row_map: torch.Tensor | None) -> None:
        """Gathers ``positions`` [S, H_kv, K] of ``kv_pool`` into [S, H_kv, K, 2D]."""
        self._pending[layer_idx] = self._executor.submit(
            entries_of, kv_pool, block_table, positions, row_map)

    def wait(self, layer_idx: int) -> tuple[torch.Tensor, float]:
        """Waits for this layer's transfer only; returns (staged entries, seconds)."""
        start = time.perf_counter()
        staged = self._pending.pop(layer_idx).result()
        return staged, time.perf_counter() - start

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def make_transfer(name: str, device: torch.device):
    """``auto``: in place (host and device memory are one on the CPU platform)."""
    if device.type != "cpu":
        raise ValueError(f"--infinigen-transfer {name}: the CPU platform's transfers "
                         f"run on the CPU, not on {device}")
    if name in ("auto", "in-place"):
        return InPlaceTransfer()
    return CopyTransfer(device)
