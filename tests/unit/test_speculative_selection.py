# SPDX-License-Identifier: Apache-2.0
"""The torch harness's block-granular rule (benchmarks/accuracy/speculative_selection.py)."""

from __future__ import annotations

import torch

from benchmarks.accuracy.speculative_selection import block_mask


def test_block_mask_keeps_the_best_blocks_the_sink_and_the_own_block():
    scores = torch.zeros(2, 1, 64)  # [H, n, T]
    scores[0, 0, 37] = 5.0  # head 0: block 2 is the best
    scores[1, 0, 20] = 5.0  # head 1: block 1
    mask = block_mask(scores, torch.tensor([50]), torch.tensor([10]), block_size=16)
    kept = [sorted(set(torch.nonzero(mask[h, 0]).flatten().tolist())) for h in range(2)]
    own = list(range(48, 50))  # block 3 holds positions 48-49 of the context
    assert kept[0] == list(range(16)) + list(range(32, 48)) + own
    assert kept[1] == list(range(32)) + own
    assert not bool(mask[:, 0, 50:].any())  # nothing past the context
