# SPDX-License-Identifier: Apache-2.0
"""The frontier benchmark's pieces: the settings grid, the rule's floor and token cap,
the speed interpolation and the targets (``benchmarks/accuracy/frontier*.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.accuracy import frontier, frontier_report
from benchmarks.accuracy.key_forms import FormSpec, KeyForm
from benchmarks.accuracy.speculative_selection import (
    CAP_BINDING_ALPHA,
    SelectionCounts,
    coarse_candidates,
    make_selector,
    make_unit_selector,
    outward,
)


def test_grid_has_every_rule_budget_and_the_caps():
    grid = frontier.settings_grid(["alpha 5 (paper)", "budget binding"], [0.1, 0.2], [256])
    labels = [s.label for s in grid]
    assert labels == ["alpha 5 (paper) @ 0.1", "alpha 5 (paper) @ 0.2", "budget binding @ 0.1",
                      "budget binding @ 0.2", "alpha 5 (paper) @ 0.2, cap 256",
                      "budget binding @ 0.2, cap 256", "budget binding @ 1, cap 256"]


def _select(alpha: float, budget: float, token_cap=None, floor=0.0):
    gen = torch.Generator().manual_seed(0)
    heads, group, dim, tokens = 2, 2, 8, 200
    eye = [(torch.zeros(heads * group, 1, dim), torch.zeros(heads, 1, dim))]
    form = KeyForm(FormSpec("fp32", "identity", "fp32", 1.0), eye, 1, [0])
    counts = SelectionCounts()
    select = make_selector(form, scale=1.0, alpha=alpha, budget=budget, token_cap=token_cap,
                           floor=floor, counts=counts)
    query = torch.randn(heads * group, 2, dim, generator=gen)
    keys = torch.randn(heads, tokens, dim, generator=gen)
    chosen = select(0, query, keys, torch.tensor([100, 200]))
    return chosen.sum(dim=-1)  # [H_kv, rows]


def test_binding_keeps_the_budget_and_the_cap_bounds_it():
    assert _select(CAP_BINDING_ALPHA, 0.2).tolist() == [[20, 40], [20, 40]]
    assert _select(CAP_BINDING_ALPHA, 0.2, token_cap=30).tolist() == [[20, 30], [20, 30]]
    assert _select(CAP_BINDING_ALPHA, 1.0, token_cap=30).tolist() == [[30, 30], [30, 30]]


def test_the_control_selects_every_token_whatever_the_scores_spread():
    """The select-all control runs at alpha infinite: at 1,000 (the budget binding's) a
    score further below the best was dropped (the 12-layer recall models' layers 8-10
    span about 1,560), and the mean count made the other head drop its lowest too."""
    eye = [(torch.zeros(4, 1, 8), torch.zeros(2, 1, 8))]
    form = KeyForm(FormSpec("fp32", "identity", "fp32", 1.0), eye, 1, [0])
    keys = torch.randn(2, 50, 8, generator=torch.Generator().manual_seed(0))
    keys[0, 7] *= -1e4  # far below the best
    query = torch.ones(4, 1, 8)
    positions = torch.tensor([50])
    binding = make_selector(form, scale=1.0, alpha=CAP_BINDING_ALPHA, budget=1.0)
    assert binding(0, query, keys, positions).sum() < 100  # the case the control met
    select_all = make_selector(form, scale=1.0, alpha=frontier.CONTROL_RULE.alpha, budget=1.0)
    assert select_all(0, query, keys, positions).sum() == 100


def test_the_floor_raises_the_count_under_the_cap():
    small = _select(1e-6, 0.2)  # a tiny alpha counts only the best token
    assert small.max() <= 1
    floored = _select(1e-6, 0.2, floor=0.1)
    assert floored.tolist() == [[10, 20], [10, 20]]
    assert _select(1e-6, 0.05, floor=0.1).tolist() == [[5, 10], [5, 10]]  # the cap wins


def test_interpolation_is_linear_between_points_and_says_when_outside():
    points = [{"density": 0.0, "vs_dense": 0.5}, {"density": 0.2, "vs_dense": 0.9}]
    value, outside = frontier_report.interpolate(points, 0.1)
    assert value == pytest.approx(0.7) and not outside
    value, outside = frontier_report.interpolate(points, 0.21)
    assert value == pytest.approx(0.92) and outside
    # no estimate far from what was measured (one point: only near it)
    assert frontier_report.interpolate(points, 0.3) is None
    assert frontier_report.interpolate([], 0.1) is None
    one = [{"density": 0.016, "vs_dense": 0.4}]
    assert frontier_report.interpolate(one, 0.0156) == (0.4, True)
    assert frontier_report.interpolate(one, 0.2) is None


def _row(task, label, value, first=None, density=0.1, budget=0.2, cap=None):
    row = {"task": task, "rule": label.split(" @")[0], "label": label, "value": value,
           "density": density, "budget": budget, "token_cap": cap}
    if first is not None:
        row["buckets"] = {"first_quarter": first}
    return row


def _dense(task, value, first=None):
    row = {"task": task, "rule": "dense", "value": value, "density": math.nan}
    if first is not None:
        row["buckets"] = {"first_quarter": first}
    return row


def test_targets_need_both_models_first_quarter_and_the_book():
    results = [_dense("recall-llama-12l", 1.0, 1.0), _dense("recall-llama-12l-4k", 0.8, 0.8),
               _dense("gutenberg-llama-2k", 100.0)]
    results += [_row("recall-llama-12l", "a @ 0.2", 1.0, 1.0),
                _row("recall-llama-12l-4k", "a @ 0.2", 0.8, 0.78, density=0.2),
                _row("gutenberg-llama-2k", "a @ 0.2", 101.0),
                _row("recall-llama-12l", "b @ 0.2", 1.0, 1.0),
                _row("recall-llama-12l-4k", "b @ 0.2", 0.8, 0.70),  # first quarter lost
                _row("gutenberg-llama-2k", "b @ 0.2", 101.0),
                _row("recall-llama-12l", "c @ 0.2, cap 256", 1.0, 1.0, cap=256),
                _row("recall-llama-12l-4k", "c @ 0.2, cap 256", 0.8, 0.8, density=0.06,
                     cap=256),
                _row("gutenberg-llama-2k", "c @ 0.2, cap 256", 103.0, cap=256),  # 1.03x
                _row("recall-llama-12l", "d, same-layer @ 0.2", 1.0, 1.0)]
    two = {"dense_layers": 2, "speculation": "previous-layer"}
    payload = {"results": results,
               "tasks": {name: {"sparse_layers": [2, 3]} for name in (
                   "recall-llama-12l", "recall-llama-12l-4k", "gutenberg-llama-2k")},
               "speed": [{"density": 0.0, "vs_dense": 0.5, **two},
                         {"density": 0.2, "vs_dense": 0.9, **two},
                         {"density": 0.2, "vs_dense": 0.3, **two, "dense_layers": 1},
                         {"density": 0.1, "vs_dense": 0.6}]}  # (a file before they said)
    rows = {e["label"]: e for e in frontier_report.frontier_rows(payload)}
    assert rows["a @ 0.2"]["meets"] and not rows["b @ 0.2"]["meets"]
    assert not rows["c @ 0.2, cap 256"]["meets"]
    # each rule's estimate from its own dense layers and speculation, none if unmeasured
    assert rows["a @ 0.2"]["vs_dense_16k"] == pytest.approx(0.9)
    assert rows["d, same-layer @ 0.2"]["vs_dense_16k"] is None
    payload["tasks"] = {name: {"sparse_layers": [1, 2, 3]} for name in payload["tasks"]}
    rows = {e["label"]: e for e in frontier_report.frontier_rows(payload)}
    assert rows["a @ 0.2"]["vs_dense_16k"] == pytest.approx(0.3)
    payload["tasks"] = {name: {"sparse_layers": [2, 3]} for name in payload["tasks"]}
    rows = {e["label"]: e for e in frontier_report.frontier_rows(payload)}
    # a token cap bounds the density at 16K to cap / 16K
    assert rows["c @ 0.2, cap 256"]["density_16k"] == pytest.approx(256 / 16384)


def test_depth_tables_give_each_setting_over_dense_by_the_needles_depth():
    depths = lambda first, middle, last: {  # noqa: E731
        "first_quarter": first, "middle": middle, "last_quarter": last}
    dense = {**_dense("recall-llama-12l-4k", 0.8), "buckets": depths(0.9, 0.8, 0.0)}
    capped = {**_row("recall-llama-12l-4k", "a @ 0.2, cap 128", 0.6, cap=128),
              "buckets": depths(0.45, 0.8, 0.0)}
    book = [_dense("gutenberg-llama-2k", 100.0), _row("gutenberg-llama-2k", "a @ 0.2", 101.0)]
    control = {**_row("recall-llama-12l-4k", "control", 0.8), "rule": "control"}
    sections = frontier_report.depth_sections({"results": [dense, control, capped, *book]})
    assert len(sections) == 1  # recall tasks only
    lines = sections[0].splitlines()
    assert lines[0] == "## recall-llama-12l-4k by needle depth (÷ dense)"
    assert lines[4] == "| dense (accuracy) | 0.900 | 0.800 | 0.000 | 0.800 |"
    # a bucket dense never answers has no ratio; the control is not a setting
    assert lines[5] == "| a @ 0.2, cap 128 | 0.500 | 1.000 |  | 0.750 |" and len(lines) == 6


def _select_units(unit: int, budget: float, summary: str = "bound", bits: int = 16,
                  token_cap=None, fine: float = 0.0, recent_tokens: int = 0,
                  coarse: int = 0, over: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    heads, group, dim, tokens = 2, 2, 8, 200
    eye = [(torch.zeros(heads * group, 1, dim), torch.zeros(heads, 1, dim))]
    form = KeyForm(FormSpec("fp32", "identity", "fp32", 1.0), eye, 1, [0])
    counts = SelectionCounts()
    select = make_unit_selector(form, scale=1.0, budget=budget, unit=unit, summary=summary,
                                bits=bits, token_cap=token_cap, fine=fine,
                                recent_tokens=recent_tokens, coarse=coarse, over=over,
                                counts=counts)
    query = torch.randn(heads * group, 2, dim, generator=gen)
    keys = torch.randn(heads, tokens, dim, generator=gen)
    chosen = select(0, query, keys, torch.tensor([100, 200]))
    return chosen, counts


@pytest.mark.parametrize(("summary", "bits"), [("bound", 16), ("bound", 8), ("bound", 4),
                                               ("mean", 16)])
def test_unit_rules_keep_whole_units_and_the_open_one(summary, bits):
    """k = budget x context tokens: the own unit's (100 % 16 = 4, 200 % 16 = 8) and
    ceil(rest / 16) whole units; coarse then fine keeps exactly k of its candidates."""
    chosen, counts = _select_units(16, 0.2, summary, bits)
    kept = chosen.sum(dim=-1)
    assert kept.tolist() == [[4 + 16, 8 + 32], [4 + 16, 8 + 32]]
    assert bool(chosen[:, 0, 96:100].all()) and bool(chosen[:, 1, 192:200].all())
    units = chosen[:, 1, :192].view(2, 12, 16)
    assert bool((units.all(dim=-1) | ~units.any(dim=-1)).all())  # whole units only
    fine, fine_counts = _select_units(16, 0.2, summary, bits, fine=2.0)
    assert fine.sum(dim=-1).tolist() == [[20, 40], [20, 40]]
    assert fine_counts.reranked == 2 * (32 + 64)  # 2 heads x (2 units + 4 units) x 16


def test_two_level_bounds_score_only_the_best_super_units_and_keep_k():
    """A super-unit's bound is at least each of its units': with every complete
    super-unit a candidate the rule is the one-level rule; narrowed, it keeps the same
    number of tokens, all from candidate super-units or the last, incomplete one, and
    tallies the units it scored."""
    one, _ = _select_units(16, 0.2, bits=8)
    everything, _ = _select_units(16, 0.2, bits=8, coarse=64, over=100.0)
    assert torch.equal(one, everything)
    narrowed, counts = _select_units(16, 0.2, bits=8, coarse=64, over=1.0)
    assert narrowed.sum(dim=-1).tolist() == one.sum(dim=-1).tolist()
    # Row 0 (100 tokens): k' = 20 - 4 -> 1 super-unit of 64 (the one complete), and the
    # complete units of the last (64-95); row 1 (200): k' = 40 - 8 -> 1 of the 3 complete,
    # the last (192-) holding only the row's own unit. Per KV head.
    assert counts.reranked == 2 * ((64 + 32) + (64 + 0))
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 200, 4, generator=gen) * 0.1
    keys[0, 130, :] = 5.0  # super-unit 2 (128-191) holds the only large key
    query = torch.ones(1, 1, 4)
    allowed = coarse_candidates(query, keys, torch.tensor([200]), torch.tensor([16]), unit=16,
                                coarse=64, over=1.0, bits=8)
    assert allowed[0, 0].nonzero().flatten().tolist() == [8, 9, 10, 11]
    keys[0, 10, :] = 4.0  # and super-unit 0 the next largest
    allowed = coarse_candidates(query, keys, torch.tensor([180]), torch.tensor([16]), unit=16,
                                coarse=64, over=1.0, bits=8)  # super-unit 2 incomplete
    assert allowed[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    landmark = coarse_candidates(query, keys, torch.tensor([180]), torch.tensor([16]),
                                 unit=16, coarse=64, over=1.0, bits=8, summary="mean")
    assert landmark[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="not whole units"):
        coarse_candidates(query, keys, torch.tensor([200]), torch.tensor([16]), unit=16,
                          coarse=40, over=1.0, bits=8)


def test_the_recent_window_adds_the_last_tokens_on_top_of_the_rule():
    """--infinigen-recent-tokens in the harness: the rule's tokens unchanged, the
    last r context tokens added, and the density counts the union."""
    plain, plain_counts = _select_units(16, 0.2, bits=8)
    recent, counts = _select_units(16, 0.2, bits=8, recent_tokens=16)
    assert bool((recent >= plain).all())
    assert bool(recent[:, 0, 84:100].all()) and bool(recent[:, 1, 184:200].all())
    added = recent & ~plain
    assert bool((~added[:, 0, :84]).all()) and bool((~added[:, 1, :184]).all())
    assert not bool(recent[:, 0, 100:].any())  # nothing past the row's context
    assert counts.selected == plain_counts.selected + float(added.sum())


def test_outward_rounding_bounds_every_value():
    """Up to the float16 rounding of the scale (a relative 2^-11 of the largest value,
    its code clamped): the product's kernels round the scale up instead."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(50, 16, 32, generator=gen) * torch.rand(1, 1, 32, generator=gen) * 8
    high_true, low_true = values.amax(dim=1), values.amin(dim=1)
    slack = torch.maximum(high_true.abs(), low_true.abs()).amax(dim=-1, keepdim=True) * 2 ** -10
    for bits in (8, 4):
        high, low = outward(high_true, low_true, bits)
        assert bool((high >= high_true - slack).all()) and bool((low <= low_true + slack).all())
        step = slack * 2 ** 10 / ((1 << (bits - 1)) - 1)
        assert bool((high - high_true <= step * 1.01).all())


def test_selection_bytes_per_token():
    rules = frontier.RULES
    assert frontier.selection_bytes(rules["budget binding"], {}) == 48.0
    assert frontier.selection_bytes(rules["bound, units of 16"], {}) == 32.0
    assert frontier.selection_bytes(rules["bound 8-bit, units of 16"], {}) == (256 + 2) / 16
    assert frontier.selection_bytes(rules["bound 4-bit, units of 16"], {}) == (128 + 2) / 16
    assert frontier.selection_bytes(rules["bound 32, then int keys over 2x"],
                                    {"rerank_density": 0.5}) == 16.0 + 24.0
    two_level = rules["bound 8-bit 16 within 8-bit 256 x4, recent 16"]
    assert frontier.selection_bytes(two_level, {"rerank_density": 0.25}) == (
        (256 + 2) / 256 + 0.25 * (256 + 2) / 16)
    landmarks = rules["bound 8-bit 16 within mean 256 x4, recent 16"]
    assert frontier.selection_bytes(landmarks, {"rerank_density": 0.25}) == (
        128 * 2 / 256 + 0.25 * (256 + 2) / 16)


@pytest.mark.parametrize("recent_tokens", [0, 16])
def test_the_mirror_keeps_what_the_products_kernel_keeps(recent_tokens):
    """The frontier's torch mirror of the default rule (8-bit bounds of 16-token
    units, the budget binding, the recent window) keeps each row's and KV
    head's tokens exactly as the CPU kernel ``select_bounds`` does, on keys
    written through the product's kernels (the mirror rounds its scale to
    float16, the kernel up: the units' order is the same here)."""
    from tests.reference.bound_pools import BLOCK, BoundPool
    from vllm_infinigen.platforms.cpu import kernels
    from vllm_infinigen.worker.step_plan import token_budget

    head_size, kv_heads, group, budget = 32, 2, 2, 0.2
    lens = [230, 100, 129, 64, 47]
    pool = BoundPool(seed=5, unit=16, bits=8, dtype=torch.float32, num_kv_heads=kv_heads,
                     head_size=head_size, context_lens=lens)
    gen = torch.Generator().manual_seed(9)
    query = torch.randint(-3, 4, (len(lens), kv_heads, group, head_size), generator=gen).float()
    caps = token_budget(pool.context_lens, budget)
    positions, _ = kernels.select_bounds(
        query, pool.bounds, pool.scales, pool.kv_pool, pool.block_table, pool.context_lens,
        caps, scale=1.0, alpha=float("inf"), recent_tokens=recent_tokens)
    select = make_unit_selector(None, scale=1.0, budget=budget, unit=16, bits=8,
                                recent_tokens=recent_tokens)
    for row, n in enumerate(lens):
        token_ids = torch.arange(n)
        blocks = pool.block_table[row, token_ids // BLOCK].to(torch.int64)
        keys = pool.kv_pool[blocks, :, token_ids % BLOCK, :head_size].permute(1, 0, 2)
        mirror = select(0, query[row].reshape(kv_heads * group, 1, head_size), keys,
                        torch.tensor([n]))
        for head in range(kv_heads):
            got = positions[row, head][positions[row, head] >= 0].tolist()
            assert mirror[head, 0].nonzero().flatten().tolist() == got, (row, head)


def test_a_recall_model_of_the_project_runs_as_a_task(tmp_path):
    """``--recall-model`` / ``--recall-prompts``: a model this project trained (the
    committed checkpoint), with prompts from a file, runs as the frontier's task, named
    after its folder; alone they must come together."""
    from benchmarks.harness import paths
    from tests.shared_data import require_shared

    prompts = require_shared("data/recall/recall-1k.jsonl")
    model = paths.REPO / "benchmarks" / "models" / "recall-llama-12l-toward-16k"
    out = tmp_path / "frontier_run"
    assert frontier.main(["--recall-model", str(model), "--recall-prompts", str(prompts),
                          "--limit", "2", "--rules", "bound 8-bit, units of 16, recent 16",
                          "--budget", "0.2", "--token-caps", "--speed", "--out", str(out)]) == 0
    saved = frontier.report.read_results(out)
    assert list(saved[2]["tasks"]) == [model.name]
    rules = {row["rule"] for row in saved[2]["results"]}
    assert {"dense", "bound 8-bit, units of 16, recent 16"} <= rules
    assert "task_table" not in saved[1] and saved[1]["recall_model"] == str(model)
    assert "![accuracy against the step](frontier_run.png)" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        frontier.parse_args(["--recall-model", str(model)])


def test_a_recall_model_is_read_with_its_positions_interpolated(tmp_path, monkeypatch):
    """``--rope-linear-factor F`` reaches the recall model's config as a linear RoPE
    (what ``recall_lengths`` measures dense with), and only with ``--recall-model``."""
    from benchmarks.harness import paths

    model = paths.REPO / "benchmarks" / "models" / "recall-llama-12l-toward-16k"
    args = frontier.parse_args(["--recall-model", str(model), "--recall-prompts", "p.jsonl",
                                "--rope-linear-factor", "2"])
    assert args.task_table[model.name].rope_linear_factor == 2.0
    seen = []

    class Stop(Exception):
        pass

    def load(name, config=None, **kwargs):
        seen.append(config.rope_parameters)
        raise Stop

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    with pytest.raises(Stop):
        frontier.run_task(args.task_table[model.name], [], args)
    assert seen == [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}]
    payload = {"tasks": {model.name: {"num_sequences": 1, "context": 8, "sparse_layers": [2],
                                      "max_control_logit_diff": 0.0,
                                      "rope_linear_factor": 2.0}},
               "results": [{"task": model.name, "rule": "dense", "value": 1.0},
                           {"task": model.name, "rule": "control", "value": 1.0}]}
    assert "(RoPE positions interpolated linearly by 2)" in "\n".join(
        frontier_report.sections(payload))
    with pytest.raises(SystemExit):
        frontier.parse_args(["--rope-linear-factor", "2"])


def test_a_bucket_dense_never_retrieves_reads_nan_not_a_division_by_zero():
    dense = {"value": 0.5, "buckets": {"first_quarter": 0.0, "middle": 1.0}}
    row = {"value": 0.25, "buckets": {"first_quarter": 0.0, "middle": 0.5}}
    assert math.isnan(frontier_report.ratio(row, dense, "first_quarter"))
    assert frontier_report.ratio(row, dense, "middle") == 0.5
    assert frontier_report.ratio(row, dense) == 0.5


def test_a_recall_model_named_as_a_shared_task_is_refused(tmp_path):
    """Results are keyed by the folder's name: a recall model named as a shared task
    would replace it, its factor applied to both."""
    model = tmp_path / "recall-llama-12l-4k"
    with pytest.raises(SystemExit):
        frontier.parse_args(["--recall-model", str(model), "--recall-prompts", "p.jsonl"])
