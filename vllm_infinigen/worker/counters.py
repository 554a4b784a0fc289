# SPDX-License-Identifier: Apache-2.0
"""Worker side: step counters read back from the device without waiting for the
step, and the counters the connector reports from them.

vLLM's runner asks the KV connector for its stats right after it has queued a
step's forward (``kv_connector_model_runner_mixin._get_kv_connector_output``).
A plain host read of counters that the step's kernels add to would wait for
the whole step, and with it the host's preparation of the next step, which
vLLM otherwise overlaps with the GPU's work. ``CounterDrain`` copies the
counters to pinned host memory behind the step, asynchronously, and hands
back the copy made at the previous drain: the counters arrive one step late
and none is lost (``wait=True`` reads everything now, for a benchmark's
totals). On the CPU the read is immediate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.pool_index import PoolIndex


class CounterDrain:
    """Drains one device tensor of counts (the caller adds to it between drains)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # pinned: the copy in flight
        self._ready = None  # torch.Event recorded after that copy

    def __call__(self, counts: torch.Tensor, *, wait: bool = False) -> torch.Tensor | None:
        """The counts since the last drain that have reached the host (a host
        tensor of ``counts``' shape, or None when none has yet), and
        ``counts`` zeroed. On the CPU, or with ``wait``, every count so far."""
        if counts.is_cpu:
            values = counts.clone()
            counts.zero_()
            return values
        previous = None
        if self._ready is not None:
            self._ready.synchronize()  # the copy behind the previous step: done by now
            previous = self._host.clone()
        if wait:
            current = counts.cpu()  # waits for the steps queued so far
            counts.zero_()
            self._ready = None
            return current if previous is None else previous + current
        if self._host is None:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        self._host.copy_(counts, non_blocking=True)
        counts.zero_()  # in stream order, after the copy
        self._ready = torch.Event(device=counts.device)
        self._ready.record()
        return previous


def layer_counters(layers: Sequence[LayerState], drained: torch.Tensor | None,
                   fetch_wait_us: Sequence[int], *, total_kv_heads: int,
                   entry_bytes: int) -> dict[str, float]:
    """The sparse layers' counters from a drain of the runtime's ``stats``
    ([layers, 2]: entries attended, context tokens, summed over this rank's KV
    heads); tokens as the mean over the model's KV heads (vLLM sums the ranks).

    Args:
        drained: ``CounterDrain``'s answer (None: nothing has reached the host yet).
        fetch_wait_us: Microseconds each layer waited for its selected K/V.
        entry_bytes: One pool entry (a token's K and V of one layer and KV head).
    """
    out: dict[str, float] = {}
    values = [] if drained is None else drained.tolist()
    for state, (entries, context) in zip(layers, values):
        if state.sparse and context:
            idx = state.layer_idx
            out[f"selected_tokens.{idx}"] = entries / total_kv_heads
            out[f"candidate_tokens.{idx}"] = context * state.num_kv_heads / total_kv_heads
            out[f"selected_kv_bytes.{idx}"] = entries * entry_bytes
            if fetch_wait_us[idx]:  # (the CPU build never waits)
                out[f"fetch_wait_us.{idx}"] = fetch_wait_us[idx]
    return out


def pool_counters(pool_index: PoolIndex, sparse_layers: Sequence[LayerState], *, rank: int,
                  entry_bytes: int) -> dict[str, float]:
    """A capped pool's evictions since the last call, per sparse layer, and its
    occupancy in bytes (a gauge per rank, summed by ``InfiniGenStats.reduce``)."""
    out: dict[str, float] = {}
    for pool_layer, count in enumerate(pool_index.take_evictions()):
        if count:
            out[f"evictions.{sparse_layers[pool_layer].layer_idx}"] = count
    occupancy = pool_index.occupancy()
    if occupancy is not None:
        used, capacity = occupancy
        out[f"pool_used_bytes.{rank}"] = used * entry_bytes
        out[f"pool_capacity_bytes.{rank}"] = capacity * entry_bytes
    return out
