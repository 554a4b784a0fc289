# SPDX-License-Identifier: Apache-2.0
"""The step plan: the budget in tokens of each row (the fraction capped by
``--infinigen-budget-tokens``), and the plan of a decode step made on the device
(no host read: every row selects, its context only on the device)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.worker.step_plan import build_device_plan, build_plan

TABLE = torch.arange(12, dtype=torch.int32).view(3, 4)


def _metadata(seq_lens, query_start, max_query_len=None):
    return SimpleNamespace(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           query_start_loc=torch.tensor(query_start, dtype=torch.int32),
                           block_table=TABLE, max_query_len=max_query_len)


def test_the_host_plan_caps_the_budget_in_tokens():
    config = InfiniGenConfig(alpha=1.0, budget=0.5, min_context=0, budget_tokens=6)
    plan = build_plan(_metadata([41, 9, 30], [0, 1, 2, 3]), config, 16, None)
    assert plan.context_host == [40, 8, 29]
    assert plan.token_caps.tolist() == plan.caps_host == [6, 4, 6]
    uncapped = build_plan(_metadata([41, 9, 30], [0, 1, 2, 3]),
                          InfiniGenConfig(alpha=1.0, budget=0.5, min_context=0), 16, None)
    assert uncapped.caps_host == [20, 4, 14]


def test_a_uniform_decode_step_is_planned_on_the_device_when_the_data_path_does():
    config = InfiniGenConfig(alpha=1.0, min_context=4096)
    metadata = _metadata([41, 9, 0], [0, 1, 2, 2], max_query_len=1)  # a padding row
    plan = build_plan(metadata, config, 16, None, on_device=True)
    assert plan.on_device and plan.selects and not plan.short_decode_only
    assert plan.context_lens.tolist() == [40, 8, -1]  # no min-context split on the host
    rows = plan.sparse_rows
    assert rows.tokens == slice(0, 3) and rows.size == 3 and rows.context_host is None
    assert plan.dense_rows.size == 0 and not plan.has_other_rows
    assert torch.equal(rows.block_table, TABLE)
    # the host plans: no device planning asked, a step with prompt rows, evaluation mode
    assert not build_plan(metadata, config, 16, None).on_device
    prompt = _metadata([41, 9, 30], [0, 1, 2, 12], max_query_len=10)
    assert not build_plan(prompt, config, 16, None, on_device=True).on_device
    evaluating = InfiniGenConfig(alpha=1.0, eval_dense_prefix=4)
    assert not build_plan(metadata, evaluating, 16, None, on_device=True).on_device
    assert build_device_plan(metadata, 16).num_decodes == 3


def test_the_host_plan_slices_the_rows_that_are_the_steps_first():
    """Rows that are the step's first rows in order come as a slice (each
    layer's query[tokens] a view, not a gather); others as their indices."""
    config = InfiniGenConfig(min_context=20)
    decode = build_plan(_metadata([41, 9, 30], [0, 1, 2, 3]), config, 16, None)
    assert not decode.on_device
    assert decode.sparse_rows.tokens.tolist() == [0, 2]  # row 1 is short
    assert decode.dense_rows.tokens.tolist() == [1]
    every = build_plan(_metadata([41, 29, 30], [0, 1, 2, 3]), config, 16, None)
    assert every.sparse_rows.tokens == slice(0, 3) and every.dense_rows.size == 0
    short = build_plan(_metadata([4, 9, 3], [0, 1, 2, 3]), config, 16, None)
    assert short.short_decode_only and short.dense_rows.tokens == slice(0, 3)
    query = torch.arange(12.0).view(3, 4)
    for rows, plan in ((every.sparse_rows, every), (short.dense_rows, short)):
        assert torch.equal(query[rows.tokens], query[plan.tokens])
    # a prompt (rows 0-9) before a decode row: the decode row is token 10
    mixed = build_plan(_metadata([10, 30], [0, 10, 11]), config, 16,
                       lambda n: torch.tensor([10, 5])[:n])
    assert mixed.sparse_rows.tokens.tolist() == [10]
