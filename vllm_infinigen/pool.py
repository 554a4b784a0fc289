# SPDX-License-Identifier: Apache-2.0
"""Where each KV entry of the sparse layers lives in a capped host pool.

Uncapped, the pool has a row for every slot of the dense layers' KV-cache
group and a token's row is its slot id (``IdentityPoolIndex``): vLLM's
allocator admits, preempts and frees pool space with the dense blocks.

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
prefill rows of later chunks attend without it. All bookkeeping is a few
tensor ops per step, over [sparse layers, KV heads, rows].
"""

from __future__ import annotations

import torch

from vllm_infinigen.config import EVICTION_POLICIES, FLAG_OF_FIELD, infinigen_config_of

_COUNT_SHIFT = 40  # key = newer_half << 62 | count << 40 | insertion tick
_NEWER_HALF = 1 << 62


def pool_bytes_per_token(vllm_config) -> int:
    """Bytes of K and V of all sparse layers (all ranks) for one token."""
    config = infinigen_config_of(vllm_config.additional_config)
    model = vllm_config.model_config
    hf = model.hf_text_config
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    num_sparse = max(hf.num_hidden_layers - config.dense_layers, 0)
    return 2 * num_sparse * num_kv_heads * model.get_head_size() * model.dtype.itemsize


def pool_rows(vllm_config, num_slots: int) -> int:
    """Tokens the pool holds per (layer, KV head): the cap, or every slot.

    Raises:
        ValueError: When the cap cannot hold one step's tokens, naming the flags.
    """
    config = infinigen_config_of(vllm_config.additional_config)
    if config.cpu_pool_gib is None:
        return num_slots
    rows = int(config.cpu_pool_gib * 2**30) // pool_bytes_per_token(vllm_config)
    step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if rows < step_tokens:
        raise ValueError(
            f"{FLAG_OF_FIELD['cpu_pool_gib']} {config.cpu_pool_gib} holds {rows} tokens, "
            f"fewer than one step writes ({step_tokens}, --max-num-batched-tokens); "
            f"raise it to at least "
            f"{step_tokens * pool_bytes_per_token(vllm_config) / 2**30:.4g}"
        )
    return min(rows, num_slots)


def make_pool_index(num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                    policy: str, device: torch.device):
    """A capped index when the pool has fewer rows than slots, else the identity."""
    if num_rows >= num_slots:
        return IdentityPoolIndex(num_slots)
    return CappedPoolIndex(num_layers, num_heads, num_slots, num_rows, policy, device)


