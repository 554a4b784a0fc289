# SPDX-License-Identifier: Apache-2.0
"""Skew matrices: SVD slices, the skew file format and its checks, model fingerprints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.shared_data import require_shared
from vllm_infinigen.layout import partial_rank
from vllm_infinigen.skewing.calibration import (
    CALIBRATION_TEXT,
    calibration_chunks,
    calibration_memory_bytes,
    compute_skew_tables,
    load_dtype,
    read_calibration_files,
    skew_from_activations,
)
from vllm_infinigen.skewing.tables import (
    SKEW_FLAG,
    SkewTables,
    load_skew_tables,
    model_fingerprint,
    save_skew_tables,
)

# The bundled stories260K (head_dim 32, as vLLM on CPU runs it).
STORIES_DIR = str(BUNDLED_MODEL)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 16
NUM_CALIBRATION_TOKENS = 64


def orthonormal_basis(dim: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    """[dim, rank] with orthonormal columns, float64."""
    basis, _ = torch.linalg.qr(torch.randn(dim, rank, generator=gen, dtype=torch.float64))
    return basis


def low_rank_activations(rank: int, seed: int):
    """Queries and keys of KV head h lie in their own rank-dim subspace.

    Returns:
        queries [H_q, T, D], keys [H_kv, T, D] (float32) and the subspace
        bases [H_kv, D, rank] (float64).
    """
    gen = torch.Generator().manual_seed(seed)
    group = NUM_HEADS // NUM_KV_HEADS
    bases = torch.stack([orthonormal_basis(HEAD_DIM, rank, gen) for _ in range(NUM_KV_HEADS)])
    coeffs_q = torch.randn(NUM_HEADS, NUM_CALIBRATION_TOKENS, rank, generator=gen,
                           dtype=torch.float64)
    coeffs_k = torch.randn(NUM_KV_HEADS, NUM_CALIBRATION_TOKENS, rank, generator=gen,
                           dtype=torch.float64)
    # Query head q belongs to KV head q // group (vLLM's GQA layout).
    queries = torch.stack([coeffs_q[q] @ bases[q // group].T for q in range(NUM_HEADS)])
    keys = torch.stack([coeffs_k[h] @ bases[h].T for h in range(NUM_KV_HEADS)])
    return queries.float(), keys.float(), bases


def test_skew_from_activations_orthonormal_columns():
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(NUM_HEADS, NUM_CALIBRATION_TOKENS, HEAD_DIM, generator=gen)
    keys = torch.randn(NUM_KV_HEADS, NUM_CALIBRATION_TOKENS, HEAD_DIM, generator=gen)
    skew = skew_from_activations(queries, keys, rank=5)
    assert skew.shape == (NUM_KV_HEADS, HEAD_DIM, 5)
    assert skew.dtype == torch.float32
    gram = skew.transpose(1, 2) @ skew  # [H_kv, rank, rank]
    torch.testing.assert_close(gram, torch.eye(5).expand_as(gram), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_partial_scores_exact_for_low_rank_queries(rank):
    queries, keys, _ = low_rank_activations(rank, seed=rank)
    skew = skew_from_activations(queries, keys, rank)
    group = NUM_HEADS // NUM_KV_HEADS
    for q in range(NUM_HEADS):
        h = q // group
        full = queries[q] @ keys[h].T  # [T, T]
        partial = (queries[q] @ skew[h]) @ (keys[h] @ skew[h]).T
        torch.testing.assert_close(partial, full, atol=1e-4, rtol=1e-4)


def test_skew_is_per_kv_head_group():
    """Each KV head's slice spans the subspace of its own query group only."""
    rank = 3
    queries, keys, bases = low_rank_activations(rank, seed=11)
    skew = skew_from_activations(queries, keys, rank).double()
    for h in range(NUM_KV_HEADS):
        # Same column space: projecting the true basis onto the slice keeps it.
        projected = skew[h] @ (skew[h].T @ bases[h])
        torch.testing.assert_close(projected, bases[h], atol=1e-5, rtol=0)
        other = bases[(h + 1) % NUM_KV_HEADS]
        assert torch.linalg.norm(skew[h] @ (skew[h].T @ other) - other) > 0.1
    # The slice of another KV head does not reproduce this head's scores.
    full = queries[0] @ keys[0].T
    wrong = (queries[0] @ skew[1].float()) @ (keys[0] @ skew[1].float()).T
    assert (wrong - full).abs().max() > 0.1


