# SPDX-License-Identifier: Apache-2.0
"""The attribution benchmark's settings, density matching and report, on made-up results."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.accuracy import attribution, attribution_report
from benchmarks.accuracy.attribution import FIXED_K_ALPHA, Task


def args(**overrides) -> argparse.Namespace:
    values = {"budget": [0.05, 0.1], "partial_ratio": [0.2, 0.5],
              "calibration": ["in-domain", "book"], "dense_layers": 2, "dense_layers_factor": [1]}
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
           density=None, keys="partial", dense_layers=2, **extra):
    return {"task": "recall", "kind": kind, "keys": keys, "r": r, "calibration": calibration,
            "dense_layers": dense_layers, "speculation": speculation, "rule": rule,
            "budget": budget, "value": value, "density": density, "seconds": 1.0, **extra}


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


def test_variants_add_int_keys_and_dense_layers_with_the_grid_each_row_reads():
    variants = attribution.variants(args(dense_layers_factor=[1, 2]))
    assert [(v.keys, v.r, v.calibration, v.dense_layers) for v in variants] == [
        ("partial", 1.0, "in-domain", 2), ("int", None, None, 2),
        ("partial", 0.2, "in-domain", 2), ("partial", 0.5, "in-domain", 2),
        ("partial", 0.2, "book", 2), ("partial", 1.0, "in-domain", 1)]
    full, int_keys, default_r, other_r, book, one_dense = variants
    assert full.combos == int_keys.combos == default_r.combos == attribution.EVERY_COMBO
    assert other_r.combos == one_dense.combos == (("same-layer", "fixed-k"),
                                                  ("previous-layer", "fixed-k"))
    assert book.combos == (("same-layer", "fixed-k"), ("previous-layer", "alpha"))
    assert attribution.grid([0.1], book.combos) == [
        {"speculation": "same-layer", "alpha": FIXED_K_ALPHA, "budget": 0.1},
        {"speculation": "previous-layer", "alpha": 5.0, "budget": 0.1}]


def test_engine_settings_name_the_keys_form():
    int_keys, partial = attribution.Variant("int", None, None, 2), attribution.Variant(
        "partial", 0.2, "book", 1)
    assert attribution.infinigen_settings(int_keys, None) == {"speculation_keys": "int",
                                                              "dense_layers": 2}
    assert attribution.infinigen_settings(partial, "s.safetensors") == {
        "speculation_keys": "partial", "partial_ratio": 0.2, "skew_file": "s.safetensors",
        "dense_layers": 1}


def test_three_models_run_by_default():
    parsed = attribution.parse_args([])
    assert parsed.tasks == ["recall", "book", "recall-12l"]
    assert attribution.TASK_INFO["recall-12l"][0].name == "recall-llama-12l"
    assert parsed.dense_layers == 2 and parsed.dense_layers_factor == [1]


def test_the_defaults_ask_for_the_artifact_density_on_the_book_only():
    shipped = {"speculation": "previous-layer", "alpha": 5.0, "budget": 0.2}
    book = Task("book", Path("g"), "perplexity", False, 1025, None, None, [])
    assert attribution.follow_ups(book, None, "grid", shipped, {"density": 0.19}) == [
        ("artifact-density", {**shipped, "matched_budget": 0.2,
                              "budget": round(attribution.artifact_density(0.2), 4)})]
    assert attribution.follow_ups(task(), None, "grid", shipped, {"density": 0.05}) == []


def twelve_layer_results() -> list[dict]:
    """recall-12l at 0.1: the alpha count starves the int keys; the cap binding does not."""
    fq = {"first_quarter": 1.0, "middle": 1.0, "last_quarter": 1.0}

    def at(value, first, density, **fields):
        return result("grid", value, budget=0.1, density=density, task="recall-12l",
                      buckets={**fq, "first_quarter": first}, **fields)

    int_keys = {"keys": "int"}
    return [
        result("dense", 1.0, task="recall-12l", buckets=fq, keys=None, dense_layers=None),
        result("control", 1.0, 1.0, "in-domain", "previous-layer", "fixed-k", 1.0, 1.0,
               task="recall-12l"),
        at(1.0, 1.0, 0.1, speculation="same-layer", rule="fixed-k", **int_keys),
        at(0.69, 0.6, 0.03, speculation="previous-layer", rule="alpha", **int_keys),
        at(1.0, 1.0, 0.1, speculation="previous-layer", rule="fixed-k", **int_keys),
        at(1.0, 1.0, 0.1, r=1.0, calibration="in-domain", speculation="previous-layer",
           rule="fixed-k"),
        at(0.715, 0.7, 0.045, r=1.0, calibration="in-domain", speculation="previous-layer",
           rule="alpha"),
        at(0.465, 0.4, 0.05, r=0.2, calibration="in-domain", speculation="previous-layer",
           rule="alpha"),
        at(0.585, 0.5, 0.1, r=0.2, calibration="in-domain", speculation="previous-layer",
           rule="fixed-k"),
        at(0.99, 1.0, 0.1, r=1.0, calibration="in-domain", speculation="same-layer",
           rule="fixed-k", dense_layers=1),
        {"task": "recall-12l", "kind": "refused", "keys": "partial", "r": 0.2,
         "calibration": "book", "dense_layers": 2,
         "error": "--calibration-text: 2048 of its 2048 tokens are unknown; give text"},
    ]


def test_report_shows_int_keys_dense_layers_and_the_previous_layer_verdict():
    twelve = Task("recall-12l", Path("recall-llama-12l"), "accuracy", True, 1088)
    sections, control_ok = attribution_report.sections([twelve], twelve_layer_results(),
                                                       args(budget=[0.1]))
    text = "\n".join(sections)
    assert control_ok
    assert "Dense accuracy: 1.0000 (first quarter 1.000, middle 1.000, last quarter 1.000)" in text
    assert ("| (2) speculation keys | same-layer, int keys (every channel, 4 bits), fixed k "
            "| 1.000 | 1.000 | 1.000 | 0.100 |") in text
    assert "| (5) dense layers | same-layer, full keys, fixed k, 1 dense (not 2) | 0.990 |" in text
    assert ("| defaults | previous-layer, int keys, alpha 5 | 0.690 | 0.690 | 0.600 "
            "| 0.030 |") in text
    # Previous-layer at 0.1: accuracy, ÷ dense, first quarter, its ÷ dense, density, verdict.
    assert "| defaults: int keys, alpha 5 | 0.690 | 0.690 | 0.600 | 0.600 | 0.030 | no |" in text
    assert ("| partial keys r 0.2, in-domain skew, alpha 5 | 0.465 | 0.465 | 0.400 "
            "| 0.400 | 0.050 | no |") in text
    assert text.index("| defaults: int keys, alpha 5 |") < text.index("| partial keys r 0.2,")
    assert ("| int keys, cap binding (fixed k) | 1.000 | 1.000 | 1.000 | 1.000 | 0.100 "
            "| yes |") in text
    assert ("| r 0.2, in-domain skew, cap binding | 0.585 | 0.585 | 0.500 | 0.500 | 0.100 "
            "| no |") in text
    assert ("The defaults do not reach 0.95x dense overall and on first-quarter needles at "
            "budget 0.1 (density 0.030 of the 0.1 cap). Reaching it: int keys, cap binding "
            "(fixed k); full keys (r 1), cap binding.") in text
    assert ("| full keys (r 1), alpha 5 | 0.715 | 0.715 | 0.700 | 0.700 | 0.045 | no |") in text
    assert ("With alpha 5 even the full keys stay below it (0.715 at density 0.045): at the "
            "default alpha the count on the previous layer's speculated scores limits") in text
    assert "best previous-layer (prefetch) | over int keys and every r, calibration, rule | " \
           "1.000 (previous-layer, int keys, fixed k)" in text
    assert "Calibration refused by the product (no engine, rows blank): r 0.2 book text" in text
    assert "| recall-12l | refused |" not in text


def test_book_report_puts_the_int_keys_default_beside_the_partial_keys_at_02():
    book = Task("book", Path("gutenberg-llama-2k"), "perplexity", False, 1025)
    results = [result("dense", 100.0, task="book", keys=None, dense_layers=None),
               result("control", 100.0, 1.0, "in-domain", "previous-layer", "fixed-k", 1.0, 1.0,
                      task="book")]
    for keys, r, calibration, value in (("int", None, None, 102.0),
                                        ("partial", 0.2, "in-domain", 103.0),
                                        ("partial", 0.2, "book", 104.0)):
        results.append(result("grid", value, r, calibration, "previous-layer", "alpha", 0.2,
                              0.199, keys=keys, task="book"))
    sections, control_ok = attribution_report.sections([book], results, args(budget=[0.2]))
    text = "\n".join(sections)
    assert control_ok
    assert ("Perplexity ÷ dense at budget 0.2 (previous-layer, alpha 5): defaults (int keys) "
            "1.020x (density 0.199); partial keys r 0.2: in-domain skew 1.030x; "
            "book skew 1.040x.") in text
    assert "| defaults | previous-layer, int keys, alpha 5 | 102.000 | 0.980 | 0.199 |" in text
    assert ("| partial keys | previous-layer, partial keys r 0.2, alpha 5, in-domain skew "
            "| 103.000 |") in text
    assert "| factor | configuration | perplexity @ 0.2 | dense ÷ | density |" in text
