# SPDX-License-Identifier: Apache-2.0
"""Worker side: InfiniGen's per-step data path over every layer of one worker.

Data path of one decode step, for a model with L layers and ``dense_layers=2``::

    layer 0   dense (vLLM's kernel and paged cache)
    layer 1   dense; speculates for layer 2 from its attention input
    layer 2   writes its new K/V through to the pool, attends over what
              layer 1 selected, read in place; speculates for layer 3
    ...
    layer L-1 attends over what layer L-2 selected

Sparse layers hold no blocks in vLLM's cache (``spec.py``); their K/V and
partial keys live in ``LayerState`` buffers addressed by the dense group's
block ids. Rows with a context shorter than ``min_context`` attend densely
over the pool; prompt rows attend causally over it. The compiled kernels
(``kernels/``) do the writing, selecting and attending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from vllm.logger import init_logger

from vllm_infinigen import baselines, kernels, policies
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.kernels.reference import entries_of
from vllm_infinigen.layer_state import LayerState
from vllm_infinigen.pool import IdentityPoolIndex, make_pool_index
from vllm_infinigen.step_plan import StepPlan, build_plan
from vllm_infinigen.transfer import make_transfer

logger = init_logger(__name__)


class InfiniGenRuntime:
    """Owns every layer's state and the per-step plan on one worker."""

    def __init__(self, config: InfiniGenConfig, alpha: float, layers: list[LayerState],
                 device: torch.device):
        self.config = config
        self.alpha = alpha
        self.layers = layers
        self.device = device
        # stats: [layers, 2] entries attended and context tokens; each layer's
        # kernels add to its row (``state.stats`` is a view). Tokens are
        # counted as the mean over all KV heads of the model: a tensor-parallel
        # rank adds its heads' share, and vLLM sums the ranks.
        self.stats = torch.zeros((len(layers), 2), dtype=torch.float64)
        for state in layers:
            state.stats = self.stats[state.layer_idx]
        self.total_kv_heads = layers[0].num_kv_heads  # of the model, all ranks
        self.pool_index = IdentityPoolIndex(0)
        self.pool_entry_bytes = 0  # one (layer, head) entry: K and V
        self._admitted_for: object | None = None
        self.reference_layer = ""  # a dense layer: its metadata indexes the pool
        self.rank = 0  # tensor-parallel rank of this worker
        self.block_size = 0  # of the dense group, set with the pool
        self.transfer = make_transfer(config.transfer, device)
        self.swap_wait_us = [0] * len(layers)
        self._plan_source: object | None = None
        self._plan: StepPlan | None = None
        # num_reqs -> [num_reqs] prompt length of each request of the step, in
        # the attention metadata's order (set by the worker; None: every row
        # with one query token and some context is a decode row).
        self.prompt_lens_of: Callable[[int], torch.Tensor] | None = None

    def row_map(self, state: LayerState) -> torch.Tensor | None:
        """[num_blocks, H_kv, block_size] rows of ``state``'s entries in a capped pool."""
        index = self.pool_index
        return index.row_map[state.pool_layer] if index.capped else None

    def allocate_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      num_rows: int, sized_by: str = "") -> None:
        """Allocates every sparse layer's pool and partial keys.

        Args:
            num_blocks: Blocks of the dense group (its block ids address the pool).
            num_rows: Tokens the pool holds per layer and head (``pool_rows``).
            sized_by: The setting that sized the pool, for the log line.
        """
        import psutil

        sparse = [state for state in self.layers if state.sparse]
        num_slots = num_blocks * block_size
        if block_size % baselines.QUEST_PAGE_SIZE:
            raise ValueError(f"InfiniGen needs a block size that is a multiple of "
                             f"{baselines.QUEST_PAGE_SIZE}; got --block-size {block_size}")
        capped = num_rows < num_slots
        num_units = -(-num_rows // block_size) if capped else num_blocks
        pool_bytes = num_units * block_size * sum(s.pool_bytes_per_token(dtype) for s in sparse)
        free_bytes = psutil.virtual_memory().available
        if pool_bytes > 0.9 * free_bytes:
            raise ValueError(
                f"InfiniGen's pool for {num_rows} tokens needs {pool_bytes / 2**30:.2f} GiB "
                f"of host memory, {free_bytes / 2**30:.2f} GiB is free; set "
                "--infinigen-cpu-pool-gib or lower --kv-cache-memory-bytes (uncapped, "
                "the pool holds every token the dense layers' blocks can hold)"
            )
        self.block_size = block_size
        for pool_layer, state in enumerate(sparse):
            state.pool_layer = pool_layer
            state.allocate(num_units, num_blocks, block_size, dtype, self.device)
        self.pool_index = make_pool_index(
            len(sparse), sparse[0].num_kv_heads, num_slots, num_rows,
            self.config.eviction, self.device, block_size=block_size,
        )
        self.pool_entry_bytes = 2 * sparse[0].head_size * dtype.itemsize
        for state in sparse:
            state.ensure_policy_state(self.config.policy)
        logger.info(
            "InfiniGen: pool of %d tokens per sparse layer and KV head (%d layers x %d "
            "KV heads), %s: %.3f GiB host memory, sized by %s; partial keys for %d "
            "tokens: %.3f GiB device memory; transfer %s; CPU kernels for %s",
            num_rows, len(sparse), sparse[0].num_kv_heads,
            f"capped below the dense group's {num_slots} slots, {self.config.eviction} "
            f"eviction" if capped else "a row per dense slot (uncapped)",
            pool_bytes / 2**30, sized_by or "the dense group's slots",
            num_slots, num_slots * sum(s.partial_bytes_per_token(dtype) for s in sparse) / 2**30,
            self.transfer.name, kernels.load(),
        )

    def begin_step(self, attn_metadata, slot_mapping: torch.Tensor) -> None:
        """Gives the step's new tokens their pool rows (once per step)."""
        if self._admitted_for is attn_metadata:
            return
        self._admitted_for = attn_metadata
        self.pool_index.admit(slot_mapping.to(torch.int64))

    def release(self, slots: torch.Tensor) -> None:
        """Frees the pool rows of a finished or preempted request's slots."""
        self.pool_index.release(slots)

    def update_selection(self, alpha: float | None = None, **changes) -> None:
        """Changes the selection settings of the running engine (for sweeps).

        Args:
            alpha: New alpha, if given.
            changes: New ``budget``, ``sink_tokens``, ``recent_tokens``,
                ``eviction``, ``policy``, ``eval_dense_prefix`` or ``min_context``.

        Raises:
            ValueError: On other settings or bad values, naming the flag.
        """
        allowed = {"budget", "sink_tokens", "recent_tokens", "eviction", "policy",
                   "eval_dense_prefix", "min_context"}
        if set(changes) - allowed:
            raise ValueError(f"only alpha and {sorted(allowed)} can change at run time")
        if alpha is not None:
            changes["alpha"] = alpha
        self.config = dataclasses.replace(self.config, **changes)
        if alpha is not None:
            self.alpha = float(alpha)
        if "eviction" in changes and self.pool_index.capped:
            self.pool_index.policy = self.config.eviction
        self._plan_source = None
        for state in self.layers:
            if state.sparse and state.kv_pool is not None:
                state.ensure_policy_state(self.config.policy)

    def take_counters(self) -> dict[str, float]:
        """Drains the counters (one host copy per step, not per layer)."""
        out: dict[str, float] = {}
        values = self.stats.tolist()
        self.stats.zero_()
        for state, (entries, context) in zip(self.layers, values):
            if state.sparse and context:
                idx = state.layer_idx
                out[f"selected_tokens.{idx}"] = entries / self.total_kv_heads
                out[f"candidate_tokens.{idx}"] = context * state.num_kv_heads / self.total_kv_heads
                out[f"swap_bytes.{idx}"] = entries * self.pool_entry_bytes
                out[f"swap_wait_us.{idx}"] = self.swap_wait_us[idx]
        self.swap_wait_us = [0] * len(self.layers)
        index = self.pool_index
        if index.capped:
            evictions = index.evictions.tolist()
            index.evictions.zero_()
            for state in self.layers:
                if state.sparse and evictions[state.pool_layer]:
                    out[f"evictions.{state.layer_idx}"] = evictions[state.pool_layer]
            # A gauge per rank (summed over ranks by InfiniGenStats.reduce).
            out[f"pool_used_bytes.{self.rank}"] = int(index.occupied().sum()) * self.pool_entry_bytes
            out[f"pool_capacity_bytes.{self.rank}"] = (
                index.num_rows * index.num_heads * index.num_layers * self.pool_entry_bytes)
        return out

    def plan_for(self, attn_metadata, block_size: int) -> StepPlan:
        """The step's rows, from the dense group's metadata (cached per step)."""
        if self._plan_source is not attn_metadata:
            self._plan = build_plan(attn_metadata, self.config, block_size, self.prompt_lens_of)
            self._plan_source = attn_metadata
        return self._plan

    def speculate(self, state: LayerState, plan: StepPlan) -> None:
        """Layer ``state`` selects the tokens of ``state.next`` for the sparse rows."""
        target = state.next
        policies.speculate(state, plan, self.config, self.alpha, self.row_map(target))
        self._start_transfer(target, plan)

    def _start_transfer(self, target: LayerState, plan: StepPlan) -> None:
        """Counts the selection's uses (capped pool) and sends ``target`` its entries."""
        positions = target.selection
        block_table = plan.sparse_rows.block_table
        row_map = self.row_map(target)
        if row_map is not None:
            self.pool_index.record_selection(target.pool_layer, positions, block_table)
        self.transfer.start(target.layer_idx, target.kv_pool, block_table, positions, row_map)

    def attend_decode(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Attention of a sparse layer's selecting rows; query, output: [T, H_q, D]."""
        row_map = self.row_map(state)
        if plan.dense_rows.size:
            rows = plan.dense_rows
            output[rows.tokens] = kernels.attend_decode(
                query[rows.tokens], state.kv_pool, rows.block_table, rows.context_lens, None,
                scale=state.scale, row_map=row_map, stats=state.stats)
        rows = plan.sparse_rows
        if not rows.size:
            return
        if self.config.policy != "infinigen":
            policies.select_in_layer(state, plan, self.config, query)
            self._start_transfer(state, plan)
        positions = state.selection
        if positions is None:
            raise RuntimeError(
                f"InfiniGen: sparse layer {state.layer_idx} has no selection; "
                f"layer {state.layer_idx - 1} did not speculate for it"
            )
        state.selection = None
        tokens = rows.tokens
        probs = None
        if self.config.policy == "h2o":
            probs = torch.empty(positions.shape, dtype=torch.float32)
        staged, waited = self.transfer.wait(state.layer_idx)
        self.swap_wait_us[state.layer_idx] += int(waited * 1e6)
        if staged is None:
            out = kernels.attend_decode(
                query[tokens], state.kv_pool, rows.block_table, rows.context_lens, positions,
                scale=state.scale, row_map=row_map, probs=probs, stats=state.stats)
        else:
            out = self._attend_staged(state, plan, query[tokens], staged, positions, probs)
        output[tokens] = out
        if probs is not None:
            policies.accumulate_h2o(state, plan, positions, probs)

    def _attend_staged(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                       staged: torch.Tensor, positions: torch.Tensor,
                       probs: torch.Tensor | None) -> torch.Tensor:
        """Attention over staged entries [S, H_kv, K, 2D] (``--infinigen-transfer copy``).

        The staging buffer serves as a pool with one block per row: the
        selected entries at offsets 0..K-1, the row's own entry at K.
        """
        rows = plan.sparse_rows
        num_rows, width = positions.shape[0], positions.shape[-1]
        own = rows.context_lens[:, None, None].expand(-1, state.num_kv_heads, 1)
        current = entries_of(state.kv_pool, rows.block_table, own.contiguous(),
                             self.row_map(state))
        staged_pool = torch.cat([staged.to(current.dtype), current], dim=2).contiguous()
        offsets = torch.arange(width, dtype=torch.int32).expand_as(positions)
        staged_positions = torch.where(positions >= 0, offsets, -1).contiguous()
        state.stats += torch.tensor([float((positions >= 0).sum()),
                                     float(rows.context_lens.sum())], dtype=torch.float64)
        return kernels.attend_decode(
            query, staged_pool, torch.arange(num_rows, dtype=torch.int32)[:, None],
            torch.full((num_rows,), width, dtype=torch.int64), staged_positions,
            scale=state.scale, probs=probs)

    def attend_prompt(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Causal attention of the prompt rows over the pool; query, output: [T, H_q, D]."""
        if self.config.policy == "h2o" and state.h2o_accumulated is not None:
            policies.attend_prompt_h2o(state, plan, query, output, self.row_map(state))
            return
        kernels.attend_prefill(query, output, state.kv_pool, plan.all_block_table,
                               plan.query_start, plan.seq_lens, plan.prompt_requests,
                               scale=state.scale, row_map=self.row_map(state))
