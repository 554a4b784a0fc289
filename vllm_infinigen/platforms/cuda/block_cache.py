# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the device block cache's bookkeeping, as tensors on its device.

Consecutive decode steps select largely the same blocks, so each sparse
layer keeps the blocks earlier steps fetched in device memory, and a step
fetches over PCIe only the selected blocks missing from it. Per (sparse
layer, KV head) the cache has ``slots_per_head`` slots; a slot holds one
KV head's block (``block_size`` tokens of K|V, one pool unit)::

    cache units   [H_kv * slots_per_head + 1, block_size, 2 * D] per layer
                  (flat slot = head * slots_per_head + slot; the last unit is
                  scratch for masked writes)
    slot_of       [layers, num_blocks * H_kv + 1]  slot of (block id, head), -1
    block_of      [layers, H_kv, slots + 1]        block id in each slot, -1 free

One ``lookup`` per layer and step (no Python loop over blocks, no host sync):
the selected blocks found in the cache are hits; the missing ones, each
(block, head) once, take the slots with the lowest eviction keys, never a
slot hit in the same step, and come back as a fetch list sorted by pool unit
(``block_id * H_kv + head``) for one gather kernel. Eviction keys::

    lru      the step that last selected the slot's block (default: replaying
             selections recorded on two trained models, it hits as often as
             counter with 1x or 3x the widest step's blocks as slots and
             0.4-1.6 points more often with 1.5x-2x;
             benchmarks/results/selection_reuse.md)
    counter  the artifact's pool rule: among the older half (by insertion),
             the fewest selections

Invariants: ``slot_of`` and ``block_of`` are inverse where >= 0; a step never
selects more blocks per head than there are slots (``lookup`` refuses).
Blocks change owner only through vLLM's allocator, so a finished or preempted
request's blocks leave the cache (``release_blocks``) before their ids return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import reference

EVICTION_RULES = ("lru", "counter")
# The cache's counters, as ``take_stats`` keys them; ``scheduler/metrics.COUNTERS``
# documents and exports each (``vllm:infinigen_<name>_total``, labelled by layer).
CACHE_COUNTERS = ("cache_hits", "cache_misses", "pcie_bytes")
# What ``DeviceBlockCache.counters`` counts per (layer, KV head): entries attended
# besides the rows' own and context tokens (head 0), written by ``place``; hits
# and misses, by ``lookup`` and ``place`` (misses also by ``place_prompt``).
COUNTS = ("attended", "context", "hits", "misses")
_BIG = 1 << 62  # sorts after every block id and unit
_NEWER_HALF = 1 << 61
_COUNT_SHIFT = 36
_MAX_USES = (1 << (61 - _COUNT_SHIFT)) - 1  # uses saturate there, below the half's bit


@dataclass(frozen=True)
class CacheLookup:
    """One layer's selection, placed in its cache.

    ``fetch_units[:num_fetch]`` (ascending) are to be copied from the host
    pool, viewed as units [units * H_kv, block_size, 2 * D], into the flat
    cache slots ``fetch_slots[:num_fetch]``; both hold -1 after.
    """

    slots: torch.Tensor  # [S, H_kv, W] int64 flat cache slot of each selected block, -1 padded
    fetch_units: torch.Tensor  # [H_kv * S * W] int64 pool unit of each missing block
    fetch_slots: torch.Tensor  # [H_kv * S * W] int64 flat cache slot it goes to
    num_fetch: torch.Tensor  # [1] int64 valid entries of fetch_* (the gather's bound)


