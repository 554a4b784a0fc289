# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's capped host pool: where each KV entry of the sparse layers lives.

Uncapped, the pool has a row for every slot of the dense layers' KV-cache
group and a token's row is its slot id (``worker/pool_index.IdentityPoolIndex``).
With ``--infinigen-cpu-pool-gib``, the pool has fewer rows than there are
slots (``CappedPoolIndex``). Every (sparse layer, KV head) then keeps its own
map from slot id to row and evicts on its own when it runs out of rows, as the
paper's pool does: a head keeps the entries it selects, not those other heads
select. Eviction policies (the InfiniGen artifact's three, lower key first):

    fifo      the oldest entry
    lru       the entry selected least recently (its insertion counts as a use)
    counter   among the oldest half of the entries, the one selected least often
              (ties: the oldest); the paper's default and best

An evicted entry is gone for good: the selector no longer sees its token, and
prefill rows of later chunks attend without it.

With vLLM's prefix caching a finished or preempted request's blocks keep their
K/V for a later request that hits them, so their entries are *retired*
instead of freed (``retire_blocks``): kept, first to go under every policy (their
keys below every live entry's), counted neither as held (``occupancy``) nor as
evictions when they go. A request that hits them revives them
(``revive_blocks``: keys as if admitted now); a slot written again drops them.

Cost per step. The slot -> row map is block-granular,
``row_map[layer, block, head, offset]`` (int32, -1 when absent), so a kernel can
read one layer's map as a ``[num_blocks, H, block_size]`` array. Every
(layer, head) keeps a stack of its free rows; admitting ``n`` tokens pops ``n``
rows of each (O(layers x heads x n)) and releasing pushes them back, with no
scan of the pool. Only when some (layer, head) has fewer than ``n`` free rows
are the policy's keys computed, over the rows of the layers concerned, and
evicted in a batch: each such (layer, head) evicts its lowest-key entries until
it has ``n + num_rows // 16`` free rows (never more entries than it holds). It
thus evicts a little early, by at most ``num_rows // 16`` entries, so that a
head sets off a scan (of its layer) at most once per ``num_rows // 16`` tokens
admitted.
"""

from __future__ import annotations

import torch

from vllm_infinigen.config import EVICTION_POLICIES
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.worker.pool_index import IdentityPoolIndex, PoolIndex

_COUNT_SHIFT = 40  # key = newer_half << 62 | count << 40 | insertion tick
_NEWER_HALF = 1 << 62
_MAX_COUNT = (1 << (62 - _COUNT_SHIFT)) - 1  # counts saturate there, below the half's bit
_NEVER = torch.iinfo(torch.int64).max  # eviction key of a free row
_RESERVE_FRACTION = 16  # a batch eviction leaves num_rows // 16 rows spare
_RETIRED = -1  # insertion and use tick of a retired entry: below every live one's


def make_pool_index(num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                    policy: str, device: torch.device, *, block_size: int) -> PoolIndex:
    """A capped index when the pool has fewer rows than slots, else the identity.

    Args:
        block_size: Tokens per block of the dense group; lays out the capped
            index's ``row_map`` (ignored by the identity).
    """
    if num_rows >= num_slots:
        return IdentityPoolIndex(num_slots)
    return CappedPoolIndex(num_layers, num_heads, num_slots, num_rows, policy, device,
                           block_size=block_size)


class CappedPoolIndex:
    """Per-(layer, head) maps from slot id to one of ``num_rows`` pool rows.

    Args:
        num_layers: Sparse layers (index 0 is the first sparse layer).
        num_heads: KV heads per layer on this worker.
        num_slots: Slot ids of the dense group (block ids x block size).
        num_rows: Rows of the pool per (layer, head).
        policy: One of ``EVICTION_POLICIES``.
        block_size: Tokens per block of the dense group; must divide
            ``num_slots``. None: one block of all ``num_slots`` (hand-built cases).

    Raises:
        ValueError: On an unknown policy, or a block size not dividing the slots.
    """

    def __init__(self, num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                 policy: str, device: torch.device | str = "cpu", *,
                 block_size: int | None = None) -> None:
        self.set_eviction(policy)
        block_size = num_slots if block_size is None else block_size
        if block_size <= 0 or num_slots % block_size:
            raise ValueError(f"block size {block_size} does not divide {num_slots} slots")
        self.num_rows = num_rows
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.block_size = block_size
        self.num_blocks = num_slots // block_size
        shape = (num_layers, num_heads, num_rows)
        # row_map[l, b, h, o]: row of slot b * block_size + o's entry, -1 when absent.
        self.row_map = torch.full((num_layers, self.num_blocks, num_heads, block_size), -1,
                                  dtype=torch.int32, device=device)
        self.owner = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.inserted = torch.zeros(shape, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(shape, dtype=torch.int64, device=device)
        self.count = torch.zeros(shape, dtype=torch.int64, device=device)
        self.evictions = torch.zeros(num_layers, dtype=torch.int64, device=device)
        # free_rows[l, h, :num_free[l, h]]: a stack of free rows, row 0 on top.
        self.free_rows = torch.arange(num_rows - 1, -1, -1, dtype=torch.int64,
                                      device=device).repeat(num_layers, num_heads, 1)
        self.num_free = torch.full((num_layers, num_heads), num_rows, dtype=torch.int64,
                                   device=device)  # [L, H]
        self.num_retired = torch.zeros_like(self.num_free)  # [L, H] retired entries held
        self._tick = 0
        self._layer_ids = torch.arange(num_layers, device=device)
        self._heads = torch.arange(num_heads, device=device)[None, :, None]

    def set_eviction(self, policy: str) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"--infinigen-eviction must be one of {list(EVICTION_POLICIES)}, got {policy!r}"
            )
        self.eviction = policy

    def row_map_of(self, layer: int) -> torch.Tensor:
        return self.row_map[layer]

    def take_evictions(self) -> list[int]:
        evictions = self.evictions.tolist()
        self.evictions.zero_()
        return evictions

    def occupancy(self) -> tuple[int, int]:
        held = self.occupied().sum() - self.num_retired.sum()
        return (int(held), self.num_rows * self.num_heads * self.num_layers)

    @property
    def row_of(self) -> torch.Tensor:
        """[L, num_slots + 1, H] int64 copy of ``row_map`` by slot id (tests, debugging).

        Slot ``num_slots`` is the padding slot and maps to the padding row.
        """
        by_slot = self.row_map.permute(0, 1, 3, 2).reshape(
            self.row_map.shape[0], self.num_slots, self.num_heads).to(torch.int64)
        pad = torch.full_like(by_slot[:, :1], self.num_rows)
        return torch.cat([by_slot, pad], dim=1)

    def rows(self, layer: int, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` in the KV heads ``heads`` (broadcast together), int64.

        -1 where the entry is absent (evicted); padding slots (< 0) map to the
        padding row ``num_rows``.
        """
        padding = slots < 0
        rows = self.row_map[layer].view(-1)[self._flat(slots.clamp(min=0), heads)]
        return torch.where(padding, self.num_rows, rows.to(torch.int64))

    def occupied(self) -> torch.Tensor:
        """[layers] entries held (summed over heads)."""
        return self.num_rows * self.num_heads - self.num_free.sum(dim=1)

    def release(self, slots: torch.Tensor) -> None:
        """Frees the entries of ``slots`` (a finished or preempted request's)."""
        slots = torch.unique(slots[slots >= 0])
        if slots.numel() == 0:
            return
        table = self.row_map.view(self.row_map.shape[0], -1)  # [L, blocks * H * block]
        where = self._flat(slots[None, :], self._heads[0])  # [H, n]
        rows = table[:, where].to(torch.int64)  # [L, H, n]
        self._free(self._layer_ids, rows, rows >= 0)
        table[:, where] = -1

    def release_blocks(self, block_ids: list[int]) -> None:
        """Frees the entries of every slot of ``block_ids``."""
        self.release(self._slots_of(block_ids))

    def retire_blocks(self, block_ids: list[int]) -> None:
        """Keeps the entries of ``block_ids`` (prefix-cached, held by no live
        request), first to be evicted."""
        rows, held = self._held_rows(block_ids)
        held &= self._ticks_of(rows, self.inserted) != _RETIRED
        self.num_retired += held.sum(dim=-1)
        self._set_ticks(rows, held, _RETIRED)

    def revive_blocks(self, block_ids: list[int]) -> None:
        """The retired entries of ``block_ids`` (a new request's prefix-cache
        hit) held again, as if admitted now."""
        rows, held = self._held_rows(block_ids)
        held &= self._ticks_of(rows, self.inserted) == _RETIRED
        self.num_retired -= held.sum(dim=-1)
        self._set_ticks(rows, held, self._tick)
        self._tick += 1

    def _slots_of(self, block_ids: list[int]) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.row_map.device)
        return (blocks[:, None] * self.block_size
                + torch.arange(self.block_size, device=blocks.device)).flatten()

    def _held_rows(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, H, n] rows of the slots of ``block_ids`` (-1 clamped to 0) and
        where they are held."""
        table = self.row_map.view(self.row_map.shape[0], -1)
        slots = torch.unique(self._slots_of(block_ids))
        rows = table[:, self._flat(slots[None, :], self._heads[0])].to(torch.int64)
        return rows.clamp(min=0), rows >= 0

    def _ticks_of(self, rows: torch.Tensor, ticks: torch.Tensor) -> torch.Tensor:
        return ticks.gather(-1, rows)

    def _set_ticks(self, rows: torch.Tensor, held: torch.Tensor, tick: int) -> None:
        """Insertion and use ticks of ``rows`` [L, H, n] where ``held``; count 0."""
        where = (self._layer_ids.view(-1, 1, 1).expand_as(rows)[held],
                 self._heads.expand_as(rows)[held], rows[held])
        self.inserted[where] = tick
        self.last_used[where] = tick
        self.count[where] = 0

    def admit(self, slots: torch.Tensor) -> None:
        """Gives every (layer, head) a row for each new slot, evicting when full.

        Args:
            slots: [n] slot ids of the tokens about to be written (< 0 ignored).

        Raises:
            ValueError: When a step writes more tokens than the pool has rows.
        """
        slots = _first_occurrences(slots[slots >= 0])
        count = slots.numel()
        if count == 0:
            return
        if count > self.num_rows:
            raise ValueError(
                f"a step writes {count} tokens but the pool holds {self.num_rows} per "
                "head; raise --infinigen-cpu-pool-gib or lower --max-num-batched-tokens"
            )
        self.release(slots)  # a reused slot id drops what it held
        if bool((self.num_free < count).any()):
            self._evict(count)
        steps = torch.arange(count, device=slots.device)
        rows = self.free_rows.gather(-1, self.num_free[..., None] - 1 - steps)  # [L, H, n]
        self.num_free -= count
        new_slots = slots.view(1, 1, count).expand_as(rows)
        ticks = (self._tick + steps).view(1, 1, count).expand_as(rows)
        self._tick += count
        self.owner.scatter_(-1, rows, new_slots)
        self.inserted.scatter_(-1, rows, ticks)
        self.last_used.scatter_(-1, rows, ticks)
        self.count.scatter_(-1, rows, torch.zeros_like(rows))
        table = self.row_map.view(self.row_map.shape[0], -1)
        table[:, self._flat(slots[None, :], self._heads[0])] = rows.to(torch.int32)

    def record_use(self, layer: int, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Counts a selection of ``rows`` [B, H, K] (where ``valid``) in ``layer``."""
        heads = self._heads[0].expand_as(rows)
        rows, heads = rows[valid], heads[valid]
        self.count[layer].index_put_((heads, rows), torch.ones_like(rows), accumulate=True)
        self.last_used[layer][heads, rows] = self._tick
        self._tick += 1  # later uses and insertions are more recent

    def record_selection(self, layer: int, positions: torch.Tensor,
                         block_table: torch.Tensor) -> None:
        """``record_use`` of a selection in one kernel call.

        Args:
            positions: [B, H, K] int32 selected positions (-1: none).
            block_table: [B, max_blocks] int32 block ids of each row's request.
        """
        kernels.record_uses(positions, block_table, self.row_map[layer], self.count[layer],
                            self.last_used[layer], self._tick)
        self._tick += 1  # later uses and insertions are more recent

    def _flat(self, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Index into one layer's flattened ``row_map`` (slots >= 0, broadcast)."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return (blocks * self.num_heads + heads) * self.block_size + offsets

    def _free(self, layers: torch.Tensor, rows: torch.Tensor, held: torch.Tensor) -> None:
        """Frees ``rows`` [l, H, k] of ``layers`` [l] where ``held``; pushes them.

        Leaves ``row_map`` to the caller.
        """
        top = self.num_free[layers][..., None] + held.cumsum(dim=-1) - 1  # [l, H, k]
        layer_of = layers.view(-1, 1, 1).expand_as(rows)[held]
        head_of = self._heads.expand_as(rows)[held]
        freed = rows[held]
        retired = self.inserted[layer_of, head_of, freed] == _RETIRED
        self.num_retired.index_put_((layer_of[retired], head_of[retired]),
                                    -torch.ones_like(freed[retired]), accumulate=True)
        self.owner[layer_of, head_of, freed] = -1
        self.free_rows[layer_of, head_of, top[held]] = freed
        self.num_free[layers] += held.sum(dim=-1)

    def _evict(self, needed: int) -> None:
        """Evicts, in the layers where a head has fewer than ``needed`` free rows.

        Each such (layer, head) evicts its lowest-key entries until it has
        ``needed + num_rows // 16`` free rows, or holds nothing.
        """
        short = self.num_free < needed  # [L, H]
        layers = torch.nonzero(short.any(dim=1)).flatten()  # [l]
        free = self.num_free[layers]  # [l, H]
        want = needed + self.num_rows // _RESERVE_FRACTION - free
        want = torch.where(short[layers], want.clamp(max=self.num_rows - free), 0)
        key = self._eviction_key(layers)  # [l, H, rows]
        victims = torch.topk(key, int(want.max()), dim=-1, largest=False).indices
        ranks = torch.arange(victims.shape[-1], device=victims.device)
        held = ranks < want[..., None]  # [l, H, k]: the want lowest keys
        previous = self.owner[layers].gather(-1, victims)  # [l, H, k] slots
        held &= previous >= 0
        live = held & (self.inserted[layers].gather(-1, victims) != _RETIRED)
        self.evictions[layers] += live.sum(dim=(1, 2))  # (retired entries: not losses)
        table = self.row_map.view(self.row_map.shape[0], -1)
        where = self._flat(previous.clamp(min=0), self._heads)  # [l, H, k]
        layer_of = layers.view(-1, 1, 1).expand_as(where)
        table[layer_of[held], where[held]] = -1
        self._free(layers, victims, held)

    def _eviction_key(self, layers: torch.Tensor) -> torch.Tensor:
        """[l, H, rows] int64 keys of ``layers``' rows; lower goes first, free: never."""
        owner, inserted = self.owner[layers], self.inserted[layers]
        free = owner < 0
        if self.eviction == "fifo":
            key = inserted
        elif self.eviction == "lru":
            key = self.last_used[layers]
        else:
            # The oldest half: insertion tick at most the median of the held ones.
            held = (~free).sum(dim=-1, keepdim=True)
            order = torch.where(free, _NEVER, inserted)
            ordered = order.sort(dim=-1).values
            half = torch.clamp((held + 1) // 2 - 1, min=0)
            cutoff = ordered.gather(-1, half)
            newer = (inserted > cutoff).to(torch.int64) * _NEWER_HALF
            key = newer + (self.count[layers].clamp(max=_MAX_COUNT) << _COUNT_SHIFT) + inserted
        return key.masked_fill(free, _NEVER)


def _first_occurrences(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` [n] without repeats, each at its first position."""
    unique, inverse = torch.unique(slots, return_inverse=True)
    if unique.numel() == slots.numel():
        return slots
    positions = torch.arange(slots.numel(), device=slots.device)
    first = torch.full_like(unique, slots.numel()).scatter_reduce_(
        0, inverse, positions, reduce="amin")
    return slots[first.sort().values]
