# SPDX-License-Identifier: Apache-2.0
"""The attribution benchmark's settings, density matching and report, on made-up results."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.accuracy import attribution, attribution_report
from benchmarks.accuracy.attribution import FIXED_K_ALPHA, Task


def args(**overrides) -> argparse.Namespace:
    values = dict(budget=[0.05, 0.1], partial_ratio=[0.2, 0.5], calibration=["in-domain", "book"])
    return argparse.Namespace(**{**values, **overrides})


def task(higher_is_better: bool = True) -> Task:
    return Task("recall", Path("recall-llama-1k"), "accuracy" if higher_is_better
                else "perplexity", higher_is_better, 1088, None, None, [])


def test_engine_variants_cover_each_factor_once():
    assert attribution.engine_variants(args()) == [
        (1.0, "in-domain"), (0.2, "in-domain"), (0.5, "in-domain"), (0.2, "book")]


def test_grid_is_speculation_by_rule_by_budget():
    grid = attribution.grid([0.05, 0.1])
    assert len(grid) == 8
    assert {(s["speculation"], attribution.rule_of(s)) for s in grid} == {
        ("same-layer", "fixed-k"), ("same-layer", "alpha"),
        ("previous-layer", "fixed-k"), ("previous-layer", "alpha")}


def test_artifact_density_keeps_short_rows_dense():
    # Rows of context 64..1023 capped at 0.1 x 1024 = 102.4: rows below it are dense.
    expected = sum(min(1.0, 102.4 / p) for p in range(64, 1024)) / 960
    assert attribution.artifact_density(0.1) == pytest.approx(expected)
    assert 0.1 < attribution.artifact_density(0.1) < attribution.artifact_density(0.2) <= 1
    assert attribution.artifact_density(1.0) == 1.0


def test_follow_ups_match_the_alpha_rule_density():
    alpha = {"speculation": "same-layer", "alpha": 5.0, "budget": 0.1}
    follow = attribution.follow_ups(task(), 1.0, "grid", alpha, {"density": 0.07})
    assert follow == [("density-matched", {"speculation": "same-layer", "alpha": FIXED_K_ALPHA,
                                           "budget": 0.07, "matched_budget": 0.1})]
    # At the budget already, with partial keys, for fixed k, or a follow-up itself: none.
    assert attribution.follow_ups(task(), 1.0, "grid", alpha, {"density": 0.099}) == []
    assert attribution.follow_ups(task(), 0.5, "grid", alpha, {"density": 0.07}) == []
    assert attribution.follow_ups(task(), 1.0, "grid", {**alpha, "alpha": FIXED_K_ALPHA},
                                  {"density": 0.07}) == []
    assert attribution.follow_ups(task(), 1.0, "density-matched", alpha,
                                  {"density": 0.07}) == []


def test_book_task_asks_for_the_artifact_density_of_infinigen_as_shipped():
    book = Task("book", Path("g"), "perplexity", False, 1025, None, None, [])
    shipped = {"speculation": "previous-layer", "alpha": 5.0, "budget": 0.1}
    follow = attribution.follow_ups(book, 0.2, "grid", shipped, {"density": 0.09})
    assert follow == [("artifact-density", {**shipped, "matched_budget": 0.1,
                                            "budget": round(attribution.artifact_density(0.1), 4)})]


def result(kind, value, r=None, calibration=None, speculation=None, rule=None, budget=None,
           density=None, **extra):
    return {"task": "recall", "kind": kind, "r": r, "calibration": calibration,
            "speculation": speculation, "rule": rule, "budget": budget, "value": value,
            "density": density, "seconds": 1.0, **extra}


def made_up_results(control_value: float) -> list[dict]:
    out = [result("dense", 0.98), result("control", control_value, 1.0, "in-domain",
                                         "previous-layer", "fixed-k", 1.0, 1.0)]
    values = {("same-layer", "fixed-k"): 0.97, ("previous-layer", "fixed-k"): 0.70,
              ("same-layer", "alpha"): 0.96, ("previous-layer", "alpha"): 0.65}
    for r, calibration in attribution.engine_variants(args()):
        for (spec, rule), value in values.items():
            for budget in (0.05, 0.1):
                penalty = 0.0 if r == 1.0 else (0.2 if calibration == "book" else 0.01 / r)
                out.append(result("grid", value - penalty, r, calibration, spec, rule, budget,
                                  budget * 0.9))
    return out


def test_report_names_the_best_configuration_and_the_factors_below_095():
    sections, control_ok = attribution_report.sections([task()], made_up_results(0.98), args())
    text = "\n".join(sections)
    assert control_ok and "equals dense" in text
    # Best with partial keys at 0.1: same-layer, fixed k, r 0.5 (penalty 0.02), in-domain.
    assert ("the best configuration with partial keys is same-layer, r 0.5, fixed k, "
            "in-domain skew: 0.950 = 0.969x dense (reaches 0.95x)") in text
    assert "(1) speculation (previous-layer, full keys, fixed k): 0.714x" in text
    assert "(4) calibration (same-layer, r 0.2, fixed k, book skew): 0.786x" in text
    assert "(3) alpha count" not in text.split("Alone below")[1].split("\n")[0]


def test_report_flags_a_control_that_differs_from_dense():
    sections, control_ok = attribution_report.sections([task()], made_up_results(0.95), args())
    assert not control_ok
    assert "DIFFERS FROM DENSE" in "\n".join(sections)


def test_quality_is_a_fraction_of_dense_for_both_metrics():
    assert attribution_report.quality(task(True), 0.49, 0.98) == pytest.approx(0.5)
    assert attribution_report.quality(task(False), 200.0, 100.0) == pytest.approx(0.5)