class DeviceBlockCache:
    """Which blocks each (sparse layer, KV head) holds in its device slots.

    Args:
        num_layers: Sparse layers (index 0 is the first sparse layer).
        num_kv_heads: KV heads per layer on this worker.
        slots_per_head: Cache slots of each (layer, KV head).
        num_blocks: Block ids of the dense KV-cache group (they name the blocks).
        device: Where the bookkeeping lives (the cache's device).
        eviction: One of ``EVICTION_RULES``.

    Memory: 4 bytes per (layer, block id, KV head) for ``slot_of`` and 24 per
    (layer, KV head, slot) for the rest.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, slots_per_head: int,
                 num_blocks: int, device: torch.device | str, *, eviction: str = "lru") -> None:
        if eviction not in EVICTION_RULES:
            raise ValueError(f"eviction must be one of {list(EVICTION_RULES)}, got {eviction!r}")
        self.eviction = eviction
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.slots_per_head, self.num_blocks = slots_per_head, num_blocks
        self.device = torch.device(device)
        shape = (num_layers, num_kv_heads, slots_per_head + 1)  # last column: scratch
        self.block_of = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.last_used = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.inserted = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.num_uses = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.slot_of = torch.full((num_layers, num_blocks * num_kv_heads + 1), -1,
                                  dtype=torch.int32, device=self.device)
        # Per (layer, KV head): COUNTS since ``take_counters``, and the lookups so
        # far (the ticks live on the device: no host state changes per lookup,
        # so a step can be captured in a CUDA graph).
        self.counters = torch.zeros((num_layers, num_kv_heads, len(COUNTS)), dtype=torch.int64,
                                    device=self.device)
        self.ticks = torch.zeros((num_layers, num_kv_heads), dtype=torch.int64,
                                 device=self.device)
        # Per layer: units staged from the pool beside the cache (``staged.py``).
        self.staged = torch.zeros((num_layers, 1), dtype=torch.int64, device=self.device)
        self._heads = torch.arange(num_kv_heads, device=self.device)[:, None]  # [H, 1]

    @property
    def num_units(self) -> int:
        """Units of a layer's cache tensor (``allocate_units``), scratch included."""
        return self.num_kv_heads * self.slots_per_head + 1

    def allocate_units(self, block_size: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_units, block_size, 2 * D] one layer's cache storage (uninitialised)."""
        return torch.empty((self.num_units, block_size, 2 * head_size), dtype=dtype,
                           device=self.device)

    def _check_width(self, num_rows: int, width: int) -> int:
        """S * W, the most blocks a head may need in a step (host-side shapes).

        Raises:
            ValueError: If it exceeds the slots per head.
        """
        per_head = num_rows * width
        if per_head > self.slots_per_head:
            raise ValueError(
                f"a step selects up to {per_head} blocks per KV head ({num_rows} rows x "
                f"{width}) but the device block cache has {self.slots_per_head} slots per "
                "head, sized at start-up for --max-num-seqs rows at the start-up "
                "--infinigen-budget, --infinigen-budget-tokens and --infinigen-min-context; "
                "restart with a larger --max-num-seqs, or with --max-num-batched-tokens at "
                "most --max-num-seqs where prompt rows select (--infinigen-eval-dense-prefix)")
        return per_head

    # -- per layer and step (worker, ``start_fetch``)

    def place(self, layer: int, block_ids: torch.Tensor, seq_lens: torch.Tensor,
              context_lens: torch.Tensor) -> CacheLookup:
        """``lookup`` of the device-only step (LRU): one kernel on CUDA, no host read.

        The misses of a head, in entry order, take its victims in slot order
        (``lookup`` pairs them by block id and key); ``fetch_units`` and
        ``fetch_slots`` are [H_kv, S * W], each head's first ``num_fetch[h]``
        valid. Also counts, per head, the entries its rows attend besides their
        own (``seq_lens`` [S * H_kv]) and, on head 0, the rows' context tokens.

        Args:
            block_ids: [S, H_kv, W] int64 from ``kernels.select``; a block
                may repeat across rows (shared prefixes): one slot, one fetch.
            context_lens: [S] tokens before each row's own (< 0: padding).

        Raises:
            ValueError: If S * W exceeds the slots per head, or the cache's
                rule is not LRU.
        """
        if self.eviction != "lru":
            raise ValueError(f"the device-only step evicts by lru, not {self.eviction!r}")
        num_rows, num_heads, width = block_ids.shape
        per_head = self._check_width(num_rows, width)
        slots = torch.empty_like(block_ids, dtype=torch.int64)
        units = torch.empty((num_heads, per_head), dtype=torch.int64, device=self.device)
        destinations = torch.empty_like(units)
        num_fetch = torch.empty(num_heads, dtype=torch.int64, device=self.device)
        state = (self.slot_of[layer], self.block_of[layer], self.last_used[layer],
                 self.ticks[layer])
        kernels.place_lru(block_ids, slots, *state, units, destinations, num_fetch,
                          self.counters[layer], seq_lens, context_lens,
                          capacity=self.slots_per_head)
        return CacheLookup(slots, units, destinations, num_fetch)


    def lookup(self, layer: int, block_ids: torch.Tensor) -> CacheLookup:
        """Places a step's selection of ``layer`` in its cache; counts hits and misses.

        Args:
            layer: Index among the sparse layers.
            block_ids: [S, H_kv, W] int64 selected block ids (-1: none), each
                < ``num_blocks``; a block may repeat (shared prefixes).

        Raises:
            ValueError: If S * W exceeds the slots per head (sized from shapes).
        """
        num_rows, num_heads, width = block_ids.shape
        per_head = self._check_width(num_rows, width)
        self.ticks[layer] += 1
        tick = self.ticks[layer][:, None].expand(num_heads, per_head)
        heads, capacity = self._heads, self.slots_per_head
        slot_of = self.slot_of[layer]
        # ids: [H, M] per head; each (block, head) once, ascending (the first of equals)
        ids = block_ids.permute(1, 0, 2).reshape(num_heads, per_head).to(torch.int64)
        keyed = torch.where(ids >= 0, ids, _BIG).sort(dim=-1).values
        previous = torch.cat([torch.full_like(keyed[:, :1], -1), keyed[:, :-1]], dim=1)
        first = (keyed < _BIG) & (keyed != previous)
        known = keyed.clamp(max=self.num_blocks - 1)
        cached = slot_of[known * num_heads + heads].to(torch.int64)  # [H, M]
        hit = first & (cached >= 0)
        miss = first & (cached < 0)
        hit_slots = torch.where(hit, cached, capacity)
        self.last_used[layer].scatter_(1, hit_slots, tick)
        self.num_uses[layer].scatter_add_(1, hit_slots, hit.to(torch.int64))
        num_miss = miss.sum(dim=1)  # [H]
        missing = torch.where(miss, keyed, _BIG).sort(dim=-1).values  # ascending, then _BIG
        take = torch.arange(per_head, device=self.device)[None, :] < num_miss[:, None]
        victims = self._victims(layer, hit_slots, per_head)  # [H, M]
        new_blocks = torch.where(take, missing, 0)
        dest = torch.where(take, victims, capacity)
        self._map(layer, take, new_blocks, dest, tick)
        self.inserted[layer].scatter_(1, dest, tick)
        self.num_uses[layer].scatter_(1, dest, 1)
        self.counters[layer, :, COUNTS.index("hits")] += hit.sum(dim=1)
        self.counters[layer, :, COUNTS.index("misses")] += num_miss
        # Every selected entry's flat slot, in the selection's order.
        valid = block_ids >= 0
        entries = (block_ids.clamp(min=0) * num_heads + heads.view(1, -1, 1)).to(torch.int64)
        slots = slot_of[entries].to(torch.int64) + heads.view(1, -1, 1) * capacity
        slots = torch.where(valid, slots, -1)
        # The fetch list, all heads, ascending by pool unit.
        units = torch.where(take, new_blocks * num_heads + heads, _BIG).flatten()
        units, order = units.sort()
        flat_dest = (heads * capacity + victims).flatten()[order]
        fetching = units < _BIG
        return CacheLookup(slots, torch.where(fetching, units, -1),
                           torch.where(fetching, flat_dest, -1), num_miss.sum().view(1))

    def _map(self, layer: int, take: torch.Tensor, blocks: torch.Tensor, dest: torch.Tensor,
             tick: torch.Tensor) -> None:
        """Where ``take`` [H, M]: block ``blocks`` into slot ``dest`` (capacity
        elsewhere), the block the slot held unmapped, its last use ``tick``."""
        heads, slot_of, block_of = self._heads, self.slot_of[layer], self.block_of[layer]
        scratch_entry = slot_of.shape[0] - 1
        old = block_of.gather(1, dest)
        old_entry = old.clamp(min=0) * self.num_kv_heads + heads
        # Only where the old block's map names the slot (``place_lru_reference``).
        names_dest = slot_of[old_entry].to(torch.int64) == dest
        slot_of.index_fill_(0, torch.where(take & (old >= 0) & names_dest, old_entry,
                                           scratch_entry).flatten(), -1)
        slot_of.index_put_((torch.where(take, blocks * self.num_kv_heads + heads,
                                        scratch_entry).flatten(),), dest.to(torch.int32).flatten())
        slot_of[scratch_entry] = -1
        block_of.scatter_(1, dest, torch.where(take, blocks, -1))
        self.last_used[layer].scatter_(1, dest, tick)

    def _victims(self, layer: int, hit_slots: torch.Tensor, count: int) -> torch.Tensor:
        """[H, count] slots with the lowest eviction keys, never one hit this step
        (``hit_slots`` [H, M], ``slots_per_head`` where no hit); free slots
        first, ties by slot index."""
        capacity = self.slots_per_head
        if self.eviction == "lru":
            key = self.last_used[layer, :, :capacity] + 1  # free: 0
        else:
            inserted = self.inserted[layer, :, :capacity]
            free = inserted < 0
            held = (~free).sum(dim=1, keepdim=True)
            ordered = torch.where(free, _BIG, inserted).sort(dim=-1).values
            cutoff = ordered.gather(1, torch.clamp((held + 1) // 2 - 1, min=0))
            newer = (inserted > cutoff).to(torch.int64) * _NEWER_HALF
            uses = self.num_uses[layer, :, :capacity].clamp(max=_MAX_USES)
            key = newer + (uses << _COUNT_SHIFT) + inserted + 1
            key = torch.where(free, 0, key)
        protected = torch.zeros(key.shape[0], capacity + 1, dtype=torch.bool, device=self.device)
        protected.scatter_(1, hit_slots, True)
        key = torch.where(protected[:, :capacity], _BIG, key)
        # A stable sort breaks ties by slot index: the same slots on every device.
        return torch.sort(key, dim=-1, stable=True).indices[:, :count]

    def place_prompt(self, layer: int, block_ids: torch.Tensor, written: int,
                     keep: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A prompt request's blocks placed in ``layer``'s cache before the step
        writes its tokens, so that they are written into the cache as well as the
        pool and attended there (``platforms/cuda/prompts.py``). Least recently
        used slots evicted, never one of ``keep``; reads the fit back to the host
        (a prompt step is planned on the host).

        Args:
            block_ids: [n] int64 the request's blocks in position order, each
                < ``num_blocks``.
            written: Leading blocks that hold tokens of earlier steps (chunked
                prefill): those missing are fetched from the pool; the rest
                receive this step's tokens only and are not.
            keep: Flat slots (-1: none) of any shape that must stay: the
                selection in flight (``CacheLookup.slots``) and the prompts
                placed before in the step (this method's slots).

        Returns:
            (slots [H_kv, n] int64 flat cache slot of each block, fetch_units,
            fetch_slots [F] int64 ascending by pool unit, for
            ``kernels.gather_units``); or None, the cache untouched, when a head
            has fewer slots to give than the request misses.
        """
        num_heads, capacity = self.num_kv_heads, self.slots_per_head
        heads, count = self._heads, block_ids.shape[0]
        slot_of, last_used = self.slot_of[layer], self.last_used[layer]
        ids = block_ids.to(self.device, torch.int64)[None, :].expand(num_heads, -1)  # [H, n]
        entries = ids * num_heads + heads
        cached = slot_of[entries].to(torch.int64)
        hit, miss = cached >= 0, cached < 0
        kept = torch.zeros(num_heads * capacity + 1, dtype=torch.bool, device=self.device)
        for flat in keep:  # flat slot = head * capacity + slot
            flat = flat.reshape(-1).to(self.device, torch.int64)
            kept[torch.where(flat >= 0, flat, num_heads * capacity)] = True
        protected = torch.zeros(num_heads, capacity + 1, dtype=torch.bool, device=self.device)
        protected[:, :capacity] = kept[:-1].view(num_heads, capacity)
        protected.scatter_(1, torch.where(hit, cached, capacity), True)
        num_miss = miss.sum(dim=1)
        if bool((num_miss > capacity - protected[:, :capacity].sum(dim=1)).any()):
            return None
        self.ticks[layer] += 1
        tick = self.ticks[layer][:, None].expand(num_heads, count)
        last_used.scatter_(1, torch.where(hit, cached, capacity), tick)
        # The misses, in position order, take the free then least recent slots.
        key = torch.where(protected[:, :capacity], _BIG, last_used[:, :capacity] + 1)
        order = torch.sort(key, dim=1, stable=True).indices
        rank = (miss.cumsum(dim=1) - 1).clamp(min=0)
        victim = torch.where(miss, order.gather(1, rank), capacity)  # [H, n]
        self._map(layer, miss, ids, victim, tick)
        fetch = miss & (torch.arange(count, device=self.device)[None, :] < written)
        self.counters[layer, :, COUNTS.index("misses")] += fetch.sum(dim=1)
        flat = heads * capacity + torch.where(hit, cached, victim)
        units, order = entries[fetch].sort()
        return flat, units, flat[fetch][order]

    # -- writes of new tokens (worker, ``write``)

    def cached_token_slots(self, layer: int, slot_mapping: torch.Tensor,
                           block_size: int) -> torch.Tensor:
        """[T, H_kv] flat cache slot holding each new token's block per head, -1
        where not cached (``reference.cached_token_slots``).

        Args:
            slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        """
        return reference.cached_token_slots(self.slot_of[layer], slot_mapping, block_size,
                                            self.num_kv_heads, self.slots_per_head)

    # -- once per step (worker, ``execute_model``)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drops a finished or preempted request's blocks from every layer's cache
        (no host sync: the ids reach the device behind the queued step)."""
        if not block_ids:
            return
        heads = self._heads.view(1, -1)
        blocks = host_to_device(block_ids, self.device)
        entries = (blocks[:, None] * self.num_kv_heads + heads).flatten()  # [n * H]
        slots = self.slot_of[:, entries].to(torch.int64)  # [L, n * H]
        held = slots >= 0
        layer_of = torch.arange(self.num_layers, device=self.device)[:, None].expand_as(slots)
        head_of = heads.expand(len(block_ids), -1).flatten()[None, :].expand_as(slots)
        where = (layer_of, head_of, torch.where(held, slots, self.slots_per_head))
        for table, value in ((self.block_of, -1), (self.last_used, -1), (self.inserted, -1),
                             (self.num_uses, 0)):
            table.index_put_(where, table.new_full((), value))
        self.slot_of[:, entries] = -1

    def take_counters(self) -> tuple[list[int], list[int]]:
        """(hits, misses) per sparse layer since the last call: (block, KV head)
        entries found in the cache and fetched. One host copy, which waits for
        the kernels queued so far (the data path drains ``take_counter_tensor``
        instead, ``worker/counters.py``)."""
        counts = self.take_counter_tensor().t().tolist()
        return counts[0], counts[1]

    def take_attended(self) -> torch.Tensor:
        """[layers, 2] (entries attended besides the rows' own, context tokens)
        counted by ``place`` since the last call, zeroed (in stream order)."""
        counts = self.counters[:, :, :2].sum(dim=1)
        self.counters[:, :, :2].zero_()
        return counts

    def take_counter_tensor(self) -> torch.Tensor:
        """[layers, 3] (hits, misses, units staged) on the device since the last
        call, the counters zeroed (in stream order)."""
        counts = torch.cat([self.counters[:, :, COUNTS.index("hits"):].sum(dim=1),
                            self.staged], dim=1)
        self.counters[:, :, COUNTS.index("hits"):].zero_()
        self.staged.zero_()
        return counts


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device`` without a host sync: ``torch.tensor(values,
    device=...)`` copies from pageable memory, which torch follows with a stream
    synchronize (the host would wait for the step queued before, and vLLM's
    overlap of the next step's preparation with it would be lost); from pinned
    memory the copy is queued like a kernel (its buffer kept until it is done
    by torch's pinned-memory allocator)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
