# SPDX-License-Identifier: Apache-2.0
"""select_tokens against an independent, loop-by-loop reference of the paper's rule."""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference.selector import max_selected, select_tokens, token_caps
from tests.reference.token_rule import kept_sets, reference_selection

RANK = 8
SCALE = 1 / math.sqrt(RANK)
CONTEXT_LENS = [1, 7, 23, 40]
NUM_TOKENS = 48  # N: every row is padded, even the longest one


def random_inputs(num_heads, num_kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = len(CONTEXT_LENS)
    partial_query = torch.randn(batch, num_heads, RANK, generator=gen) * 2
    partial_keys = torch.randn(batch, NUM_TOKENS, num_kv_heads, RANK, generator=gen)
    # Padding that would win every comparison if it were not masked out: it
    # aligns with the first query head of each KV head's group.
    group = num_heads // num_kv_heads
    for b, n in enumerate(CONTEXT_LENS):
        partial_keys[b, n:] = 100 * partial_query[b, ::group].sign()[None]
    return partial_query, partial_keys


def run_both(num_heads, num_kv_heads, alpha, budget, sink_tokens, recent_tokens, seed,
             width=None):
    partial_query, partial_keys = random_inputs(num_heads, num_kv_heads, seed)
    if width is None:
        width = max_selected(CONTEXT_LENS, budget, sink_tokens + recent_tokens)
    selection = select_tokens(
        partial_query, partial_keys, torch.tensor(CONTEXT_LENS), scale=SCALE,
        alpha=alpha, budget=budget, width=width,
        sink_tokens=sink_tokens, recent_tokens=recent_tokens,
    )
    expected = reference_selection(
        partial_query, partial_keys, CONTEXT_LENS, scale=SCALE, alpha=alpha,
        budget=budget, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
    )
    return selection, expected


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 4), (4, 4), (8, 1)],
                         ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("alpha", [0.5, 2.0, 8.0])
@pytest.mark.parametrize("budget", [0.1, 0.3, 1.0])
@pytest.mark.parametrize("sink_tokens,recent_tokens", [(0, 0), (2, 3)],
                         ids=["no-window", "window"])
def test_matches_reference(num_heads, num_kv_heads, alpha, budget, sink_tokens,
                           recent_tokens):
    selection, (kept, num_selected) = run_both(
        num_heads, num_kv_heads, alpha, budget, sink_tokens, recent_tokens, seed=0
    )
    assert selection.num_selected.tolist() == num_selected
    assert kept_sets(selection) == kept


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_matches_reference_with_spare_slots(seed):
    """A K larger than needed (here N) changes nothing but the padding."""
    selection, (kept, num_selected) = run_both(8, 4, 2.0, 0.3, 1, 2, seed,
                                               width=NUM_TOKENS)
    assert selection.positions.shape == (len(CONTEXT_LENS), 4, NUM_TOKENS)
    assert selection.num_selected.tolist() == num_selected
    assert kept_sets(selection) == kept


def test_grid_covers_both_limits():
    """The reference grid exercises both the alpha count and the budget cap."""
    _, (_, by_alpha) = run_both(8, 4, 0.5, 1.0, 0, 0, seed=0)
    _, (_, by_budget) = run_both(8, 4, 8.0, 0.1, 0, 0, seed=0)
    caps = [max(1, math.floor(n * 1.0)) for n in CONTEXT_LENS]
    assert any(count < cap for count, cap in zip(by_alpha, caps))
    assert by_budget == [max(1, math.floor(n * 0.1)) for n in CONTEXT_LENS]


def test_hand_built_counts_floor_of_mean():
    # One channel, query 1, scale 1: the scores are the keys themselves.
    # head 0 scores [0, 5, 4.5, 1]: 2 within alpha=1; head 1 [3, 2.9, 2.8, -5]: 3.
    partial_query = torch.ones(1, 2, 1)
    keys = torch.tensor([[0.0, 3.0], [5.0, 2.9], [4.5, 2.8], [1.0, -5.0]])
    partial_keys = keys[None, :, :, None]  # [1, 4, 2, 1]
    selection = select_tokens(partial_query, partial_keys, torch.tensor([4]), scale=1.0,
                              alpha=1.0, budget=1.0, width=4)
    assert selection.num_selected.tolist() == [2]  # floor((2 + 3) / 2)
    assert kept_sets(selection) == [[{1, 2}, {0, 1}]]

    with_sink = select_tokens(partial_query, partial_keys, torch.tensor([4]), scale=1.0,
                              alpha=1.0, budget=1.0, width=4, sink_tokens=1)
    assert with_sink.num_selected.tolist() == [3]
    assert kept_sets(with_sink) == [[{0, 1, 2}, {0, 1, 2}]]


