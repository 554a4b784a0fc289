# SPDX-License-Identifier: Apache-2.0
"""Worker-side InfiniGen: per-layer state, the pool, speculation and sparse attention.

Data path of one decode step, for a model with L layers and ``dense_layers=2``::

    layer 0   dense (vLLM's kernel and paged cache)
    layer 1   dense; speculates for layer 2 from its attention input
    layer 2   attends over what layer 1 selected, read from the pool;
              speculates for layer 3
    ...
    layer L-1 attends over what layer L-2 selected

Sparse layers hold no blocks in vLLM's cache (see ``spec.py``). Their K/V is
written through to the pool as it is produced, in a simple [row, head, dim]
layout. Tokens are named by their slot ids in the dense layers' KV-cache group
(a dense block exists for every token of every running request, so vLLM's own
allocator, preemption and freeing manage them); ``pool.py`` maps a slot to its
row, one to one when the pool is uncapped, per (layer, head) with eviction
when ``--infinigen-cpu-pool-gib`` caps it. The partial keys sit beside the
pool on the device, by slot. Prefill rows of a sparse layer attend densely
over the pool; decode rows over the selected entries only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from vllm_infinigen import baselines
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.ops import capture_pre_hook
from vllm_infinigen.pool import IdentityPoolIndex, make_pool_index
from vllm_infinigen.selector import Selection, max_selected, select_tokens
from vllm_infinigen.sparse_attention import attend_gathered, slots_of_positions
from vllm_infinigen.spec import InfiniGenSparseSpec
from vllm_infinigen.transfer import make_transfer

logger = init_logger(__name__)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Pool memory: pinned host memory where a CUDA device copies from it."""
    return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


@dataclass
class StepPlan:
    """The decode rows of one step, computed once per step on the host."""

    rows: torch.Tensor  # [B] request index in the batch
    tokens: torch.Tensor  # [B] token index of each decode row
    context_lens: torch.Tensor  # [B] tokens before the current one
    context_host: list[int]  # host copy of context_lens
    block_table: torch.Tensor  # [B, max_blocks]
    context_slots: torch.Tensor  # [B, N] slot of every context position
    num_slots: int  # K of the selections this step
    other_rows: list[int]  # request index of every non-decode row
    query_start: list[int]  # [num_reqs + 1] host copy of query_start_loc
    seq_lens: list[int]  # [num_reqs] host copy
    all_block_table: torch.Tensor  # [num_reqs, max_blocks] dense group

    @property
    def has_other_rows(self) -> bool:
        """Prefill (or chunked-prefill) rows are present."""
        return bool(self.other_rows)

    @property
    def num_decodes(self) -> int:
        return self.rows.shape[0]


