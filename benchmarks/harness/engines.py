# SPDX-License-Identifier: Apache-2.0
"""Offline engines (``vllm.LLM``) for benchmarks and tests, shut down on exit.

InfiniGen settings travel in two forms: a setting without the prefix, as the
worker's ``set_infinigen_selection`` takes it (``{"budget": 0.2}``), and
``LLM`` keyword arguments (``infinigen_budget=0.2``); ``infinigen_kwargs``
turns the first into the second::

    with engine(model, kv_manager="infinigen", **infinigen_kwargs(SELECT_ALL)) as llm:
        llm.generate(...)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# Every engine here: float32 on the CPU, seeded, with the stats the counters need.
ENGINE_DEFAULTS = dict(dtype="float32", seed=0, disable_log_stats=False)
# InfiniGen selecting every token (alpha 1e4 keeps every score in reach of the
# best; budget 1.0 caps nothing): its outputs must equal stock vLLM's.
SELECT_ALL = {"budget": 1.0, "alpha": 1e4}


def with_selection_everywhere(llm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """InfiniGen engines of the tests and accuracy benchmarks select at every context.

    Short prompts would otherwise attend densely (``--infinigen-min-context``,
    which has tests of its own) and hide the selection; an explicit
    ``infinigen_min_context`` is kept.
    """
    if llm_kwargs.get("kv_manager") == "infinigen":
        return {"infinigen_min_context": 0, **llm_kwargs}
    return dict(llm_kwargs)


def infinigen_kwargs(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """``LLM`` keyword arguments of InfiniGen settings (``None`` values left out)."""
    return {f"infinigen_{key}": value for key, value in (settings or {}).items()
            if value is not None}


@contextlib.contextmanager
def engine(model: str | Path, **llm_kwargs: Any) -> Iterator[Any]:
    """An offline ``LLM`` (``ENGINE_DEFAULTS`` unless overridden), shut down on exit.

    Registers the plugin in this process first: ``kv_manager`` and the
    ``infinigen_*`` keywords exist only once ``vllm_infinigen.register()`` ran.
    """
    import vllm_infinigen
    from vllm import LLM

    vllm_infinigen.register()
    llm = LLM(model=str(model), **{**ENGINE_DEFAULTS, **llm_kwargs})
    try:
        yield llm
    finally:
        # The engine core and its workers stop now, not when ``llm`` is collected.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
