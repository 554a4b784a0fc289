# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the data path of a pinned host pool and a device block cache.

Per sparse layer (``DataPath``, ``worker/data_path.py``)::

    host      kv_pool [num_blocks, H_kv, block_size, 2 * D], pinned on CUDA (host_pool.py),
              in the model's dtype or FP8 (K / k_scale, V / v_scale: ``kernels``)
    device    speculation keys (bounds, int or partial, ``layer_state.py``)
              block cache units [H_kv * slots + 1, block_size, 2 * D]
              and its bookkeeping (block_cache.py)

    select          layer i, for layer i+1 (the layer's ``selector``): block
                    scores and the block rule in two kernels (bound keys; int
                    keys: alpha counts in a third; ``kernels/selection.py``), a
                    ``DeviceSelection`` of static shape
    start_fetch     places it in the cache (one kernel: hits, LRU victims,
                    the fetch list) and gathers the missing (block, KV head)
                    units (one kernel); on CUDA on a side stream of low
                    priority, finished by an event
    write           the layer's new K|V written through to the pool, the bounds
                    or int keys of the units they close: no wait for the gather
    attend_selected waits for the gather, writes the new K|V into the cached
                    copies of their blocks (``_flush``), attends each (row, KV
                    head) over its cached blocks (one launch, splits merged)
    place_prompts,  a step's prompt rows: their blocks placed in the cache
    attend_prompt   before the write, attended there (``prompts.py``)

A decode step of the device-only plan (``plans_on_device``) reads nothing back
to the host and allocates the same shapes whatever the selection (widths from
the table and the start-up settings, ``kernels.static_width``; counts on
the device until ``add_counts``; settings in a device tensor): it can run in
a CUDA graph.

Attention over the cached blocks is ``kernels.attend_units`` (Triton on CUDA,
torch elsewhere), the cache slots of a (row, KV head)'s blocks being its table
(docs/design.md). Dense rows of a host-planned step, and prompts the cache
cannot hold, stage their blocks (``staged.py``).

With ``device="cpu"`` the whole path runs in torch on the CPU (CI).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import BOUND_UNIT
from vllm_infinigen.memory import CAP_FLAG, PoolPlan
from vllm_infinigen.platforms.cuda import kernels, prompts, staged
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache
from vllm_infinigen.platforms.cuda.memory import refuse_widening
from vllm_infinigen.platforms.cuda.kernels import (
    DeviceSelection,
    blocks_of_positions,
    selection_of_blocks,
)
from vllm_infinigen.worker.counters import CounterDrain
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.pool_index import IdentityPoolIndex, PoolIndex
from vllm_infinigen.worker.step_plan import RowSet, StepPlan

@dataclass
class _LayerCache:
    """One sparse layer's device cache and the selection in flight towards it."""

    index: int  # among the sparse layers: the cache bookkeeping's layer
    units: torch.Tensor  # [H_kv * slots + 1, block_size, 2 * D] on the device
    host_pool: object | None  # host_pool.HostPool that owns a pinned pool
    host_pool_shape: tuple[int, int]  # (block ids, KV heads)
    selection: DeviceSelection | None = None  # in flight towards the attention
    slots: torch.Tensor | None = None  # [S, H_kv, W] flat cache slots of its blocks
    context_lens: torch.Tensor | None = None  # [S] the placement read them
    ready: object | None = None  # torch.cuda.Event recorded after the gather
    prompts: tuple[StepPlan, dict] | None = None  # the step's cached prompts (prompts.place)
    pending: tuple | None = None  # (key, value, slots) written, not yet into the cache


class CudaDataPath:
    """``DataPath`` of the CUDA platform (works on any device; see the module docstring).

    Args:
        device: Where the speculation keys and the block cache live.
        slots_per_head: Cache slots per (sparse layer, KV head); a step's
            rows x blocks per head must fit (``memory.cache_slots_per_head``).
        host_pool: (layer, num_blocks) -> the layer's pool [num_blocks, H_kv,
            block_size, 2 * D] in host memory the device can read (the GPU
            benchmark's shared regions); None: a pinned pool per sparse layer
            (``host_pool.py``) on CUDA, a plain tensor elsewhere.
    """

    plans_on_device = True
    has_fused_short = False  # ``decode_short`` is ``write`` then ``attend_dense``

    def __init__(self, device: torch.device | str, slots_per_head: int, *,
                 host_pool: Callable[[LayerState, int], torch.Tensor] | None = None) -> None:
        self.device = torch.device(device)
        self.slots_per_head = slots_per_head
        self._host_pool = host_pool
        self._layers: dict[int, _LayerCache] = {}
        self._cache: DeviceBlockCache | None = None  # every layer's bookkeeping, once configured
        self._layer_rows = None  # the layers' rows of the runtime's stats, on the device
        self._stream = None
        if self.device.type == "cuda":
            # Priority 0, the lowest (the model's stream has it too unless raised).
            self._stream = torch.cuda.Stream(self.device, priority=0)
        self.settings: torch.Tensor | None = None  # [4] float64 (kernels.SETTINGS): configure
        self._start = None  # the settings at start-up (InfiniGenConfig): the width
        self._stats_drain = CounterDrain()

    def describe(self) -> str:
        where = ("pinned host pool, Triton gather on a side stream" if self._stream
                 else f"torch reference on {self.device}")
        return (f"device block cache of {self.slots_per_head} blocks per layer and KV head "
                f"(lru), {where}; decode steps planned on the device")

    # -- DataPath

    def configure(self, config: InfiniGenConfig) -> None:
        """Takes the selection settings: once every sparse layer is allocated
        (the cache's bookkeeping is made then), and at each change. The
        settings of the first call size every selection (``width``).

        Raises:
            ValueError: On a change the cache and captured graphs cannot follow
                (``memory.refuse_widening``), naming the flag."""
        values = kernels.settings_tensor(config.alpha, config.budget, config.min_context,
                                         self.device, config.budget_tokens)
        if self.settings is None:
            self.settings = values
            self._start = config
        else:
            refuse_widening(self._start, config)
            self.settings.copy_(values)  # in place: a captured graph reads this tensor
        entries = list(self._layers.values())
        if entries and self._cache is None:
            blocks, heads = entries[0].host_pool_shape
            self._cache = DeviceBlockCache(len(entries), heads, self.slots_per_head, blocks,
                                           self.device)
            self._layer_rows = torch.tensor(list(self._layers), device=self.device)
            kernels.reserve_attention(self.device)  # before vLLM captures its graphs

    def allocate(self, layer: LayerState, plan: PoolPlan, num_blocks: int,
                 dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        if plan.capped:  # refused at start-up (refusals.py); its plan never caps
            raise RuntimeError(f"the CUDA data path gathers whole blocks from a pool with a "
                               f"row per slot, got a capped one ({CAP_FLAG} is refused on CUDA)")
        block_size, heads, head_size = plan.block_size, layer.num_kv_heads, layer.head_size
        host_pool = None
        shape = (num_blocks, heads, block_size, head_size)
        if self._host_pool is not None:
            layer.kv_pool = self._host_pool(layer, num_blocks)
        elif self._stream is not None:
            from vllm_infinigen.platforms.cuda.host_pool import allocate_host_pool

            host_pool = allocate_host_pool(*shape, kv_dtype)
            layer.kv_pool = host_pool.tensor
        else:
            layer.kv_pool = torch.zeros(shape[:3] + (2 * head_size,), dtype=kv_dtype)
        layer.num_blocks = num_blocks
        layer.selector = functools.partial(self.select, layer)  # whole blocks, on the device
        layer.allocate_speculation_keys(num_blocks, block_size, dtype, self.device,
                                        partial=kernels.with_scratch_block)
        if self._cache is not None:
            raise RuntimeError("CudaDataPath.allocate after the cache was made (configure)")
        units = torch.zeros((heads * self.slots_per_head + 1, block_size, 2 * head_size),
                            dtype=kv_dtype, device=self.device)
        self._layers[layer.layer_idx] = _LayerCache(len(self._layers), units, host_pool,
                                                    (num_blocks, heads))

    def width(self, table_blocks: int, block_size: int) -> int:
        """Blocks per KV head of every selection (``kernels.static_width`` of
        the start-up settings)."""
        if (start := self._start) is None:
            raise RuntimeError("CudaDataPath.configure was not called")
        sink, recent = self._windows(block_size)
        return kernels.static_width(table_blocks, block_size, budget=start.budget,
                                    min_context=start.min_context, sink_blocks=sink,
                                    recent_blocks=recent, budget_tokens=start.budget_tokens)

    def _windows(self, block_size: int) -> tuple[int, int]:
        return kernels.window_blocks(self._start.sink_tokens, self._start.recent_tokens,
                                     block_size)

    def pool_index(self, num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                   eviction: str, *, block_size: int) -> PoolIndex:
        """A row per dense slot: a capped pool is refused at start-up (``refusals.py``)."""
        if num_rows < num_slots:
            raise RuntimeError(f"a capped pool ({num_rows} rows for {num_slots} slots) on "
                               "CUDA: --infinigen-cpu-pool-gib is refused at start-up")
        return IdentityPoolIndex(num_slots)

    def select(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
               row_map: torch.Tensor | None = None) -> DeviceSelection:
        """InfiniGen's rule in whole blocks for ``layer``'s rows (its ``selector``).

        Args:
            query: [S, H_kv, G, R] (``policies.infinigen.skewed``): every
                channel (bounds, int keys), or the skewed partial query.
        """
        block_size = layer.block_size
        table = rows.block_table.to(self.device)
        context_lens = rows.context_lens.to(self.device)
        query = query.to(self.device)
        scale = layer.scale * layer.kv_scales()["key_scale"]  # keys encoded from the pool
        if layer.bound_keys:
            counts, blocks = kernels.bound_scores(  # the rule counts these units itself
                query, layer.bounds, layer.bound_scales, table, context_lens, scale=scale,
                block_size=block_size)
        else:
            tokens, blocks = (kernels.int_scores(
                query, layer.key_codes, layer.key_scales, table, context_lens, scale=scale,
                settings=self.settings) if layer.int_keys else kernels.partial_scores(
                query, layer.partial_keys, table, context_lens, scale=layer.scale))
            counts = kernels.alpha_counts(tokens, blocks, context_lens, self.settings,
                                          block_size=block_size)
        sink, recent = self._windows(block_size)
        logical, physical, seq_lens = kernels.select(
            blocks, counts, context_lens, table, self.settings, block_size=block_size,
            width=self.width(table.shape[1], block_size), sink_blocks=sink,
            recent_blocks=recent, unit=BOUND_UNIT if layer.bound_keys else 0)
        return DeviceSelection(logical, physical, seq_lens)

    def write(self, layer: LayerState, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, row_map: torch.Tensor | None,
              closes_group: bool = True) -> None:
        """The write-through of the new tokens and their cached copies, then the
        bounds or int keys they close. With a gather in flight towards the layer
        (issued in the layer before) nothing waits for it: the next layer's
        selection and gather follow at once, the cached copies once it has
        landed (``_flush``)."""
        entry = self._layers[layer.layer_idx]
        if entry.pending is not None:  # the last step's, if nothing read the cache since
            self._flush(entry, layer)
        device_slots = slots.to(self.device, torch.int64)
        if layer.speculation_keys == "partial":
            kernels.write_partial_keys(layer.partial_keys, key, layer.skew, device_slots)
        key, value = key.to(self.device), value.to(self.device)
        in_flight = entry.slots is not None  # else no gather to race: the copies at once
        cache = () if in_flight else (entry.units, self._cache.slot_of[entry.index],
                                      self.slots_per_head)
        # On the compute stream: the next gather (side stream) waits for it.
        kernels.write_tokens(layer.kv_pool, key, value, device_slots, *cache, **layer.kv_scales())
        if layer.int_keys and closes_group:
            kernels.encode_groups(layer.key_codes, layer.key_scales, layer.kv_pool, device_slots)
        if layer.bound_keys and closes_group:
            kernels.encode_bounds(layer.bounds, layer.bound_scales, layer.kv_pool, device_slots)
        entry.pending = (key, value, device_slots) if in_flight else None

    def start_fetch(self, layer: LayerState, rows: RowSet,
                    selection: DeviceSelection | torch.Tensor,
                    row_map: torch.Tensor | None) -> None:
        """Places ``selection`` in the layer's cache and gathers the missing blocks.

        Args:
            selection: From ``select``; or [S, H_kv, W] positions (-1 padded)
                of another rule, turned into their blocks (with sorts).
        """
        if isinstance(selection, torch.Tensor):
            width = min(selection.shape[-1] + 1, rows.block_table.shape[1])
            logical = blocks_of_positions(selection.to(self.device), rows.context_lens,
                                          layer.block_size, width)
            selection = selection_of_blocks(logical, rows, layer.block_size)
        entry = self._layers[layer.layer_idx]
        self._flush(entry, layer)  # (eval mode: a selection made after the layer's write)
        context_lens = rows.context_lens.to(self.device)
        if self._stream is None:
            lookup = self._cache.place(entry.index, selection.physical, selection.seq_lens,
                                       context_lens)
            kernels.gather_units(layer.kv_pool, entry.units, lookup.fetch_units,
                                 lookup.fetch_slots, lookup.num_fetch)
        else:
            # No record_stream (a captured graph takes none): the entry holds what the
            # placement reads until the compute stream has waited for ``ready``; the
            # side stream waits for the compute stream (the last step's attention).
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # the selection, and last step's attention
            with torch.cuda.stream(self._stream):
                lookup = self._cache.place(entry.index, selection.physical,
                                           selection.seq_lens, context_lens)
                kernels.gather_units(layer.kv_pool, entry.units, lookup.fetch_units,
                                     lookup.fetch_slots, lookup.num_fetch)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self._stream)
        entry.prompts = None  # this placement may have evicted their blocks
        # Held until the attention, after which the placement has read them.
        entry.selection, entry.slots, entry.context_lens = selection, lookup.slots, context_lens

    def attend_selected(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                        positions: object, row_map: torch.Tensor | None,
                        probs: torch.Tensor | None,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """Attention over the cached blocks. The wait for the gather is an event
        on the device: no host time is spent, so the seconds waited are 0.

        Raises:
            ValueError: If ``probs`` is asked for (policies that record the
                attention received run on the CPU build only)."""
        entry = self._layers[layer.layer_idx]
        if entry.slots is None:
            raise RuntimeError(f"InfiniGen: sparse layer {layer.layer_idx} attends unfetched")
        if probs is not None:
            raise ValueError("the CUDA data path does not report the attention each "
                             "selected entry received")
        self._flush(entry, layer)
        num_rows, num_heads, width = entry.slots.shape
        out = kernels.attend_units(query.to(self.device), entry.units,
                                   entry.slots.view(num_rows * num_heads, width),
                                   entry.selection.seq_lens, num_kv_heads=num_heads,
                                   scale=layer.scale, out=out, **layer.kv_scales())
        entry.selection = entry.slots = entry.context_lens = None
        return out, 0.0

    def attend_dense(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        """Each row over its whole context, its blocks staged from the pool (no cache)."""
        entry = self._layers[layer.layer_idx]
        self._flush(entry, layer)
        return staged.attend_dense(layer, rows, query, self.device,
                                   self._cache.staged[entry.index])

    def decode_short(self, layer: LayerState, rows: RowSet, query: torch.Tensor, key, value,
                     slots: torch.Tensor, row_map: None, out: torch.Tensor) -> None:
        self.write(layer, key, value, slots, row_map)
        n = rows.context_lens.shape[0]
        out[:n] = self.attend_dense(layer, rows, query[:n], row_map)

    def place_prompts(self, layer: LayerState, plan: StepPlan) -> None:
        """Before the write of a step with prompt rows: their blocks into the cache."""
        entry = self._layers[layer.layer_idx]
        self._wait(entry)
        entry.prompts = plan, prompts.place(self._cache, entry.index, entry.units, layer,
                                            plan, entry.slots)

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> None:
        """Each prompt request over its cached blocks, or staged (``prompts.attend``)."""
        entry = self._layers[layer.layer_idx]
        self._flush(entry, layer)
        placed, entry.prompts = entry.prompts, None
        tables = placed[1] if placed is not None and placed[0] is plan else {}
        prompts.attend(tables, entry.units, layer, plan, query, output, self.device,
                       self._cache.staged[entry.index])

    def shutdown(self) -> None:
        for entry in self._layers.values():
            if entry.host_pool is not None:
                entry.host_pool.close()

    # -- beside the protocol: the scheduler's release, the metrics

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drops a finished or preempted request's blocks from every layer's cache."""
        if self._cache is not None:
            self._cache.release_blocks(block_ids)

    def add_counts(self, stats: torch.Tensor) -> None:
        """Adds the entries the selections attended and the rows' context tokens,
        counted on the device per layer, to the runtime's [layers, 2] ``stats``."""
        if self._cache is not None:  # (the rows made once: no host sync a step)
            stats.index_add_(0, self._layer_rows.to(stats.device),
                             self._cache.take_attended().to(stats.device, stats.dtype))

    def take_stats(self, wait: bool = False) -> dict[str, int]:
        """``block_cache.CACHE_COUNTERS`` since the last call, keyed
        ``"<counter>.<layer_idx>"`` (PCIe bytes: the misses and staged units),
        one asynchronous copy per step, read a step later on a GPU
        (``worker/counters.py``; ``wait``: now)."""
        counts = (None if self._cache is None
                  else self._stats_drain(self._cache.take_counter_tensor(), wait=wait))
        if counts is None:
            return {}
        stats: dict[str, int] = {}
        for (layer_idx, entry), (hit, miss, staged_units) in zip(self._layers.items(),
                                                                 counts.tolist()):
            if hit or miss or staged_units:
                unit_bytes = entry.units[0].numel() * entry.units.element_size()
                stats.update({f"cache_hits.{layer_idx}": hit, f"cache_misses.{layer_idx}": miss,
                              f"pcie_bytes.{layer_idx}": (miss + staged_units) * unit_bytes})
        return stats

    # -- helpers

    def _wait(self, entry: _LayerCache) -> None:
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            entry.ready = None

    def _flush(self, entry: _LayerCache, layer: LayerState) -> None:
        """Waits for the layer's gather, then writes the step's new tokens into the
        cached copies of their blocks (gathered, or placed for a prompt, before)."""
        self._wait(entry)
        if entry.pending is not None:
            (key, value, slots), entry.pending = entry.pending, None
            kernels.write_cached_tokens(entry.units, self._cache.slot_of[entry.index],
                                        self.slots_per_head, key, value, slots,
                                        **layer.kv_scales())
