# SPDX-License-Identifier: Apache-2.0
"""InfiniGen settings: one frozen dataclass, validated where it is built."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from vllm_infinigen.architectures import AttentionPlan
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.policies import POLICY_NAMES, policy_class

KV_MANAGERS = ("vllm", "infinigen")

# The paper's alpha: a margin in logit space (OPT 4, Llama-2 5).
DEFAULT_ALPHA_NO_ROPE = 4.0
DEFAULT_ALPHA_ROPE = 5.0

# Below this many context tokens a sparse layer attends densely over the pool
# (measured: benchmarks/README.md, "Short contexts").
DEFAULT_MIN_CONTEXT = 1024

# CLI flag of each field, for error messages and argparse.
FLAG_OF_FIELD = {
    "alpha": "--infinigen-alpha",
    "partial_ratio": "--infinigen-partial-ratio",
    "budget": "--infinigen-budget",
    "skew_file": "--infinigen-skew-file",
    "dense_layers": "--infinigen-dense-layers",
    "sink_tokens": "--infinigen-sink-tokens",
    "recent_tokens": "--infinigen-recent-tokens",
    "transfer": "--infinigen-transfer",
    "cpu_pool_gib": "--infinigen-cpu-pool-gib",
    "eviction": "--infinigen-eviction",
    "policy": "--infinigen-policy",
    "eval_dense_prefix": "--infinigen-eval-dense-prefix",
    "min_context": "--infinigen-min-context",
    "speculation": "--infinigen-speculation",
}
TRANSFERS = ("auto", "in-place", "copy")
EVICTION_POLICIES = ("counter", "lru", "fifo")
SPECULATIONS = ("previous-layer", "same-layer")
# Selection policies: InfiniGen's, and baselines on the same machinery.
POLICIES = POLICY_NAMES


@dataclass(frozen=True)
class InfiniGenConfig:
    """What InfiniGen does in every engine process.

    Args:
        alpha: The paper's alpha: a token is counted as important for a head
            when its speculated score is above ``max(score) - alpha``. ``None``
            picks the paper's value for the model family at engine start
            (4 without RoPE, 5 with RoPE).
        partial_ratio: The paper's r: fraction of the head dimension kept in
            the partial query weight and the partial key cache.
        budget: Cap on the selected tokens of a request, as a fraction of the
            tokens already in its context (the paper's max_num_kv, 0.2).
        skew_file: File written by ``vllm-infinigen prepare``; without it the
            engine computes the skewing at load time (and caches it).
        dense_layers: The first layers attend densely (the paper keeps 2); the
            last dense layer speculates for the first sparse one.
        sink_tokens: First tokens of the context always attended (0: the
            paper keeps none).
        recent_tokens: Last tokens of the context always attended, besides the
            current token, which is always attended.
        transfer: How selected entries reach the attention: ``in-place``
            (read from the pool; CPU, where host and device memory are one),
            ``copy`` (staged through double buffers by a copy worker, as on a
            GPU), or ``auto`` (in place on CPU, copy elsewhere).
        cpu_pool_gib: Cap on the host pool of the sparse layers' K/V, in GiB,
            beside the KV space (``None``: sized by the worker within the
            memory grant, ``memory.py``). When full, each (layer, KV head)
            evicts by ``eviction``.
        eviction: ``counter`` (the least often selected of the oldest half;
            the paper's best), ``lru`` or ``fifo``; see ``pool.py``.
        policy: ``infinigen``, or a baseline at the same budget on the same
            machinery: ``h2o``, ``streaming`` or ``quest`` (``policies/``).
        eval_dense_prefix: Evaluation mode (``None``: off). Prompt rows at
            positions >= this many tokens are computed like decode rows, each
            over the tokens the policy selects from the positions before it,
            so prompt logprobs (lm-eval's loglikelihood) measure the
            selection; the first ``eval_dense_prefix`` rows stay dense. A row
            at position p gets what a decode step at context p would get: the
            mode equals teacher-forced decoding of the same tokens, in one
            prefill (InfiniGen, StreamingLLM and Quest; H2O is refused). For
            accuracy measurements only: it costs a selection per prompt token.
        speculation: Whose query selects a sparse layer's tokens (policy
            ``infinigen``): ``previous-layer`` (the paper: layer i, from its
            attention input, for layer i+1, so the entries can be fetched
            ahead) or ``same-layer`` (the layer's own query, in the layer).
            The baselines always select in the layer.
        min_context: Rows whose context is shorter than this attend densely
            over the pool in the sparse layers, without speculating (0: every
            row attends over its selection). Below it a selection saves too
            little to pay for itself, and keeps few tokens.
    """

    alpha: float | None = None
    partial_ratio: float = 0.2
    budget: float = 0.2
    skew_file: str | None = None
    dense_layers: int = 2
    sink_tokens: int = 0
    recent_tokens: int = 0
    transfer: str = "auto"
    cpu_pool_gib: float | None = None
    eviction: str = "counter"
    policy: str = "infinigen"
    eval_dense_prefix: int | None = None
    min_context: int = DEFAULT_MIN_CONTEXT
    speculation: str = "previous-layer"

    def __post_init__(self) -> None:
        if self.alpha is not None and not _is_number(self.alpha, positive=True):
            raise ValueError(
                f"{FLAG_OF_FIELD['alpha']} must be a number > 0, got {self.alpha!r}"
            )
        for name in ("partial_ratio", "budget"):
            value = getattr(self, name)
            if not _is_number(value, positive=True) or value > 1:
                raise ValueError(
                    f"{FLAG_OF_FIELD[name]} must be in (0, 1], got {value!r}"
                )
        for name in ("dense_layers", "sink_tokens", "recent_tokens", "min_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{FLAG_OF_FIELD[name]} must be an integer >= 0, got {value!r}"
                )
        prefix = self.eval_dense_prefix
        if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int)
                                   or prefix < 1):
            raise ValueError(
                f"{FLAG_OF_FIELD['eval_dense_prefix']} must be an integer >= 1 (the "
                f"first prompt token has no context to select from), got {prefix!r}"
            )
        if self.transfer not in TRANSFERS:
            raise ValueError(
                f"{FLAG_OF_FIELD['transfer']} must be one of {list(TRANSFERS)}, "
                f"got {self.transfer!r}"
            )
        if self.cpu_pool_gib is not None and not _is_number(self.cpu_pool_gib, positive=True):
            raise ValueError(
                f"{FLAG_OF_FIELD['cpu_pool_gib']} must be a number > 0, "
                f"got {self.cpu_pool_gib!r}"
            )
        if self.speculation not in SPECULATIONS:
            raise ValueError(
                f"{FLAG_OF_FIELD['speculation']} must be one of {list(SPECULATIONS)}, "
                f"got {self.speculation!r}"
            )
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"{FLAG_OF_FIELD['eviction']} must be one of {list(EVICTION_POLICIES)}, "
                f"got {self.eviction!r}"
            )
        policy = policy_class(self.policy)  # an unknown name fails, naming the flag
        if prefix is not None and policy.eval_mode_refusal:
            raise ValueError(
                f"{FLAG_OF_FIELD['eval_dense_prefix']} does not apply to "
                f"{FLAG_OF_FIELD['policy']} {self.policy}: {policy.eval_mode_refusal}"
            )
        if not policy.supports_capped_pool and self.cpu_pool_gib is not None:
            raise ValueError(
                f"{FLAG_OF_FIELD['policy']} {self.policy} runs on an uncapped pool; "
                f"remove {FLAG_OF_FIELD['cpu_pool_gib']}"
            )
        if self.dense_layers < 1:
            raise ValueError(
                f"{FLAG_OF_FIELD['dense_layers']} must be >= 1: layer 0 has no "
                "previous layer to speculate for it"
            )
        if self.skew_file is not None:
            if not isinstance(self.skew_file, str) or not self.skew_file:
                raise ValueError(
                    f"{FLAG_OF_FIELD['skew_file']} must be a file path, "
                    f"got {self.skew_file!r}"
                )
            if not os.path.isfile(self.skew_file):
                raise ValueError(
                    f"{FLAG_OF_FIELD['skew_file']}: no such file: {self.skew_file}"
                )

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> InfiniGenConfig:
        """Builds the config from ``additional_config["infinigen"]``.

        Raises:
            ValueError: On unknown keys or bad values, naming the flag.
        """
        values = dict(values or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown InfiniGen setting(s) {unknown}; known: {sorted(known)} "
                f"(flags {', '.join(FLAG_OF_FIELD.values())})"
            )
        for name in ("alpha", "partial_ratio", "budget", "cpu_pool_gib"):
            if isinstance(values.get(name), int) and not isinstance(
                values.get(name), bool
            ):
                values[name] = float(values[name])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_alpha(self, uses_rope: bool) -> float:
        if self.alpha is not None:
            return float(self.alpha)
        return DEFAULT_ALPHA_ROPE if uses_rope else DEFAULT_ALPHA_NO_ROPE


def _is_number(value: Any, positive: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if value != value:  # NaN
        return False
    return value > 0 if positive else True


def kv_manager_of(additional_config: dict[str, Any] | None) -> str:
    """The ``kv_manager`` named in vLLM's ``additional_config`` ("vllm" if absent).

    Raises:
        ValueError: If the name is not one of ``KV_MANAGERS``.
    """
    if not isinstance(additional_config, dict):
        return "vllm"  # vLLM also accepts a hashable config object: not ours
    name = additional_config.get("kv_manager", "vllm")
    if name not in KV_MANAGERS:
        raise ValueError(
            f"--kv-manager must be one of {list(KV_MANAGERS)}, got {name!r}"
        )
    return name


def infinigen_config_of(additional_config: dict[str, Any] | None) -> InfiniGenConfig | None:
    """The InfiniGen config in vLLM's ``additional_config``, or None when off."""
    if kv_manager_of(additional_config) != "infinigen":
        if (additional_config or {}).get("infinigen"):
            raise ValueError(
                "InfiniGen settings were given but --kv-manager is not "
                "'infinigen'; add --kv-manager infinigen"
            )
        return None
    return InfiniGenConfig.from_dict((additional_config or {}).get("infinigen"))


@dataclass(frozen=True)
class EngineSetup:
    """What every InfiniGen part of one engine reads: the settings and the
    model's layout, derived once per process from vLLM's config."""

    config: InfiniGenConfig
    layout: ModelLayout
    dtype_bytes: int  # of the model's K/V (the pool, the partial keys)
    step_tokens: int  # tokens one step writes at most (--max-num-batched-tokens)

    @property
    def pool_bytes_per_token(self) -> int:
        """K/V bytes of every sparse layer for one token, all ranks."""
        return self.layout.pool_bytes_per_token(self.dtype_bytes)


# id(additional_config) -> (that dict, its setup): one parse per process and
# config; the dict is kept so that its id cannot be reused.
_setups: dict[int, tuple[dict, EngineSetup]] = {}


def engine_setup(vllm_config, parsed: InfiniGenConfig | None = None) -> EngineSetup | None:
    """The engine's ``EngineSetup`` (None when InfiniGen is off), parsed once.

    Args:
        parsed: The settings, already parsed from this ``additional_config``
            by the caller (the front end, which validates them first).
    """
    additional = vllm_config.additional_config
    cached = _setups.get(id(additional))
    if cached is not None and cached[0] is additional:
        return cached[1]
    config = parsed if parsed is not None else infinigen_config_of(additional)
    if config is None:
        return None
    model = vllm_config.model_config
    layout = dataclasses.replace(
        ModelLayout.from_hf_config(model.hf_text_config, config.dense_layers,
                                   config.partial_ratio,
                                   window_layers=AttentionPlan.of(model).window_layers),
        head_dim=model.get_head_size())
    setup = EngineSetup(config, layout, model.dtype.itemsize,
                        vllm_config.scheduler_config.max_num_batched_tokens)
    _setups[id(additional)] = (additional, setup)
    return setup
