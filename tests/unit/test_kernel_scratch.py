# SPDX-License-Identifier: Apache-2.0
"""The selection ops' score scratch (rows x KV heads x the longest context,
kept by the calling thread across calls) is given back after a long-context
call, not held at its peak for the process's life."""

from __future__ import annotations

import os

import torch

from vllm_infinigen.platforms.cpu import kernels

BLOCK, RANK = 16, 4


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _select(context: int) -> None:
    """One row, one KV head of ``context`` tokens: every block id the same one
    (the inputs stay small, the scratch is 4 bytes a token)."""
    keys = torch.randn(1, 1, RANK, BLOCK)
    table = torch.zeros(1, -(-context // BLOCK), dtype=torch.int32)
    kernels.select_tokens(torch.randn(1, 1, 1, RANK), keys, table,
                          torch.tensor([context]), torch.tensor([1]), scale=1.0,
                          alpha=float("inf"))


def test_a_long_context_calls_scratch_is_given_back():
    torch.set_num_threads(1)
    _select(1024)
    before = _resident_mib()
    _select(1 << 25)  # 128 MiB of scores
    peak = _resident_mib()
    _select(1024)
    after = _resident_mib()
    assert peak - before > 100, (before, peak)
    assert after - before < 32, (before, peak, after)
