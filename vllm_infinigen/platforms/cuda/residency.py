# SPDX-License-Identifier: Apache-2.0
"""CUDA worker: vLLM's full CUDA graphs for both residencies of
``--infinigen-residency device-first``.

A full decode graph replays what its capture ran. While the engine is
resident a sparse layer runs vLLM's kernel over its blocks; once it moved
(``scheduler/spec.py``), InfiniGen's selection over the pool. The attention
runs eagerly between piecewise graphs (``refusals.py``), so only the full
graphs depend on the residency. At start-up ``capture_both`` captures the
full graphs twice, first as the moved engine runs, then as the resident one
does (the set in use), both in vLLM's one graph pool (vLLM's graphs share it
already: one replays at a time); at each move, to the pool or back, the
runtime's ``on_move`` puts the other set in place, before that step's
forward. Nothing is captured after start-up (vLLM forbids it), and a move
costs one dictionary swap per full-graph wrapper.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger

from vllm_infinigen.worker.runtime import InfiniGenRuntime

logger = init_logger(__name__)


def full_graph_wrappers(model) -> list[CUDAGraphWrapper]:
    """vLLM's wrappers of ``model`` (the runner's, outermost first) that
    capture full graphs: ``CUDAGraphWrapper``s of runtime mode FULL."""
    wrappers = []
    while isinstance(model, CUDAGraphWrapper):
        if model.runtime_mode == CUDAGraphMode.FULL:
            wrappers.append(model)
        model = model.runnable
    return wrappers


class ResidencyGraphs:
    """The full graphs of both residencies (see the module docstring)."""

    def __init__(self, runtime: InfiniGenRuntime, model_of: Callable[[], object]) -> None:
        """Args:
            runtime: The worker's runtime (``resident`` decides what a capture runs).
            model_of: () -> the model runner's model (its wrappers are made
                when the model loads, after the runtime).
        """
        self._runtime = runtime
        self._model_of = model_of
        # (wrapper, the entries of the residency not in use)
        self._other: list[tuple[CUDAGraphWrapper, dict]] = []
        runtime.on_move.append(self.move)

    def capture_both(self, capture_model: Callable[[], int]) -> int:
        """Runs vLLM's ``capture_model`` for the moved engine, keeps its full
        graphs aside, and again for the resident one. Returns the bytes both
        took (vLLM's measure)."""
        runtime = self._runtime
        wrappers = full_graph_wrappers(self._model_of())
        if not runtime.resident or not wrappers:  # no full graph depends on it
            return capture_model()
        runtime.resident = False
        try:
            taken = capture_model()
        finally:
            runtime.resident = True
        for wrapper in wrappers:
            self._other.append((wrapper, wrapper.concrete_cudagraph_entries))
            wrapper.concrete_cudagraph_entries = {}
        taken += capture_model()
        logger.info("InfiniGen: full CUDA graphs captured for both residencies "
                    "(--infinigen-residency device-first): %d each",
                    sum(len(entries) for _, entries in self._other))
        return taken

    def move(self, resident: bool) -> None:
        """At a move (to the pool, or back: ``resident``): the other residency's
        full graphs replace those in use, which are kept for the next move."""
        for index, (wrapper, entries) in enumerate(self._other):
            self._other[index] = (wrapper, wrapper.concrete_cudagraph_entries)
            wrapper.concrete_cudagraph_entries = entries
