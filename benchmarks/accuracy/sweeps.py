# SPDX-License-Identifier: Apache-2.0
"""Engines, selection sweeps and command-line options shared by the accuracy benchmarks.

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

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.accuracy.teacher_forcing import engine_kwargs
from benchmarks.harness import fp8_attention
from benchmarks.harness.engines import (
    SELECT_ALL,
    engine,
    infinigen_kwargs,
    with_selection_everywhere,
)
from vllm_infinigen.config import POLICIES

KV_MANAGERS = ("vllm", "infinigen")
T = TypeVar("T")


def selection_counts(llm) -> tuple[float, float]:
    """(selected, candidate) tokens so far, summed over the sparse layers."""
    from vllm_infinigen.scheduler.metrics import summarize

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


def start_engine(
    model: str | Path,
    kv_manager: str,
    *,
    max_model_len: int,
    infinigen: dict[str, Any] | None = None,
    kv_cache_memory_bytes: int = 256 << 20,
    kv_cache_dtype: str = "auto",
    **llm_kwargs: Any,
) -> AbstractContextManager[Any]:
    """An offline float32, eager engine set up for teacher forcing.

    InfiniGen selects at every context length: accuracy is measured on the
    selection, which the dense short-context path (``--infinigen-min-context``)
    would hide.

    Args:
        model: Model directory.
        kv_manager: "vllm" (stock) or "infinigen".
        max_model_len: vLLM's ``max_model_len``.
        infinigen: ``infinigen_*`` start-up settings without the prefix
            (e.g. ``{"budget": 0.2, "dense_layers": 1}``); InfiniGen only.
        kv_cache_memory_bytes: KV space (CPU: size it explicitly).
        kv_cache_dtype: vLLM's ``--kv-cache-dtype`` (inside ``kv_cache_dtype_run``).
        llm_kwargs: Other ``LLM`` keyword arguments (e.g. ``max_logprobs``).
    """
    if kv_manager not in KV_MANAGERS:
        raise ValueError(f"kv_manager must be one of {KV_MANAGERS}, got {kv_manager!r}")
    if infinigen and kv_manager != "infinigen":
        raise ValueError("infinigen settings need kv_manager='infinigen'")
    # A sweep switches the selection at run time, to policies and an evaluation mode
    # that vLLM's prefix caching cannot serve (InfiniGenConfig.prefix_caching_refusal):
    # each setting prefills its prompts itself.
    own = {"enable_prefix_caching": False} if kv_manager == "infinigen" else {}
    return engine(model, **with_selection_everywhere(dict(
        kv_manager=kv_manager, **infinigen_kwargs(infinigen), **engine_kwargs(), **own,
        max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
        enforce_eager=True, **({} if kv_cache_dtype == "auto" else
                               {"kv_cache_dtype": kv_cache_dtype}), **llm_kwargs)))


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
    Beside a baseline, InfiniGen's settings keep no recent window (``recent_tokens``
    0): its default 16 tokens come on top of the budget, which no baseline has.
    """
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {POLICIES}")
    explicit = list(policies) != ["infinigen"]
    fair = {"recent_tokens": 0} if set(policies) - {"infinigen"} else {}
    grid = [{**({"policy": policy} if explicit else {}), "budget": budget,
             **(fair if policy == "infinigen" else {})}
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


def add_selection_options(parser: argparse.ArgumentParser, budgets: Sequence[float],
                          policies: Sequence[str] = ("infinigen",)) -> None:
    """``--budget``, ``--policy`` and ``--no-select-all-control``: the settings an
    InfiniGen engine is swept through (``selection_grid``)."""
    parser.add_argument("--budget", type=float, nargs="+", default=list(budgets),
                        help="selection budgets, swept on one engine")
    parser.add_argument("--policy", nargs="+", default=list(policies), choices=POLICIES,
                        help="selection rules (--infinigen-policy), swept on the InfiniGen engine")
    parser.add_argument("--no-select-all-control", dest="select_all_control",
                        action="store_false",
                        help="skip the control (budget 1, alpha 1e4: should equal dense)")


def add_run_options(parser: argparse.ArgumentParser, *, max_model_len: int,
                    kv_cache_bytes: int, batch_size: int, out: Path) -> None:
    """``--max-model-len``, ``--kv-cache-bytes``, ``--batch-size`` and ``--out``."""
    parser.add_argument("--max-model-len", type=int, default=max_model_len)
    parser.add_argument("--kv-cache-bytes", type=int, default=kv_cache_bytes)
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help="requests per engine call (progress granularity)")
    parser.add_argument("--out", type=Path, default=out,
                        help="results stem: writes .json, .md and .png")


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: vLLM's, for every engine of the run."""
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", *fp8_attention.FORMATS],
                        help="vLLM's --kv-cache-dtype, for every engine (FP8: vLLM's own "
                             "attention where the host has it, else emulated in this process; "
                             "the report says which)")


@contextlib.contextmanager
def kv_cache_dtype_run(kv_cache_dtype: str) -> Iterator[str]:
    """The run's engines with ``kv_cache_dtype``: FP8 on a host whose vLLM has no
    FP8 attention through ``fp8_attention``'s double, in this process. Yields
    what the report says of it ("" for ``auto``)."""
    if kv_cache_dtype == "auto" or fp8_attention.native():
        yield fp8_attention.described(kv_cache_dtype)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the double patches this process
    with fp8_attention.emulated():
        yield fp8_attention.described(kv_cache_dtype)


def check_budgets(parser: argparse.ArgumentParser, budgets: Sequence[float]) -> None:
    """Exits with a usage error unless every budget is in (0, 1]."""
    if not all(0 < budget <= 1 for budget in budgets):
        parser.error("--budget values must be in (0, 1]")


def inputs_missing(*paths: str | Path) -> bool:
    """Whether a model or data path is absent (then the benchmark is skipped, said on stderr)."""
    for path in paths:
        if not Path(path).exists():
            print(f"skipped: {path} is absent", file=sys.stderr)
            return True
    return False
