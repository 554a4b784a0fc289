# SPDX-License-Identifier: Apache-2.0
"""Every process: InfiniGen's settings, each declared once.

A setting is one field of ``InfiniGenConfig``, made with ``setting()``: its
type, default, help and validity live there, and everything else is derived
from the field: the ``--infinigen-<name>`` flag and its ``--help`` line
(``frontend/args.py``), the ``infinigen_<name>`` keyword of ``LLM(...)``, the
``additional_config["infinigen"]["<name>"]`` key, the check in
``__post_init__`` and whether a running engine may change it
(``set_infinigen_selection``). ``engine_setup.py`` parses them once per process,
with the model's layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_infinigen.layout import BOUND_BITS, BOUND_UNIT, SPECULATION_KEYS
from vllm_infinigen.policies import POLICY_NAMES, POLICY_TRAITS

KV_MANAGERS = ("vllm", "infinigen")

# The workers extend vLLM's V1 model runner (its input batch, requests, _sample,
# _bookkeeping_sync): the front end keeps the engine on it (frontend/checks.py),
# the worker mixin refuses V2 (worker/base.py).
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER_REFUSAL = (
    "--kv-manager infinigen runs on vLLM's V1 model runner (its input batch, "
    "_sample and _bookkeeping_sync), not on Model Runner V2; set "
    f"{V2_RUNNER_ENV}=0")
FLAG_PREFIX = "--infinigen-"
KWARG_PREFIX = "infinigen_"

# The paper's alpha for RoPE models: a margin in logit space (Llama-2 5; OPT,
# without RoPE, 4). Not the default: on the trained models the count on the
# previous layer's speculated scores keeps too little (at 4K, half of dense's
# retrieval), while the budget binding keeps it (benchmarks/results/frontier.md);
# by default every row keeps its budget (alpha off, resolved to infinity).
PAPER_ALPHA_ROPE = 5.0

# Below this many context tokens a sparse layer attends densely over the pool:
# the measured crossover on the CPU build (benchmarks/results/crossover_gqa128.md
# and crossover_gqa64.md: selecting beats dense from 4K tokens, head_dim 128
# and 64, at ~1 % kept and with the budget binding; below, dense attention's
# K/V still fits the caches and the speculation's fixed cost dominates).
DEFAULT_MIN_CONTEXT = 4096

TRANSFERS = ("auto", "in-place", "copy")
EVICTION_POLICIES = ("counter", "lru", "fifo")
SPECULATIONS = ("previous-layer", "same-layer")
RESIDENCIES = ("pool", "device-first")
# Selection policies: InfiniGen's, and baselines on the same machinery.
POLICIES = POLICY_NAMES


def flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return FLAG_PREFIX + name.replace("_", "-")


# Checks: value -> what is wrong with it (None: nothing).
def _number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and value == value)  # NaN fails


def _positive(value: Any) -> str | None:
    return None if _number(value) and value > 0 else "must be a number > 0"


def _fraction(value: Any) -> str | None:
    return None if _number(value) and 0 < value <= 1 else "must be in (0, 1]"


def _count(minimum: int, why: str = "") -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return f"must be an integer >= {minimum}{why}"
        return None
    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"must be one of {list(choices)}"


def _existing_file(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a file path"
    return None if os.path.isfile(value) else f"no such file: {value}"


def setting(default: Any, help: str, *, check: Callable[[Any], str | None] | None = None,
            choices: tuple[str, ...] | None = None, runtime: bool = False,
            show_default: bool = True) -> Any:
    """One InfiniGen setting, as a field of ``InfiniGenConfig``.

    Args:
        default: Its value when not given (None: "not set"; None is always valid).
        help: Its ``--help`` text; "(default X)" is appended unless
            ``show_default`` is False or the default is None.
        check: value -> the problem with it, or None (``choices`` checks itself).
        choices: The values it takes.
        runtime: A running engine may change it (``set_infinigen_selection``).
    """
    if choices is not None and check is None:
        check = _one_of(choices)
    return dataclasses.field(default=default, metadata={
        "help": help, "check": check, "choices": choices, "runtime": runtime,
        "show_default": show_default})


@dataclass(frozen=True)
class InfiniGenConfig:
    """What InfiniGen does in every engine process (the paper's symbols spelled out)."""

    # The paper's alpha: a token counts as important for a head when its
    # speculated score is above max(score) - alpha, and a row keeps its heads'
    # mean count, capped by the budget. None: off, the budget binds.
    alpha: float | None = setting(
        None, "The paper's rule: a row keeps the tokens scoring within this margin "
        "(logits) of its best, at most the budget (the paper: 4 for OPT, 5 for Llama-2). "
        "Default: off, every row keeps its budget (--infinigen-budget, "
        "--infinigen-budget-tokens), which keeps retrieval on trained models where the "
        "paper's count loses it (README, 'Accuracy').", check=_positive, runtime=True)
    # What the speculation scores: each unit's upper bound of q . k from its
    # keys' per-channel max and min (bounds: the int keys' accuracy at a third
    # of their bytes, benchmarks/results/frontier.md), every key channel in a few
    # bits (int: more accurate than the partial keys on every model and budget
    # measured, at the same bytes per token; docs/measured.md), or the paper's
    # partial keys, r of the skewed channels (partial).
    speculation_keys: str = setting(
        "bounds", "Keys the speculation scores: bounds (per unit of "
        f"{BOUND_UNIT} tokens, each channel's max and min key in {BOUND_BITS} bits: a unit "
        "scores its upper bound of q.k, Quest's, and whole units are selected; needs no "
        "skew), int (every key "
        "channel, 4 bits per token in a float32 cache, 2 in a 16-bit one, one scale per "
        "channel and 16 tokens; needs no skew) or partial (the paper's partial keys: "
        "--infinigen-partial-ratio of the skewed channels, calibrated by a skew file).",
        choices=SPECULATION_KEYS)
    # The paper's r: channels kept in the partial query weight and partial keys.
    partial_ratio: float = setting(
        0.2, "Fraction of head channels in the partial query/key (--infinigen-speculation-keys "
        "partial).", check=_fraction)
    # Cap on a request's selected tokens, a fraction of its context (max_num_kv).
    budget: float = setting(
        0.2, "Cap on selected tokens, as a fraction of the context.", check=_fraction,
        runtime=True)
    # A cap in tokens beside the fraction: the bytes a step reads stop growing
    # with the context (what RetroInfer and ShadowKV select: 2-4K tokens).
    budget_tokens: int | None = setting(
        None, "Cap on selected tokens per request and KV head, in tokens: a row keeps at "
        "most min(--infinigen-budget x context, this) (default: no cap).", check=_count(1),
        runtime=True)
    skew_file: str | None = setting(
        None, "Skew file from `vllm-infinigen prepare` for --infinigen-speculation-keys "
        "partial (default: computed at start-up on bundled calibration text, then cached).",
        check=_existing_file)
    # The first full-attention layers attend densely; the last speculates for
    # the first sparse one.
    dense_layers: int = setting(
        2, "First layers kept dense.",
        check=_count(1, ": layer 0 has no previous layer to speculate for it"))
    sink_tokens: int = setting(0, "First context tokens always attended.", check=_count(0),
                               runtime=True)
    # 16: the last whole unit beside the row's own, which the bound keys would
    # otherwise rank like any other (gutenberg-llama-2k perplexity 1.021x ->
    # 1.011x dense at budget 0.2, benchmarks/results/frontier_recent.md).
    recent_tokens: int = setting(16, "Last context tokens always attended, on top of the "
                                 "budget (the bound keys count the row's own unit of 16 "
                                 "in the budget: the window adds the tokens before it).",
                                 check=_count(0), runtime=True)
    transfer: str = setting(
        "auto", "How selected KV reaches the attention: in-place (CPU: read from the "
        "pool), copy (staged by a copy worker), auto (the platform's own).", choices=TRANSFERS)
    # Host pool of the sparse layers' K/V (all ranks) beside the KV space;
    # None: sized by the worker within the memory grant (memory.py).
    cpu_pool_gib: float | None = setting(
        None, "Size of the host pool of the sparse layers' K/V in GiB, beside the KV "
        "space (default: sized within the memory grant with the KV space, uncapped when "
        "--gpu-memory-utilization sizes both); when full, each layer and KV head evicts "
        "by --infinigen-eviction.", check=_positive)
    eviction: str = setting(
        "counter", "Pool eviction policy when capped (counter: the least often selected of "
        "the oldest half).", choices=EVICTION_POLICIES, runtime=True)
    policy: str = setting(
        "infinigen", "Selection policy: infinigen, or a baseline at the same budget on the "
        "same machinery: h2o, streaming, quest.", choices=POLICIES, runtime=True)
    # Evaluation mode: prompt rows at positions >= N attend like decode rows
    # over their selection (teacher-forced decoding in one prefill).
    eval_dense_prefix: int | None = setting(
        None, "Evaluation mode for accuracy measurements (default: off): prompt rows past "
        "the first N tokens attend like decode rows, over the selected tokens only, so "
        "prompt logprobs (e.g. lm-eval) measure the selection.",
        check=_count(1, " (the first prompt token has no context to select from)"),
        runtime=True)
    min_context: int = setting(
        DEFAULT_MIN_CONTEXT, "Rows with a shorter context attend densely in the sparse "
        "layers, without speculating (0: always select).", check=_count(0), runtime=True)
    # Dense while memory allows (issue 35): the sparse layers stay in vLLM's
    # device blocks until they run short (scheduler/residency.py, Residency).
    residency: str = setting(
        "pool", "Where the sparse layers' K/V lives: pool (the host pool from the first "
        "token, attended through InfiniGen's selection) or device-first (vLLM's device "
        "blocks and kernel while the blocks last, written through to the pool; when a "
        "step's blocks would not fit, every request moves to the pool and the selection, "
        "until they fit in half the free blocks again (copied back from the pool) or "
        "have finished).", choices=RESIDENCIES)
    speculation: str = setting(
        "previous-layer", "Whose query selects a sparse layer's tokens: previous-layer (the "
        "paper: layer i selects for layer i+1 ahead of it) or same-layer (the layer's own "
        "query; no prefetch).", choices=SPECULATIONS, runtime=True)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            problem = setting_problem(field.name, value)
            if problem is not None:
                raise ValueError(f"{flag(field.name)} {problem}, got {value!r}")
        for name in ("skew_file", "partial_ratio"):  # the partial keys' own settings
            default = type(self).__dataclass_fields__[name].default
            if self.speculation_keys != "partial" and getattr(self, name) != default:
                raise ValueError(
                    f"{flag(name)} applies to {flag('speculation_keys')} partial; "
                    f"add {flag('speculation_keys')} partial or remove {flag(name)}")
        traits = POLICY_TRAITS[self.policy]
        if self.eval_dense_prefix is not None and traits.eval_mode_refusal:
            raise ValueError(
                f"{flag('eval_dense_prefix')} does not apply to {flag('policy')} "
                f"{self.policy}: {traits.eval_mode_refusal}")
        # A resident step attends with vLLM's kernel, not the policy's nor the evaluation's.
        if self.device_first and (traits.device_first_refusal or self.eval_dense_prefix):
            why = (f"{flag('policy')} {self.policy}: {traits.device_first_refusal}"
                   if traits.device_first_refusal else f"{flag('eval_dense_prefix')} measures the "
                   "selection on prompt rows, which vLLM's kernel attends while the blocks last")
            raise ValueError(f"{why}; use {flag('residency')} pool, not device-first")
        if not traits.supports_capped_pool and self.cpu_pool_gib is not None:
            raise ValueError(
                f"{flag('policy')} {self.policy} runs on an uncapped pool; "
                f"remove {flag('cpu_pool_gib')}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> InfiniGenConfig:
        """Builds the config from ``additional_config["infinigen"]``.

        Raises:
            ValueError: On unknown keys or bad values, naming the flag.
        """
        values = dict(values or {})
        fields = {field.name: field for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown InfiniGen setting(s) {unknown}; known: {sorted(fields)} "
                f"(flags {', '.join(flag(name) for name in fields)})"
            )
        for name, value in values.items():
            if (value_type(fields[name]) is float and isinstance(value, int)
                    and not isinstance(value, bool)):
                values[name] = float(value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def device_first(self) -> bool:
        """``--infinigen-residency device-first``: dense in vLLM's device blocks while
        they last."""
        return self.residency == "device-first"

    def prefix_caching_refusal(self) -> str | None:
        """Why vLLM's prefix caching cannot run with these settings (None: it can).

        A hit gives a request another request's blocks: the dense layers' K/V in
        them, and by the same slot ids the sparse layers' pool rows and
        speculation keys, which hold what a prefill of the same tokens would
        write. Not where that is not so. (``device-first``: a resident request's hit
        shares the sparse layers' cached blocks too, and what they lack of it is
        filled from the pool, or the engine moves to it: ``scheduler/spec.py``.)
        """
        if self.eval_dense_prefix is not None:
            return (f"{flag('eval_dense_prefix')} selects in the prompt's rows, so a cached "
                    "prompt's K/V depend on the selection that computed them")
        reason = POLICY_TRAITS[self.policy].prefix_caching_refusal
        return None if reason is None else f"{flag('policy')} {self.policy}: {reason}"

    def resolved_alpha(self) -> float:
        """The margin the kernels apply: the setting, or infinity (off: every finite
        score counts, so each row keeps its budget)."""
        return math.inf if self.alpha is None else float(self.alpha)


def setting_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for setting ``name``, by the setting's own check
    (None: nothing; None is always valid)."""
    check = InfiniGenConfig.__dataclass_fields__[name].metadata["check"]
    return None if value is None or check is None else check(value)


def settings() -> tuple[dataclasses.Field, ...]:
    """Every setting (a field of ``InfiniGenConfig``), in declaration order."""
    return dataclasses.fields(InfiniGenConfig)


def value_type(field: dataclasses.Field) -> type:
    """The type of a setting's values: ``float | None`` -> float."""
    name = str(field.type).split("|")[0].strip()
    return {"float": float, "int": int, "str": str, "bool": bool}[name]


def runtime_settings() -> frozenset[str]:
    """Settings a running engine may change (``set_infinigen_selection``)."""
    return frozenset(field.name for field in settings() if field.metadata["runtime"])


# CLI flag of each setting, for error messages and tests.
FLAG_OF_FIELD = {field.name: flag(field.name) for field in settings()}


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
    if additional_config is not None and not isinstance(additional_config, dict):
        return None  # vLLM also accepts a hashable config object: not ours
    if kv_manager_of(additional_config) != "infinigen":
        if (additional_config or {}).get("infinigen"):
            raise ValueError(
                "InfiniGen settings were given but --kv-manager is not "
                "'infinigen'; add --kv-manager infinigen"
            )
        return None
    return InfiniGenConfig.from_dict((additional_config or {}).get("infinigen"))
