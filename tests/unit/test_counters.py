# SPDX-License-Identifier: Apache-2.0
"""``worker/counters.py`` on the CPU: every count at once (the one-step lag on a GPU:
``tests/gpu/test_cuda_device.py``)."""

from __future__ import annotations

import torch

from tests.reference.device_step import DecodeStep, config
from vllm_infinigen.worker.counters import CounterDrain


def test_on_the_cpu_a_drain_returns_every_count_and_zeroes_them():
    drain, counts = CounterDrain(), torch.zeros(2, 2)
    counts += 3
    assert drain(counts).tolist() == [[3.0, 3.0]] * 2
    assert counts.abs().sum() == 0
    counts += 1
    assert drain(counts, wait=True).tolist() == [[1.0, 1.0]] * 2


def test_the_cuda_data_path_counts_each_step_once():
    """The runtime's and the block cache's counters, drained after each step of the
    CUDA data path on CPU tensors: each step's lookups are counted in its own drain."""
    step = DecodeStep(config())
    drained = []
    for seed in range(3):
        step.run(seed=seed + 1)
        drained.append(step.runtime.take_counters())
    assert step.runtime.take_counters() == {}  # nothing left behind
    for counters in drained:
        looked_up = sum(v for k, v in counters.items()
                        if k.startswith(("cache_hits.", "cache_misses.")))
        assert looked_up > 0 and counters["candidate_tokens.2"] > 0
