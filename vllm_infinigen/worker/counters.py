# SPDX-License-Identifier: Apache-2.0
"""Worker side: step counters read back from the device without waiting for the step.

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

import torch


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
