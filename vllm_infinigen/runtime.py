# SPDX-License-Identifier: Apache-2.0
"""Worker-side InfiniGen: per-layer state, speculation and sparse decode.

Data path of one decode step, for a model with L layers and ``dense_layers=2``::

    layer 0   dense
    layer 1   dense attention; speculates for layer 2 from its attention input
    layer 2   attends over what layer 1 selected; speculates for layer 3
    ...
    layer L-1 attends over what layer L-2 selected

Every sparse layer writes its K/V (in a simple [slot, head, dim] layout, by
vLLM slot id) and its partial keys as they are produced, prefill and decode
alike. Prefill rows and mixed batches attend densely with the platform kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.ops import capture_pre_hook
from vllm_infinigen.selector import Selection, max_selected, select_tokens
from vllm_infinigen.sparse_attention import attend_selected, slots_of_positions

logger = init_logger(__name__)

# Counters per layer, columns of InfiniGenRuntime.counters.
SELECTED, CANDIDATE, SWAP_BYTES = 0, 1, 2


@dataclass
class StepPlan:
    """The decode rows of one step, computed once per step on the host."""

    rows: torch.Tensor  # [B] request index in the batch
    tokens: torch.Tensor  # [B] token index of each decode row
    context_lens: torch.Tensor  # [B] tokens before the current one
    block_table: torch.Tensor  # [B, max_blocks]
    context_slots: torch.Tensor  # [B, N] slot of every context position
    num_slots: int  # K of the selections this step
    has_other_rows: bool  # prefill rows present: run the dense kernel too

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
        # [S + 1, H_kv, D] and [S + 1, H_kv, R]; row S takes padding slots.
        self.key_store: torch.Tensor | None = None
        self.value_store: torch.Tensor | None = None
        self.partial_key_cache: torch.Tensor | None = None

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        rows = num_slots + 1
        shape = (rows, self.num_kv_heads, self.head_size)
        self.key_store = torch.zeros(shape, dtype=dtype, device=device)
        self.value_store = torch.zeros(shape, dtype=dtype, device=device)
        rank = self.skew.shape[-1]
        self.partial_key_cache = torch.zeros(
            (rows, self.num_kv_heads, rank), dtype=dtype, device=device
        )

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores new K/V and partial keys. key, value: [T, H_kv, D]."""
        pad_row = self.key_store.shape[0] - 1
        slots = slot_mapping.to(torch.int64)
        slots = torch.where(slots < 0, pad_row, slots)
        self.key_store[slots] = key
        self.value_store[slots] = value
        partial = torch.einsum("thd,hdr->thr", key.float(), self.skew)
        self.partial_key_cache[slots] = partial.to(self.partial_key_cache.dtype)


