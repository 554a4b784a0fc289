# SPDX-License-Identifier: Apache-2.0
"""The Ray patch: enabled only for the Ray backend on CPU, our classes swapped in,
per-rank thread binding, and a clear error without Ray."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

import vllm_infinigen
from vllm_infinigen.patch import patch_ray

STORIES_DIR = str(Path(vllm_infinigen.__file__).parent / "assets" / "stories260k")
RAY_EXTRA = "Ray is not installed (the ray and test extras)"
vllm_infinigen.register()  # what vLLM's plugin loader does in every process


def two_rank_args(backend: str, **kwargs) -> EngineArgs:
    return EngineArgs(model=STORIES_DIR, tensor_parallel_size=2,
                      distributed_executor_backend=backend, **kwargs)


@pytest.fixture
def enable_calls(monkeypatch) -> list[int]:
    calls = []
    original = patch_ray.enable
    monkeypatch.setattr(patch_ray, "enable", lambda: (calls.append(1), original())[1])
    return calls


@pytest.mark.parametrize("kv_manager", ["vllm", "infinigen"])
def test_mp_backend_does_not_enable_the_patch(enable_calls, kv_manager):
    args = two_rank_args("mp", kv_manager=kv_manager)
    config = args.create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert enable_calls == []
    if kv_manager == "vllm":
        stock = patch_ray._original_create_engine_config(two_rank_args("mp"))
        assert config.compute_hash() == stock.compute_hash()


@pytest.mark.parametrize("kv_manager", ["vllm", "infinigen"])
def test_without_ray_the_error_names_the_extra_and_mp(monkeypatch, enable_calls, kv_manager):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ValueError) as info:
        two_rank_args("ray", kv_manager=kv_manager).create_engine_config()
    assert "pip install 'vllm-infinigen[ray]'" in str(info.value)
    assert "--distributed-executor-backend mp" in str(info.value)
    assert enable_calls == []


def test_ray_backend_swaps_in_the_cpu_classes_once(monkeypatch):
    pytest.importorskip("ray", reason=RAY_EXTRA)
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor, ray_executor_v2
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from vllm_infinigen.platforms.cpu import ray_connection
    from vllm_infinigen.platforms.cpu import ray_executor as ray_cpu
    from vllm_infinigen.platforms.cpu import ray_executor_v1 as ray_cpu_v1

    ray_config = two_rank_args("ray").create_engine_config()
    patch_ray.enable()  # a second time: no wrapper of a wrapper
    assert Executor.__dict__["get_class"].__func__ is patch_ray._get_class
    assert patch_ray._original_get_class is not patch_ray._get_class
    assert CpuPlatform.ray_device_key == ray_connection.RAY_DEVICE_KEY
    assert ray_cpu.v1_executor_module() is ray_cpu_v1  # vLLM 0.32 has the V1 executor
    assert ray_executor.RayWorkerWrapper is ray_cpu_v1.CPURayWorkerWrapper
    assert ray_executor_v2.RayWorkerProc is ray_cpu.CPURayWorkerProc
    # vLLM's default Ray executor is V2; V1 on request.
    assert Executor.get_class(ray_config) is ray_cpu.CPURayExecutorV2
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    assert Executor.get_class(ray_config) is ray_cpu_v1.CPURayDistributedExecutor
    mp_config = two_rank_args("mp").create_engine_config()
    assert Executor.get_class(mp_config) is MultiprocExecutor


def test_omp_cpu_list_follows_vllm_cpu_omp_threads_bind(monkeypatch):
    pytest.importorskip("ray", reason=RAY_EXTRA)
    from vllm_infinigen.platforms.cpu.ray_executor import omp_cpu_list

    config = two_rank_args("mp").create_engine_config()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert [omp_cpu_list(config, rank) for rank in (0, 1)] == [[0], [1]]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert omp_cpu_list(config, 0) is None


def test_bind_threads_sets_the_calling_thread_only(monkeypatch):
    pytest.importorskip("ray", reason=RAY_EXTRA)
    from vllm_infinigen.platforms.cpu.ray_executor import bind_threads

    first_core = min(os.sched_getaffinity(0))
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    # CPUWorker.init_device replaces torch.set_num_threads with a no-op.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    seen = {}

    def in_thread():
        bind_threads([first_core])
        seen["bound"] = (os.sched_getaffinity(0), torch.get_num_threads())
        bind_threads(None)
        seen["after_none"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == {"bound": ({first_core}, 1), "after_none": {first_core}}
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


def test_cpu_slots_env_merges_and_restores(monkeypatch):
    pytest.importorskip("ray", reason=RAY_EXTRA)
    from vllm_infinigen.platforms.cpu.ray_connection import RAY_RESOURCES_ENV, _cpu_slots_for_new_nodes

    monkeypatch.delenv(RAY_RESOURCES_ENV, raising=False)
    with _cpu_slots_for_new_nodes(4):
        assert json.loads(os.environ[RAY_RESOURCES_ENV]) == {"vllm_cpu": 4}
    assert RAY_RESOURCES_ENV not in os.environ
    monkeypatch.setenv(RAY_RESOURCES_ENV, '{"disk": 1, "vllm_cpu": 8}')
    with _cpu_slots_for_new_nodes(4):  # the user's count wins
        assert json.loads(os.environ[RAY_RESOURCES_ENV]) == {"disk": 1, "vllm_cpu": 8}
    assert os.environ[RAY_RESOURCES_ENV] == '{"disk": 1, "vllm_cpu": 8}'


def test_without_vllms_v1_ray_executor_the_v2_executor_still_runs_on_cpu():
    """vLLM 0.33 deletes ``vllm/v1/executor/ray_executor.py`` (and ``RayWorkerWrapper``):
    importing ours, binding the workers and choosing the executor must not need it."""
    pytest.importorskip("ray", reason=RAY_EXTRA)
    import subprocess

    script = """
