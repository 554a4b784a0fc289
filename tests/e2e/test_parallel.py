# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism with vLLM's multiprocessing and Ray executors: each rank
selects over its own KV heads, from its own pool, and the output is the
single-process one. With Ray, every rank's threads sit on the rank's core and
no process of the engine or of Ray outlives the engine's shutdown."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from benchmarks.harness.paths import BUNDLED_MODEL
from benchmarks.harness.servers import alive, process_tree
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([3, 40, 150, 333], seed=3)
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism on the CPU backend needs 2 cores, one per rank")
    return cores


@pytest.fixture(scope="module")
def two_ranks(monkeypatch_module, cores):
    # vLLM's CPU workers bind their OpenMP threads to disjoint cores; with one
    # NUMA node they must be told which (rank 0 | rank 1).
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    return dict(tensor_parallel_size=2)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def single_process_stock(shared_engine) -> list[list[int]]:
    """The stock engine of test_pool_cap.py too: tests list it before ``two_ranks``,
    so that it starts before the rank binding is set."""
    return greedy_tokens(shared_engine(BUNDLED_MODEL), PROMPTS, MAX_TOKENS)


@pytest.fixture
def ray_available(monkeypatch):
    pytest.importorskip("ray", reason="the Ray tests need `pip install 'vllm-infinigen[ray]'`")
    # rank_threads sends a function to the workers.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def check_select_all_then_select_per_rank(llm, single_process_stock) -> None:
    assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == single_process_stock
    counters = summarize(llm.get_metrics())
    assert counters["selected_tokens"] == counters["candidate_tokens"]
    # Every rank runs the rule on its own 2 of the 4 KV heads: the budget
    # holds for the whole model.
    llm.collective_rpc("set_infinigen_selection", kwargs={"budget": 0.2, "alpha": 5.0,
                                                          "recent_tokens": 0})
    before = summarize(llm.get_metrics())
    outputs = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
    after = summarize(llm.get_metrics())
    assert [len(out) for out in outputs] == [MAX_TOKENS] * len(PROMPTS)
    for layer in ("2", "3", "4"):
        selected = after["selected_tokens"][layer] - before["selected_tokens"][layer]
        candidates = after["candidate_tokens"][layer] - before["candidate_tokens"][layer]
        assert 0 < selected <= 0.2 * candidates


def rank_threads(llm) -> list[tuple[list[int], int]]:
    """Per rank: the cores its RPC thread may run on, and its OpenMP thread count."""
    # A lambda travels by value (the workers cannot import this module).
    return [tuple(r) for r in llm.collective_rpc(
        lambda worker: (sorted(os.sched_getaffinity(0)), torch.get_num_threads()))]


def engine_processes(known: set[int]) -> list:
    """Descendants of this process that did not exist before (psutil objects)."""
    return [proc for proc in process_tree(os.getpid())[1:] if proc.pid not in known]


def assert_all_gone(procs: list, timeout: float = 60.0) -> None:
    """Waits until every process has exited (zombies count); fails at the deadline."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(procs) == [], [(proc.pid, proc.name()) for proc in alive(procs)]


def shut_down_while_stepping(llm) -> int | None:
    """Shuts the engine down in the middle of a step: one request is still
    generating (400 tokens asked, 3 produced). Returns the engine core's exit code."""
    from vllm import SamplingParams

    engine_ = llm.llm_engine
    engine_.add_request("busy", PROMPTS[0],
                        SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    while not any(len(out.outputs[0].token_ids) >= 3 for out in engine_.step()):
        pass
    engine_core = engine_.engine_core.resources.engine_manager.processes[0]
    engine_.engine_core.shutdown()
    # Past vLLM's grace, shutdown SIGKILLs the process tree without reaping
    # it: its exit code exists only once joined (None before, on a slow machine).
    engine_core.join(timeout=30)
    return engine_core.exitcode


def test_mp_two_ranks_select_all_equals_single_process_and_select_per_rank(
        single_process_stock, two_ranks):
    with engine(str(BUNDLED_MODEL), processes=True, **two_ranks,
                distributed_executor_backend="mp", **SELECT_ALL) as llm:
        check_select_all_then_select_per_rank(llm, single_process_stock)


def test_ray_two_ranks_select_all_equals_single_process_and_select_per_rank(
        single_process_stock, ray_available, two_ranks, cores):
    """vLLM's default Ray executor (RayExecutorV2), a local Ray started by the engine."""
    known = {proc.pid for proc in process_tree(os.getpid())}
    with engine(str(BUNDLED_MODEL), processes=True, **two_ranks,
                distributed_executor_backend="ray", **SELECT_ALL) as llm:
        assert rank_threads(llm) == [([cores[0]], 1), ([cores[1]], 1)]
        check_select_all_then_select_per_rank(llm, single_process_stock)
        started = engine_processes(known)
        names = {proc.name() for proc in started}
    assert {"raylet", "gcs_server"} <= names, names
    assert_all_gone(started)


def test_ray_v1_executor_stock_manager_equals_single_process(
        single_process_stock, ray_available, two_ranks, cores, monkeypatch):
    """``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``: the compiled-graph executor, vLLM's own manager."""
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    known = {proc.pid for proc in process_tree(os.getpid())}
    with engine(str(BUNDLED_MODEL), processes=True, **two_ranks,
                distributed_executor_backend="ray") as llm:
        assert rank_threads(llm) == [([cores[0]], 1), ([cores[1]], 1)]
        assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == single_process_stock
        started = engine_processes(known)
        names = {proc.name() for proc in started}
        # vLLM's SIGTERM reaches the engine core inside the compiled graph's
        # channel operations; it must still stop Ray and exit by itself.
        exitcode = shut_down_while_stepping(llm)
    assert {"raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
    # It exited by itself, or was killed finalizing after vLLM's 5 s of grace;
    # never aborted by Ray (-6) nor crashed.
    assert exitcode in (0, -signal.SIGKILL), exitcode
    assert_all_gone(started)
