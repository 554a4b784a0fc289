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


def test_the_held_out_prompts_are_saved_as_the_harnesses_read_them(tmp_path):
    """``--save-prompts DIR --prompts-only``: the generator's prompts, gzipped, read back
    by ``retrieval.load_examples`` (which checks each needle's bucket) unchanged; the
    committed 8K file is that command's output."""
    from benchmarks.accuracy import retrieval

    require_shared(recall_lengths.GENERATOR)
    task = recall_lengths.recall_task()
    assert recall_lengths.main(["--lengths", "512:12", "--prompts", "6", "--save-prompts",
                                str(tmp_path), "--prompts-only"]) == 0
    saved = retrieval.load_examples(tmp_path / "recall-512.jsonl.gz", None)
    assert saved == task.make_eval_set(6, seed=11 + 512, L=512, N=12)
    committed = paths.REPO / "benchmarks" / "data" / "recall-8192.jsonl.gz"
    first = retrieval.load_examples(committed, 2)
    assert first == task.make_eval_set(2, seed=11 + 8192, L=8192, N=190)


def test_prompts_only_needs_somewhere_to_save_them():
    import pytest

    with pytest.raises(SystemExit):
        recall_lengths.main(["--lengths", "512:12", "--prompts-only"])
    with pytest.raises(SystemExit):
        recall_lengths.main(["--lengths", "512:12"])  # no --model, no --out
