# SPDX-License-Identifier: Apache-2.0
"""Engines and selection sweeps shared by the accuracy benchmarks.

One engine per KV manager; an InfiniGen engine is switched between selection
settings (budget, sink/recent window, alpha) with the worker's
``set_infinigen_selection``, and each setting's selected fraction is read from
the counter difference over its own scoring calls::

    with start_engine(model, "infinigen", max_model_len=2048) as llm:
        for setting in sweep(llm, "infinigen", [{"budget": 0.1}, {"budget": 0.2}]):
            with SelectionMeter(llm) as meter:
                ... score with teacher forcing ...
            meter.fraction   # selected / candidate tokens of this block
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.accuracy.teacher_forcing import engine_kwargs

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("VLLM_INFINIGEN_SHARED", REPO.parent / "shared"))
KV_MANAGERS = ("vllm", "infinigen")
# Control setting: InfiniGen selecting every token (the alpha rule cannot bind),
# which must score as dense vLLM. Sweep it last: its alpha stays in force.
SELECT_ALL = {"budget": 1.0, "alpha": 1e4}
# Selection rules of ``--infinigen-policy`` (switchable at run time).
POLICIES = ("infinigen", "h2o", "streaming", "quest")
T = TypeVar("T")


def selection_counts(llm) -> tuple[float, float]:
    """(selected, candidate) tokens so far, summed over the sparse layers."""
    from vllm_infinigen.metrics import summarize

    counters = summarize(llm.get_metrics())
    return (sum(counters.get("selected_tokens", {}).values()),
            sum(counters.get("candidate_tokens", {}).values()))


class SelectionMeter:
    """Selected fraction of the sparse decode steps run inside the ``with`` block.

    ``fraction`` is None when no sparse decode step ran (dense vLLM).
    """

    def __init__(self, llm):
        self.llm = llm
        self.selected = self.candidates = 0.0

    def __enter__(self) -> SelectionMeter:
        self._before = selection_counts(self.llm)
        return self

    def __exit__(self, *exc) -> None:
        selected, candidates = selection_counts(self.llm)
        self.selected = selected - self._before[0]
        self.candidates = candidates - self._before[1]

    @property
    def fraction(self) -> float | None:
        return self.selected / self.candidates if self.candidates else None


@contextlib.contextmanager
def start_engine(
    model: str,
    kv_manager: str,
    *,
    max_model_len: int,
    infinigen: dict[str, Any] | None = None,
    kv_cache_memory_bytes: int = 256 << 20,
    **llm_kwargs: Any,
) -> Iterator[Any]:
    """An offline float32, eager engine set up for teacher forcing.

    Args:
        model: Model directory.
        kv_manager: "vllm" (stock) or "infinigen".
        max_model_len: vLLM's ``max_model_len``.
        infinigen: ``infinigen_*`` start-up settings without the prefix
            (e.g. ``{"budget": 0.2, "dense_layers": 1}``); InfiniGen only.
        kv_cache_memory_bytes: KV space (CPU: size it explicitly).
        llm_kwargs: Other ``LLM`` keyword arguments (e.g. ``max_logprobs``).
    """
    import vllm_infinigen  # noqa: F401  (adds the kv_manager keyword)
    from vllm import LLM

    if kv_manager not in KV_MANAGERS:
        raise ValueError(f"kv_manager must be one of {KV_MANAGERS}, got {kv_manager!r}")
    if infinigen and kv_manager != "infinigen":
        raise ValueError("infinigen settings need kv_manager='infinigen'")
    prefixed = {f"infinigen_{key}": value for key, value in (infinigen or {}).items()
                if value is not None}
    if kv_manager == "infinigen":
        # Accuracy is measured on the selection at every context length; the
        # dense short-context path (--infinigen-min-context) would hide it.
        prefixed.setdefault("infinigen_min_context", 0)
    llm = LLM(
        model=model,
        kv_manager=kv_manager,
        **prefixed,
        **engine_kwargs(),
        dtype="float32",
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **llm_kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def sweep(llm, kv_manager: str, settings: Sequence[dict[str, Any]]) -> Iterator[dict | None]:
    """Yields each selection setting after switching the engine to it.

    Dense vLLM yields None once. InfiniGen settings are keyword arguments of
    ``set_infinigen_selection`` (budget, sink_tokens, recent_tokens, alpha); a
    changed alpha stays in force for the following settings.
    """
    if kv_manager != "infinigen":
        yield None
        return
    for setting in settings:
        llm.collective_rpc("set_infinigen_selection", kwargs=dict(setting))
        yield dict(setting)


def selection_grid(budgets: Sequence[float], policies: Sequence[str] = ("infinigen",),
                   select_all_control: bool = False) -> list[dict[str, Any]]:
    """Every (policy, budget) setting, policy-major, then the control if asked.

    With the default policy alone the settings carry no ``policy`` key (so
    they also work on runtimes without ``--infinigen-policy``); otherwise every
    setting names its policy, since a switched policy stays in force. The
    select-all control is InfiniGen's rule and comes last (its alpha stays).
    """
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {POLICIES}")
    explicit = list(policies) != ["infinigen"]
    grid = [{**({"policy": policy} if explicit else {}), "budget": budget}
            for policy in policies for budget in budgets]
    if select_all_control:
        grid.append({**({"policy": "infinigen"} if explicit else {}), **SELECT_ALL})
    return grid


def policy_of(setting: dict | None) -> str | None:
    """The setting's selection rule; None for dense vLLM."""
    return None if setting is None else setting.get("policy", "infinigen")


def is_control(setting: dict | None) -> bool:
    """Whether the setting is the select-all control."""
    return setting is not None and all(setting.get(k) == v for k, v in SELECT_ALL.items())


def batched(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of at most ``size`` items."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]


def default_path(relative: str) -> Path:
    """A path under ``../shared`` (``VLLM_INFINIGEN_SHARED`` overrides)."""
    return SHARED / relative
