# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the data path of a pinned host pool and a device block cache.

Per sparse layer (``DataPath``, ``worker/data_path.py``)::

    host      kv_pool [num_blocks, H_kv, block_size, 2 * D]   pinned on CUDA
                                                              (host_pool.py)
    device    speculation keys (partial or int, ``layer_state.py``)
              block cache units [H_kv * slots + 1, block_size, 2 * D]
              and its bookkeeping (block_cache.py)

    write           device: speculation keys and the cached copies of the new
                    tokens' blocks; host: write-through of K|V and the int
                    keys of the groups it closes (kernels.store_rows and
                    encode_groups: Triton through the pool's UVA pointer on
                    CUDA, no host sync; writes.py elsewhere)
    start_fetch     layer i, for layer i+1: the selected positions become
                    blocks (each position's block and the row's own block),
                    the cache looks them up, one gather moves only the
                    missing (block, KV head) units; on CUDA on a side stream
                    of low priority, finished by an event
    attend_selected waits for that event, attends each (row, KV head) over
                    its cached blocks through a substituted block table

Attention over the cached blocks is ``kernels.attend_units`` (Triton on CUDA,
torch elsewhere): block-granular, every context token of a selected block is
attended, through the substituted table and sequence lengths
(``block_cache.substitute_block_table``: one sequence per (row, KV head)).
Not vLLM's paged attention: its backends take one block table per request
for all of the layer's KV heads, over vLLM's own KV tensor, where each KV
head here selects its own blocks, held in the cache's units (docs/design.md).
Dense and prompt rows stage their blocks from the pool (the same gather) and
attend in torch.

Every tensor is created on a named device: with ``device="cpu"`` the whole
path runs in torch on the CPU (CI); nothing CUDA-only runs there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_infinigen.layout import KEY_GROUP, int_key_bits
from vllm_infinigen.memory import CAP_FLAG, PoolPlan
from vllm_infinigen.platforms.cuda import kernels, writes
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache, substitute_block_table
from vllm_infinigen.platforms.cuda.block_selection import physical_block_ids
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.step_plan import RowSet, StepPlan

_BIG = 1 << 62
_PROMPT_CHUNK = 256  # query rows per causal-attention chunk (bounds the score tensor)


