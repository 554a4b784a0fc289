# SPDX-License-Identifier: Apache-2.0
"""Worker side: the seam between the neutral runtime and a platform's data path.

The runtime (``runtime.py``) decides what a step does: which rows select,
which policy selects, when the next layer's selection is made. A platform's
``DataPath`` decides where the bytes live and how they move::

    plans_on_device whether decode steps are planned without a host read
                    (``step_plan.build_device_plan``; CUDA)
    allocate        a sparse layer's host pool, device speculation keys and
                    ``selector`` (InfiniGen's rule at the platform's granularity)
    pool_index      where each entry lives in the pool (a row per slot, or the
                    platform's capped pool)
    configure       the selection settings, after every layer is allocated
                    and at each change in a running engine
    write           new tokens: the device write (speculation keys, and
                    whatever the platform keeps on the device) and the host
                    write-through of K|V to the pool
    start_fetch     layer i, for layer i+1: the selected entries start towards
                    the attention (CPU: nothing to move)
    attend_selected layer i+1: waits for its own fetch, attends over it
    attend_dense    rows with a short context, over their whole context
    decode_short    a short decode-only step's write and dense attention of a
                    layer; one fused call where ``has_fused_short`` (the CPU's),
                    which the runtime then uses (``runtime.fuses_short``)
    place_prompts   before the write of a step with prompt rows (CUDA: their
                    blocks into the device cache, to be written and read there)
    attend_prompt   prompt rows, causally over the pool and the step's tokens
                    (the pool need not be addressable by the attention kernel)
    release_blocks  a finished or preempted request's block ids (a device
                    cache drops them)
    add_counts      the attended and context tokens the platform counted on
                    its device (CUDA), into the runtime's counters
    take_stats      the platform's own counters (CUDA: the block cache's)

The implementations are ``platforms/cpu/data_path.py`` and
``platforms/cuda/data_path.py``; the runtime does not know which it drives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from vllm_infinigen.memory import PoolPlan
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.pool_index import PoolIndex
    from vllm_infinigen.worker.step_plan import RowSet, StepPlan


class DataPath(Protocol):
    """Where one worker's sparse layers keep their K/V, and how it reaches attention."""

    plans_on_device: bool
    has_fused_short: bool  # whether ``decode_short`` is one fused op

    def describe(self) -> str:
        """A few words for the start-up log (transfer, kernels)."""

    def configure(self, config) -> None:
        """Takes the selection settings (``InfiniGenConfig``): once every sparse
        layer is allocated, and at each change of a running engine.

        Raises:
            ValueError: On a change the platform cannot follow, naming the flag.
        """

    def allocate(self, layer: LayerState, plan: PoolPlan, num_blocks: int,
                 dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Sets ``layer.num_blocks``, ``layer.kv_pool`` [units, H_kv, block_size,
        2 * D] (host) of ``kv_dtype`` (the model's ``dtype``, or FP8 with
        ``--kv-cache-dtype fp8``), the layer's speculation keys (device;
        ``layer_state.py``, of the model's ``dtype``) and its ``selector``."""

    def pool_index(self, num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                   eviction: str, *, block_size: int) -> PoolIndex:
        """The index of the sparse layers' pool rows (``worker/pool_index.py``):
        ``num_rows`` per (layer, KV head) for ``num_slots`` dense slots."""

    def write(self, layer: LayerState, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, row_map: torch.Tensor | None,
              closes_group: bool = True) -> None:
        """New K/V [T, H_kv, D] of ``slots`` [T] int64 (< 0: padding).

        Args:
            closes_group: Whether a slot closes a 16-token group of the int
                keys (``layout.closes_key_group``); False: they encode nothing
                in this step, and need no call.
        """

    def start_fetch(self, layer: LayerState, rows: RowSet, positions: object,
                    row_map: torch.Tensor | None) -> None:
        """Starts moving a selection of ``layer`` towards its attention: positions
        [S, H_kv, W] int32 (-1 padded), or what the layer's ``selector`` made."""

    def attend_selected(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                        positions: torch.Tensor, row_map: torch.Tensor | None,
                        probs: torch.Tensor | None,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """Attention of ``rows`` over their selection and their own entry.

        Args:
            query: [S, H_q, D] the rows' queries.
            positions: [S, H_kv, W] int32 selected positions, -1 padded.
            probs: [S, H_kv, W] float32 to fill with the attention each
                selected entry received (None: not wanted).
            out: [S, H_q, D] to write the output into (rows of a step planned
                on the device), or None.

        Returns:
            ([S, H_q, D] output, seconds waited for the fetch).
        """

    def attend_dense(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        """[S, H_q, D] attention of ``rows`` over their whole context."""

    def decode_short(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                     row_map: torch.Tensor | None, out: torch.Tensor) -> None:
        """``write`` and ``attend_dense`` of a short decode-only step, ``rows``
        being the step's first rows, their output written into ``out``
        (query, out: [T, H_q, D]; key, value: [T, H_kv, D]; slots: [T])."""

    def place_prompts(self, layer: LayerState, plan: StepPlan) -> None:
        """Before ``write`` in a step with prompt rows: whatever keeps their tokens
        where their attention reads them (CUDA: their blocks in the device cache)."""

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> None:
        """Causal attention of the step's prompt rows; query, output: [T, H_q, D]."""

    def release_blocks(self, block_ids: list[int]) -> None:
        """A finished or preempted request's dense block ids, before vLLM reuses
        them: whatever the platform keeps by block id lets go of them."""

    def add_counts(self, stats: torch.Tensor) -> None:
        """Adds what the platform counted on its device to ``stats`` [layers, 2]
        (entries attended besides the rows' own, context tokens), per layer."""

    def take_stats(self, wait: bool = False) -> dict[str, int]:
        """The platform's counters since the last call, keyed ``"<counter>.<layer_idx>"``
        (on a device they may arrive a step late, ``worker/counters.py``;
        ``wait``: all of them now)."""

    def shutdown(self) -> None:
        """Stops whatever the data path runs beside the model."""
