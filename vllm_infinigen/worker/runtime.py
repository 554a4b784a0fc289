# SPDX-License-Identifier: Apache-2.0
"""Worker side: InfiniGen's per-step data path over every layer of one worker.

Data path of one decode step, for a model with L layers and ``dense_layers=2``::

    layer 0   dense (vLLM's kernel and paged cache)
    layer 1   dense; speculates for layer 2 from its attention input
    layer 2   writes its new K/V through to the pool, attends over what
              layer 1 selected, read in place; speculates for layer 3
    ...
    layer L-1 attends over what layer L-2 selected

Sparse layers hold no blocks in vLLM's cache (``scheduler/spec.py``); their K/V and
speculation keys live in ``LayerState`` buffers addressed by the dense group's
block ids. In models with sliding-window layers beside full-attention ones
(Gemma 3, ``layout.window_layers``) the windowed layers are left to vLLM and the
split above runs over the full-attention layers alone: layer i is then the i-th
full-attention layer, and it speculates for the next one from its own attention
input. Rows with a context shorter than ``min_context`` attend densely over the
pool; prompt rows attend causally over it. Where the bytes live and how they
move, and the selecting, is the platform's ``DataPath`` (``data_path.py``; the
CPU's kernels in ``platforms/cpu/kernels/``, CUDA's in ``platforms/cuda/kernels/``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from vllm_infinigen.logs import init_logger

from vllm_infinigen.config import InfiniGenConfig, runtime_settings
from vllm_infinigen.layout import ModelLayout, closes_key_group
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.policies import check_block_size, policy_class
from vllm_infinigen.policies.base import UsedPolicies
from vllm_infinigen.worker.counters import CounterDrain, layer_counters, pool_counters
from vllm_infinigen.worker.data_path import DataPath
from vllm_infinigen.worker.layer_state import LayerSource, LayerState
from vllm_infinigen.worker.pool_index import IdentityPoolIndex, PoolIndex
from vllm_infinigen.worker.step_plan import StepPlan, build_plan

logger = init_logger(__name__)

# num_reqs -> [num_reqs] prompt length of each request of a step, in the
# attention metadata's order.
PromptLengths = Callable[[int], torch.Tensor]


class InfiniGenRuntime:
    """Owns every layer's state, the pool index and the per-step plan on one
    worker; a short decode-only step in one call per layer (``fuses_short``).

    Args:
        config: The engine's settings with ``alpha`` resolved for the model.
        sources: Every attention layer of the model, in order (the first
            full-attention layer is dense: its metadata indexes the pool).
        device: Where the speculation keys live (the platform's device).
        data_path: The platform's storage and movement of K/V (``data_path.py``).
        layout: The model's layout (all ranks: the counters are per model KV
            head), which names the sparse and the windowed layers.
        rank: Tensor-parallel rank of this worker (for the per-rank gauges).
        prompt_lens_of: The step's prompt lengths; None: every row with one
            query token and some context is a decode row.
    """

    def __init__(self, config: InfiniGenConfig, sources: Sequence[LayerSource],
                 device: torch.device, data_path: DataPath, *, layout: ModelLayout,
                 rank: int = 0, prompt_lens_of: PromptLengths | None = None):
        if config.alpha is None:
            raise ValueError("the runtime needs a resolved alpha (InfiniGenConfig.resolved_alpha)")
        self.config = config
        self.device = device
        self.layout = layout
        self.total_kv_heads = layout.num_kv_heads
        self.rank = rank
        self.prompt_lens_of = prompt_lens_of
        # The first dense full-attention layer: its group's metadata and slots
        # (block ids) are the step's rows and the pool's addresses.
        self.reference_layer = next(source.name for source in sources
                                    if source.index == layout.full_layers[0])
        # stats: [layers, 2] entries attended and context tokens; each layer's
        # kernels add to its row (``state.stats`` is a view). Tokens are
        # counted as the mean over all KV heads of the model: a tensor-parallel
        # rank adds its heads' share, and vLLM sums the ranks.
        self.stats = torch.zeros((len(sources), 2), dtype=torch.float64, device=device)
        self._stats_drain = CounterDrain()
        self.layers = self._layer_states(sources)
        self.pool_index: PoolIndex = IdentityPoolIndex(0)
        self.pool_entry_bytes = 0  # one (layer, head) entry: K and V
        self.block_size = 0  # tokens per block of the dense group, once allocated
        self.data_path = data_path
        self.fetch_wait_us = [0] * len(sources)
        # --infinigen-residency device-first: whether the sparse layers are in
        # vLLM's device blocks this step (the connector's metadata sets it,
        # ``set_resident``); ``on_move`` runs at each change, given the new one
        # (the CUDA worker swaps its full CUDA graphs there).
        self.resident = config.device_first
        self.on_move: list[Callable[[bool], None]] = []
        self._drain_in_full = False  # back in the device blocks: the pool's last counts
        # Every policy used so far keeps its state current; ``policy`` selects.
        self.policies = UsedPolicies(policy_class)
        self.policy = self.policies.get(config.policy)
        self._admitted_for: object | None = None
        # (slot tensor, whether it closes an int-key group): checked once a step.
        self._closing: tuple[torch.Tensor, bool] | None = None
        self._plan_source: object | None = None
        self._plan: StepPlan | None = None
        self.plan_on_host = False  # a prompt row vLLM calls a decode (``cuda/worker.py``)

    def _layer_states(self, sources: Sequence[LayerSource]) -> list[LayerState]:
        """Layer states, built last first: the full-attention layer before a
        sparse one speculates for it; windowed layers take no part."""
        sparse_layers = self.layout.sparse_layers
        windowed = set(self.layout.window_layers)
        states: list[LayerState] = []
        next_full: LayerState | None = None  # the next full-attention layer
        for source in reversed(sources):
            sparse = source.index in sparse_layers
            full = source.index not in windowed
            after = next_full if full and next_full is not None and next_full.sparse else None
            state = LayerState(
                source.index, source.name, source.attention, source.self_attn, sparse,
                skew=source.skew, query_proj=source.query_proj if sparse else None,
                next=after, windowed=not full,
                pool_layer=sparse_layers.index(source.index) if sparse else -1,
                stats=self.stats[source.index],
                speculation_keys=self.config.speculation_keys)
            states.insert(0, state)
            if full:
                next_full = state
        self._speculator = {state.next.layer_idx: state for state in states
                            if state.next is not None}
        return states

    @property
    def sparse_layers(self) -> list[LayerState]:
        return [state for state in self.layers if state.sparse]

    def row_map(self, state: LayerState) -> torch.Tensor | None:
        """[num_blocks, H_kv, block_size] rows of ``state``'s entries in a capped pool."""
        return self.pool_index.row_map_of(state.pool_layer)

    def allocate_pool(self, plan: PoolPlan, num_blocks: int, dtype: torch.dtype,
                      kv_dtype: torch.dtype | None = None) -> None:
        """Allocates every sparse layer's pool and partial keys, as planned.

        Args:
            plan: The worker's pool (``memory.plan_pool``).
            num_blocks: Blocks of the dense group (its block ids address the pool).
            dtype: The model's (the speculation keys').
            kv_dtype: The pool's elements (``config.kv_dtype``; None: ``dtype``).
        """
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        sparse = self.sparse_layers
        block_size = plan.block_size
        check_block_size(block_size)  # the policies' pages
        kv_heads = sparse[0].num_kv_heads  # of this rank
        self.block_size = block_size
        self.pool_entry_bytes = self.layout.kv_bytes_per_token_layer(kv_dtype.itemsize, 1)
        for state in sparse:
            self.data_path.allocate(state, plan, num_blocks, dtype, kv_dtype)
        self.data_path.configure(self.config)
        self.pool_index = self.data_path.pool_index(
            len(sparse), kv_heads, plan.num_slots, plan.num_rows, self.config.eviction,
            block_size=block_size)
        self.policies.allocate(sparse)
        partial_bytes = (plan.num_slots
                         * self.layout.partial_bytes_per_token(dtype.itemsize, kv_heads))
        logger.info(
            "InfiniGen: pool of %d tokens per sparse layer and KV head (%d layers x %d "
            "KV heads, %s), %s: %.3f GiB host memory, sized by %s; speculation keys for %d "
            "tokens: %.3f GiB device memory; %s",
            plan.num_rows, len(sparse), kv_heads, str(kv_dtype).removeprefix("torch."),
            f"capped below the dense group's {plan.num_slots} slots, {self.config.eviction} "
            f"eviction" if plan.capped else "a row per dense slot (uncapped: never evicts, "
            "--infinigen-eviction unused)",
            plan.num_bytes / 2**30, plan.sized_by, plan.num_slots, partial_bytes / 2**30,
            self.data_path.describe(),
        )

    def shutdown(self) -> None:
        """Stops whatever the data path runs beside the model (a copy worker)."""
        self.data_path.shutdown()

    def release_blocks(self, block_ids: list[int]) -> None:
        """Frees the pool rows of a finished or preempted request's dense blocks
        (and the data path's copies of them)."""
        self.pool_index.release_blocks(block_ids)
        self.data_path.release_blocks(block_ids)

    def update_selection(self, **changes) -> None:
        """Changes the selection settings of the running engine (for sweeps).

        Args:
            changes: New values of the settings declared with ``runtime=True``
                (``config.py``); alpha None: off.

        Raises:
            ValueError: On other settings or bad values, naming the flag.
        """
        allowed = runtime_settings()
        if set(changes) - allowed:
            raise ValueError(f"{sorted(set(changes) - allowed)}: only {sorted(allowed)} can "
                             "change at run time; start the engine with the others' flags")
        config = dataclasses.replace(self.config, **changes)
        config = dataclasses.replace(config, alpha=config.resolved_alpha())  # None: off
        policy = self.policies.get(config.policy)  # first: a refusal changes nothing
        self.data_path.configure(config)
        self.config, self.policy = config, policy
        self.pool_index.set_eviction(self.config.eviction)
        self._plan_source = None

    def take_counters(self, wait: bool = False, full: bool = False) -> dict[str, float]:
        """Drains the counters: one asynchronous copy per step, not per layer,
        read a step later on a GPU (``worker/counters.py``: a read now would
        wait for the step, which vLLM overlaps with preparing the next one;
        ``wait``: every count now); none while resident (no layer selects) but
        those of the steps over the pool before the return, in full (``full``: all)."""
        out: dict[str, float] = {}
        if not self.resident or self._drain_in_full or full:
            wait = wait or self.resident
            self.data_path.add_counts(self.stats)
            out.update(layer_counters(self.layers, self._stats_drain(self.stats, wait=wait),
                                      self.fetch_wait_us, total_kv_heads=self.total_kv_heads,
                                      entry_bytes=self.pool_entry_bytes))
            out.update(self.data_path.take_stats(wait=wait))
            self._drain_in_full = False
        self.fetch_wait_us = [0] * len(self.layers)
        out.update(pool_counters(self.pool_index, self.sparse_layers, rank=self.rank,
                                 entry_bytes=self.pool_entry_bytes))
        return out

    # -- one step, layer by layer (called by the attention impls, ``attention.py``)

    def begin_layer(self, state: LayerState, dense_metadata, slot_mapping: torch.Tensor,
                    block_size: int) -> StepPlan:
        """Before a layer's attention: the step's plan, and the selection this
        layer makes for the next one (policies that select ahead).

        Args:
            dense_metadata: The dense group's attention metadata of the step.
            slot_mapping: The dense group's slot of each new token.
        """
        self.begin_step(dense_metadata, slot_mapping)
        plan = self.plan_for(dense_metadata, block_size)
        ahead = plan.selects and self.policy.selects_ahead(self.config)
        deferred = ahead and self._deferred(plan)
        if state.next is not None and ahead and not deferred:
            self.speculate(state, plan)
        if not (state.next is not None and deferred):
            state.capture(None)
        return plan

    def attend(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
               output: torch.Tensor) -> None:
        """A sparse layer's attention; query, output: [T, H_q, D], output in place."""
        if (self.policy.selects_ahead(self.config) and plan.selects
                and self._deferred(plan)):
            previous = self._speculator[state.layer_idx]
            self.speculate(previous, plan)
            previous.capture(None)
        if plan.has_other_rows:
            self.attend_prompt(state, plan, query, output)
        if plan.num_decodes:
            self.attend_decode(state, plan, query, output)

    def _deferred(self, plan: StepPlan) -> bool:
        """Evaluation mode with prompt rows: they select among this step's own
        tokens, whose partial keys in the next layer do not exist before that
        layer runs: the next layer runs this layer's speculation itself, after
        writing them (same inputs, same result as in decode)."""
        return plan.has_other_rows and self.config.eval_dense_prefix is not None

    def begin_step(self, attn_metadata, slot_mapping: torch.Tensor) -> None:
        """Gives the step's new tokens their pool rows (once per step)."""
        if self._admitted_for is attn_metadata:
            return
        self._admitted_for = attn_metadata
        self._closing = None
        self.pool_index.admit(slot_mapping.to(torch.int64))

    def write(self, state: LayerState, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, attn_metadata=None) -> None:
        """New K/V [T, H_kv, D] of a sparse layer into the pool; slot_mapping [T]; the
        prompt rows placed first (``attn_metadata``: the dense group's)."""
        slots = slot_mapping.to(torch.int64)
        if attn_metadata is not None and not self.resident:
            plan = self.plan_for(attn_metadata, self.block_size)
            if plan.has_other_rows:
                self.data_path.place_prompts(state, plan)
        # Checked once per step: every layer writes the same slot tensor. On a
        # device (or a data path planning there) the check costs a host sync
        # per step: there the data path's encoding kernel finds them itself.
        if self._closing is None or self._closing[0] is not slot_mapping:
            on_host = slots.is_cpu and not self.data_path.plans_on_device
            self._closing = (slot_mapping, not on_host or closes_key_group(slots))
        self.data_path.write(state, key, value, slots, self.row_map(state),
                             closes_group=self._closing[1])
        self.policies.on_write(state, key, slots)

    def plan_for(self, attn_metadata, block_size: int) -> StepPlan:
        """The step's rows, from the dense group's metadata (cached per step)."""
        if self._plan_source is not attn_metadata:
            on_device = self.data_path.plans_on_device and not self.plan_on_host
            self._plan = build_plan(attn_metadata, self.config, block_size, self.prompt_lens_of,
                                    on_device=on_device)
            self._plan_source = attn_metadata
        return self._plan

    def fuses_short(self, attn_metadata) -> bool:
        """Whether each sparse layer runs this step in one call (``decode_short``):
        a short decode-only step (``docs/short_path.md``), the sparse layers in
        the pool, a data path with the fused op and no policy used so far that
        keeps state of the writes (H2O, Quest). One answer for a layer's KV
        update and its forward; attn_metadata: the dense group's."""
        if self.resident or not self.data_path.has_fused_short or self.policies.keep_write_state:
            return False  # (before the plan: a device data path is not asked to plan here)
        return self.plan_for(attn_metadata, self.block_size).short_decode_only

    def decode_short(self, state: LayerState, attn_metadata, slot_mapping: torch.Tensor,
                     query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     output: torch.Tensor) -> None:
        """A sparse layer's ``write`` and dense ``attend_decode`` in one data-path
        call, when ``fuses_short``. Every row decodes one token, so the rows are
        the step's first, in order: the op reads ``query`` [T, H_q, D] and
        writes ``output`` in place; key, value: [T, H_kv, D] the new entries."""
        self.begin_step(attn_metadata, slot_mapping)
        plan = self.plan_for(attn_metadata, self.block_size)
        self.data_path.decode_short(state, plan.dense_rows, query, key, value, slot_mapping,
                                    self.row_map(state), output)

    def set_resident(self, resident: bool) -> None:
        """The step's residency, from the scheduler (``scheduler/spec.py``: to the
        pool when the blocks run short, back once its requests fit or finished);
        at each change ``on_move`` runs, given the new residency."""
        if resident != self.resident:
            self.resident = resident
            self._drain_in_full = resident
            for switch in self.on_move:
                switch(resident)

    def speculates(self, attn_metadata: dict) -> bool:
        """Whether any layer may need its attention input in this step
        (``attn_metadata``: the forward context's, by layer name)."""
        if self.resident:  # every sparse layer attends with vLLM's kernel
            return False
        plan = self.plan_for(attn_metadata[self.reference_layer], self.block_size)
        return not plan.short_decode_only

    def speculate(self, state: LayerState, plan: StepPlan) -> None:
        """Layer ``state`` selects the tokens of ``state.next`` for the sparse rows."""
        target = state.next
        positions = self.policy.select_ahead(state, plan, self.config, self.row_map(target))
        target.offer_selection(positions)
        self._start_transfer(target, plan, positions)

    def _start_transfer(self, target: LayerState, plan: StepPlan,
                        positions: torch.Tensor) -> None:
        """Counts the selection's uses (capped pool) and sends ``target`` its entries."""
        rows = plan.sparse_rows
        self.pool_index.record_selection(target.pool_layer, positions, rows.block_table)
        self.data_path.start_fetch(target, rows, positions, self.row_map(target))

    def attend_decode(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Attention of a sparse layer's selecting rows; query, output: [T, H_q, D]."""
        row_map = self.row_map(state)
        if plan.dense_rows.size:
            rows = plan.dense_rows
            output[rows.tokens] = self.data_path.attend_dense(state, rows, query[rows.tokens],
                                                              row_map)
        rows = plan.sparse_rows
        if not rows.size:
            return
        policy = self.policy
        if not policy.selects_ahead(self.config):
            positions = policy.select(state, plan, query, self.config, row_map)
            state.offer_selection(positions)
            self._start_transfer(state, plan, positions)
        positions = state.take_selection()
        probs = (torch.empty(positions.shape, dtype=torch.float32, device=positions.device)
                 if policy.records_attention else None)
        # Rows planned on the device are the step's first rows: attended in place.
        target = output[rows.tokens] if isinstance(rows.tokens, slice) else None
        out, waited = self.data_path.attend_selected(state, rows, query[rows.tokens], positions,
                                                     row_map, probs, out=target)
        self.fetch_wait_us[state.layer_idx] += int(waited * 1e6)
        if out is not target:
            output[rows.tokens] = out
        if probs is not None:
            policy.on_attend(state, plan, positions, probs)

    def attend_prompt(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Causal attention of the prompt rows over the pool; query, output: [T, H_q, D]."""
        if self.policy.attend_prompt(state, plan, query, output, self.row_map(state)):
            return
        self.data_path.attend_prompt(state, plan, query, output, self.row_map(state))
