# SPDX-License-Identifier: Apache-2.0
"""Which models InfiniGen accepts: model types, and sliding windows as vLLM resolves them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm.engine.arg_utils import EngineArgs

import vllm_infinigen
from vllm_infinigen.architectures import AttentionPlan, window_refusal
from vllm_infinigen.frontend import checks, skew_setup

STORIES_DIR = Path(vllm_infinigen.__file__).parent / "assets" / "stories260k"
vllm_infinigen.register()

MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


def variant(tmp_path: Path, **changes) -> str:
    """stories260K (5 layers, 512 positions) with ``changes`` in its config.json."""
    out = tmp_path / "model"
    shutil.copytree(STORIES_DIR, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def check(model: str, **kwargs) -> None:
    checks.check_engine_args(EngineArgs(model=model, **kwargs))


@pytest.mark.parametrize("family", [MISTRAL, QWEN2, QWEN3], ids=lambda f: f["model_type"])
def test_window_shorter_than_the_context_is_refused_naming_flags(tmp_path, family):
    model = variant(tmp_path, **family, sliding_window=128, use_sliding_window=True,
                    max_window_layers=0)
    with pytest.raises(ValueError) as info:
        check(model)
    message = str(info.value)
    assert message.startswith("--kv-manager infinigen: ")
    assert f"model type {family['model_type']!r}" in message
    assert "window of 128 tokens on every layer" in message
    assert "max model length 512" in message
    assert "--max-model-len 128" in message and "--disable-sliding-window" in message


@pytest.mark.parametrize("kwargs", [{"max_model_len": 128}, {"max_model_len": 100},
                                    {"disable_sliding_window": True}])
def test_window_that_never_excludes_a_token_is_accepted(tmp_path, kwargs):
    """A window reaching past --max-model-len, or switched off, is full attention."""
    check(variant(tmp_path, **MISTRAL, sliding_window=128), **kwargs)


@pytest.mark.parametrize("family", [QWEN2, QWEN3], ids=lambda f: f["model_type"])
def test_qwen_window_switched_off_in_config_is_accepted(tmp_path, family):
    """Qwen checkpoints name a window they do not use (use_sliding_window false)."""
    check(variant(tmp_path, **family, sliding_window=128, use_sliding_window=False))
    with pytest.raises(ValueError, match="window of 128"):
        check(variant(tmp_path / "on", **family, sliding_window=128, use_sliding_window=True,
                      max_window_layers=0))


def test_qwen_window_on_some_layers_is_refused_as_vllm_does(tmp_path):
    model = variant(tmp_path, **QWEN2, sliding_window=4096, use_sliding_window=True,
                    max_window_layers=2)
    with pytest.raises(ValueError, match=r"'qwen2' with a sliding window on 3 of 5 layers"
                                         r" \(max_window_layers\) is refused by vLLM"):
        check(model)


def test_attention_plan_resolves_as_vllm(tmp_path):
    plan = checks.attention_plan(
        EngineArgs(model=variant(tmp_path, **MISTRAL, sliding_window=128)).create_model_config(),
        {"sliding_window": 128})
    assert plan == AttentionPlan("mistral", (128,) * 5, 512)
    assert plan.window_excludes_tokens and plan.full_layers == []
    assert checks.attention_plan(EngineArgs(model=str(STORIES_DIR)).create_model_config(),
                                 {}) is None
    # A window on some layers, from layer_types (Llama reads them per layer).
    mixed = AttentionPlan("llama", (64, None, 64, None), 512)
    assert mixed.full_layers == [1, 3] and mixed.window == 64
    assert "on 2 of 4 layers" in window_refusal(mixed)
    assert window_refusal(AttentionPlan("llama", (None,) * 4, 512)) is None


def test_unused_window_is_switched_off_only_with_infinigen(tmp_path):
    """The engine config of an accepted window: full attention with InfiniGen
    (the window never excludes a token), vLLM's own window without it."""
    model = variant(tmp_path, **MISTRAL, sliding_window=4096)
    common = dict(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=128)
    stock = EngineArgs(**common).create_engine_config()
    assert stock.model_config.get_sliding_window() == 4096
    ours = EngineArgs(**common, kv_manager="infinigen").create_engine_config()
    assert ours.model_config.get_sliding_window() is None
    assert ours.model_config.max_model_len == 512