class LayerState:
    """InfiniGen state of one attention layer on this worker."""

    def __init__(self, layer_idx: int, layer_name: str, attn: torch.nn.Module,
                 self_attn: torch.nn.Module, sparse: bool):
        self.layer_idx = layer_idx
        self.layer_name = layer_name
        self.sparse = sparse
        self.pool_layer = -1  # index among the sparse layers, in the pool index
        impl = attn.impl
        self.num_heads = impl.num_heads
        self.num_kv_heads = impl.num_kv_heads
        self.head_size = impl.head_size
        self.scale = impl.scale
        self.qkv_proj = getattr(self_attn, "qkv_proj", None)
        self.rotary_emb = getattr(self_attn, "rotary_emb", None)
        self.skew: torch.Tensor | None = None  # [H_kv, D, R]
        self.next: LayerState | None = None  # the sparse layer it speculates for
        self.captured_input: torch.Tensor | None = None  # [T, hidden]
        self.selection: Selection | None = None
        # Pool: [P + 1, H_kv, D] by row; partial keys: [S + 1, H_kv, R] by
        # slot. The last row / slot takes padding.
        self.key_store: torch.Tensor | None = None
        self.value_store: torch.Tensor | None = None
        self.partial_key_cache: torch.Tensor | None = None
        self.heads: torch.Tensor | None = None  # [H_kv] KV head ids
        self.selected_slots: torch.Tensor | None = None  # [B, H_kv, K] of the selection
        # Baseline state, by slot (allocated by ``ensure_policy_state``).
        self.h2o_accumulated: torch.Tensor | None = None  # [S + 1, H_kv]
        self.h2o_alive: torch.Tensor | None = None  # [S + 1, H_kv]
        self.quest_min: torch.Tensor | None = None  # [S / page + 1, H_kv, D]
        self.quest_max: torch.Tensor | None = None

    def allocate(self, num_rows: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """The pool (host) and partial key cache (device) of one sparse layer."""
        shape = (num_rows + 1, self.num_kv_heads, self.head_size)
        self.key_store = host_zeros(shape, dtype)
        self.value_store = host_zeros(shape, dtype)
        rank = self.skew.shape[-1]
        self.partial_key_cache = torch.zeros(
            (num_slots + 1, self.num_kv_heads, rank), dtype=dtype, device=device
        )
        self.heads = torch.arange(self.num_kv_heads, device=device)

    def pool_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_size * dtype.itemsize

    def partial_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_kv_heads * self.skew.shape[-1] * dtype.itemsize

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              index) -> None:
        """Stores new K/V in the rows ``index`` gave them, and partial keys.

        key, value: [T, H_kv, D]; slot_mapping: [T] (< 0: padding).
        """
        slots = slot_mapping.to(torch.int64)
        rows = index.rows(self.pool_layer, slots[:, None], self.heads[None, :])  # [T, H_kv]
        self.key_store[rows, self.heads] = key
        self.value_store[rows, self.heads] = value
        pad_slot = self.partial_key_cache.shape[0] - 1
        slots = torch.where(slots < 0, pad_slot, slots)
        partial = torch.einsum("thd,hdr->thr", key.float(), self.skew)
        self.partial_key_cache[slots] = partial.to(self.partial_key_cache.dtype)
        if self.h2o_accumulated is not None:
            self.h2o_accumulated[slots] = 0
            self.h2o_alive[slots] = True
        if self.quest_min is not None:
            self._update_pages(key, slots)

    def ensure_policy_state(self, policy: str) -> None:
        """Allocates a baseline's per-slot state (from the pool, if it has data)."""
        num_slots = self.partial_key_cache.shape[0]
        device = self.partial_key_cache.device
        if policy == "h2o" and self.h2o_accumulated is None:
            self.h2o_accumulated = torch.zeros((num_slots, self.num_kv_heads),
                                               dtype=torch.float32, device=device)
            self.h2o_alive = torch.ones((num_slots, self.num_kv_heads),
                                        dtype=torch.bool, device=device)
        if policy == "quest" and self.quest_min is None:
            page = baselines.QUEST_PAGE_SIZE
            keys = self.key_store[: (num_slots - 1)].to(device)  # uncapped: row = slot
            pages = keys.view(-1, page, self.num_kv_heads, self.head_size)
            pad = torch.zeros((1, self.num_kv_heads, self.head_size), dtype=keys.dtype,
                              device=device)
            self.quest_min = torch.cat([pages.amin(dim=1), pad])
            self.quest_max = torch.cat([pages.amax(dim=1), pad])

    def _update_pages(self, key: torch.Tensor, slots: torch.Tensor) -> None:
        """Folds new keys into their pages' min/max; a page restarts at its first slot."""
        page_size = baselines.QUEST_PAGE_SIZE
        pages = slots // page_size
        first = pages[slots % page_size == 0]
        self.quest_min[first] = float("inf")
        self.quest_max[first] = float("-inf")
        index = pages[:, None, None].expand_as(key)
        self.quest_min.scatter_reduce_(0, index, key.to(self.quest_min.dtype), "amin")
        self.quest_max.scatter_reduce_(0, index, key.to(self.quest_max.dtype), "amax")


