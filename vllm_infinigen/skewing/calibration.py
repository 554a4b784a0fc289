# SPDX-License-Identifier: Apache-2.0
"""Skewing matrices computed from calibration text (front end: ``prepare`` and start-up).

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
import inspect
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from vllm_infinigen.layout import ModelLayout, partial_rank, read_hf_config
from vllm_infinigen.skewing.tables import SkewTables, model_fingerprint

# Chapters I-III of Jane Austen's Pride and Prejudice (1813, public domain;
# Project Gutenberg #1342, without its header and illustrations): ~3,400
# words, over 2,048 tokens with any tokenizer, as the artifact calibrates on
# 2,048 tokens of a PG-19 book.
CALIBRATION_TEXT = Path(__file__).parent.parent / "assets" / "calibration.txt"


# Logged whenever an engine uses a skew computed from CALIBRATION_TEXT; the
# numbers are from benchmarks/results/attribution.md (budget 0.1, defaults).
BUNDLED_CALIBRATION_NOTE = (
    "InfiniGen: the skewing of the partial keys comes from the bundled calibration text "
    "(chapters of an English novel); for text of your own domain run `vllm-infinigen "
    "prepare MODEL --calibration-text FILE_OR_DIR ... --out SKEW`, then "
    "--infinigen-skew-file SKEW (measured: three calibration texts within 0.3% of each "
    "other in perplexity on a model trained on books, docs/measured.md; text the "
    "model's tokenizer cannot read is refused)"
)


CALIBRATION_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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


def load_dtype(model_dir: str, dtype: str = "auto") -> torch.dtype:
    """The dtype calibration runs the model in.

    ``auto``: float32 for float32 checkpoints (small models, exact as they are
    stored), bfloat16 for every 16-bit one, so that no float32 copy of a large
    model is ever made (float16 runs as bfloat16: same memory, no overflow).
    """
    if dtype != "auto":
        if dtype not in CALIBRATION_DTYPES:
            raise ValueError(f"calibration dtype must be one of {list(CALIBRATION_DTYPES)}, "
                             f"got {dtype!r}")
        return CALIBRATION_DTYPES[dtype]
    config = read_hf_config(model_dir)
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    return torch.float32 if stored == "float32" else torch.bfloat16


def _weight_elements(model_dir: str) -> int:
    """Parameters stored in the checkpoint's safetensors files (from their headers)."""
    total = 0
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def calibration_memory_bytes(model_dir: str, max_tokens: int = 2048,
                             dtype: str = "auto") -> int:
    """About the most memory ``compute_skew_tables`` takes beyond the process.

    The weights in the calibration dtype, the captured queries and keys of
    every layer, and one layer's forward working set (attention scores of a
    chunk and the widest activation, in float32).
    """
    config = read_hf_config(model_dir)
    config = config.get("text_config") or config
    itemsize = torch.empty(0, dtype=load_dtype(model_dir, dtype)).element_size()
    layout = ModelLayout.from_hf_config(config)
    tokens = min(max_tokens, config.get("max_position_embeddings") or max_tokens)
    hidden = config.get("hidden_size") or layout.num_heads * layout.head_dim
    widest = max(config.get("intermediate_size") or 0, config.get("vocab_size") or 0,
                 4 * hidden)
    captured = (layout.num_layers * max_tokens * (layout.num_heads + layout.num_kv_heads)
                * layout.head_dim * itemsize)
    working = 4 * tokens * (tokens * layout.num_heads + 4 * widest)
    return _weight_elements(model_dir) * itemsize + captured + working