def test_skew_file_of_another_family_is_refused_naming_the_file(tmp_path):
    """Every family's skew file is accepted for its own model and refused for
    each other family's, naming the file: the fingerprint (model_type and
    weights) tells them apart even where the shapes agree (llama, qwen3 and
    qwen3_moe here: 4 layers, 2 KV heads of 32)."""
    from benchmarks.harness import models
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.layout import ModelLayout
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import save_skew_tables

    families = {
        "llama": models.build_tiny_llama(tmp_path / "llama", num_kv_heads=2),
        "qwen3": models.build_tiny_qwen3(tmp_path / "qwen3"),
        "qwen3_moe": models.build_tiny_qwen3(tmp_path / "qwen3_moe", moe=True),
        "gemma3_text": models.build_tiny_gemma3(tmp_path / "gemma3"),
        "opt": models.build_tiny_opt(tmp_path / "opt"),
    }
    skew_files = {}
    for family, model in families.items():
        skew_files[family] = str(tmp_path / f"{family}.skew.safetensors")
        save_skew_tables(compute_skew_tables(str(model), 0.2), skew_files[family])
    layouts = {family: ModelLayout.of_model_dir(model) for family, model in families.items()}
    for owner, skew_file in skew_files.items():
        config = InfiniGenConfig(speculation_keys="partial", skew_file=skew_file)
        for family, model in families.items():
            if family == owner:
                assert skew_setup.prepare_skew_file(
                    str(model), config, layouts[family]) == skew_file
                continue
            with pytest.raises(ValueError) as info:
                skew_setup.prepare_skew_file(str(model), config, layouts[family])
            assert str(info.value).startswith(
                f"--infinigen-skew-file {skew_file}: written for another model"), (owner, family)


@pytest.mark.parametrize("dense,sparse,windowed", [(2, 2, 4), (2, 2, 22), (1, 3, 4),
                                                   (2, 3, 3), (3, 5, 40)])
def test_kv_cache_group_size_with_windows_matches_vllm(dense, sparse, windowed):
    """Our mirror of the grouping equals vLLM's, sliding-window groups included."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from tests.vllm_api import kv_cache_groups_uniform_page_size
    from vllm_infinigen.layout import kv_cache_group_size
    from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec, dense_group_index

    shape = dict(block_size=128, num_kv_heads=1, head_size=32, dtype=torch.float32)
    full = FullAttentionSpec(**shape)
    specs = {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(**shape, sliding_window=64)
             for i in range(windowed)}
    specs.update({f"model.layers.{windowed + i}.self_attn.attn": full for i in range(dense)})
    specs.update({f"model.layers.{windowed + dense + i}.self_attn.attn":
                  InfiniGenSparseSpec.of(full) for i in range(sparse)})
    groups = kv_cache_groups_uniform_page_size(specs)
    size = kv_cache_group_size(dense, sparse, windowed)
    assert max(len(group.layer_names) for group in groups) == size
    dense_group = groups[dense_group_index(groups)]
    assert dense_group.layer_names == [f"model.layers.{windowed + i}.self_attn.attn"
                                       for i in range(dense)]


def test_gemma3_layout_splits_full_attention_layers():
    from vllm_infinigen.layout import ModelLayout

    # Gemma 3 1B's pattern: a full-attention layer every 6th of 26.
    windowed = tuple(idx for idx in range(26) if (idx + 1) % 6)
    layout = ModelLayout("gemma3_text", num_layers=26, num_heads=4, num_kv_heads=1,
                         head_dim=256, window_layers=windowed)
    assert layout.full_layers == [5, 11, 17, 23]
    assert layout.sparse_layers == [17, 23] and layout.num_sparse == 2
    assert layout.group_size == 2  # 22 windowed, 2 dense, 2 sparse
    assert layout.max_dense_layers() == 2  # 3 dense + 1 sparse: groups of 1


def test_gemma3_keeps_its_windows(tmp_path):
    """Windowed layers stay windowed (not refused, not switched off), even
    where the window is shorter than the context; the checks count the
    full-attention layers only."""
    from benchmarks.harness import models

    model = str(models.build_tiny_gemma3(tmp_path / "gemma3"))
    args = EngineArgs(model=model, max_model_len=512)
    plan = checks.attention_plan(args.create_model_config(), {"sliding_window": 64})
    assert plan.windows == (64, None) * 4 and plan.window_excludes_tokens
    assert plan.window_layers == (0, 2, 4, 6) and plan.full_layers == [1, 3, 5, 7]
    assert window_refusal(plan) is None and not plan.switches_window_off
    check(model, max_model_len=512)
    with pytest.raises(ValueError, match="--infinigen-dense-layers 4 leaves no sparse layer "
                                         "in a 8-layer model with 4 full-attention layers"):
        check(model, kv_manager="infinigen", infinigen_dense_layers=4)
    with pytest.raises(ValueError, match="--infinigen-dense-layers 3 would split the dense "
                                         "layers over several KV-cache groups; use at most 2"):
        check(model, kv_manager="infinigen", infinigen_dense_layers=3)


@pytest.mark.parametrize("changes,reason", [
    ({**QWEN2, "dual_chunk_attention_config": {"chunk_size": 256}}, "dual-chunk attention"),
    ({**QWEN3, "is_causal": False}, "bidirectional attention"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
     "bidirectional attention"),
    ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
])
def test_attention_variants_are_refused_naming_model_type_and_reason(tmp_path, changes,
                                                                      reason):
    with pytest.raises(ValueError) as info:
        check(variant(tmp_path, **changes))
    assert f"model type {changes['model_type']!r}" in str(info.value)
    assert reason in str(info.value)
