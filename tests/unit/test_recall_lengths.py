# SPDX-License-Identifier: Apache-2.0
"""The recall model committed with the project loads and retrieves, measured by the
length-and-depth benchmark (the recall task's generator is in ../shared)."""

from __future__ import annotations

import json

from benchmarks.accuracy import recall_lengths
from benchmarks.harness import paths
from tests.shared_data import require_shared

MODEL = paths.REPO / "benchmarks" / "models" / "recall-llama-12l-toward-16k"


def test_the_committed_checkpoint_retrieves_at_1k_by_needle_depth(tmp_path):
    require_shared(recall_lengths.GENERATOR)
    assert recall_lengths.main(["--model", str(MODEL), "--lengths", "1024:24", "--prompts", "12",
                                "--out", str(tmp_path / "r")]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    result = saved["results"]["1024"]
    assert result["prompts"] == {"first_quarter": 4, "middle": 4, "last_quarter": 4, "all": 12}
    assert result["accuracy"]["all"] >= 0.75  # 0.947 at 1K before the continued training
    assert saved["meta"]["model"] == str(MODEL)
    text = (tmp_path / "r.md").read_text()
    assert "| 1,024 (24 pairs, n=12) |" in text and "seed 1035" in text


def test_a_linear_rope_factor_reads_the_positions_interpolated(tmp_path):
    require_shared(recall_lengths.GENERATOR)
    assert recall_lengths.main(["--model", str(MODEL), "--lengths", "512:12", "--prompts", "3",
                                "--rope-linear-factor", "2", "--out", str(tmp_path / "r")]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["settings"]["rope_linear_factor"] == 2.0
    assert "RoPE positions interpolated linearly by 2" in (tmp_path / "r.md").read_text()