class IdentityPoolIndex:
    """Row of a slot's entry = the slot id (uncapped pool)."""

    capped = False

    def __init__(self, num_slots: int) -> None:
        self.num_rows = num_slots
        self.evictions = None

    def rows(self, layer: int, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` in the KV heads ``heads`` (broadcast together).

        Padding slots (< 0) map to the padding row ``num_rows``.
        """
        slots = torch.where(slots < 0, self.num_rows, slots)
        return slots + torch.zeros_like(heads)

    def admit(self, slots: torch.Tensor) -> None:
        return None

    def release(self, slots: torch.Tensor) -> None:
        return None

    def record_use(self, layer: int, rows: torch.Tensor, valid: torch.Tensor) -> None:
        return None


class CappedPoolIndex:
    """Per-(layer, head) maps from slot id to one of ``num_rows`` pool rows.

    Args:
        num_layers: Sparse layers (index 0 is the first sparse layer).
        num_heads: KV heads per layer on this worker.
        num_slots: Slot ids of the dense group (block ids x block size).
        num_rows: Rows of the pool per (layer, head).
        policy: One of ``EVICTION_POLICIES``.
    """

    capped = True

    def __init__(self, num_layers: int, num_heads: int, num_slots: int, num_rows: int,
                 policy: str, device: torch.device | str = "cpu") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"--infinigen-eviction must be one of {list(EVICTION_POLICIES)}, got {policy!r}"
            )
        self.policy = policy
        self.num_rows = num_rows
        self.num_slots = num_slots
        shape = (num_layers, num_heads, num_rows)
        # row_of[l, s, h]: row of slot s's entry, -1 when absent; slot num_slots
        # is the padding slot and maps to the padding row num_rows.
        self.row_of = torch.full((num_layers, num_slots + 1, num_heads), -1,
                                 dtype=torch.int64, device=device)
        self.row_of[:, num_slots] = num_rows
        self.owner = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.inserted = torch.zeros(shape, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(shape, dtype=torch.int64, device=device)
        self.count = torch.zeros(shape, dtype=torch.int64, device=device)
        self.evictions = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self._tick = 0
        self._layers = torch.arange(num_layers, device=device)[:, None, None]
        self._heads = torch.arange(num_heads, device=device)[None, :, None]

    def rows(self, layer: int, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` in the KV heads ``heads`` (broadcast together).

        -1 where the entry is absent (evicted); padding slots (< 0) map to the
        padding row ``num_rows``.
        """
        slots = torch.where(slots < 0, self.num_slots, slots)
        return self.row_of[layer][slots, heads]

    def occupied(self) -> torch.Tensor:
        """[layers] entries held (summed over heads)."""
        return (self.owner >= 0).sum(dim=(1, 2))

    def release(self, slots: torch.Tensor) -> None:
        """Frees the entries of ``slots`` (a finished or preempted request's)."""
        slots = slots[slots >= 0]
        if slots.numel() == 0:
            return
        rows = self.row_of[:, slots].permute(0, 2, 1)  # [L, H, n]
        held = rows >= 0
        layers = self._layers.expand_as(rows)[held]
        heads = self._heads.expand_as(rows)[held]
        self.owner[layers, heads, rows[held]] = -1
        self.row_of[:, slots] = -1

    def admit(self, slots: torch.Tensor) -> None:
        """Gives every (layer, head) a row for each new slot, evicting when full.

        Args:
            slots: [n] slot ids of the tokens about to be written (< 0 ignored).

        Raises:
            ValueError: When a step writes more tokens than the pool has rows.
        """
        slots = slots[slots >= 0]
        count = slots.numel()
        if count == 0:
            return
        if count > self.num_rows:
            raise ValueError(
                f"a step writes {count} tokens but the pool holds {self.num_rows} per "
                "head; raise --infinigen-cpu-pool-gib or lower --max-num-batched-tokens"
            )
        self.release(slots)  # a reused slot id drops what it held
        victims = torch.topk(self._eviction_key(count), count, dim=-1, largest=False).indices
        previous = self.owner.gather(-1, victims)  # [L, H, n]
        evicted = previous >= 0
        self.evictions += evicted.sum(dim=(1, 2))
        layers = self._layers.expand_as(victims)
        heads = self._heads.expand_as(victims)
        self.row_of[layers[evicted], previous[evicted], heads[evicted]] = -1
        new_slots = slots.view(1, 1, count).expand_as(victims)
        ticks = self._tick + torch.arange(count, device=slots.device).view(1, 1, count)
        self._tick += count
        self.owner.scatter_(-1, victims, new_slots)
        self.inserted.scatter_(-1, victims, ticks.expand_as(victims))
        self.last_used.scatter_(-1, victims, ticks.expand_as(victims))
        self.count.scatter_(-1, victims, torch.zeros_like(victims))
        self.row_of[layers, new_slots, heads] = victims

    def record_use(self, layer: int, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Counts a selection of ``rows`` [B, H, K] (where ``valid``) in ``layer``."""
        heads = self._heads[0].expand_as(rows)
        rows, heads = rows[valid], heads[valid]
        self.count[layer].index_put_((heads, rows), torch.ones_like(rows), accumulate=True)
        self.last_used[layer][heads, rows] = self._tick
        self._tick += 1  # later uses and insertions are more recent

    def _eviction_key(self, needed: int) -> torch.Tensor:
        """[L, H, rows] int64; the ``needed`` lowest are taken (free rows: -1)."""
        free = self.owner < 0
        if bool((free.sum(dim=-1) >= needed).all()):
            return (~free).to(torch.int64) - 1  # free rows first, no eviction
        if self.policy == "fifo":
            key = self.inserted.clone()
        elif self.policy == "lru":
            key = self.last_used.clone()
        else:
            # The oldest half: insertion tick at most the median of the held ones.
            held = (~free).sum(dim=-1, keepdim=True)
            order = torch.where(free, torch.iinfo(torch.int64).max, self.inserted)
            ordered = order.sort(dim=-1).values
            half = torch.clamp((held + 1) // 2 - 1, min=0)
            cutoff = ordered.gather(-1, half)
            newer = (self.inserted > cutoff).to(torch.int64) * _NEWER_HALF
            key = newer + (self.count << _COUNT_SHIFT) + self.inserted
        return key.masked_fill(free, -1)
