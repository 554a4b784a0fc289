# SPDX-License-Identifier: Apache-2.0
"""Every process: the host pool InfiniGen plans, decided in one place.

The pool holds every sparse layer's K/V, a row per (token, sparse layer, KV
head). How many tokens it holds is decided once per worker::

    front end   cap_rows(): --infinigen-cpu-pool-gib must hold one step's
                tokens (refused at start-up otherwise)
    worker      the platform splits its memory grant into vLLM's KV space,
                the partial keys and a byte budget for the pool
                (CPU: ``platforms/cpu/memory.py``); once vLLM has made its
                blocks, plan_pool() turns the flag or that budget into the
                PoolPlan the runtime allocates
    scheduler   cap_rows() again, to tell a capped pool (whose use the
                workers report) from one with a row per slot

Nothing here imports torch: the front end and the scheduler read it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_infinigen.layout import ModelLayout

# Of free host memory, at most, for a pool (and for the budget a platform
# gives it): the rest stays for the process and the OS.
FREE_MEMORY_SHARE = 0.9
CAP_FLAG = "--infinigen-cpu-pool-gib"
# A capped pool's row map (``platforms/cpu/pool_index.py``), per (sparse layer,
# KV head): an int32 row per slot of the dense group, and per row five int64
# (owner, inserted, last use, count, the free stack).
INDEX_BYTES_PER_SLOT = 4
INDEX_BYTES_PER_ROW = 40


@dataclass(frozen=True)
class BlockCosts:
    """Bytes one block id of the dense group costs on one worker."""

    pages: int  # vLLM's pages (every layer of a KV-cache group)
    partial: int  # speculation keys (partial or int) of every sparse layer
    pool: int  # the pool's K/V rows of every sparse layer


def block_costs(layout: ModelLayout, dtype_bytes: int, block_size: int,
                kv_heads: int, kv_dtype_bytes: int | None = None) -> BlockCosts:
    """What one block id costs a worker with ``kv_heads`` KV heads (its
    rank's): per block id vLLM stores one page per layer of a group
    (``group_size`` pages, ``layout.kv_cache_group_size``); the speculation
    keys and the pool cover every token of the dense group in every sparse
    layer. A platform splits its grant by these (``platforms/<name>/memory.py``).

    Args:
        dtype_bytes: Of the model's dtype (the speculation keys).
        kv_dtype_bytes: Of a cached K/V element, vLLM's pages and the pool
            (1 with ``--kv-cache-dtype fp8``; None: ``dtype_bytes``).
    """
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    return BlockCosts(
        pages=layout.group_size * block_size * layout.kv_bytes_per_token_layer(
            kv_bytes, kv_heads),
        partial=block_size * layout.partial_bytes_per_token(dtype_bytes, kv_heads),
        pool=block_size * layout.pool_bytes_per_token(kv_bytes, kv_heads))


def cap_rows(cpu_pool_gib: float | None, pool_bytes_per_token: int,
             step_tokens: int) -> int | None:
    """Tokens per (sparse layer, KV head) that ``--infinigen-cpu-pool-gib`` pays for.

    Args:
        cpu_pool_gib: The flag's value (None: unset, the answer is None).
        pool_bytes_per_token: K/V bytes of every sparse layer, all ranks
            (``ModelLayout.pool_bytes_per_token``).
        step_tokens: Tokens one step writes (``--max-num-batched-tokens``).

    Raises:
        ValueError: When the cap cannot hold one step's tokens, naming the flags.
    """
    if cpu_pool_gib is None:
        return None
    rows = int(cpu_pool_gib * 2**30) // pool_bytes_per_token
    if rows < step_tokens:
        raise ValueError(
            f"{CAP_FLAG} {cpu_pool_gib} holds {rows} tokens, fewer than one step "
            f"writes ({step_tokens}, --max-num-batched-tokens); raise it to at least "
            f"{step_tokens * pool_bytes_per_token / 2**30:.4g}"
        )
    return rows


@dataclass(frozen=True)
class PoolPlan:
    """The pool of one worker, as the runtime allocates it.

    Uncapped, a row per slot of the dense group, addressed by block id;
    capped, ``num_rows`` rows per (layer, KV head), each mapped to a slot by
    the pool index (``platforms/cpu/pool_index.py``), in units of ``block_size`` rows.
    """

    num_rows: int  # tokens per (sparse layer, KV head)
    num_slots: int  # slots of the dense KV-cache group (block ids x block size)
    block_size: int
    num_bytes: int  # host bytes of every sparse layer's pool on this worker
    sized_by: str  # the setting that decided it, for the start-up log
    index_bytes: int = 0  # a capped pool's row map beside it (host bytes)

    @property
    def capped(self) -> bool:
        return self.num_rows < self.num_slots

    @property
    def num_units(self) -> int:
        """Blocks of ``block_size`` rows per (sparse layer, KV head)."""
        return -(-self.num_rows // self.block_size)


def plan_pool(*, num_blocks: int, block_size: int, bytes_per_token: int, step_tokens: int,
              cap: int | None, budget: int | None, sized_by: str, free: int,
              uncapped_only: str | None = None, cappable: bool = True,
              entries_per_token: int = 0, beside: int = 0, ranks: int = 1) -> PoolPlan:
    """Decides the pool of a worker whose dense group has ``num_blocks`` blocks.

    Args:
        bytes_per_token: K/V bytes of every sparse layer for one token, this
            worker's KV heads.
        cap: ``cap_rows`` of the flag (None: unset).
        budget: Bytes the platform gives the pool, its row map included
            (None: a row per slot, or the flag's cap).
        sized_by: The setting that granted them, for the log and the errors.
        free: Free host memory now, in bytes.
        uncapped_only: The policy's flag where it cannot run on a pool that
            evicts (None: it can).
        cappable: The platform takes ``CAP_FLAG`` (CUDA's pool has a row per slot).
        entries_per_token: Sparse layers x this worker's KV heads (a capped
            pool's row map has ``INDEX_BYTES_PER_*`` for each).
        beside: Host bytes allocated with the pool and not yet out of ``free``
            (the CPU build's speculation keys).
        ranks: Workers of this host planning alike at the same time, each
            against the same free memory.

    Raises:
        ValueError: When a budget cannot hold one step's tokens, or the pool
            would not fit in free host memory, naming the flags that change it.
    """
    num_slots = num_blocks * block_size
    if budget is None:
        rows = num_slots if cap is None else min(cap, num_slots)
    else:
        rows = min(num_slots, budget // bytes_per_token)
        if rows < num_slots:  # capped: its row map comes out of the budget too
            slot_map = entries_per_token * INDEX_BYTES_PER_SLOT * num_slots
            rows = max(0, budget - slot_map) // (
                bytes_per_token + entries_per_token * INDEX_BYTES_PER_ROW)
        if rows < min(step_tokens, num_slots):
            raise ValueError(
                f"InfiniGen's pool gets {budget / 2**30:.3f} GiB from {sized_by}: {rows} "
                f"tokens, fewer than one step writes ({step_tokens}, "
                "--max-num-batched-tokens). Raise --gpu-memory-utilization, lower "
                f"--kv-cache-memory-bytes, or size the pool with {CAP_FLAG}"
            )
    capped = rows < num_slots
    if capped and uncapped_only:
        raise ValueError(
            f"{uncapped_only} runs on an uncapped pool, and the {budget / 2**30:.3f} GiB it "
            f"gets from {sized_by} hold {rows} of the dense layers' {num_slots} tokens: "
            "raise --gpu-memory-utilization or lower --kv-cache-memory-bytes")
    units = -(-rows // block_size) if capped else num_blocks
    index = (entries_per_token * (INDEX_BYTES_PER_SLOT * num_slots + INDEX_BYTES_PER_ROW * rows)
             if capped else 0)
    plan = PoolPlan(rows, num_slots, block_size, units * block_size * bytes_per_token,
                    sized_by or "the dense group's slots", index)
    needed = plan.num_bytes + index + beside
    if ranks * needed > FREE_MEMORY_SHARE * free:
        if cap is not None:
            fix = f"lower {CAP_FLAG}"
        elif cappable:
            fix = (f"set {CAP_FLAG}, or lower --gpu-memory-utilization or "
                   "--kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE)")
        else:
            fix = (f"lower --gpu-memory-utilization or --kv-cache-memory-bytes (this "
                   f"platform refuses {CAP_FLAG})")
        parts = [f"{plan.num_bytes / 2**30:.2f} GiB of K/V"] + [
            f"{size / 2**30:.2f} GiB {what}" for size, what in (
                (index, "row map"), (beside, "speculation keys")) if size]
        each = f", on each of this host's {ranks} workers" if ranks > 1 else ""
        raise ValueError(
            f"InfiniGen's pool for {rows} tokens needs {needed / 2**30:.2f} GiB "
            f"of host memory ({', '.join(parts)}{each}), {free / 2**30:.2f} GiB is free; "
            f"{fix} (sized by {plan.sized_by})")
    return plan
