# SPDX-License-Identifier: Apache-2.0
"""The device call that continues the recall model (``benchmarks/gpu/continue_recall.py``),
run whole on the CPU in the training script's smoke form: what comes back is the
checkpoint to commit, read with its positions interpolated."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from benchmarks.accuracy import recall_lengths
from benchmarks.gpu import continue_recall
from tests.shared_data import require_shared
from tests.unit.test_recall_lengths import MODEL


def test_a_smoke_run_comes_back_as_a_bfloat16_checkpoint_read_interpolated(tmp_path):
    scripts = require_shared(recall_lengths.GENERATOR)
    out = tmp_path / "out"
    assert continue_recall.main([
        "--scripts", str(scripts), "--init", str(MODEL), "--rope-linear-factor", "4",
        "--work", str(tmp_path / "work"), "--pack-to", str(out),
        "--", "--smoke", "--device", "cpu"]) == 0
    parts = sorted(out.iterdir())
    assert parts and all(p.stat().st_size <= continue_recall.PART_BYTES for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back" / "checkpoint"
    assert sorted(p.name for p in back.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        *continue_recall.TOKENIZER_FILES]
    config = json.loads((back / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 4.0,
                                         "rope_theta": 10000.0}
    assert config["dtype"] == "float32"  # bfloat16 weights, trained on in float32

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    weights = load_file(back / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    model = LlamaForCausalLM.from_pretrained(back)
    assert model.model.rotary_emb.rope_type == "linear"
    results = json.loads((tmp_path / "back" / "run" / "results.json").read_text())
    # The smoke form trains for at most 8 steps or 5 s (fewer on a busy machine).
    assert 1 <= results["steps"] <= 8 and "heldout_384_fp32" in results


def test_the_training_keeps_to_its_arguments_and_the_work_folder_starts_empty(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    common = ["--init", str(MODEL), "--work", str(tmp_path / "w"), "--pack-to", str(tmp_path)]
    with pytest.raises(SystemExit, match="carry shared/prototypes/recall-training"):
        continue_recall.main(["--scripts", str(scripts), *common])
    (scripts / "recall_long.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(SystemExit, match="--init and --out are this script's"):
        continue_recall.main(["--scripts", str(scripts), *common, "--", "--out", "x"])
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "left").write_text("")
    with pytest.raises(SystemExit, match="is not empty"):
        continue_recall.main(["--scripts", str(scripts), *common])