def blocks_of_positions(positions: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                        width: int) -> torch.Tensor:
    """[S, H_kv, width] logical blocks holding ``positions``, and each row's own block.

    Ascending, each block once, -1 padded; the own block (``context_len //
    block_size``, the highest) is the last valid one.

    Args:
        positions: [S, H_kv, W] selected positions, -1 padded.
        context_lens: [S] tokens before each row's own.
        width: Host-side bound of the distinct blocks (``fetch_width``).
    """
    num_rows, num_heads, _ = positions.shape
    own = (context_lens.to(positions.device, torch.int64) // block_size)[:, None, None]
    blocks = torch.where(positions >= 0, positions.to(torch.int64) // block_size, _BIG)
    keyed = torch.cat([blocks, own.expand(num_rows, num_heads, 1)], dim=-1).sort(dim=-1).values
    previous = torch.cat([torch.full_like(keyed[..., :1], -1), keyed[..., :-1]], dim=-1)
    distinct = torch.where(keyed != previous, keyed, _BIG).sort(dim=-1).values[..., :width]
    return torch.where(distinct < _BIG, distinct, -1)


def fetch_width(rows: RowSet, positions: torch.Tensor, block_size: int) -> int:
    """Host-side bound of ``blocks_of_positions``' width: min(W + 1, the longest row's blocks)."""
    longest = max(rows.context_host, default=0) // block_size + 1
    return max(1, min(positions.shape[-1] + 1, longest))


@dataclass
class _LayerCache:
    """One sparse layer's device cache and the selection in flight towards it."""

    cache: DeviceBlockCache  # bookkeeping of one layer (its layer index 0)
    units: torch.Tensor  # [H_kv * slots + 1, block_size, 2 * D] on the device
    host_pool: object | None  # host_pool.HostPool that owns a pinned pool
    logical: torch.Tensor | None = None  # [S, H_kv, Wb] selected blocks, -1 padded
    slots: torch.Tensor | None = None  # [S, H_kv, Wb] their flat cache slots
    ready: object | None = None  # torch.cuda.Event recorded after the gather


class CudaDataPath:
    """``DataPath`` of the CUDA platform (works on any device; see the module docstring).

    Args:
        device: Where the speculation keys and the block cache live.
        slots_per_head: Cache slots per (sparse layer, KV head); a step's
            rows x blocks per head must fit (``memory.cache_slots_per_head``).
        eviction: The cache's rule (``block_cache.EVICTION_RULES``).
    """

    def __init__(self, device: torch.device | str, slots_per_head: int, *,
                 eviction: str = "lru") -> None:
        self.device = torch.device(device)
        self.slots_per_head = slots_per_head
        self.eviction = eviction
        self._layers: dict[int, _LayerCache] = {}
        self._stream = None
        if self.device.type == "cuda":
            # Priority 0 is the lowest: the gather yields to the model's kernels.
            self._stream = torch.cuda.Stream(self.device, priority=0)

    def describe(self) -> str:
        where = "pinned host pool, Triton gather on a side stream" if self._stream else \
            "torch reference on " + str(self.device)
        return (f"device block cache of {self.slots_per_head} blocks per layer and KV head "
                f"({self.eviction}), {where}")

    # -- DataPath

    def allocate(self, layer: LayerState, plan: PoolPlan, num_blocks: int,
                 dtype: torch.dtype) -> None:
        if plan.capped:
            raise ValueError(
                f"the CUDA data path gathers whole blocks from a pool with a row per slot; "
                f"unset {CAP_FLAG} (or give it room for every slot)")
        block_size, heads, head_size = plan.block_size, layer.num_kv_heads, layer.head_size
        host_pool = None
        if self._stream is not None:
            from vllm_infinigen.platforms.cuda.host_pool import allocate_host_pool

            host_pool = allocate_host_pool(num_blocks, heads, block_size, head_size, dtype)
            layer.kv_pool = host_pool.tensor
        else:
            layer.kv_pool = torch.zeros((num_blocks, heads, block_size, 2 * head_size),
                                        dtype=dtype, device=torch.device("cpu"))
        layer.num_blocks = num_blocks
        layer.block_granular = True  # InfiniGen's policy keeps whole blocks (its rule)
        if layer.int_keys:
            bits, groups = int_key_bits(dtype.itemsize), block_size // KEY_GROUP
            layer.key_codes = torch.zeros((num_blocks, heads, groups, head_size, 2 * bits),
                                          dtype=torch.uint8, device=self.device)
            layer.key_scales = torch.zeros((num_blocks, heads, groups, head_size),
                                           dtype=torch.float16, device=self.device)
        else:
            layer.partial_keys = writes.with_scratch_block(
                (num_blocks, heads, layer.rank, block_size), dtype, self.device)
        cache = DeviceBlockCache(1, heads, self.slots_per_head, num_blocks, self.device,
                                 eviction=self.eviction)
        units = cache.allocate_units(block_size, head_size, dtype).zero_()
        self._layers[layer.layer_idx] = _LayerCache(cache, units, host_pool)

    def write(self, layer: LayerState, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, row_map: torch.Tensor | None,
              closes_group: bool = True) -> None:
        """Device write, then the host write-through. The layer's gather (issued
        in the layer before) lands first: a new token of a cached block is
        written into its cached copy too, or attention would read it stale."""
        entry = self._layers[layer.layer_idx]
        self._wait(entry)
        device_slots = slots.to(self.device, torch.int64)
        if not layer.int_keys:
            writes.write_partial_keys(layer.partial_keys, key, layer.skew, device_slots)
        cached = entry.cache.cached_token_slots(0, device_slots, layer.block_size)
        kernels.write_cached_tokens(entry.units, cached, device_slots, key.to(self.device),
                                    value.to(self.device))
        # On the compute stream: the next gather (side stream) waits for it.
        kernels.store_rows(layer.kv_pool, key, value, device_slots)
        if layer.int_keys and closes_group:
            kernels.encode_groups(layer.key_codes, layer.key_scales, layer.kv_pool,
                                  device_slots)

    def start_fetch(self, layer: LayerState, rows: RowSet, positions: torch.Tensor,
                    row_map: torch.Tensor | None) -> None:
        block_size = layer.block_size
        logical = blocks_of_positions(positions.to(self.device), rows.context_lens, block_size,
                                      fetch_width(rows, positions, block_size))
        self.fetch_blocks(layer, rows, logical)

    def fetch_blocks(self, layer: LayerState, rows: RowSet, logical: torch.Tensor) -> None:
        """Places the selected blocks in the layer's cache and gathers the missing ones.

        A block-granular selection (``block_selection.select_blocks``) enters here.

        Args:
            logical: [S, H_kv, Wb] logical blocks of each row, ascending, -1
                padded, the row's own block the last valid one.
        """
        entry = self._layers[layer.layer_idx]
        block_ids = physical_block_ids(logical, rows.block_table.to(self.device))
        if self._stream is None:
            lookup = entry.cache.lookup(0, block_ids)
            kernels.gather_units(layer.kv_pool, entry.units, lookup.fetch_units,
                                 lookup.fetch_slots, lookup.num_fetch)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # the selection, and last step's attention
            block_ids.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                lookup = entry.cache.lookup(0, block_ids)
                kernels.gather_units(layer.kv_pool, entry.units, lookup.fetch_units,
                                     lookup.fetch_slots, lookup.num_fetch)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self._stream)
            lookup.slots.record_stream(compute)
        entry.logical, entry.slots = logical, lookup.slots

    def attend_selected(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                        positions: torch.Tensor, row_map: torch.Tensor | None,
                        probs: torch.Tensor | None) -> tuple[torch.Tensor, float]:
        """Attention over the cached blocks. The wait for the gather is an event
        on the device: no host time is spent, so the seconds waited are 0."""
        entry = self._layers[layer.layer_idx]
        if entry.slots is None:
            raise RuntimeError(f"InfiniGen: sparse layer {layer.layer_idx} attends with no "
                               "fetch started for it")
        self._wait(entry)
        context_lens = rows.context_lens.to(self.device)
        table, seq_lens = substitute_block_table(entry.slots, context_lens, layer.block_size)
        grouped = self._grouped(layer, query)
        out = kernels.attend_units(grouped, entry.units, table, seq_lens, scale=layer.scale)
        if probs is not None:
            probs.copy_(_position_probs(grouped, entry.units, table, seq_lens, entry.logical,
                                        positions.to(self.device), layer))
        self._count(layer, seq_lens, context_lens)
        entry.logical = entry.slots = None
        return out.reshape(query.shape), 0.0

    def attend_dense(self, layer: LayerState, rows: RowSet, query: torch.Tensor,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        """Each row over its whole context, its blocks staged from the pool (no cache)."""
        block_size, heads = layer.block_size, layer.num_kv_heads
        num_rows = rows.size
        width = max(rows.context_host, default=0) // block_size + 1
        context_lens = rows.context_lens.to(self.device, torch.int64)
        index = torch.arange(width, device=self.device)
        in_row = index[None, :] <= (context_lens // block_size)[:, None]  # [S, Wb]
        block_table = rows.block_table.to(self.device, torch.int64)[:, :width]
        block_ids = torch.where(in_row, block_table, -1)
        staged = self._stage(layer, block_ids.flatten())  # [S * Wb * H + 1, ...]
        # sequence (row s, head h) reads staged unit (s * Wb + j) * H + h for block j
        table = ((torch.arange(num_rows, device=self.device)[:, None, None] * width
                  + index[None, None, :]) * heads
                 + torch.arange(heads, device=self.device)[None, :, None])
        seq_lens = (context_lens + 1)[:, None].expand(num_rows, heads)
        seq_lens = seq_lens.reshape(-1).to(torch.int32)
        out = kernels.attend_units(self._grouped(layer, query), staged,
                                   table.reshape(num_rows * heads, width).to(torch.int32),
                                   seq_lens, scale=layer.scale)
        self._count(layer, seq_lens, context_lens)
        return out.reshape(query.shape)

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> None:
        """Causal attention of each prompt request over its blocks staged from the
        pool (the step's tokens were written through before), in torch."""
        block_size, heads, head_size = layer.block_size, layer.num_kv_heads, layer.head_size
        group = layer.num_heads // heads
        starts, seq_lens = plan.query_start.tolist(), plan.seq_lens.tolist()  # host tensors
        for request in plan.prompt_requests.tolist():
            start, end, seq_len = starts[request], starts[request + 1], seq_lens[request]
            num_blocks = -(-seq_len // block_size)
            block_ids = plan.all_block_table[request, :num_blocks].to(self.device, torch.int64)
            staged = self._stage(layer, block_ids)[:-1]
            # kv: [H_kv, seq_len, 2D]
            kv = staged.view(num_blocks, heads, block_size, 2 * head_size).permute(1, 0, 2, 3)
            kv = kv.reshape(heads, num_blocks * block_size, -1)[:, :seq_len].float()
            keys, values = kv[..., :head_size], kv[..., head_size:]
            first = seq_len - (end - start)  # position of the request's first row
            for chunk in range(start, end, _PROMPT_CHUNK):
                stop = min(chunk + _PROMPT_CHUNK, end)
                rows = query[chunk:stop].to(self.device).float().view(-1, heads, group, head_size)
                scores = torch.einsum("thgd,hld->thgl", rows, keys) * layer.scale
                position = first + chunk - start + torch.arange(stop - chunk, device=self.device)
                visible = torch.arange(seq_len, device=self.device)[None, :] <= position[:, None]
                scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
                out = torch.einsum("thgl,hld->thgd", torch.softmax(scores, dim=-1), values)
                output[chunk:stop] = out.reshape(stop - chunk, -1, head_size).to(output.dtype)

    def shutdown(self) -> None:
        for entry in self._layers.values():
            if entry.host_pool is not None:
                entry.host_pool.close()

    # -- beside the protocol: the scheduler's release, the metrics

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drops a finished or preempted request's blocks from every layer's cache."""
        for entry in self._layers.values():
            entry.cache.release_blocks(block_ids)

    def take_stats(self) -> dict[str, int]:
        """``block_cache.CACHE_COUNTERS`` since the last call, keyed
        ``"<counter>.<layer_idx>"`` (hits, misses, bytes over PCIe): one host
        copy per step, for every layer."""
        if not self._layers:
            return {}
        caches = [entry.cache for entry in self._layers.values()]
        counts = torch.stack([torch.cat([cache.hits, cache.misses]) for cache in caches])
        stats: dict[str, int] = {}
        for (layer_idx, entry), (hits, misses) in zip(self._layers.items(), counts.tolist()):
            entry.cache.hits.zero_()
            entry.cache.misses.zero_()
            if hits or misses:
                unit_bytes = entry.units[0].numel() * entry.units.element_size()
                stats.update({f"cache_hits.{layer_idx}": hits,
                              f"cache_misses.{layer_idx}": misses,
                              f"pcie_bytes.{layer_idx}": misses * unit_bytes})
        return stats

    # -- helpers

    def _wait(self, entry: _LayerCache) -> None:
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            entry.ready = None

    def _grouped(self, layer: LayerState, query: torch.Tensor) -> torch.Tensor:
        """[S * H_kv, G, D] one sequence per (row, KV head), from [S, H_q, D]."""
        heads = layer.num_kv_heads
        return query.to(self.device).reshape(-1, heads, layer.num_heads // heads,
                                             layer.head_size).reshape(
            -1, layer.num_heads // heads, layer.head_size)

    def _stage(self, layer: LayerState, block_ids: torch.Tensor) -> torch.Tensor:
        """[M * H_kv + 1, block_size, 2 * D] units of ``block_ids`` [M] (-1: none) from
        the pool, unit (m, h) at m * H_kv + h; the last unit is scratch."""
        heads = layer.num_kv_heads
        count = block_ids.shape[0] * heads
        staged = torch.zeros((count + 1, layer.block_size, 2 * layer.head_size),
                             dtype=layer.kv_pool.dtype, device=self.device)
        head = torch.arange(heads, device=self.device)[None, :]
        valid = (block_ids >= 0)[:, None].expand(-1, heads)
        units = torch.where(valid, block_ids.clamp(min=0)[:, None] * heads + head, 0)
        slots = torch.where(valid, torch.arange(count, device=self.device).view(-1, heads),
                            count)
        kernels.gather_units(layer.kv_pool, staged, units.flatten(), slots.flatten(),
                             torch.tensor([count], dtype=torch.int64, device=self.device))
        return staged

    def _count(self, layer: LayerState, seq_lens: torch.Tensor,
               context_lens: torch.Tensor) -> None:
        """``layer.stats`` += (entries attended besides the rows' own, over KV heads;
        context tokens of the rows)."""
        attended = seq_lens.to(torch.float64).sum() - seq_lens.shape[0]
        context = context_lens.to(torch.float64).sum()
        layer.stats += torch.stack([attended, context]).to(layer.stats.device)


def _position_probs(grouped: torch.Tensor, units: torch.Tensor, table: torch.Tensor,
                    seq_lens: torch.Tensor, logical: torch.Tensor, positions: torch.Tensor,
                    layer: LayerState) -> torch.Tensor:
    """[S, H_kv, W] float32 attention each selected position received, summed over
    the KV head's query heads (0 for padding), from a torch pass over the blocks."""
    num_rows, num_heads, width = logical.shape
    block_size, head_size = units.shape[1], layer.head_size
    tokens = units[table.to(torch.int64)].reshape(table.shape[0], -1, 2 * head_size).float()
    scores = torch.einsum("ngd,ntd->ngt", grouped.float(), tokens[..., :head_size]) * layer.scale
    live = torch.arange(tokens.shape[1], device=units.device)[None, :] < seq_lens[:, None]
    weights = torch.softmax(scores.masked_fill(~live[:, None, :], float("-inf")), dim=-1)
    per_head = weights.sum(dim=1).view(num_rows, num_heads, width * block_size)
    keyed = torch.where(logical >= 0, logical, _BIG).contiguous()
    wanted = positions.to(torch.int64).clamp(min=0)
    index = torch.searchsorted(keyed, (wanted // block_size).contiguous())
    token = (index.clamp(max=width - 1) * block_size + wanted % block_size)
    picked = per_head.gather(-1, token)
    return torch.where(positions >= 0, picked, 0.0)
