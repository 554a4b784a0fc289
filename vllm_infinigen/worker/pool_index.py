# SPDX-License-Identifier: Apache-2.0
"""Worker side: where each KV entry of the sparse layers lives in the host pool.

Uncapped, the pool has a row for every slot of the dense layers' KV-cache
group and a token's row is its slot id (``IdentityPoolIndex``): vLLM's
allocator admits, preempts and frees pool space with the dense blocks. A
platform that caps its pool (``--infinigen-cpu-pool-gib``: the CPU build,
``platforms/cpu/pool_index.py``) gives the runtime its own ``PoolIndex``
through its data path (``DataPath.pool_index``).
"""

from __future__ import annotations

from typing import Protocol

import torch


class PoolIndex(Protocol):
    """Where each (sparse layer, KV head) keeps a slot's K/V entry in the pool.

    Every row-addressing call takes the sparse layer's index among the sparse
    layers (``LayerState.pool_layer``); slots are the dense group's slot ids.
    """

    num_rows: int  # rows per (layer, KV head)

    def row_map_of(self, layer: int) -> torch.Tensor | None:
        """[num_blocks, H, block_size] int32 rows of ``layer``'s entries (-1:
        evicted) for the kernels; None when a slot's row is the slot id."""

    def admit(self, slots: torch.Tensor) -> None:
        """Gives the step's new slots [n] (< 0 ignored) their rows."""

    def release(self, slots: torch.Tensor) -> None:
        """Frees the rows of ``slots`` [n] (< 0 ignored)."""

    def release_blocks(self, block_ids: list[int]) -> None:
        """Frees the rows of a finished or preempted request's blocks."""

    def retire_blocks(self, block_ids: list[int]) -> None:
        """With prefix caching, instead of ``release_blocks``: keeps the rows of
        blocks no live request holds (vLLM keeps their K/V for a hit), first to go."""

    def revive_blocks(self, block_ids: list[int]) -> None:
        """A new request hit these blocks in vLLM's prefix cache: their retired
        rows are held again."""

    def record_selection(self, layer: int, positions: torch.Tensor,
                         block_table: torch.Tensor) -> None:
        """Counts a selection's uses (the eviction policy's input)."""

    def set_eviction(self, policy: str) -> None:
        """Switches the eviction policy (``--infinigen-eviction``)."""

    def take_evictions(self) -> list[int]:
        """Entries evicted per layer since the last call (empty: never evicts)."""

    def occupancy(self) -> tuple[int, int] | None:
        """(entries held, entries of capacity) summed over layers and heads;
        None when the scheduler's block count says it (a row per slot)."""


class IdentityPoolIndex:
    """Row of a slot's entry = the slot id (uncapped pool); nothing to track."""

    def __init__(self, num_slots: int) -> None:
        self.num_rows = num_slots

    def row_map_of(self, layer: int) -> None:
        return None

    def rows(self, layer: int, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` in the KV heads ``heads`` (broadcast together).

        Padding slots (< 0) map to the padding row ``num_rows``.
        """
        slots = torch.where(slots < 0, self.num_rows, slots)
        return slots + torch.zeros_like(heads)

    def admit(self, slots: torch.Tensor) -> None:
        return None

    def release(self, slots: torch.Tensor) -> None:
        return None

    def release_blocks(self, block_ids: list[int]) -> None:
        return None

    def retire_blocks(self, block_ids: list[int]) -> None:
        return None

    def revive_blocks(self, block_ids: list[int]) -> None:
        return None

    def record_selection(self, layer: int, positions: torch.Tensor,
                         block_table: torch.Tensor) -> None:
        return None

    def set_eviction(self, policy: str) -> None:
        return None

    def take_evictions(self) -> list[int]:
        return []

    def occupancy(self) -> None:
        return None