class InfiniGenRuntime:
    """Owns every layer's state and the per-step plan on one worker."""

    def __init__(self, config: InfiniGenConfig, alpha: float, layers: list[LayerState],
                 device: torch.device):
        self.config = config
        self.alpha = alpha
        self.layers = layers
        self.device = device
        # counters: [num_layers, 3] selected / candidate tokens, swap bytes.
        self.counters = torch.zeros((len(layers), 3), dtype=torch.int64, device=device)
        self._plan_source: object | None = None
        self._plan: StepPlan | None = None

    def update_selection(self, alpha: float | None = None, **changes) -> None:
        """Changes the selection settings of the running engine (for sweeps).

        Args:
            alpha: New alpha, if given.
            changes: New ``budget``, ``sink_tokens`` or ``recent_tokens``.

        Raises:
            ValueError: On other settings or bad values, naming the flag.
        """
        allowed = {"budget", "sink_tokens", "recent_tokens"}
        if set(changes) - allowed:
            raise ValueError(f"only alpha and {sorted(allowed)} can change at run time")
        if alpha is not None:
            changes["alpha"] = alpha
        self.config = dataclasses.replace(self.config, **changes)
        if alpha is not None:
            self.alpha = float(alpha)

    def take_counters(self) -> dict[str, int]:
        """Drains the counters (one host copy per step, not per layer)."""
        values = self.counters.tolist()
        self.counters.zero_()
        out: dict[str, int] = {}
        for state, (selected, candidate, swap_bytes) in zip(self.layers, values):
            if state.sparse and candidate:
                out[f"selected_tokens.{state.layer_idx}"] = selected
                out[f"candidate_tokens.{state.layer_idx}"] = candidate
                out[f"swap_bytes.{state.layer_idx}"] = swap_bytes
        return out

    def plan_for(self, attn_metadata, block_size: int) -> StepPlan:
        if self._plan_source is attn_metadata:
            return self._plan
        query_start = attn_metadata.query_start_loc.cpu()
        seq_lens = attn_metadata.seq_lens.cpu()
        num_reqs = seq_lens.shape[0]
        query_lens = query_start[1 : num_reqs + 1] - query_start[:num_reqs]
        is_decode = (query_lens == 1) & (seq_lens > 1)
        rows = torch.nonzero(is_decode).flatten()
        context_lens = seq_lens[rows] - 1
        context_host = context_lens.tolist()
        max_context = max(context_host, default=1)
        device = self.device
        block_table = attn_metadata.block_table[rows.to(attn_metadata.block_table.device)]
        positions = torch.arange(max_context, device=device).expand(len(rows), max_context)
        num_window = self.config.sink_tokens + self.config.recent_tokens
        self._plan = StepPlan(
            rows=rows.to(device),
            tokens=query_start[rows].to(device=device, dtype=torch.int64),
            context_lens=context_lens.to(device=device, dtype=torch.int64),
            block_table=block_table,
            context_slots=slots_of_positions(positions, block_table, block_size),
            num_slots=max_selected(context_host, self.config.budget, num_window),
            has_other_rows=len(context_host) < num_reqs,
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
        qkv, _ = target.qkv_proj(hidden)
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
        target.selection = select_tokens(
            partial_query,
            partial_keys,
            plan.context_lens,
            scale=target.scale,
            alpha=self.alpha,
            budget=self.config.budget,
            num_slots=plan.num_slots,
            sink_tokens=self.config.sink_tokens,
            recent_tokens=self.config.recent_tokens,
        )

    def attend_sparse(self, state: LayerState, plan: StepPlan, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, block_size: int) -> torch.Tensor:
        """Decode attention of a sparse layer; query: [T, H_q, D]. Returns [B, H_q, D]."""
        selection = state.selection
        if selection is None:
            raise RuntimeError(
                f"InfiniGen: sparse layer {state.layer_idx} has no selection; "
                f"layer {state.layer_idx - 1} did not speculate for it"
            )
        state.selection = None
        slots = slots_of_positions(selection.positions, plan.block_table, block_size)
        out = attend_selected(
            query[plan.tokens],
            state.key_store,
            state.value_store,
            slots,
            selection.valid,
            key[plan.tokens],
            value[plan.tokens],
            state.scale,
        )
        selected = selection.num_selected.sum()
        entry_bytes = 2 * state.num_kv_heads * state.head_size * state.key_store.element_size()
        self.counters[state.layer_idx] += torch.stack(
            [selected, plan.context_lens.sum(), selected * entry_bytes]
        )
        return out


class InfiniGenImplMixin:
    """Mixed into a layer's attention impl class; runs InfiniGen around it.

    ``install`` adds the instance attributes ``infinigen_runtime`` and
    ``infinigen_layer``.
    """

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        runtime, state = self.infinigen_runtime, self.infinigen_layer
        num_tokens = attn_metadata.num_actual_tokens
        block_size = kv_cache.shape[2]
        if state.sparse:
            if state.key_store is None:
                state.allocate(kv_cache.shape[0] * block_size, key.dtype, key.device)
            state.write(key[:num_tokens], value[:num_tokens],
                        attn_metadata.slot_mapping[:num_tokens])
        plan = runtime.plan_for(attn_metadata, block_size)
        if state.next is not None and plan.num_decodes:
            runtime.speculate(state, plan)
        state.captured_input = None
        if not (state.sparse and plan.num_decodes):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        if plan.has_other_rows:
            super().forward(layer, query, key, value, kv_cache, attn_metadata,
                            output, output_scale, output_block_scale)
        output[plan.tokens] = runtime.attend_sparse(state, plan, query, key, value, block_size)
        return output


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
    for idx, name in by_index:
        state = layers[idx]
        impl = attention[name].impl
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