class InfiniGenRuntime:
    """Owns every layer's state and the per-step plan on one worker."""

    def __init__(self, config: InfiniGenConfig, alpha: float, layers: list[LayerState],
                 device: torch.device):
        self.config = config
        self.alpha = alpha
        self.layers = layers
        self.device = device
        # counters: [num_layers, 3] selected / candidate tokens, swap bytes.
        # Tokens are counted as the mean over all KV heads of the model: a
        # tensor-parallel rank adds its heads' share, and vLLM sums the ranks.
        self.counters = torch.zeros((len(layers), 3), dtype=torch.float64, device=device)
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

    def allocate_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      num_rows: int) -> None:
        """Allocates every sparse layer's pool and partial keys.

        Args:
            num_blocks: Blocks of the dense group (its slots name the tokens).
            num_rows: Tokens the pool holds per layer and head (``pool_rows``).
        """
        import psutil

        sparse = [state for state in self.layers if state.sparse]
        num_slots = num_blocks * block_size
        pool_bytes = num_rows * sum(s.pool_bytes_per_token(dtype) for s in sparse)
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
            state.allocate(num_rows, num_slots, dtype, self.device)
        self.pool_index = make_pool_index(
            len(sparse), sparse[0].num_kv_heads, num_slots, num_rows,
            self.config.eviction, self.device,
        )
        self.pool_entry_bytes = 2 * sparse[0].head_size * dtype.itemsize
        if block_size % baselines.QUEST_PAGE_SIZE:
            raise ValueError(f"InfiniGen needs a block size that is a multiple of "
                             f"{baselines.QUEST_PAGE_SIZE}; got --block-size {block_size}")
        for state in sparse:
            state.ensure_policy_state(self.config.policy)
        logger.info(
            "InfiniGen: pool of %d tokens x %d sparse layers (%s): %.3f GiB host "
            "memory; partial keys for %d tokens: %.3f GiB device memory; transfer %s",
            num_rows, len(sparse),
            f"capped, {self.config.eviction} eviction" if self.pool_index.capped
            else "a row per dense slot",
            pool_bytes / 2**30, num_slots,
            num_slots * sum(s.partial_bytes_per_token(dtype) for s in sparse) / 2**30,
            self.transfer.name,
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
                ``eviction``, ``policy`` or ``eval_dense_prefix``.

        Raises:
            ValueError: On other settings or bad values, naming the flag.
        """
        allowed = {"budget", "sink_tokens", "recent_tokens", "eviction", "policy",
                   "eval_dense_prefix"}
        if set(changes) - allowed:
            raise ValueError(f"only alpha and {sorted(allowed)} can change at run time")
        if alpha is not None:
            changes["alpha"] = alpha
        self.config = dataclasses.replace(self.config, **changes)
        if alpha is not None:
            self.alpha = float(alpha)
        if "eviction" in changes and self.pool_index.capped:
            self.pool_index.policy = self.config.eviction
        for state in self.layers:
            if state.sparse and state.key_store is not None:
                state.ensure_policy_state(self.config.policy)

    def take_counters(self) -> dict[str, float]:
        """Drains the counters (one host copy per step, not per layer)."""
        values = self.counters.tolist()
        self.counters.zero_()
        out: dict[str, int] = {}
        for state, (selected, candidate, swap_bytes) in zip(self.layers, values):
            if state.sparse and candidate:
                out[f"selected_tokens.{state.layer_idx}"] = selected
                out[f"candidate_tokens.{state.layer_idx}"] = candidate
                out[f"swap_bytes.{state.layer_idx}"] = swap_bytes
                out[f"swap_wait_us.{state.layer_idx}"] = self.swap_wait_us[state.layer_idx]
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
        return out

    def plan_for(self, attn_metadata, block_size: int) -> StepPlan:
        """The step's decode rows, from the dense group's metadata (cached per step).

        In evaluation mode (``eval_dense_prefix``) every prompt row past the
        dense prefix is a decode row too: its context is the positions before it.
        """
        if self._plan_source is attn_metadata:
            return self._plan
        query_start = attn_metadata.query_start_loc.cpu()
        seq_lens = attn_metadata.seq_lens.cpu()
        num_reqs = seq_lens.shape[0]
        query_lens = query_start[1 : num_reqs + 1] - query_start[:num_reqs]
        # A decode row computes a sampled token: past the prompt. (vLLM's own
        # split counts a one-token prompt chunk as a decode; it is a prompt row.)
        prompt_lens = (torch.ones_like(seq_lens) if self.prompt_lens_of is None
                       else self.prompt_lens_of(num_reqs).to(seq_lens.dtype))
        is_decode = (query_lens == 1) & (seq_lens > prompt_lens)
        rows = torch.nonzero(is_decode).flatten()
        tokens = query_start[rows]
        context_lens = seq_lens[rows] - 1
        prefix = self.config.eval_dense_prefix
        if prefix is not None and not bool(is_decode.all()):
            rows, tokens, context_lens = _with_prompt_rows(
                ~is_decode, query_start, seq_lens, max(prefix, 1))
        context_host = context_lens.tolist()
        max_context = max(context_host, default=1)
        device = self.device
        block_table = attn_metadata.block_table[rows.to(attn_metadata.block_table.device)]
        positions = torch.arange(max_context, device=device).expand(len(rows), max_context)
        num_window = self.config.sink_tokens + self.config.recent_tokens
        self._plan = StepPlan(
            rows=rows.to(device),
            tokens=tokens.to(device=device, dtype=torch.int64),
            context_lens=context_lens.to(device=device, dtype=torch.int64),
            context_host=context_host,
            block_table=block_table,
            context_slots=slots_of_positions(positions, block_table, block_size),
            num_slots=max_selected(context_host, self.config.budget, num_window),
            other_rows=torch.nonzero(~is_decode).flatten().tolist(),
            query_start=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
            all_block_table=attn_metadata.block_table,
        )
        self._plan_source = attn_metadata
        return self._plan

    def speculate(self, state: LayerState, plan: StepPlan) -> None:
        """Layer ``state`` selects the tokens of ``state.next`` for the decode rows."""
        target = state.next
        if state.captured_input is None:
            raise RuntimeError(
                f"InfiniGen: layer {state.layer_idx} has no captured attention "
                "input; the qkv_proj pre-hook did not run"
            )
        hidden = state.captured_input[plan.tokens]  # [B, hidden]
        qkv, _ = target.qkv_proj.forward(hidden)  # not __call__: skip its capture hook
        q_size = target.num_heads * target.head_size
        kv_size = target.num_kv_heads * target.head_size
        query = qkv[:, :q_size]
        if target.rotary_emb is not None:
            key = qkv[:, q_size : q_size + kv_size]
            query, _ = target.rotary_emb(plan.context_lens, query.contiguous(), key.contiguous())
        group = target.num_heads // target.num_kv_heads
        # query: [B, H_kv, G, D] -> partial_query: [B, H_q, R]
        query = query.float().view(-1, target.num_kv_heads, group, target.head_size)
        partial_query = torch.einsum("bhgd,hdr->bhgr", query, target.skew)
        partial_query = partial_query.reshape(query.shape[0], target.num_heads, -1)
        partial_keys = target.partial_key_cache[plan.context_slots]  # [B, N, H_kv, R]
        index = self.pool_index
        present = None
        if index.capped:  # [B, N, H_kv]: entries the pool still holds
            present = index.rows(target.pool_layer, plan.context_slots[..., None],
                                 target.heads) >= 0
        selection = select_tokens(
            partial_query,
            partial_keys,
            plan.context_lens,
            scale=target.scale,
            alpha=self.alpha,
            budget=self.config.budget,
            num_slots=plan.num_slots,
            sink_tokens=self.config.sink_tokens,
            recent_tokens=self.config.recent_tokens,
            present=present,
        )
        self._start_transfer(target, plan, selection)

    def _start_transfer(self, target: LayerState, plan: StepPlan, selection: Selection) -> None:
        """Sends ``target`` its selected entries, from the pool rows that hold them."""
        index = self.pool_index
        target.selection = selection
        slots = slots_of_positions(selection.positions, plan.block_table, self.block_size)
        target.selected_slots = slots
        rows = index.rows(target.pool_layer, slots, target.heads[None, :, None])
        if index.capped:
            rows = torch.where(selection.valid, rows, index.num_rows)  # evicted -> padding
            index.record_use(target.pool_layer, rows, selection.valid)
        self.transfer.start(target.layer_idx, target.key_store, target.value_store, rows)

    def select_in_layer(self, state: LayerState, plan: StepPlan, query: torch.Tensor) -> None:
        """A baseline policy selects for ``state`` from its own state and query."""
        policy = self.config.policy
        budget = self.config.budget
        context_host = plan.context_host
        num_tokens = plan.context_slots.shape[1]
        if policy == "streaming":
            selection = baselines.streaming_select(
                plan.context_lens, budget, state.num_kv_heads, num_tokens,
                max_selected(context_host, budget, 0))
        elif policy == "h2o":
            slots = plan.context_slots  # [B, N]
            selection = baselines.h2o_select(
                state.h2o_accumulated[slots].permute(0, 2, 1),
                state.h2o_alive[slots].permute(0, 2, 1),
                plan.context_lens, budget, max_selected(context_host, budget, 0))
            # Permanent eviction: whatever was not kept is gone for this request.
            kept = torch.zeros((slots.shape[0], state.num_kv_heads, num_tokens),
                               dtype=torch.bool, device=slots.device)
            kept.scatter_(-1, selection.positions, selection.valid)
            in_context = (torch.arange(num_tokens, device=slots.device)[None]
                          < plan.context_lens[:, None])
            heads = state.heads[None, None, :]
            drop = (~kept.permute(0, 2, 1)) & in_context[..., None]
            state.h2o_alive[slots[..., None].expand_as(drop)[drop],
                            heads.expand_as(drop)[drop]] = False
        else:
            page = baselines.QUEST_PAGE_SIZE
            starts = torch.arange(0, num_tokens, page, device=query.device)
            page_ids = plan.context_slots[:, starts] // page  # [B, P]
            page_min, page_max = state.quest_min[page_ids], state.quest_max[page_ids]
            if self.config.eval_dense_prefix is not None and plan.has_other_rows:
                self._quest_bounds_as_in_decode(state, plan, page_min, page_max)
            selection = baselines.quest_select(
                query[plan.tokens], page_min, page_max,
                plan.context_lens, budget, baselines.quest_num_slots(context_host, budget))
        self._start_transfer(state, plan, selection)

    def _quest_bounds_as_in_decode(self, state: LayerState, plan: StepPlan,
                                   page_min: torch.Tensor, page_max: torch.Tensor) -> None:
        """Evaluation mode: each row's last page bounds the keys up to the row only.

        The page bounds hold every key this step wrote, later prompt rows
        included; a decode step at position p bounds positions page_start..p.
        page_min, page_max: [B, P, H_kv, D], changed in place.
        """
        page = baselines.QUEST_PAGE_SIZE
        last = plan.context_lens // page  # [B] page of each row's own position
        positions = last[:, None] * page + torch.arange(page, device=last.device)
        upto = positions <= plan.context_lens[:, None]  # [B, page]
        slots = slots_of_positions(torch.minimum(positions, plan.context_lens[:, None]),
                                   plan.block_table, self.block_size)
        keys = state.key_store[slots].to(page_min.device, page_min.dtype)  # uncapped: row = slot
        hidden = ~upto[..., None, None]
        low = keys.masked_fill(hidden, float("inf")).amin(dim=1)  # [B, H_kv, D]
        high = keys.masked_fill(hidden, float("-inf")).amax(dim=1)
        rows = torch.nonzero(last < page_min.shape[1]).flatten()
        page_min[rows, last[rows]] = low[rows]
        page_max[rows, last[rows]] = high[rows]

    def attend_sparse(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Decode attention of a sparse layer; query: [T, H_q, D]. Returns [B, H_q, D]."""
        if self.config.policy != "infinigen":
            self.select_in_layer(state, plan, query)
        selection = state.selection
        if selection is None:
            raise RuntimeError(
                f"InfiniGen: sparse layer {state.layer_idx} has no selection; "
                f"layer {state.layer_idx - 1} did not speculate for it"
            )
        state.selection = None
        keys, values, waited = self.transfer.wait(state.layer_idx)
        self.swap_wait_us[state.layer_idx] += int(waited * 1e6)
        out, probs = attend_gathered(query[plan.tokens], keys, values, selection.valid,
                                     key[plan.tokens], value[plan.tokens], state.scale,
                                     return_probs=True)
        if state.h2o_accumulated is not None and self.config.policy == "h2o":
            valid = selection.valid
            heads = state.heads[None, :, None].expand_as(valid)
            state.h2o_accumulated.index_put_(
                (state.selected_slots[valid], heads[valid]), probs[valid], accumulate=True)
        entries = selection.valid.sum().to(torch.float64)  # (token, KV head) pairs
        entry_bytes = 2 * state.head_size * state.key_store.element_size()
        self.counters[state.layer_idx] += torch.stack([
            entries / self.total_kv_heads,
            plan.context_lens.sum() * (state.num_kv_heads / self.total_kv_heads),
            entries * entry_bytes,
        ])
        return out


    def attend_pool(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                    output: torch.Tensor, block_size: int) -> None:
        """Dense causal attention of a sparse layer's non-decode rows, over the pool.

        query: [T, H_q, D]; output: [T, H_q, D], written in place. Entries a
        capped pool evicted are left out.
        """
        group = state.num_heads // state.num_kv_heads
        index = self.pool_index
        for row in plan.other_rows:
            start, end = plan.query_start[row], plan.query_start[row + 1]
            seq_len = plan.seq_lens[row]
            if end == start:
                continue
            positions = torch.arange(seq_len, device=query.device)[None]
            slots = slots_of_positions(positions, plan.all_block_table[row : row + 1],
                                       block_size)[0]
            rows = index.rows(state.pool_layer, slots[:, None], state.heads[None, :])  # [L, H_kv]
            present = rows >= 0
            rows = torch.where(present, rows, index.num_rows)
            # keys, values: [H_q, L, D], each KV head repeated for its group.
            keys = state.key_store[rows, state.heads].transpose(0, 1).repeat_interleave(group, 0)
            values = state.value_store[rows, state.heads].transpose(0, 1).repeat_interleave(group, 0)
            first = seq_len - (end - start)  # position of the first query row
            causal = (torch.arange(seq_len, device=query.device)[None, :]
                      <= first + torch.arange(end - start, device=query.device)[:, None])
            # [H_q, rows, L]: causal, and only what the pool holds.
            mask = causal[None] & present.t().repeat_interleave(group, 0)[:, None, :]
            queries = query[start:end].transpose(0, 1).float()
            if state.h2o_accumulated is not None and self.config.policy == "h2o":
                # H2O scores tokens by the attention they receive, prefill included.
                logits = torch.einsum("hqd,hkd->hqk", queries, keys.float()) * state.scale
                probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
                out = torch.einsum("hqk,hkd->hqd", probs, values.float())
                received = probs.sum(dim=1).view(state.num_kv_heads, group, -1).sum(dim=1)
                state.h2o_accumulated[slots] += received.t()
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    queries, keys.float(), values.float(), attn_mask=mask, scale=state.scale,
                )
            output[start:end] = out.transpose(0, 1).to(output.dtype)


