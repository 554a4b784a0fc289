# SPDX-License-Identifier: Apache-2.0
"""The GPU time-to-first-token benchmark (``benchmarks/gpu/prefill.py``) on the CPU:
its self-test runs every variant through the product's prefill path with tiny
shapes, checks every variant's logits against dense's and that InfiniGen's
prefill copies nothing from the pool where the staged path does."""

from __future__ import annotations

import json

from benchmarks.gpu import prefill


def test_the_self_test_prefills_every_variant_and_reads_nothing_back(tmp_path):
    out = tmp_path / "prefill"
    assert prefill.main(["--self-test", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert results["check"]["passed"] and not results["check"]["prompt_read_from_pool"]
    chunked, whole = results["contexts"]
    assert chunked["chunk"] < chunked["context"] == whole["chunk"]
    for result in (chunked, whole):
        variants = result["variants"]
        assert list(variants) == list(prefill.VARIANTS)
        assert variants["infinigen"]["pcie_GB"] == 0.0
        assert variants["infinigen_staged"]["pcie_GB"] > 0
        assert all(v["max_abs_diff_vs_first"] < 1e-4 for v in variants.values())
        assert variants["dense"]["x_dense"] == 1.0
    text = out.with_suffix(".md").read_text()
    assert "- command:" in text and "repository commit:" in text
    assert "| 256 | 96 | infinigen |" in text


def _result(cached_gb: float, staged_gb: float, diff: float = 0.0) -> dict:
    entry = {"ttft_ms": 1.0, "max_abs_diff_vs_first": 0.0}
    return {"context": 256, "chunk": 96, "variants": {
        "dense": entry, "infinigen": {**entry, "pcie_GB": cached_gb,
                                      "max_abs_diff_vs_first": diff},
        "infinigen_staged": {**entry, "pcie_GB": staged_gb}}}


def test_the_check_fails_on_a_prompt_read_back_or_logits_apart():
    assert prefill.checks([_result(0.0, 0.5)], 1e-4)["passed"]
    read_back = prefill.checks([_result(0.1, 0.5)], 1e-4)
    assert not read_back["passed"] and read_back["prompt_read_from_pool"]
    assert not prefill.checks([_result(0.0, 0.5, diff=0.01)], 1e-4)["passed"]
