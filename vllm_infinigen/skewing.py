# SPDX-License-Identifier: Apache-2.0
"""Skewing matrices: computed offline from calibration text, stored as safetensors.

For each layer and KV head, the post-RoPE queries of the head's query group on a
calibration text are stacked, Q = U S V^T, and the skewed query q V puts most
of its energy into few columns. The ``partial_ratio * head_dim`` columns with
the largest summed |q V| + |k V| are kept: ``skew[layer][kv_head]`` is the
matching [head_dim, rank] slice of V. Because V is orthogonal, a query and a
key multiplied by the full V give the same score; the partial columns
approximate it. Models without RoPE need no special case: the skew is applied
to the projected query (bias included), which equals folding it into W_q and
the bias as the paper does.
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
CALIBRATION_TEXT = Path(__file__).parent / "assets" / "calibration.txt"
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

    @property
    def rank(self) -> int:
        return self.skew[0].shape[-1]


def local_model_dir(model: str) -> str:
    """A local directory for ``model`` (a path, or a snapshot in the HF cache)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as e:
        raise ValueError(
            f"--kv-manager infinigen needs the model files on disk; {model!r} is "
            f"neither a directory nor in the local Hugging Face cache ({e})"
        ) from e


def model_fingerprint(model_dir: str) -> str:
    """Identifies a checkpoint: its shape-defining config and weight bytes.

    Hashes the config fields that define shapes, then for every safetensors
    file its header (names, shapes, offsets) and first MiB of tensor data.
    """
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    subset = {key: config.get(key) for key in _FINGERPRINT_CONFIG_KEYS}
    digest.update(json.dumps(subset, sort_keys=True).encode())
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_len))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]


def skew_from_activations(
    queries: torch.Tensor, keys: torch.Tensor, rank: int
) -> torch.Tensor:
    """One layer's skew slices from its calibration activations.

    Args:
        queries: [H_q, T, D] post-RoPE queries.
        keys: [H_kv, T, D] post-RoPE keys.
        rank: Channels kept per KV head.

    Returns:
        [H_kv, D, rank] float32.
    """
    num_heads, num_tokens, head_dim = queries.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    slices = []
    for kv_head in range(num_kv_heads):
        # stacked: [G * T, D], the queries of every head sharing this KV head.
        stacked = queries[kv_head * group : (kv_head + 1) * group].reshape(-1, head_dim)
        stacked = stacked.double()
        _, _, vh = torch.linalg.svd(stacked, full_matrices=False)
        basis = vh.T  # [D, D], columns by decreasing singular value
        energy = (stacked @ basis).abs().sum(0) + (keys[kv_head].double() @ basis).abs().sum(0)
        columns = torch.topk(energy, rank).indices.sort().values
        slices.append(basis[:, columns].float())
    return torch.stack(slices)


def compute_skew_tables(
    model_dir: str,
    partial_ratio: float,
    calibration_text: str | None = None,
    max_tokens: int = 2048,
) -> SkewTables:
    """Runs the model (transformers, CPU, float32) over calibration text.

    Args:
        model_dir: Hugging Face model directory.
        partial_ratio: The paper's r.
        calibration_text: Text to calibrate on; defaults to the bundled one.
        max_tokens: Tokens of the text used (the artifact uses 2048), capped
            by the model's context.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        # query: [1, H_q, T, D] and key: [1, H_kv, T, D], after RoPE. OPT
        # scales its queries before this call (and passes scaling 1.0): undo
        # it, so that |qV| and |kV| weigh alike for every model family.
        queries = query[0].detach()
        if kwargs.get("scaling") == 1.0 and getattr(module, "scaling", 1.0) != 1.0:
            queries = queries / module.scaling
        captured[module.layer_idx] = (queries, key[0].detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("infinigen_calibration", capture)
    # sdpa's masks: a custom function otherwise gets no sliding-window mask (Gemma 3).
    AttentionMaskInterface.register("infinigen_calibration", sdpa_mask)
    if calibration_text is None:
        calibration_text = CALIBRATION_TEXT.read_text()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="infinigen_calibration"
    )
    limit = min(max_tokens, getattr(model.config, "max_position_embeddings", max_tokens))
    ids = tokenizer(
        calibration_text, return_tensors="pt", truncation=True, max_length=limit
    ).input_ids
    if ids.shape[1] < 16:
        raise ValueError(
            f"calibration text gives only {ids.shape[1]} tokens; give a longer one"
        )
    with torch.no_grad():
        model(input_ids=ids)
    head_dim = captured[0][0].shape[-1]
    rank = partial_rank(head_dim, partial_ratio)
    skew = [skew_from_activations(*captured[idx], rank) for idx in sorted(captured)]
    return SkewTables(skew, model_fingerprint(model_dir), partial_ratio)


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

    def fail(reason: str) -> ValueError:
        return ValueError(f"{SKEW_FLAG} {path}: {reason}")

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises several types for bad files
        raise fail(f"not a readable safetensors file ({e})") from e
    if metadata.get("format") != "vllm-infinigen-skew":
        raise fail("not a skew file written by `vllm-infinigen prepare`")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise fail(f"format version {metadata.get('format_version')}, expected {FORMAT_VERSION}")
    if metadata.get("fingerprint") != fingerprint:
        raise fail(
            f"written for another model (fingerprint {metadata.get('fingerprint')}, "
            f"this model {fingerprint}); run `vllm-infinigen prepare` for this model"
        )
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