def test_partial_rank():
    assert partial_rank(32, 0.2) == 6
    assert partial_rank(128, 0.2) == 25
    assert partial_rank(64, 1.0) == 64
    assert partial_rank(4, 0.1) == 1  # at least one channel


# ---------------------------------------------------------------------------
# Skew files


def make_tables(num_layers=2, partial_ratio=0.2, fingerprint="f" * 32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rank = partial_rank(HEAD_DIM, partial_ratio)
    skew = [torch.randn(NUM_KV_HEADS, HEAD_DIM, rank, generator=gen) for _ in range(num_layers)]
    return SkewTables(skew, fingerprint, partial_ratio)


def load(path, **overrides):
    kwargs = dict(fingerprint="f" * 32, partial_ratio=0.2, num_layers=2,
                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    kwargs.update(overrides)
    return load_skew_tables(str(path), **kwargs)


def test_save_load_round_trip_exact(tmp_path):
    tables = make_tables()
    path = tmp_path / "sub" / "skew.safetensors"
    save_skew_tables(tables, str(path))
    assert os.listdir(path.parent) == ["skew.safetensors"]  # no temporary left
    loaded = load(path)
    assert loaded.fingerprint == tables.fingerprint
    assert loaded.partial_ratio == 0.2
    assert loaded.rank == 3
    assert len(loaded.skew) == 2
    for got, want in zip(loaded.skew, tables.skew):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)


def assert_load_fails(path, match=None, **overrides):
    with pytest.raises(ValueError) as info:
        load(path, **overrides)
    message = str(info.value)
    assert str(path) in message
    assert SKEW_FLAG in message
    if match is not None:
        assert match in message
    return message


@pytest.mark.parametrize("keep", [0, 4, 8, 60, -1])
def test_load_truncated_file(tmp_path, keep):
    path = tmp_path / "skew.safetensors"
    save_skew_tables(make_tables(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    assert_load_fails(path, match="not a readable safetensors file")


def test_load_not_safetensors(tmp_path):
    path = tmp_path / "skew.safetensors"
    path.write_text("this is not a safetensors file, just text that is long enough\n" * 4)
    assert_load_fails(path, match="not a readable safetensors file")


def test_load_missing_file(tmp_path):
    assert_load_fails(tmp_path / "absent.safetensors", match="not a readable")


def test_load_safetensors_of_another_kind(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"layers.0.skew": torch.zeros(NUM_KV_HEADS, HEAD_DIM, 3)}, str(path))
    assert_load_fails(path, match="not a skew file")


def test_load_wrong_fingerprint(tmp_path):
    path = tmp_path / "skew.safetensors"
    save_skew_tables(make_tables(fingerprint="a" * 32), str(path))
    message = assert_load_fails(path, match="another model")
    assert "a" * 32 in message and "f" * 32 in message


def test_load_wrong_partial_ratio(tmp_path):
    path = tmp_path / "skew.safetensors"
    save_skew_tables(make_tables(partial_ratio=0.25), str(path))
    assert_load_fails(path, match="--infinigen-partial-ratio 0.25")


@pytest.mark.parametrize(
    "overrides",
    [{"num_kv_heads": 2}, {"head_dim": 32}],
    ids=["kv-heads", "head-dim"],
)
def test_load_wrong_shapes(tmp_path, overrides):
    path = tmp_path / "skew.safetensors"
    save_skew_tables(make_tables(), str(path))
    assert_load_fails(path, match="layer 0 has shape (4, 16, 3)", **overrides)


def test_load_missing_layer(tmp_path):
    path = tmp_path / "skew.safetensors"
    save_skew_tables(make_tables(num_layers=2), str(path))
    assert_load_fails(path, match="no tensor for layer 2; write it again with "
                      "`vllm-infinigen prepare` for this model and ratio", num_layers=3)


# ---------------------------------------------------------------------------
# Fingerprints

FAKE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "vocab_size": 128,
}


def make_model_dir(path, config=None, num_floats=600_000):
    """A fake model dir: config.json and one ~2.3 MiB safetensors file."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or FAKE_CONFIG))
    gen = torch.Generator().manual_seed(0)
    save_file({"weight": torch.randn(num_floats, generator=gen)}, str(path / "model.safetensors"))
    return path


def flip_data_byte(model_dir, data_offset):
    """Flips one byte at ``data_offset`` bytes into the tensor data."""
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len + data_offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_fingerprint_stable_across_copies(tmp_path):
    first = make_model_dir(tmp_path / "a")
    second = tmp_path / "b"
    shutil.copytree(first, second)
    assert model_fingerprint(str(first)) == model_fingerprint(str(second))
    assert len(model_fingerprint(str(first))) == 32


@pytest.mark.parametrize("data_offset", [0, 12345, (1 << 20) - 1])
def test_fingerprint_changes_with_one_weight_byte(tmp_path, data_offset):
    model_dir = make_model_dir(tmp_path / "m")
    before = model_fingerprint(str(model_dir))
    flip_data_byte(model_dir, data_offset)
    assert model_fingerprint(str(model_dir)) != before


def test_fingerprint_reads_only_first_mib(tmp_path):
    model_dir = make_model_dir(tmp_path / "m")
    before = model_fingerprint(str(model_dir))
    flip_data_byte(model_dir, (1 << 20) + 10)
    assert model_fingerprint(str(model_dir)) == before


@pytest.mark.parametrize(
    "field,value",
    [("hidden_size", 128), ("num_hidden_layers", 3), ("num_attention_heads", 4),
     ("num_key_value_heads", 2), ("head_dim", 16), ("vocab_size", 256),
     ("model_type", "mistral"), ("architectures", ["MistralForCausalLM"])],
)
def test_fingerprint_changes_with_config_shape(tmp_path, field, value):
    before = model_fingerprint(str(make_model_dir(tmp_path / "a")))
    after = model_fingerprint(str(make_model_dir(tmp_path / "b", {**FAKE_CONFIG, field: value})))
    assert after != before


def test_fingerprint_without_weights(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(FAKE_CONFIG))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        model_fingerprint(str(model_dir))


# ---------------------------------------------------------------------------
# The real tiny model


def test_compute_skew_tables_stories260k():
    tables = compute_skew_tables(STORIES_DIR, 0.2, max_tokens=256)
    assert len(tables.skew) == 5
    assert [tuple(s.shape) for s in tables.skew] == [(4, 32, 6)] * 5
    assert tables.rank == 6
    assert tables.partial_ratio == 0.2
    assert tables.fingerprint == model_fingerprint(STORIES_DIR)
    for skew in tables.skew:
        gram = skew.transpose(1, 2) @ skew
        torch.testing.assert_close(gram, torch.eye(6).expand_as(gram), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# Calibration text: the bundled book, several files, chunks, memory


def test_bundled_text_is_a_book_of_at_least_2048_tokens():
    """At least 2,048 words (so 2,048 tokens with any tokenizer that does not
    merge words), and not the children's story it replaced."""
    import re

    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    assert len(re.findall(r"\w+", text)) >= 2048
    assert text.startswith("Chapter I.") and "Mr. Bennet" in text
    assert "Project Gutenberg" not in text and "[Illustration]" not in text


def test_bundled_text_calibrates_on_2048_tokens():
    tables = compute_skew_tables(STORIES_DIR, 0.2)
    assert tables.calibration_tokens == 2048


def test_read_calibration_files_takes_files_and_directories(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "notes.md").write_text("not a .txt: skipped in a directory")
    single = tmp_path / "notes.md"
    assert read_calibration_files([tmp_path, single]) == [
        "first", "second", "third", "not a .txt: skipped in a directory"]


def test_read_calibration_files_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=f"--calibration-text {tmp_path / 'missing'}: no such"):
        read_calibration_files([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.txt file"):
        read_calibration_files([tmp_path / "empty"])
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="bin.txt: not UTF-8"):
        read_calibration_files([tmp_path / "bin.txt"])


class WordTokenizer:
    """One token per word, BOS (1) first, like a Hugging Face tokenizer call."""

    bos_token_id = 1

    def __call__(self, text, verbose=False):
        class Encoded:
            input_ids = [1] + [len(word) + 10 for word in text.split()]
        return Encoded()


def test_calibration_chunks_cut_texts_at_the_context_and_stop_at_max_tokens():
    texts = [" ".join(["ab"] * 9), " ".join(["abc"] * 50)]  # 10 and 51 tokens
    chunks = calibration_chunks(WordTokenizer(), texts, max_tokens=30, context=8)
    # Text 1: 10 tokens -> 8 + (BOS + 2); text 2: the 20 tokens left -> 8 + 8 + (BOS + 4).
    assert [len(c) for c in chunks] == [8, 3, 8, 8, 5]
    assert all(chunk[0] == 1 for chunk in chunks)
    assert chunks[1] == [1, 12, 12] and chunks[4] == [1, 13, 13, 13, 13]


def test_load_dtype_keeps_float32_checkpoints_and_never_upcasts_16_bit(tmp_path):
    for stored, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                             ("float16", torch.bfloat16)):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": stored}))
        assert load_dtype(str(tmp_path)) == expected
        assert load_dtype(str(tmp_path), "float32") == torch.float32
    with pytest.raises(ValueError, match="calibration dtype"):
        load_dtype(str(tmp_path), "float16")


