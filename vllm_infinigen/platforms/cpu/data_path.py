# SPDX-License-Identifier: Apache-2.0
"""CPU worker: the data path where host and device memory are one.

The pool and the speculation keys are host tensors; the compiled CPU kernels
(``platforms/cpu/kernels/``) write them, select tokens over the speculation
keys (InfiniGen's rule, each sparse layer's ``selector``), and attend over
the selected rows where they lie in the pool (``--infinigen-transfer
in-place``, the default), or over rows staged by a copy worker (``copy``, to
measure what staging costs). A capped pool (``--infinigen-cpu-pool-gib``)
keeps its own index of rows (``pool_index.py``).
"""

from __future__ import annotations

import functools

import torch

from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu import kernels, prefill
from vllm_infinigen.platforms.cpu.huge_pages import zeros_on_huge_pages
from vllm_infinigen.platforms.cpu.pool_index import make_pool_index
from vllm_infinigen.platforms.cpu.transfer import make_transfer
from vllm_infinigen.block_layout import entries_of
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.pool_index import PoolIndex
from vllm_infinigen.worker.step_plan import RowSet, StepPlan

CPU = torch.device("cpu")


class CpuDataPath:
    """``DataPath`` (``worker/data_path.py``) of the CPU platform.

    Args:
        transfer: ``--infinigen-transfer`` (``auto`` is in place).
    """

    plans_on_device = False  # host and device memory are one: the plan reads both
    has_fused_short = True  # ``decode_short``: one compiled op (``kernels.decode_short``)

    def __init__(self, transfer: str) -> None:
        self.transfer = make_transfer(transfer, CPU)
        self._window: dict[str, float] | None = None  # the selection kernels' settings
        self._pages: str | None = None  # the pools' pages, for the log (``huge_pages``)

    def describe(self) -> str:
        pages = "" if self._pages is None else f"; pool on {self._pages}"
        return f"transfer {self.transfer.name}; CPU kernels for {kernels.load()}{pages}"

    def configure(self, config) -> None:
        """Keeps the settings the selection kernels take at each call."""
        self._window = {"alpha": config.alpha, "sink_tokens": config.sink_tokens,
                        "recent_tokens": config.recent_tokens}

    def allocate(self, layer: LayerState, plan: PoolPlan, num_blocks: int,
                 dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        layer.num_blocks = num_blocks
        layer.kv_pool, self._pages = zeros_on_huge_pages(
            (plan.num_units, layer.num_kv_heads, plan.block_size, 2 * layer.head_size),
            kv_dtype)
        layer.selector = functools.partial(self.select, layer)  # tokens, in the kernels
        layer.allocate_speculation_keys(num_blocks, plan.block_size, dtype, CPU)

    def pool_index(self, num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                   eviction: str, *, block_size: int) -> PoolIndex:
        return make_pool_index(num_layers, num_heads, num_slots, num_rows, eviction, CPU,
                               block_size=block_size)

    def select(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
               row_map: torch.Tensor | None) -> torch.Tensor:
        """InfiniGen's rule in tokens for ``layer``'s rows (its ``selector``):
        [S, H_kv, W] int32 positions, -1 padded.

        Args:
            query: [S, H_kv, G, R] (``policies.infinigen.skewed``): every
                channel for the bounds and int keys, the skewed partial
                query otherwise.
        """
        if self._window is None:
            raise RuntimeError("CpuDataPath.configure was not called")
        if layer.bound_keys or layer.int_keys:
            # Encoded from the pool, which holds K / k_scale (FP8).
            scale = layer.scale * layer.kv_scales()["key_scale"]
        if layer.bound_keys:
            selection, _ = kernels.select_bounds(
                query.float().contiguous(), layer.bounds, layer.bound_scales, layer.kv_pool,
                rows.block_table, rows.context_lens, rows.token_caps, scale=scale,
                row_map=row_map, **self._window)
        elif layer.int_keys:
            selection, _ = kernels.select_tokens_int(
                query.float().contiguous(), layer.key_codes, layer.key_scales, layer.kv_pool,
                rows.block_table, rows.context_lens, rows.token_caps, scale=scale,
                row_map=row_map, **self._window)
        else:
            selection, _ = kernels.select_tokens(
                query, layer.partial_keys, rows.block_table, rows.context_lens,
                rows.token_caps, scale=layer.scale, row_map=row_map, **self._window)
        return selection

    def write(self, layer: LayerState, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, row_map: torch.Tensor | None,
              closes_group: bool = True) -> None:
        # Host and device memory are one: the bounds and int keys are
        # encoded from the pool, so the write-through comes first.
        kernels.write_pool(layer.kv_pool, key, value, slots, row_map, **layer.kv_scales())
        if layer.bound_keys:
            if closes_group:  # a unit closes only where a group does
                kernels.write_bounds(layer.bounds, layer.bound_scales, layer.kv_pool, slots,
                                     row_map)
        elif layer.int_keys:
            if closes_group:
                kernels.write_int_keys(layer.key_codes, layer.key_scales, layer.kv_pool, slots,
                                       row_map)
        else:
            kernels.write_partial_keys(layer.partial_keys, key, layer.skew, slots)

    def start_fetch(self, layer: LayerState, rows: RowSet, positions: torch.Tensor,
                    row_map: torch.Tensor | None) -> None:
        self.transfer.start(layer.layer_idx, layer.kv_pool, rows.block_table, positions,
                            row_map)

    def attend_selected(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                        positions: torch.Tensor, row_map: torch.Tensor | None,
                        probs: torch.Tensor | None,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """(``out``, given where the rows are the step's first, is not written in
        place here: the kernel returns a new tensor, which the runtime copies.)"""
        staged, waited = self.transfer.wait(layer.layer_idx)
        if staged is None:
            out = kernels.attend_decode(
                query, layer.kv_pool, rows.block_table, rows.context_lens, positions,
                scale=layer.scale, row_map=row_map, probs=probs, stats=layer.stats,
                **layer.kv_scales())
        else:
            out = self._attend_staged(layer, rows, query, staged, positions, row_map, probs)
        return out, waited

    def attend_dense(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        return kernels.attend_decode(query, layer.kv_pool, rows.block_table, rows.context_lens,
                                     None, scale=layer.scale, row_map=row_map,
                                     stats=layer.stats, **layer.kv_scales())

    def decode_short(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                     row_map: torch.Tensor | None, out: torch.Tensor) -> None:
        """``write`` and ``attend_dense`` of a short decode-only step in one
        kernel call (``kernels.decode_short``; ``runtime.decode_short``):
        ``rows`` are the step's first rows, their output written into ``out``.

        Args:
            query, out: [T, H_q, D]; key, value: [T, H_kv, D]; slots: [T].
        """
        kernels.decode_short(query, key, value, layer.kv_pool, slots, rows.block_table,
                             rows.context_lens, scale=layer.scale, row_map=row_map,
                             key_codes=layer.key_codes, key_scales=layer.key_scales,
                             partial_keys=layer.partial_keys, skew=layer.skew,
                             stats=layer.stats, out=out, bounds=layer.bounds,
                             bound_scales=layer.bound_scales, **layer.kv_scales())

    def place_prompts(self, layer: LayerState, plan: StepPlan) -> None:
        """Nothing: the prompts attend over the pool in place."""

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> None:
        if prefill.supports(layer.head_size):  # vLLM's kernel
            args = (plan.all_block_table, plan.query_start, plan.seq_lens, plan.prompt_requests)
            if row_map is None:
                prefill.attend(query, output, layer.kv_pool, *args, scale=layer.scale,
                               **layer.kv_scales())
            else:
                prefill.attend_capped(query, output, layer.kv_pool, row_map, *args,
                                      scale=layer.scale, **layer.kv_scales())
            return
        kernels.attend_prefill(query, output, layer.kv_pool, plan.all_block_table,
                               plan.query_start, plan.seq_lens, plan.prompt_requests,
                               scale=layer.scale, row_map=row_map, **layer.kv_scales())

    def release_blocks(self, block_ids: list[int]) -> None:
        """Nothing is kept by block id beside the pool (its index frees the rows)."""

    def add_counts(self, stats: torch.Tensor) -> None:
        """The kernels count into each layer's row of ``stats`` themselves."""

    def take_stats(self, wait: bool = False) -> dict[str, int]:
        return {}

    def shutdown(self) -> None:
        self.transfer.shutdown()

    def _attend_staged(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                       staged: torch.Tensor, positions: torch.Tensor,
                       row_map: torch.Tensor | None,
                       probs: torch.Tensor | None) -> torch.Tensor:
        """Attention over staged entries [S, H_kv, K, 2D] (``--infinigen-transfer copy``).

        The staging buffer serves as a pool with one block per row: the
        selected entries at offsets 0..K-1, the row's own entry at K.
        """
        num_rows, width = positions.shape[0], positions.shape[-1]
        own = rows.context_lens[:, None, None].expand(-1, layer.num_kv_heads, 1)
        current = entries_of(layer.kv_pool, rows.block_table, own.contiguous(), row_map)
        staged_pool = torch.cat([staged.to(current.dtype), current], dim=2).contiguous()
        offsets = torch.arange(width, dtype=torch.int32, device=CPU).expand_as(positions)
        staged_positions = torch.where(positions >= 0, offsets, -1).contiguous()
        layer.stats += torch.tensor([float((positions >= 0).sum()),
                                     float(rows.context_lens.sum())],
                                    dtype=torch.float64, device=CPU)
        return kernels.attend_decode(
            query, staged_pool, torch.arange(num_rows, dtype=torch.int32, device=CPU)[:, None],
            torch.full((num_rows,), width, dtype=torch.int64, device=CPU), staged_positions,
            scale=layer.scale, probs=probs, **layer.kv_scales())
