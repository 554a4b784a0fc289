# SPDX-License-Identifier: Apache-2.0
"""Front end: which model families InfiniGen runs, and how vLLM will run their attention.

InfiniGen replaces a layer's attention with attention over a selection of the
whole context, and speculates with the next sparse layer's own query
projection, ``q_norm`` and ``rotary_emb``. That is right only for layers that
attend to the whole context the way these families do. Sliding windows:

- Gemma 3 (``HYBRID_MODEL_TYPES``) interleaves sliding-window layers with
  full-attention ones: the windowed layers stay on vLLM's sliding-window
  cache, untouched, and only full-attention layers can become sparse.
- Elsewhere a window is refused when vLLM would really use it (it is shorter
  than the longest sequence); a window that can never exclude a token is
  switched off, which is what vLLM's ``--disable-sliding-window`` does to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> how it runs (the README's "Supported models" table).
SUPPORTED_MODEL_TYPES = {
    "llama": "RoPE, scaled RoPE (Llama 3.x) through vLLM's own rotary_emb",
    "mistral": "as Llama",
    "qwen2": "as Llama, biased qkv_proj",
    "qwen3": "RoPE after a per-head q/k RMSNorm, applied in the speculation "
             "with the layer's own q_norm",
    "qwen3_moe": "as qwen3; the MoE MLP is untouched",
    "opt": "no RoPE, biased projections",
    "gemma3_text": "sliding-window layers stay on vLLM's sliding-window cache; "
                   "the full-attention layers are split into dense and sparse, "
                   "each speculating for the next full-attention layer",
}
# vLLM's Mistral format (params.json beside consolidated weights) gives a config
# without model_type, naming its architecture alone (``adapt_config_dict``).
MISTRAL_FORMAT_TYPES = {"MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}
# Families whose sliding-window layers stay beside InfiniGen's full-attention ones.
HYBRID_MODEL_TYPES = ("gemma3_text",)
# model_type -> why it is refused (others: "not supported").
REFUSED_MODEL_TYPES = {
    "gemma2": "attention logit soft-capping is not implemented in InfiniGen's "
              "attention kernels",
    "deepseek_v2": "multi-head latent attention (MLA) has no per-head keys to select",
    "deepseek_v3": "multi-head latent attention (MLA) has no per-head keys to select",
    "qwen3_next": "its linear-attention (Gated DeltaNet) layers have no KV cache to select",
}
# Families whose vLLM model has one window for every layer or none: vLLM 0.32
# refuses a mix itself (``Qwen2Model``: "Sliding window for some but all
# layers is not supported").
_UNIFORM_WINDOW_ONLY = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class AttentionPlan:
    """The attention vLLM will run for each layer of a model.

    Args:
        model_type: ``model_type`` of the text model.
        windows: Per layer, the sliding window in tokens, or None for full
            attention (as vLLM resolves it: ``EngineArgs.create_engine_config``
            sets a window for every layer when ``layer_types`` is absent or all
            ``sliding_attention``; models read per-layer windows from
            ``layer_types``).
        max_model_len: The engine's resolved ``--max-model-len``.
    """

    model_type: str
    windows: tuple[int | None, ...]
    max_model_len: int

    @classmethod
    def of(cls, model_config) -> AttentionPlan:
        """From vLLM's ``ModelConfig`` (transformers' defaults applied, e.g.
        Qwen's ``use_sliding_window``; ``--disable-sliding-window`` applied)."""
        text = model_config.hf_text_config
        num_layers = text.num_hidden_layers
        window = model_config.get_sliding_window() or None
        layer_types = getattr(text, "layer_types", None)
        if window is None:
            windows = (None,) * num_layers
        elif layer_types is None:
            windows = (window,) * num_layers
        else:
            windows = tuple(window if kind == "sliding_attention" else None
                            for kind in layer_types[:num_layers])
        return cls(getattr(text, "model_type", "") or "", windows, model_config.max_model_len)

    @property
    def window(self) -> int | None:
        """The window of the windowed layers (one size in every family here)."""
        return next((w for w in self.windows if w is not None), None)

    @property
    def full_layers(self) -> list[int]:
        return [idx for idx, window in enumerate(self.windows) if window is None]

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The windowed layers that stay windowed beside sparse ones (Gemma 3);
        () where a window is refused or switched off (``window_refusal``)."""
        if self.model_type not in HYBRID_MODEL_TYPES or not self.full_layers:
            return ()
        return tuple(idx for idx, window in enumerate(self.windows) if window is not None)

    @property
    def switches_window_off(self) -> bool:
        """A window InfiniGen runs as full attention: it never excludes a token."""
        return (self.window is not None and not self.window_layers
                and not self.window_excludes_tokens)

    @property
    def window_excludes_tokens(self) -> bool:
        """Whether a windowed layer can drop a token from a sequence vLLM admits."""
        return self.window is not None and self.window < self.max_model_len


def model_type_refusal(hf_config: dict[str, Any]) -> str | None:
    """Why a ``config.json`` cannot run with InfiniGen, or None.

    Besides the model type: attention variants of supported families that
    vLLM runs differently from what the sparse layers compute.
    """
    model_type = hf_config.get("model_type")
    if model_type in REFUSED_MODEL_TYPES:
        return f"model type {model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {model_type!r} is not supported; supported: "
                f"{list(SUPPORTED_MODEL_TYPES)}")
    if hf_config.get("dual_chunk_attention_config"):
        return (f"model type {model_type!r} with dual_chunk_attention_config is not "
                "supported: vLLM runs dual-chunk attention, InfiniGen's sparse layers "
                "plain attention over the whole context")
    if hf_config.get("is_causal") is False or hf_config.get("use_bidirectional_attention"):
        return (f"model type {model_type!r} with bidirectional attention is not "
                "supported: InfiniGen selects tokens for causal decoding")
    return None


def names_a_window(hf_config: dict[str, Any]) -> bool:
    """Whether ``config.json`` mentions a sliding window at all (cheap pre-check)."""
    return bool(hf_config.get("sliding_window")) or "sliding_attention" in (
        hf_config.get("layer_types") or ())


def window_refusal(plan: AttentionPlan) -> str | None:
    """Why the windows vLLM would run cannot run with InfiniGen, or None."""
    if plan.window is None or plan.window_layers:
        return None
    windowed = len(plan.windows) - len(plan.full_layers)
    if plan.full_layers and plan.model_type in _UNIFORM_WINDOW_ONLY:
        return (f"model type {plan.model_type!r} with a sliding window on {windowed} of "
                f"{len(plan.windows)} layers (max_window_layers) is refused by vLLM "
                "0.32 itself")
    if not plan.window_excludes_tokens:
        return None
    where = "every layer" if not plan.full_layers else f"{windowed} of {len(plan.windows)} layers"
    return (f"model type {plan.model_type!r} uses a sliding window of {plan.window} tokens "
            f"on {where}, shorter than the max model length {plan.max_model_len}; "
            "InfiniGen's sparse layers attend over the whole context. Pass "
            f"--max-model-len {plan.window} (or less), or --disable-sliding-window "
            "(vLLM then caps the context at the window)")