def test_hand_built_group_takes_best_query_head():
    # Two query heads share one KV head: the score is the max over the group.
    partial_query = torch.tensor([[[1.0], [-1.0]]])  # [1, 2, 1]
    partial_keys = torch.tensor([2.0, -3.0, 0.5])[None, :, None, None]  # [1, 3, 1, 1]
    selection = select_tokens(partial_query, partial_keys, torch.tensor([3]), scale=1.0,
                              alpha=1.5, budget=1.0, width=3)
    # max over heads: [2, 3, 0.5]; within 1.5 of 3: positions 0 and 1.
    assert selection.num_selected.tolist() == [2]
    assert kept_sets(selection) == [[{0, 1}]]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 4), (4, 4)])
def test_full_budget_huge_alpha_selects_every_token(num_heads, num_kv_heads):
    partial_query, partial_keys = random_inputs(num_heads, num_kv_heads, seed=4)
    selection = select_tokens(
        partial_query, partial_keys, torch.tensor(CONTEXT_LENS), scale=SCALE,
        alpha=1e9, budget=1.0, width=max_selected(CONTEXT_LENS, 1.0, 0),
    )
    assert selection.num_selected.tolist() == CONTEXT_LENS
    assert kept_sets(selection) == [[set(range(n))] * num_kv_heads for n in CONTEXT_LENS]


@pytest.mark.parametrize("alpha", [0.5, 3.0, 1e9])
@pytest.mark.parametrize("budget", [0.05, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("sink_tokens,recent_tokens", [(0, 0), (1, 0), (4, 4)])
def test_max_selected_bounds_num_selected(alpha, budget, sink_tokens, recent_tokens):
    partial_query, partial_keys = random_inputs(8, 4, seed=5)
    bound = max_selected(CONTEXT_LENS, budget, sink_tokens + recent_tokens)
    selection = select_tokens(
        partial_query, partial_keys, torch.tensor(CONTEXT_LENS), scale=SCALE,
        alpha=alpha, budget=budget, width=NUM_TOKENS,
        sink_tokens=sink_tokens, recent_tokens=recent_tokens,
    )
    assert int(selection.num_selected.max()) <= bound
    if alpha == 1e9:  # every head counts every token: the cap is reached
        assert int(selection.num_selected.max()) == bound


def test_max_selected_values():
    assert max_selected([10, 3], 0.2, 4) == 6  # min(10, 2 + 4), min(3, 1 + 4)
    assert max_selected([10, 3], 0.2, 0) == 2
    assert max_selected([100], 0.25, 0) == 25
    assert max_selected([2], 1.0, 8) == 2  # capped by the context
    assert max_selected([], 0.2, 4) == 1


def test_token_caps_values():
    lens = torch.tensor([0, 1, 4, 5, 10, 99, 2048])
    caps = token_caps(lens, 0.2)
    assert caps.dtype == torch.int64
    assert caps.tolist() == [1, 1, 1, 1, 2, 19, 409]
    assert token_caps(torch.tensor([10, 7]), 0.3).tolist() == [3, 2]
    assert token_caps(torch.tensor([10, 7]), 1.0).tolist() == [10, 7]


def test_absent_entries_are_never_selected():
    """Entries a capped pool evicted are out of the running, even forced ones."""
    partial_query, partial_keys = random_inputs(4, 2, seed=5)
    lens = torch.tensor(CONTEXT_LENS)
    kwargs = dict(scale=SCALE, alpha=1e4, budget=1.0, width=NUM_TOKENS,
                  sink_tokens=2, recent_tokens=2)
    gen = torch.Generator().manual_seed(6)
    present = torch.rand(len(CONTEXT_LENS), NUM_TOKENS, 2, generator=gen) < 0.6
    present[:, 0, 0] = False  # a sink token evicted in head 0 only
    full = select_tokens(partial_query, partial_keys, lens, **kwargs)
    capped = select_tokens(partial_query, partial_keys, lens, present=present, **kwargs)
    for b, n in enumerate(CONTEXT_LENS):
        for h in range(2):
            held = {t for t in range(n) if present[b, t, h]}
            everything = set(full.positions[b, h][full.valid[b, h]].tolist())
            kept = capped.positions[b, h][capped.valid[b, h]].tolist()
            assert everything == set(range(n))  # select-all without a pool cap
            assert sorted(kept) == sorted(held)  # ... and all that is held with one
            assert capped.valid[b, h].tolist() == sorted(capped.valid[b, h].tolist(),
                                                         reverse=True)  # valid first


def test_evaluation_mode_rows():
    from vllm_infinigen.worker.step_plan import _with_prompt_rows

    # Request 0 decodes (context 9); request 1 prefills positions 3..7 of its
    # prompt (a second chunk); request 2 prefills positions 0..3; prefix 5.
    query_start = torch.tensor([0, 1, 6, 10])
    seq_lens = torch.tensor([10, 8, 4])
    is_prompt = torch.tensor([False, True, True])
    rows, tokens, contexts = _with_prompt_rows(is_prompt, query_start, seq_lens, prefix=5)
    assert rows.tolist() == [0, 1, 1, 1]
    assert tokens.tolist() == [0, 3, 4, 5]  # positions 5, 6, 7 of request 1
    assert contexts.tolist() == [9, 5, 6, 7]  # a row at position p selects among p tokens
