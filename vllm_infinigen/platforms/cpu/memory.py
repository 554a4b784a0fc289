# SPDX-License-Identifier: Apache-2.0
"""CPU worker: how the user's memory grant is split between vLLM's KV space,
the partial keys and InfiniGen's host pool (the pool itself is then planned
by ``vllm_infinigen.memory.plan_pool``).

The sparse layers hold no vLLM blocks, so from the same KV space vLLM gives
the dense group several times the token slots it would give a stock engine,
and an uncapped pool wants a K/V row for each of them in every sparse layer.
On the CPU build the pool and the KV space are the same RAM, so one budget
covers both (``split_grant``):

- ``--gpu-memory-utilization`` alone (vLLM sizes the KV space from the
  fraction): the budget vLLM computed is split three ways, in proportion to
  what one block id costs in each, so that the pool holds every slot of the
  dense group (nothing is evicted) and the three together stay within it.
- ``--kv-cache-memory-bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``): the KV space
  is what the user set (vLLM's blocks and the partial keys), and the pool
  gets what the memory fraction leaves after the worker's resident memory
  and the KV space, at most 90% of free memory less the KV space (shared by
  the host's workers). When the dense group holds
  more tokens than that pays for, the pool caps itself and evicts with
  ``--infinigen-eviction``.
- ``--infinigen-cpu-pool-gib``: the pool is what the user set, beside the KV
  space (``memory.cap_rows``); it fails at start-up when free memory cannot
  hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_infinigen.memory import FREE_MEMORY_SHARE, BlockCosts


@dataclass(frozen=True)
class GrantSplit:
    """What the worker tells vLLM, and what the pool may take."""

    kv_space: int  # bytes for vLLM's blocks (``determine_available_memory``)
    partial: int  # bytes of partial keys beside them
    pool_budget: int | None  # bytes for the pool; None: --infinigen-cpu-pool-gib
    source: str  # the setting that granted the pool's bytes, for the log


def split_grant(granted: int, costs: BlockCosts, *, explicit_kv: bool,
                explicit_pool: bool, requested: int, resident: int, free: int,
                fraction: float, ranks: int = 1) -> GrantSplit:
    """Splits the worker's memory grant.

    Args:
        granted: vLLM's own KV size for this worker (explicit bytes, or the
            memory fraction less what the worker already holds).
        explicit_kv: The KV space was set in bytes, not derived from the fraction.
        explicit_pool: ``--infinigen-cpu-pool-gib`` is set.
        requested: Bytes the memory fraction grants the worker.
        resident: Bytes the worker already holds (model, buffers).
        free: Free host memory now (before vLLM's blocks are made).
        fraction: ``--gpu-memory-utilization``, for the log.
        ranks: Workers of this host, each taking a share of ``free``.
    """
    with_partial = costs.pages + costs.partial
    if explicit_pool or explicit_kv:
        kv_space = granted * costs.pages // with_partial
        partial = granted - kv_space
        if explicit_pool:
            return GrantSplit(kv_space, partial, None, "--infinigen-cpu-pool-gib")
        free_share = int(FREE_MEMORY_SHARE * free) // ranks - granted
        budget = max(0, min(requested - resident - granted, free_share))
        return GrantSplit(kv_space, partial, budget,
                          f"--gpu-memory-utilization {fraction} less the worker's "
                          f"{resident / 2**30:.2f} GiB and the KV space of "
                          f"--kv-cache-memory-bytes")
    total = with_partial + costs.pool
    kv_space = granted * costs.pages // total
    partial = granted * costs.partial // total
    return GrantSplit(kv_space, partial, granted - kv_space - partial,
                      f"--gpu-memory-utilization {fraction}, shared with the KV space")
