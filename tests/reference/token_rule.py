# SPDX-License-Identifier: Apache-2.0
"""The paper's token rule with plain loops (float64), the oracle of ``select_tokens``
(``tests/unit/test_selector.py``) and of the engine's recorded selections
(``tests/e2e/test_recorded_selection.py``), and the kept positions of a
``Selection`` in the form it returns."""

from __future__ import annotations

import math

import torch

# Scores of the reference and of the implementation (float32) differ by ~1e-6;
# no score may sit closer than this to a decision boundary of the rule.
MARGIN = 1e-4


def reference_selection(partial_query, partial_keys, context_lens, *, scale, alpha,
                        budget, sink_tokens, recent_tokens):
    """The paper's rule with plain loops, in float64.

    Returns:
        (kept, num_selected): kept[b][h] is the set of kept positions of
        request b and KV head h; num_selected[b] their number.
    """
    query = partial_query.double().tolist()  # [B][H_q][R]
    keys = partial_keys.double().tolist()  # [B][N][H_kv][R]
    num_heads = len(query[0])
    num_kv_heads = len(keys[0][0])
    group = num_heads // num_kv_heads
    kept, num_selected = [], []
    for b, n in enumerate(context_lens):
        head_scores = []
        for h in range(num_kv_heads):
            scores = []
            for t in range(n):
                dots = [
                    sum(qc * kc for qc, kc in zip(query[b][g], keys[b][t][h]))
                    for g in range(h * group, (h + 1) * group)
                ]
                scores.append(max(dots) * scale)
            head_scores.append(scores)
        counts = []
        for scores in head_scores:
            threshold = max(scores) - alpha
            assert min(abs(s - threshold) for s in scores) > MARGIN, "ill-conditioned input"
            counts.append(sum(1 for s in scores if s > threshold))
        k = math.floor(sum(counts) / len(counts))
        k = min(k, max(1, math.floor(budget * n)))
        window = {t for t in range(n) if t < sink_tokens or t >= n - recent_tokens}
        total = min(k + len(window), n)
        num_rest = total - len(window)
        kept_b = []
        for scores in head_scores:
            rest = sorted((t for t in range(n) if t not in window),
                          key=lambda t: scores[t], reverse=True)
            if 0 < num_rest < len(rest):
                gap = scores[rest[num_rest - 1]] - scores[rest[num_rest]]
                assert gap > MARGIN, "ill-conditioned input"
            kept_b.append(window | set(rest[:num_rest]))
        kept.append(kept_b)
        num_selected.append(total)
    return kept, num_selected


def kept_sets(selection):
    """Per (request, head) sets of valid positions; checks the layout invariants."""
    positions, valid, num_selected = selection.positions, selection.valid, selection.num_selected
    num_reqs, num_kv_heads, num_slots = positions.shape
    assert positions.dtype == torch.int64 and valid.dtype == torch.bool
    prefix = torch.arange(num_slots)[None, None, :] < num_selected[:, None, None]
    assert torch.equal(valid, prefix.expand_as(valid)), "valid entries must come first"
    out = []
    for b in range(num_reqs):
        row = []
        for h in range(num_kv_heads):
            chosen = positions[b, h][valid[b, h]].tolist()
            assert len(set(chosen)) == len(chosen), "duplicate positions"
            row.append(set(chosen))
        out.append(row)
    return out