class InfiniGenImplMixin:
    """Mixed into a layer's attention impl class; runs InfiniGen around it.

    ``install`` adds the instance attributes ``infinigen_runtime`` and
    ``infinigen_layer``. Dense layers run the platform kernel; sparse layers
    never touch vLLM's cache (their KV-cache group has no blocks).
    """

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        state = self.infinigen_layer
        if not state.sparse:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        runtime = self.infinigen_runtime
        context = get_forward_context()
        slots = context.slot_mapping[runtime.reference_layer]
        runtime.begin_step(context.attn_metadata[runtime.reference_layer], slots)
        num_tokens = slots.shape[0]
        state.write(key[:num_tokens], value[:num_tokens], slots, runtime.pool_index)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        runtime, state = self.infinigen_runtime, self.infinigen_layer
        block_size = kv_cache.shape[2]
        context = get_forward_context()
        dense_metadata = context.attn_metadata[runtime.reference_layer]
        runtime.begin_step(dense_metadata, context.slot_mapping[runtime.reference_layer])
        plan = runtime.plan_for(dense_metadata, block_size)
        speculates = bool(plan.num_decodes) and runtime.config.policy == "infinigen"
        # Evaluation mode: prompt rows select among this step's own tokens,
        # whose partial keys in the next layer do not exist before that layer
        # runs: the next layer runs this layer's speculation itself, after
        # writing them (same inputs, same result as in decode).
        deferred = speculates and plan.has_other_rows and runtime.config.eval_dense_prefix is not None
        if state.next is not None and speculates and not deferred:
            runtime.speculate(state, plan)
        if not (state.next is not None and deferred):
            state.captured_input = None
        if not state.sparse:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        if deferred:
            previous = runtime.layers[state.layer_idx - 1]
            runtime.speculate(previous, plan)
            previous.captured_input = None
        if plan.has_other_rows:
            runtime.attend_pool(state, plan, query, output, block_size)
        if plan.num_decodes:
            output[plan.tokens] = runtime.attend_sparse(
                state, plan, query, key, value
            )
        return output