def test_calibration_memory_counts_the_weights_from_the_headers(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 256,
              "vocab_size": 512, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(1000, 1000, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    small = calibration_memory_bytes(str(tmp_path), max_tokens=16)
    assert 2_000_000 <= small < 2_200_000  # 1M bf16 weights + activations of 16 tokens
    big = {**config, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(big))
    assert calibration_memory_bytes(str(tmp_path), max_tokens=16) > 4_000_000
    assert calibration_memory_bytes(str(tmp_path), max_tokens=2048) > (
        calibration_memory_bytes(str(tmp_path), max_tokens=16))


def test_prepare_takes_several_files_and_reports_time_and_memory(tmp_path, capsys):
    from vllm_infinigen.frontend.cli import main

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "one.txt").write_text("Once upon a time there was a cat. " * 20)
    (tmp_path / "two.txt").write_text("The dog ran to the park and played. " * 40)
    out = tmp_path / "skew.safetensors"
    assert main(["prepare", STORIES_DIR, "--calibration-text", str(tmp_path / "texts"),
                 str(tmp_path / "two.txt"), "--out", str(out), "--max-tokens", "300"]) == 0
    printed = capsys.readouterr().out
    assert "calibrated on 300 tokens of 2 calibration file(s)" in printed
    assert " s, peak RSS " in printed and " GiB" in printed
    fingerprint = model_fingerprint(STORIES_DIR)
    tables = load_skew_tables(str(out), fingerprint, 0.2, num_layers=5, num_kv_heads=4,
                              head_dim=32)
    # The second file changed the skew: not what the first alone gives.
    alone = compute_skew_tables(STORIES_DIR, 0.2, [(tmp_path / "texts" / "one.txt").read_text()],
                                max_tokens=300)
    assert alone.calibration_tokens < 300
    assert not all(torch.equal(a, b) for a, b in zip(alone.skew, tables.skew))
    # A ratio the engine would refuse stops prepare before it loads the model.
    for ratio in ("0", "1.5"):
        with pytest.raises(SystemExit):
            main(["prepare", STORIES_DIR, "--out", str(out), "--partial-ratio", ratio])
    assert "--partial-ratio must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_calibration_text_the_tokenizer_cannot_read_is_refused_naming_the_flag(tmp_path):
    """The recall models' word-level tokenizer turns English into <unk>: a skew
    from it finds nothing, so prepare (and a start-up calibration) refuses it."""
    from vllm_infinigen.frontend import cli
    from vllm_infinigen.skewing.calibration import CALIBRATION_TEXT

    recall = require_shared("models/recall-llama-1k")
    english = tmp_path / "english.txt"
    english.write_text(CALIBRATION_TEXT.read_text()[:4000])
    with pytest.raises(ValueError, match=r"\(--calibration-text, or the bundled one at "
                       r"start-up\): \d+ of its \d+ tokens are "
                       r"unknown .*'<unk>'.*vllm-infinigen prepare.*--infinigen-skew-file"):
        compute_skew_tables(str(recall), 0.2, english.read_text())
    with pytest.raises(ValueError, match="--calibration-text"):
        cli.main(["prepare", str(recall), "--calibration-text", str(english),
                  "--out", str(tmp_path / "skew.safetensors")])
    assert not (tmp_path / "skew.safetensors").exists()
    # The model's own vocabulary is accepted.
    words = " ".join(f"t{3 + i % 500}" for i in range(600))
    assert compute_skew_tables(str(recall), 0.2, words).calibration_tokens >= 600
    with pytest.raises(ValueError, match="fewer than 16"):
        compute_skew_tables(str(recall), 0.2, "t5 t6 t7")
