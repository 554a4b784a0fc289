# SPDX-License-Identifier: Apache-2.0
"""Skew files: what ``vllm-infinigen prepare`` writes and every engine process checks.

A skew file is safetensors, one ``layers.{idx}.skew`` tensor [H_kv, D, R] per
layer (float32, orthonormal columns), with the model's fingerprint (its
shape-defining config fields, then every safetensors file's header and first
MiB of weights), the partial ratio and a format version in its metadata. A
file for another model, another ratio, with wrong shapes or truncated is
refused, naming it (``load_skew_tables``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_infinigen.layout import partial_rank

FORMAT_VERSION = "1"


SKEW_FLAG = "--infinigen-skew-file"


_FINGERPRINT_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)


@dataclass(frozen=True)
class SkewTables:
    """Per-layer skew slices of one model.

    ``skew[layer_idx]``: [num_kv_heads, head_dim, rank] float32, orthonormal
    columns, applied as ``partial = x @ skew[kv_head]`` to post-RoPE queries
    and keys.
    """

    skew: list[torch.Tensor]
    fingerprint: str
    partial_ratio: float
    calibration_tokens: int | None = None  # tokens it was calibrated on (None: loaded)

    @property
    def rank(self) -> int:
        return self.skew[0].shape[-1]


# What the skew calibration and the fingerprint read of a Hub model: its config
# and tokenizer files and its Hugging Face safetensors weights, at the top of the
# repository (vLLM downloads the same weights; not the Mistral format's
# consolidated ones, nor other folders' variants).
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")
SKIPPED_FILE_PATTERNS = ("*/*", "consolidated*")


def model_files(model: str, revision: str | None = None,
                download_dir: str | None = None) -> str:
    """A local directory with ``model``'s config, tokenizer and safetensors weights.

    A directory is itself. A Hugging Face Hub id is its snapshot at ``revision``
    (``--revision``) in ``download_dir`` (``--download-dir``, where vLLM puts the
    weights; default: the Hugging Face cache), downloaded where missing as vLLM
    downloads a model, from the cache alone under ``HF_HUB_OFFLINE=1``.

    Raises:
        ValueError: If the files cannot be had, naming the model and the cause.
    """
    if os.path.isdir(model):
        return model
    if os.path.isfile(model) or "://" in model:  # a GGUF file, an object store's URL
        raise ValueError(
            f"{model!r} is no Hugging Face checkpoint, whose safetensors weights the partial "
            "keys' calibration reads; use --infinigen-speculation-keys bounds (the default) "
            "or int, which need none")
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(MODEL_FILE_PATTERNS),
                                 ignore_patterns=list(SKIPPED_FILE_PATTERNS),
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except Exception as e:
        raise ValueError(
            f"cannot get the files of {model!r} (revision {revision or 'main'}) from the "
            f"Hugging Face Hub or its cache: {e}; check the model, --revision and "
            "--download-dir (HF_HUB_OFFLINE=1 reads the cache alone)") from e


def model_fingerprint(model_dir: str) -> str:
    """Identifies a checkpoint: its shape-defining config and weight bytes.

    Hashes the config fields that define shapes, then for every safetensors
    file its header (names, shapes, offsets) and first MiB of tensor data; not
    the Mistral format's ``consolidated*`` copy of the same weights, which vLLM
    may download beside them after the front end's calibration.
    """
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    subset = {key: config.get(key) for key in _FINGERPRINT_CONFIG_KEYS}
    digest.update(json.dumps(subset, sort_keys=True).encode())
    files = sorted(path for path in glob.glob(os.path.join(model_dir, "*.safetensors"))
                   if not os.path.basename(path).startswith("consolidated"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}, which the partial keys' "
                         "skew file is checked against; use --infinigen-speculation-keys "
                         "bounds (the default) or int, which need none")
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_len))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]


def save_skew_tables(tables: SkewTables, path: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"layers.{idx}.skew": s.contiguous() for idx, s in enumerate(tables.skew)}
    metadata = {
        "format": "vllm-infinigen-skew",
        "format_version": FORMAT_VERSION,
        "fingerprint": tables.fingerprint,
        "partial_ratio": repr(tables.partial_ratio),
        "num_layers": str(len(tables.skew)),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def load_skew_tables(
    path: str,
    fingerprint: str,
    partial_ratio: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> SkewTables:
    """Loads and checks a skew file against the model being served.

    Raises:
        ValueError: Naming the file, when it is unreadable, truncated, for
            another model, another partial ratio, or has wrong shapes.
    """
    from safetensors import safe_open

    def fail(reason: str, fix: str = "; write it again with `vllm-infinigen prepare` for "
             "this model and ratio") -> ValueError:
        return ValueError(f"{SKEW_FLAG} {path}: {reason}{fix}")

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises several types for bad files
        raise fail(f"not a readable safetensors file ({e})") from e
    if metadata.get("format") != "vllm-infinigen-skew":
        raise fail("not a skew file written by `vllm-infinigen prepare`", fix="")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise fail(f"format version {metadata.get('format_version')}, expected {FORMAT_VERSION}")
    if metadata.get("fingerprint") != fingerprint:
        raise fail(
            f"written for another model (fingerprint {metadata.get('fingerprint')}, "
            f"this model {fingerprint})", fix="; run `vllm-infinigen prepare` for this model")
    file_ratio = float(metadata.get("partial_ratio", "nan"))
    if file_ratio != partial_ratio:
        raise fail(
            f"written for --infinigen-partial-ratio {file_ratio}, "
            f"the engine uses {partial_ratio}"
        )
    rank = partial_rank(head_dim, partial_ratio)
    skew = []
    for idx in range(num_layers):
        tensor = tensors.get(f"layers.{idx}.skew")
        if tensor is None:
            raise fail(f"has no tensor for layer {idx}")
        if tuple(tensor.shape) != (num_kv_heads, head_dim, rank):
            raise fail(
                f"layer {idx} has shape {tuple(tensor.shape)}, expected "
                f"{(num_kv_heads, head_dim, rank)}"
            )
        skew.append(tensor.float())
    return SkewTables(skew, fingerprint, partial_ratio)


def cached_skew_path(fingerprint: str, partial_ratio: float) -> Path:
    root = os.environ.get(
        "VLLM_INFINIGEN_CACHE", os.path.join(Path.home(), ".cache", "vllm_infinigen")
    )
    return Path(root) / f"skew-{fingerprint}-r{partial_ratio}.safetensors"