def _with_prompt_rows(is_prompt: torch.Tensor, query_start: torch.Tensor,
                      seq_lens: torch.Tensor, prefix: int):
    """Decode rows plus, per prompt request, its rows at positions >= ``prefix``.

    Returns (request index, token index in the batch, context length) of every
    row attending over a selection, in token order (host tensors).
    """
    rows, tokens, contexts = [], [], []
    for request in range(seq_lens.shape[0]):
        start, end = int(query_start[request]), int(query_start[request + 1])
        seq_len = int(seq_lens[request])
        first = seq_len - (end - start)  # position of the request's first row here
        if not is_prompt[request]:
            first_selected = seq_len - 1
        else:
            first_selected = max(first, prefix)
        positions = torch.arange(min(first_selected, seq_len), seq_len)
        rows.append(torch.full_like(positions, request))
        tokens.append(start + positions - first)
        contexts.append(positions)
    return torch.cat(rows), torch.cat(tokens), torch.cat(contexts)


def install(model: torch.nn.Module, vllm_config, config: InfiniGenConfig,
            skew: list[torch.Tensor], alpha: float, device: torch.device) -> InfiniGenRuntime:
    """Wraps the attention layers of ``model`` and hooks the speculating layers.

    Args:
        skew: Per layer [H_kv of this rank, D, R] skew slices.
    """
    from vllm.model_executor.layers.attention import Attention

    attention = {
        name: module
        for name, module in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(module, Attention)
    }
    by_index = sorted((extract_layer_index(name), name) for name in attention)
    if [idx for idx, _ in by_index] != list(range(len(by_index))):
        raise ValueError("InfiniGen needs one attention layer per decoder layer")
    modules = dict(model.named_modules())
    layers = []
    for idx, name in by_index:
        self_attn = modules.get(name.rsplit(".", 1)[0])
        state = LayerState(idx, name, attention[name], self_attn,
                           sparse=idx >= config.dense_layers)
        state.skew = skew[idx].to(device)
        layers.append(state)
    runtime = InfiniGenRuntime(config, alpha, layers, device)
    runtime.reference_layer = by_index[0][1]  # layer 0 is always dense
    for idx, name in by_index:
        state = layers[idx]
        impl = attention[name].impl
        if state.sparse:
            attention[name].get_kv_cache_spec = _sparse_spec_getter(attention[name])
        if idx + 1 < len(layers) and layers[idx + 1].sparse:
            state.next = layers[idx + 1]
            if state.next.qkv_proj is None or state.qkv_proj is None:
                raise ValueError(f"InfiniGen: layer {name} has no qkv_proj to hook")
            state.qkv_proj.register_forward_pre_hook(capture_pre_hook(name))
        # A new impl of a subclass, with the same attributes: the layer looks
        # its impl up at every call, so the swap holds under torch.compile.
        base = type(impl)
        wrapped = object.__new__(type(f"InfiniGen{base.__name__}", (InfiniGenImplMixin, base), {}))
        wrapped.__dict__.update(impl.__dict__)
        wrapped.infinigen_runtime = runtime
        wrapped.infinigen_layer = state
        attention[name].impl = wrapped
    sparse = [s.layer_idx for s in layers if s.sparse]
    logger.info(
        "InfiniGen: %d layers, dense %s, sparse %s, alpha %.2f, budget %.2f, "
        "partial rank %d of %d",
        len(layers), [s.layer_idx for s in layers if not s.sparse], sparse,
        alpha, config.budget, skew[0].shape[-1], layers[0].head_size,
    )
    return runtime


def _sparse_spec_getter(attn: torch.nn.Module):
    """The layer's ``get_kv_cache_spec``, returning the pool-backed sparse spec."""
    original = attn.get_kv_cache_spec

    def get_kv_cache_spec(vllm_config):
        spec = original(vllm_config)
        return None if spec is None else InfiniGenSparseSpec.of(spec)

    return get_kv_cache_spec