def read_calibration_files(paths: Sequence[str | os.PathLike]) -> list[str]:
    """The texts of calibration files and directories (every ``*.txt`` in a
    directory and its subdirectories, in name order).

    Raises:
        ValueError: Naming a path that does not exist, a directory without
            text files, or a file that is not UTF-8.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise ValueError(f"--calibration-text {path}: no *.txt file in the directory")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--calibration-text {path}: no such file or directory")
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"--calibration-text {path}: not UTF-8 text ({e})") from e
    return texts


def calibration_chunks(tokenizer, texts: Sequence[str], max_tokens: int,
                       context: int) -> list[list[int]]:
    """Token ids to run, in order: each text tokenized on its own (BOS as the
    tokenizer adds it), cut into chunks of at most ``context`` tokens, until
    ``max_tokens`` tokens in all."""
    chunks: list[list[int]] = []
    left = max_tokens
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for text in texts:
        if left <= 0:
            break
        # A token is rarely longer than 16 characters: no need to tokenize a whole book.
        ids = tokenizer(text[: 16 * left + 64], verbose=False).input_ids[:left]
        starts_with_bos = bool(bos) and ids[:1] == bos
        for start in range(0, len(ids), context):
            chunk = ids[start : start + context]
            if start and starts_with_bos:  # a later chunk of the same text: BOS again
                chunk = (bos + chunk)[:context]
            chunks.append(chunk)
        left -= len(ids)
    return chunks


# Calibration is refused when fewer tokens than this are known to the tokenizer,
# or when more than this share of them is its unknown token.
MIN_CALIBRATION_TOKENS = 16
MAX_UNKNOWN_SHARE = 0.5
CALIBRATION_HINT = (
    "give text the model's tokenizer reads with `vllm-infinigen prepare MODEL "
    "--calibration-text FILE_OR_DIR --out SKEW` and --infinigen-skew-file SKEW, or "
    "use --infinigen-speculation-keys bounds (the default) or int, which need no calibration")


def check_calibration_tokens(tokenizer, chunks: Sequence[Sequence[int]], model_dir: str) -> int:
    """Refuses calibration text the model cannot read: too short, or mostly the
    tokenizer's unknown token (a skew from it selects nothing useful: measured
    0.000 on recall-llama-12l, whose word-level tokenizer turns English into
    ``<unk>``). Returns the number of tokens.

    Raises:
        ValueError: Naming --calibration-text and the way out.
    """
    num_tokens = sum(map(len, chunks))
    unknown_id = tokenizer.unk_token_id
    unknown = 0 if unknown_id is None else sum(chunk.count(unknown_id) for chunk in chunks)
    known = num_tokens - unknown
    if unknown > MAX_UNKNOWN_SHARE * num_tokens:
        raise ValueError(
            f"the calibration text (--calibration-text, or the bundled one at start-up): "
            f"{unknown} of its {num_tokens} tokens are unknown to "
            f"{model_dir}'s tokenizer ({tokenizer.unk_token!r}); {CALIBRATION_HINT}"
        )
    if known < MIN_CALIBRATION_TOKENS:
        raise ValueError(
            f"the calibration text (--calibration-text, or the bundled one at start-up) "
            f"gives {known} tokens that {model_dir}'s tokenizer knows "
            f"({num_tokens} in all), fewer than {MIN_CALIBRATION_TOKENS}; {CALIBRATION_HINT}"
        )
    return num_tokens


def compute_skew_tables(
    model_dir: str,
    partial_ratio: float,
    calibration_text: str | Sequence[str] | None = None,
    max_tokens: int = 2048,
    dtype: str = "auto",
    progress: bool = False,
) -> SkewTables:
    """Runs the model (transformers, CPU) over calibration text.

    Memory: the weights in ``load_dtype`` (no float32 copy of a 16-bit
    checkpoint) plus each layer's queries and keys
    (``calibration_memory_bytes``); the skew of each layer is computed and its
    activations dropped one layer at a time.

    Args:
        model_dir: Hugging Face model directory.
        partial_ratio: The paper's r.
        calibration_text: A text or several (e.g. one per file) to calibrate
            on; defaults to the bundled one (``CALIBRATION_TEXT``).
        max_tokens: Tokens used in all (the artifact uses 2,048), each text
            cut into chunks of the model's context.
        dtype: ``auto``, ``bfloat16`` or ``float32`` (``load_dtype``).
        progress: Show progress bars (forward per layer, then skew per layer).
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    bar = None

    def capture(module, query, key, value, attention_mask, **kwargs):
        # query: [1, H_q, T, D] and key: [1, H_kv, T, D], after any q/k norm
        # and RoPE. OPT scales its queries before this call (and passes
        # scaling 1.0): undo it, so that |qV| and |kV| weigh alike for every
        # model family.
        queries = query[0].detach()
        if kwargs.get("scaling") == 1.0 and getattr(module, "scaling", 1.0) != 1.0:
            queries = queries / module.scaling
        captured.setdefault(module.layer_idx, []).append((queries, key[0].detach()))
        if bar is not None:
            bar.update()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("infinigen_calibration", capture)
    # sdpa's masks: a custom function otherwise gets no sliding-window mask (Gemma 3).
    AttentionMaskInterface.register("infinigen_calibration", sdpa_mask)
    if calibration_text is None:
        calibration_text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    texts = [calibration_text] if isinstance(calibration_text, str) else list(calibration_text)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=load_dtype(model_dir, dtype), attn_implementation="infinigen_calibration"
    )
    text_config = model.config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None) or max_tokens
    chunks = calibration_chunks(tokenizer, texts, max_tokens, context)
    num_tokens = check_calibration_tokens(tokenizer, chunks, model_dir)
    num_layers = text_config.num_hidden_layers
    bar = tqdm(total=len(chunks) * num_layers, desc=f"calibration ({num_tokens} tokens)",
               unit="layer", disable=not progress, file=sys.stderr)
    # Only the attention inputs matter: no KV cache, logits of one position.
    extra = ({"logits_to_keep": 1}
             if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
    with torch.no_grad(), bar:
        for chunk in chunks:
            model(input_ids=torch.tensor([chunk]), use_cache=False, **extra)
    bar = None
    del model
    head_dim = captured[0][0][0].shape[-1]
    rank = partial_rank(head_dim, partial_ratio)
    skew = []
    for idx in tqdm(sorted(captured), desc="skew", unit="layer", disable=not progress,
                    file=sys.stderr):
        parts = captured.pop(idx)
        queries = torch.cat([q for q, _ in parts], dim=1).float()
        keys = torch.cat([k for _, k in parts], dim=1).float()
        del parts
        skew.append(skew_from_activations(queries, keys, rank))
    return SkewTables(skew, model_fingerprint(model_dir), partial_ratio, num_tokens)
