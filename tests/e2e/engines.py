# SPDX-License-Identifier: Apache-2.0
"""Offline engines of the end-to-end tests: small, eager, selecting at every context,
and in this process unless a test asks for vLLM's own processes.

In this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the
uni-process executor's worker beside the test) an engine starts in ~4 s; with
vLLM's default processes each start spawns an engine core and a worker that
import torch and vLLM again (~30 s on this project's 2-core machine). What the
processes themselves do (signals, faults, shutdown, tensor parallelism, Ray,
``vllm serve``) is tested with them (``processes=True``, or the server).

vLLM's distributed state is one per process, and an in-process engine's
shutdown tears it down (``cleanup_dist_env_and_memory``): two such engines
cannot overlap. Starting one first closes the shared engine
(``tests/e2e/conftest.py`` registers its ``close`` in ``BEFORE_IN_PROCESS``),
which its next user restarts; any other engine still open in this process is
an error that names ``processes=True``.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable

from benchmarks.harness import engines
from benchmarks.harness.engines import infinigen_kwargs, with_selection_everywhere

TEST_ENGINE = dict(
    max_model_len=512,
    kv_cache_memory_bytes=32 << 20,
    enforce_eager=True,
    # Small steps: long prompts are chunked and share steps with decodes.
    max_num_batched_tokens=128,
)
# Called before an engine starts in this process: closes the shared engine.
BEFORE_IN_PROCESS: list[Callable[[], None]] = []
_open_in_process = 0
# ``engines.SELECT_ALL`` as ``engine`` keyword arguments.
SELECT_ALL = {"kv_manager": "infinigen", **infinigen_kwargs(engines.SELECT_ALL)}


@contextlib.contextmanager
def engine(model: str, *, processes: bool = False, **kwargs):
    """``engines.engine`` with the tests' settings (``TEST_ENGINE``), ``kwargs`` winning;
    in this process unless ``processes``."""
    llm_kwargs = with_selection_everywhere({**TEST_ENGINE, **kwargs})
    if processes:
        with engines.engine(model, **llm_kwargs) as llm:
            yield llm
        return
    global _open_in_process
    for close in BEFORE_IN_PROCESS:
        close()
    if _open_in_process:
        raise RuntimeError("another engine is open in this process, and vLLM's distributed "
                           "state is one per process: start one of them with processes=True")
    with _set_num_threads_kept(), contextlib.ExitStack() as stack:
        with _environment_kept(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
            llm = stack.enter_context(engines.engine(model, **llm_kwargs))
        _open_in_process += 1
        try:
            yield llm
        finally:
            _open_in_process -= 1


@contextlib.contextmanager
def _environment_kept(**overrides: str):
    """``os.environ`` with ``overrides`` while an engine starts, as before afterwards.

    An engine core in this process writes ``VLLM_*`` variables for itself
    (``VLLM_DIST_IDENT``) and caches vLLM's environment at start-up
    (``vllm.envs.enable_envs_cache``): both would follow the test (the shared
    engine's cache key, the next engine's settings, the unit tests' reads), so
    the variables and vLLM's uncached reads are restored once it has started.
    """
    import vllm.envs as envs

    saved = dict(os.environ)
    os.environ.update(overrides)
    envs.disable_envs_cache()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        envs.disable_envs_cache()


@contextlib.contextmanager
def _set_num_threads_kept():
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a warning (its
    processes bind their threads once): in this process the function and the
    thread count are restored when the engine has shut down. (The engine core's
    ``gc.freeze`` is undone by its own shutdown.)"""
    import torch

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[dict]:
    """Token-id prompts of the given lengths (ids 3..vocab-1, BOS first)."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]}
        for n in lengths
    ]


def greedy_tokens(llm, prompts, max_tokens: int | list[int]) -> list[list[int]]:
    """Greedy token ids of each prompt: ``max_tokens`` each, or one per prompt."""
    from vllm import SamplingParams

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]
