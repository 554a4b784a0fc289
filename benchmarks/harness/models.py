# SPDX-License-Identifier: Apache-2.0
"""Tiny Hugging Face models built from seeds (no downloads), for tests and benchmarks.

``build_*`` write a random model with the bundled 512-token tokenizer (or a
word-level one); ``long_context_model`` builds the performance benchmarks'
models once and caches them under ``paths.MODEL_CACHE``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.paths import BUNDLED_MODEL, MODEL_CACHE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(out: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, out / name)


def build_tiny_llama(out: Path, num_kv_heads: int, num_layers: int = 4, seed: int = 0,
                     num_heads: int = 4, hidden_size: int = 128,
                     max_positions: int = 1024, head_dim: int = 32,
                     intermediate_size: int | None = None,
                     rope_scaling: Mapping[str, Any] | None = None) -> Path:
    """A random Llama (head_dim 32 unless given; MLP 2 x hidden unless given) with the
    bundled 512-token tokenizer.

    ``rope_scaling`` (e.g. ``LLAMA3_ROPE_SCALING``) is written to ``config.json``
    as Llama 3.x checkpoints ship it: ``rope_theta`` beside a ``rope_scaling``
    dict, not transformers 5's ``rope_parameters``.
    """
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
    if rope_scaling is not None:
        path = Path(out) / "config.json"
        saved = json.loads(path.read_text())
        theta = saved.pop("rope_parameters", {}).get("rope_theta", 10000.0)
        saved.update(rope_theta=theta, rope_scaling=dict(rope_scaling))
        path.write_text(json.dumps(saved, indent=2))
    _copy_tokenizer(out)
    return out


# Llama 3.1's rope scaling, with the original context shrunk to 128 tokens so
# that it changes most of a 32-channel head's frequencies within test prompts
# (wavelengths above 128 / low_freq_factor positions are slowed down 8x).
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def build_tiny_qwen3(out: Path, num_layers: int = 4, seed: int = 0, moe: bool = False,
                     num_kv_heads: int = 2) -> Path:
    """A random Qwen3 (``moe``: Qwen3-MoE, 4 experts, 2 per token) with head_dim 32.

    Qwen3 normalises each head's query and key (RMSNorm over head_dim) before
    RoPE; the norms' weights are drawn at random (transformers initialises them
    to one) so that a speculation path that skipped or misapplied them would
    select differently.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=512, hidden_size=128, num_hidden_layers=num_layers,
                 num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=32,
                 max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.15, tie_word_embeddings=False)
    if moe:
        config = Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                **shape)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 2.0)
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(out)
    return out


def build_tiny_gemma3(out: Path, num_layers: int = 8, seed: int = 0,
                      sliding_window: int = 64, sliding_window_pattern: int = 2) -> Path:
    """A random Gemma 3 text model (``gemma3_text``) with head_dim 32.

    Every ``sliding_window_pattern``-th layer attends to the whole context, the
    others to the last ``sliding_window`` tokens (defaults: 8 layers,
    alternating, a 64-token window, so test prompts reach past it).
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        sliding_window=sliding_window, sliding_window_pattern=sliding_window_pattern,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        # Gemma scales embeddings by sqrt(hidden): larger weights make greedy
        # output repeat one token, which would hide differences.
        initializer_range=0.02,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(-0.5, 1.0)  # Gemma's norms scale by 1 + weight
    model.save_pretrained(out, safe_serialization=True)
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


# The long-context model of the decode sweep: few layers, wide enough that
# attention (context x 8 KV heads x 32) dominates the weights (~2.6 MB per
# layer) from a few thousand tokens on; positions for 16K + decode steps.
LONG_MODEL = {"num_layers": 6, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 8,
              "max_positions": 16384 + 1024, "seed": 0}
# A realistic attention shape (head_dim 128, GQA 4:1, 16 layers) with small
# weights (~8 MB per layer): attention-bound from a few thousand tokens on.
GQA128_MODEL = {"num_layers": 16, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
                "head_dim": 128, "intermediate_size": 512, "max_positions": 16384 + 1024,
                "seed": 0}
# The same weights with positions for 32K + decode steps (the 32K point).
GQA128_32K_MODEL = {**GQA128_MODEL, "max_positions": 32768 + 1024}
# The same with head_dim 64 (the crossover of --infinigen-min-context for both).
GQA64_MODEL = {**GQA128_MODEL, "head_dim": 64}


def long_context_model(root: Path = MODEL_CACHE, **overrides: Any) -> Path:
    """The random tiny Llama of the decode sweep, built once (seeded) and cached."""
    spec = {**LONG_MODEL, **overrides}
    out = Path(root) / model_cache_name(spec)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_tiny_llama(tmp, **spec)
    tmp.rename(out)
    return out


def model_cache_name(spec: Mapping[str, Any]) -> str:
    """Directory name of a ``build_tiny_llama`` spec: head_dim (default 32) when it is
    not hidden / heads, the MLP width when it is not 2 x hidden."""
    name = "llama-l{num_layers}-h{hidden_size}-q{num_heads}-kv{num_kv_heads}".format(**spec)
    if spec.get("head_dim", 32) != spec["hidden_size"] // spec["num_heads"]:
        name += f"-d{spec.get('head_dim', 32)}"
    if spec.get("intermediate_size") not in (None, 2 * spec["hidden_size"]):
        name += f"-i{spec['intermediate_size']}"
    return name + "-p{max_positions}-s{seed}".format(**spec)


# Llama 3.1 8B's shapes and RoPE scaling (config.json of the published model).
LLAMA31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}


def full_size_llama(root: Path = MODEL_CACHE, shape: Mapping[str, Any] = LLAMA31_8B,
                    name: str = "llama3.1-8b-shape-random-bf16", seed: int = 0) -> Path:
    """A random-weight bfloat16 checkpoint of a real model's shape, built once and cached.

    For measuring what a full-size model costs (time, memory), not its
    outputs: written one layer per safetensors shard, so building it takes
    one layer's memory. Tokenizer: the bundled 512-token one (ids below the
    vocabulary).
    """
    from safetensors.torch import save_file

    out = Path(root) / name
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = (shape["num_attention_heads"], shape["num_key_value_heads"],
                                 shape["head_dim"])

    def weight(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    def layer(idx: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{idx}."
        norm = torch.ones(hidden, dtype=torch.bfloat16)
        return {
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": weight(inter, hidden),
            p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": norm,
            p + "post_attention_layernorm.weight": norm.clone(),
        }

    # One shard at a time, each built just before it is written.
    shards = {"model-embed.safetensors": lambda: {
        "model.embed_tokens.weight": weight(shape["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": weight(shape["vocab_size"], hidden)}}
    for idx in range(shape["num_hidden_layers"]):
        shards[f"model-layer{idx:03d}.safetensors"] = lambda idx=idx: layer(idx)
    index = {}
    for file, build in shards.items():
        tensors = build()
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": index}, indent=1))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **shape}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _copy_tokenizer(tmp)
    tmp.rename(out)
    return out
