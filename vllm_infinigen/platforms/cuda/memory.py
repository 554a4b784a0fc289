# SPDX-License-Identifier: Apache-2.0
"""CUDA worker: how vLLM's GPU grant is split between its KV space, the
speculation keys and the device block cache (the pool is host memory, planned
by ``vllm_infinigen.memory.plan_pool``).

    GPU grant  = vLLM's blocks (dense layers)          per block id
               + speculation keys of the sparse layers  per block id
               + device block cache                    fixed: layers x H_kv x slots
    host       = the pool, a row per slot of the dense group (uncapped: the
                 cache names blocks by id, ``platforms/cuda/__init__.py``)

The cache must hold one step's widest selection (``DeviceBlockCache.lookup``
refuses more); beyond that, slots keep blocks for reuse in later steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_infinigen.config import InfiniGenConfig, flag
from vllm_infinigen.platforms.cuda.kernels import static_width, window_blocks

# Slots per head as a multiple of the widest step's blocks: replaying selections
# recorded on two trained models, lru with 1.5x-2x the widest step hit within
# 0.4-1.6 points of the artifact's counter rule (benchmarks/results/selection_reuse.md).
REUSE_FACTOR = 2
# Bookkeeping bytes of the cache per (layer, KV head, slot) and per (layer, KV
# head, block id) (``DeviceBlockCache``'s memory note).
SLOT_BOOKKEEPING_BYTES, BLOCK_BOOKKEEPING_BYTES = 24, 4


def cache_slots_per_head(*, max_num_seqs: int, max_model_len: int, block_size: int,
                         budget: float, min_context: int, sink_tokens: int,
                         recent_tokens: int, budget_tokens: int | None = None,
                         reuse: float = REUSE_FACTOR) -> int:
    """Slots per (sparse layer, KV head) of the device block cache.

    Every step selects the same number of blocks per row and KV head, the
    static width of ``kernels.static_width`` (the budget rounded up to
    blocks on top of the windows' blocks, or every block below the min
    context, for the longest row); ``reuse`` times that per row (at most the
    row's blocks), for every running row.

    Args:
        budget, min_context, budget_tokens: ``--infinigen-budget``,
            ``--infinigen-min-context``, ``--infinigen-budget-tokens`` at start-up (a
            running engine may not raise them: ``CudaDataPath.configure``).
        sink_tokens, recent_tokens: ``--infinigen-sink-tokens``, ``--infinigen-recent-tokens``.
    """
    table_blocks = -(-max_model_len // block_size) + 1
    sink_blocks, recent_blocks = window_blocks(sink_tokens, recent_tokens, block_size)
    width = static_width(table_blocks, block_size, budget=budget, min_context=min_context,
                         sink_blocks=sink_blocks, recent_blocks=recent_blocks,
                         budget_tokens=budget_tokens)
    return max_num_seqs * min(table_blocks, math.ceil(width * reuse))


def cache_bytes(*, num_sparse: int, kv_heads: int, slots_per_head: int, block_size: int,
                head_size: int, dtype_bytes: int) -> int:
    """Device bytes of every sparse layer's cache units (scratch included) and
    per-slot bookkeeping."""
    unit = block_size * 2 * head_size * dtype_bytes
    per_layer = (kv_heads * slots_per_head + 1) * unit
    return num_sparse * (per_layer + kv_heads * (slots_per_head + 1) * SLOT_BOOKKEEPING_BYTES)


@dataclass(frozen=True)
class DeviceSplit:
    """What the worker tells vLLM, and what InfiniGen keeps beside it."""

    kv_space: int  # bytes for vLLM's blocks (``determine_available_memory``)
    speculation: int  # bytes of speculation keys (and cache lookup tables) beside them
    cache: int  # bytes of the device block cache


def split_device_grant(granted: int, *, pages: int, speculation: int, cache: int,
                       rows: int = 1, row_blocks: int = 0) -> DeviceSplit:
    """Splits vLLM's GPU grant.

    Args:
        granted: vLLM's own KV size for this worker.
        pages: Bytes of vLLM's pages per block id (every layer of a group).
        speculation: Bytes of every sparse layer's speculation keys (and the
            cache's per-block lookup) per block id.
        cache: Bytes of the device block cache (``cache_bytes``).
        rows, row_blocks: ``--max-num-seqs``, for which the cache is sized, and the
            blocks of a ``--max-model-len`` row: the error says how many such rows
            would fit beside their blocks.

    Raises:
        ValueError: When the cache leaves nothing for vLLM's blocks, naming
            the flags that change it.
    """
    rest = granted - cache
    if rest < pages + speculation:
        fit = int(granted // (cache / rows + row_blocks * (pages + speculation)))
        fits = (f"; {fit} rows of --max-model-len would fit beside their blocks "
                f"(--max-num-seqs {fit})" if 0 < fit < rows else "")
        raise ValueError(
            f"InfiniGen's device block cache needs {cache / 2**30:.3f} GiB of the "
            f"{granted / 2**30:.3f} GiB KV space, leaving no room for one block (it holds, for "
            "each of --max-num-seqs rows, every block of a context below "
            "--infinigen-min-context and the budget's blocks above it); lower --max-num-seqs, "
            "--max-model-len, --infinigen-min-context or --infinigen-budget, set "
            "--infinigen-budget-tokens, or raise --gpu-memory-utilization "
            f"(--kv-cache-memory-bytes where given){fits}")
    kv_space = rest * pages // (pages + speculation)
    return DeviceSplit(kv_space, rest - kv_space, cache)


def refuse_widening(start: InfiniGenConfig, config: InfiniGenConfig) -> None:
    """Raises ValueError naming the flag whose change ``widening`` finds."""
    refused = widening(start, config)
    if refused == flag("policy"):  # from infinigen's, the only one CUDA starts with
        raise ValueError(f"on CUDA, {flag('policy')} {config.policy} is not supported (the "
                         "baselines run on the CPU build); keep infinigen")
    if refused:
        raise ValueError(
            f"on CUDA, {refused} cannot change that way in a running engine (the device "
            "block cache and the captured CUDA graphs are sized by its start-up value); "
            "restart the engine with the new value")


def widening(start: InfiniGenConfig, config: InfiniGenConfig) -> str | None:
    """The flag whose change from ``start`` (the settings that sized the device
    block cache and the captured graphs) a running engine cannot follow, or None."""
    if config.budget > start.budget:
        return flag("budget")
    if config.min_context > start.min_context:
        return flag("min_context")
    if start.budget_tokens is not None and (config.budget_tokens is None
                                            or config.budget_tokens > start.budget_tokens):
        return flag("budget_tokens")
    # Kernel arguments and host decisions a captured graph keeps.
    for name in ("sink_tokens", "recent_tokens", "speculation", "policy",
                 "eval_dense_prefix"):
        if getattr(config, name) != getattr(start, name):
            return flag(name)
    return None