import sys
sys.modules["vllm.v1.executor.ray_executor"] = None  # as if deleted
import vllm.v1.executor.ray_utils as ray_utils
del ray_utils.RayWorkerWrapper
from vllm.v1.executor import ray_executor_v2
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2
from vllm_infinigen.platforms.cpu import ray_executor as ray_cpu
ray_cpu.bind_cpu_workers()
assert ray_cpu.v1_executor_module() is None
assert ray_executor_v2.RayWorkerProc is ray_cpu.CPURayWorkerProc
assert ray_cpu.cpu_executor_class(RayExecutorV2) is ray_cpu.CPURayExecutorV2
assert ray_cpu.cpu_executor_class(dict) is dict
assert "vllm_infinigen.platforms.cpu.ray_executor_v1" not in sys.modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_termination_is_deferred_in_the_calling_thread_only():
    """Ray's channel waits abort on EINTR: the engine core's thread blocks
    SIGTERM and SIGINT while it runs them, and restores its mask after."""
    pytest.importorskip("ray", reason=RAY_EXTRA)
    import signal

    from vllm_infinigen.platforms.cpu.ray_connection import termination_deferred

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    seen = {}
    with termination_deferred():
        seen["inside"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        thread = threading.Thread(
            target=lambda: seen.setdefault("other", signal.pthread_sigmask(signal.SIG_BLOCK, set())))
    assert seen["inside"] == before | {signal.SIGTERM, signal.SIGINT}
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    thread.start()  # created outside the block: not deferred
    thread.join()
    assert seen["other"] == before


def test_ray_init_keeps_the_processs_sigterm_handler(monkeypatch):
    """``ray.init`` installs ``sys.exit`` for SIGTERM; vLLM's handler stays."""
    pytest.importorskip("ray", reason=RAY_EXTRA)
    import signal

    from vllm_infinigen.platforms.cpu.ray_connection import _sigterm_handler_kept

    def vllm_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, vllm_handler)
    try:
        with _sigterm_handler_kept():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init
        assert signal.getsignal(signal.SIGTERM) is vllm_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_closing_the_ray_connection_kills_what_ray_shutdown_leaves(monkeypatch):
    """A started process and its child (an agent) survive ``ray.shutdown``:
    both are killed and waited for, at once."""
    pytest.importorskip("ray", reason=RAY_EXTRA)
    import subprocess
    import time

    import psutil

    from vllm_infinigen.platforms.cpu import ray_connection

    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
             "'import time; time.sleep(600)']); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        started = psutil.Process(parent.pid)
        deadline = time.monotonic() + 30
        while not started.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [started, *started.children()]
        assert len(tree) == 2
        shutdowns = []
        monkeypatch.setattr(ray_connection.ray, "shutdown", lambda: shutdowns.append(1))
        ray_connection.RayConnection(started=[started]).close(timeout=30)
        assert shutdowns == [1]
        assert ray_connection.still_running(tree) == []
    finally:
        if parent.poll() is None:
            parent.kill()
