# SPDX-License-Identifier: Apache-2.0
"""Tiny Hugging Face models for tests, built from seeds (no downloads)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "vllm_infinigen" / "assets" / "stories260k"
SHARED = Path(os.environ.get("VLLM_INFINIGEN_SHARED", REPO.parent / "shared"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shared_path(relative: str) -> Path | None:
    path = SHARED / relative
    return path if path.exists() else None


def _copy_tokenizer(out: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, out / name)


def build_tiny_llama(out: Path, num_kv_heads: int, num_layers: int = 4, seed: int = 0,
                     num_heads: int = 4, hidden_size: int = 128,
                     max_positions: int = 1024, head_dim: int = 32,
                     intermediate_size: int | None = None) -> Path:
    """A random Llama (head_dim 32 unless given; MLP 2 x hidden unless given) with the
    bundled 512-token tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
        initializer_range=0.15, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(out)
    return out


def build_tiny_opt(out: Path, num_layers: int = 4, seed: int = 0) -> Path:
    """A random OPT (no RoPE, biased projections) with head_dim 32."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=512, hidden_size=128, ffn_dim=256, num_hidden_layers=num_layers,
        num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, init_std=0.15,
    )
    OPTForCausalLM(config).save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(out)
    return out


def build_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` entries ("w0", "w1", ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1024,
    }))


def build_wide_vocab_llama(out: Path, vocab_size: int = 10240, seed: int = 0) -> Path:
    """A random Llama whose vocabulary fits ``vllm bench latency`` (>= 10000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_word_tokenizer(out, vocab_size)
    return out
