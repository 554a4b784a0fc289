# SPDX-License-Identifier: Apache-2.0
"""The model InfiniGen reads before an engine starts is the one vLLM loads: a Hub id
at its --revision, --hf-overrides applied, the files from --download-dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file
from vllm.engine.arg_utils import EngineArgs

import vllm_infinigen
from vllm_infinigen.frontend import checks
from vllm_infinigen.skewing.tables import load_skew_tables, model_files, model_fingerprint

STORIES_DIR = Path(vllm_infinigen.__file__).parent / "assets" / "stories260k"
HUB_ID = "org/tiny"
vllm_infinigen.register()  # what vLLM's plugin loader does in every process


def add_snapshot(cache: Path, revision: str, commit: str, config_changes: dict) -> Path:
    """``HUB_ID`` at ``revision`` in a Hugging Face cache: the bundled model's files,
    its config changed by ``config_changes``."""
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(STORIES_DIR, snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, **config_changes}))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> dict[str, Path]:
    """The Hugging Face cache holds ``HUB_ID`` at main (the bundled stories260K) and at
    v2 (its config says GPT-2, which InfiniGen refuses); the Hub itself is offline from
    the engine arguments' resolution on (``hub_args``)."""
    cache = tmp_path / "hf-cache"
    snapshots = {"main": add_snapshot(cache, "main", "a" * 40, {}),
                 "v2": add_snapshot(cache, "v2", "b" * 40, {"model_type": "gpt2"})}
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshots


def hub_args(**kwargs) -> EngineArgs:
    """Engine arguments as a host online holds them: the Hub id itself (offline, vLLM's
    ``EngineArgs`` turns it into the revision's snapshot directory at once, which the
    front end read correctly before too); resolved from the cache afterwards."""
    offline = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        args = EngineArgs(model=HUB_ID, **kwargs)
    finally:
        constants.HF_HUB_OFFLINE = offline
    assert args.model == HUB_ID
    return args


def test_a_hub_id_is_checked_at_the_revision_vllm_loads(hub):
    assert checks.check_engine_args(hub_args()) is None
    # Before, the front end read main's config whatever --revision said.
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        checks.check_engine_args(hub_args(revision="v2"))


def test_hf_overrides_reach_the_layout():
    # The bundled model has 5 layers; overridden to 2, the 2 dense layers leave none.
    with pytest.raises(ValueError, match="leaves no sparse layer in a 2-layer model"):
        checks.check_engine_args(EngineArgs(model=str(STORIES_DIR),
                                            hf_overrides={"num_hidden_layers": 2}))


def test_a_hub_id_vllm_cannot_find_gets_vllms_own_error(hub):
    with pytest.raises(Exception) as stock:
        hub_args(revision="v9").create_model_config()
    with pytest.raises(Exception) as ours:
        checks.check_engine_args(hub_args(revision="v9"))
    assert (type(ours.value), str(ours.value)) == (type(stock.value), str(stock.value))


def test_a_mistral_format_checkpoint_is_checked_as_mistral(tmp_path):
    """With params.json and consolidated weights vLLM reads the Mistral format, whose
    config has no model_type (mistralai's own repositories ship both formats)."""
    model = tmp_path / "mistral"
    model.mkdir()
    (model / "params.json").write_text(json.dumps({
        "dim": 64, "n_layers": 4, "head_dim": 32, "hidden_dim": 128, "n_heads": 2,
        "n_kv_heads": 1, "norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 10000.0}))
    save_file({"tok_embeddings.weight": torch.zeros(512, 64)},
              str(model / "consolidated.safetensors"))
    (model / "config.json").write_text(json.dumps({
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "intermediate_size": 128, "vocab_size": 512}))
    model_config = EngineArgs(model=str(model)).create_model_config()
    assert not model_config.hf_config.to_dict().get("model_type")  # vLLM's Mistral format
    hf_config = checks.model_hf_config(model_config)
    assert (hf_config["model_type"], hf_config["num_hidden_layers"]) == ("mistral", 4)
    assert checks.check_engine_args(EngineArgs(model=str(model))) is None


def test_model_files_of_a_directory_a_revision_and_a_download_dir(hub, tmp_path):
    assert model_files(str(STORIES_DIR)) == str(STORIES_DIR)
    assert Path(model_files(HUB_ID)) == hub["main"]
    assert Path(model_files(HUB_ID, revision="v2")) == hub["v2"]
    # --download-dir: vLLM's weights (and the files calibration reads) live there.
    elsewhere = tmp_path / "download-dir"
    third = add_snapshot(elsewhere, "main", "c" * 40, {})
    assert Path(model_files(HUB_ID, download_dir=str(elsewhere))) == third
    with pytest.raises(ValueError, match=r"'org/absent' \(revision main\)"):
        model_files("org/absent")
    # Nothing the partial keys could calibrate on: named, not looked up on the Hub.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for model in (str(gguf), "s3://bucket/model"):
        with pytest.raises(ValueError, match="is no Hugging Face checkpoint.*"
                           "--infinigen-speculation-keys bounds"):
            model_files(model)


def test_the_fingerprint_leaves_out_the_mistral_formats_copy(tmp_path):
    """vLLM may download consolidated*.safetensors beside the Hugging Face weights after
    the front end calibrated on them: the worker's fingerprint must not change."""
    model = tmp_path / "model"
    shutil.copytree(STORIES_DIR, model)
    before = model_fingerprint(str(model))
    save_file({"tok_embeddings.weight": torch.ones(4, 4)},
              str(model / "consolidated.safetensors"))
    assert model_fingerprint(str(model)) == before
    save_file({"extra": torch.ones(4, 4)}, str(model / "model-00002.safetensors"))
    assert model_fingerprint(str(model)) != before


def test_partial_keys_of_a_hub_model_calibrate_on_its_revision(hub):
    # v3: main's files with another rope_theta (a fingerprinted field), so that a skew
    # computed from main's files would not load for it.
    add_snapshot(Path(constants.HF_HUB_CACHE), "v3", "d" * 40, {"rope_theta": 500000.0})
    args = hub_args(revision="v3", kv_manager="infinigen",
                    infinigen_speculation_keys="partial", max_model_len=256)
    vllm_config = args.create_engine_config()
    settings = vllm_config.additional_config["infinigen"]
    model_config = vllm_config.model_config
    # What the worker reads back (worker/base.py, build_runtime) is v3's files.
    worker_dir = model_files(model_config.model, model_config.revision,
                             vllm_config.load_config.download_dir)
    assert worker_dir == str(hub["main"]).replace("a" * 40, "d" * 40)
    tables = load_skew_tables(settings["skew_file"], model_fingerprint(worker_dir),
                              settings["partial_ratio"], num_layers=5, num_kv_heads=4,
                              head_dim=32)
    assert tables.fingerprint != model_fingerprint(str(hub["main"]))
