# SPDX-License-Identifier: Apache-2.0
"""Ray executors (engine-core side) and Ray workers (worker side) for vLLM's CPU backend.

Installed (``bind_cpu_workers``, and ``Executor.get_class`` by
``vllm_infinigen.patch.patch_ray``) only when the CPU platform runs
``--distributed-executor-backend ray``; importing this module imports Ray.
vLLM's V1 Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, absent from
vLLM 0.33) has its CPU classes in ``ray_executor_v1.py``, imported only where
vLLM has it.

Each Ray worker holds one ``vllm_cpu`` slot, a custom Ray resource (Ray
rejects ``CPU`` as a custom resource name, and CPU actors ask for
``num_cpus=0``). When Ray is started here, the local node gets
``max(usable cores, world size)`` slots.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import ray
import torch
from vllm.logger import init_logger
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

logger = init_logger(__name__)

RAY_DEVICE_KEY = "vllm_cpu"
RAY_RESOURCES_ENV = "RAY_OVERRIDE_RESOURCES"


# ---------------------------------------------------------------------------
# Worker side


def omp_cpu_list(vllm_config, local_rank: int) -> list[int] | None:
    """The cores vLLM's mp executor gives this rank's OpenMP threads.

    Same source as ``MultiprocExecutor`` (``OMPProcessManager``, driven by
    ``VLLM_CPU_OMP_THREADS_BIND``); None with ``nobind``.
    """
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup:
        return None
    return list(manager.cpu_lists[local_rank])


def bind_threads(cpus: list[int] | None) -> None:
    """Pins the calling thread to ``cpus`` and sizes its OpenMP team to match.

    OpenMP's thread count is per calling thread and its pool threads inherit
    the caller's affinity when they start, so every thread that runs the
    model calls this first. ``torch._C.set_num_threads`` is the real setter:
    ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` with a no-op.
    """
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus)
    torch._C.set_num_threads(len(cpus))


class CPURayWorkerProc(RayWorkerProc):
    """Ray worker of ``RayExecutorV2`` on the CPU platform."""

    omp_cpus: list[int] | None = None

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        """Called by the executor after placement: CPU workers have no device ids."""
        return ray.get_runtime_context().get_node_id(), []

    def initialize_worker(self, local_rank: int, env_vars: dict[str, str],
                          distributed_init_method: str,
                          driver_env_vars: dict[str, str] | None = None,
                          **kwargs) -> None:
        """Binds threads before the worker starts; the parent applies the same
        environment again (``VLLM_CPU_OMP_THREADS_BIND`` must be set first)."""
        for key, value in (driver_env_vars or {}).items():
            os.environ.setdefault(key, value)
        os.environ.update(env_vars)
        self.omp_cpus = omp_cpu_list(self._init_kwargs["vllm_config"], local_rank)
        bind_threads(self.omp_cpus)
        super().initialize_worker(local_rank, env_vars, distributed_init_method,
                                  driver_env_vars, **kwargs)

    def run(self) -> None:
        """The busy loop; Ray may run it on another thread than initialize_worker."""
        bind_threads(self.omp_cpus)
        super().run()


# ---------------------------------------------------------------------------
# Engine-core side


@contextlib.contextmanager
def termination_deferred() -> Iterator[None]:
    """Blocks SIGTERM and SIGINT in the calling thread while the block runs.

    Ray's compiled-graph channels wait on semaphores with
    ``RAY_CHECK_EQ(sem_wait(...), 0)``: a signal handled in that thread makes
    ``sem_wait`` fail with EINTR and the process abort (``Check failed ... -1
    vs 0`` in ``PlasmaObjectHeader::WriteAcquire``), skipping the shutdown
    that stops Ray. Blocked here, the signal goes to another thread of the
    process, and Python runs its handler (vLLM's shutdown request) in the
    main thread as soon as it runs Python code again.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _cpu_slots_for_new_nodes(num_slots: int):
    """Adds ``vllm_cpu`` slots to a Ray node that ``ray.init`` starts here."""
    previous = os.environ.get(RAY_RESOURCES_ENV)
    resources = json.loads(previous) if previous else {}
    resources.setdefault(RAY_DEVICE_KEY, num_slots)
    os.environ[RAY_RESOURCES_ENV] = json.dumps(resources)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RAY_RESOURCES_ENV, None)
        else:
            os.environ[RAY_RESOURCES_ENV] = previous


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Restores this process's SIGTERM handler after ``ray.init``.

    ``ray.init`` replaces it with ``sys.exit`` (and Ray's core worker adds a
    handler that prints a stack trace): in an engine core, vLLM's own
    handler, which asks the busy loop to shut down between steps (and so
    runs the executor's shutdown, which stops Ray), would be lost.
    """
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)


@dataclass
class RayConnection:
    """This process's connection to Ray, and the local Ray it started (if any)."""

    started: list[psutil.Process]  # direct children that ray.init started

    def close(self, timeout: float = 2.0) -> None:
        """Disconnects; stops the local Ray this process started, agents included.

        ``ray.shutdown`` stops the processes it started (GCS, raylet, ...) but
        not the raylet's agents (dashboard agent, runtime-env agent), which
        otherwise notice the raylet's death and exit a minute or more later.
        What is left of the tree is killed outright: a Ray worker that gets
        SIGTERM inside a compiled-graph channel operation aborts
        (``PlasmaObjectHeader::WriteAcquire``), and a graceful wait would
        spend the few seconds the engine core has before its parent kills it.
        Returns once every process of the tree has exited (zombies count) or
        after ``timeout`` seconds.
        """
        tree = self.process_tree()
        ray.shutdown()
        leftover = still_running(tree)
        for proc in leftover:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        deadline = time.monotonic() + timeout
        while still_running(leftover) and time.monotonic() < deadline:
            psutil.wait_procs(still_running(leftover), timeout=0.05)
        logger.debug("Ray: disconnected; killed %d leftover local Ray processes, %d "
                     "still alive", len(leftover), len(still_running(leftover)))

    def process_tree(self) -> list[psutil.Process]:
        """The processes ``ray.init`` started here and all their descendants."""
        tree = list(self.started)
        for proc in self.started:
            with contextlib.suppress(psutil.Error):
                tree += proc.children(recursive=True)
        return tree


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (a zombie has exited)."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def connect_ray(parallel_config) -> RayConnection | None:
    """Starts or joins Ray as vLLM's ``initialize_ray_cluster`` would, with CPU slots.

    Returns:
        The connection to close at shutdown, or None if Ray was already
        initialized in this process (then it is left as it is).

    Raises:
        ValueError: The cluster has fewer ``vllm_cpu`` slots than ranks.
    """
    if ray.is_initialized():
        connection = None
    else:
        if os.environ.get("RAY_USAGE_STATS_ENABLED", "0") != "1":
            os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # as vLLM does
        me = psutil.Process()
        children_before = {proc.pid for proc in me.children()}
        num_slots = max(len(os.sched_getaffinity(0)), parallel_config.world_size)
        with _cpu_slots_for_new_nodes(num_slots), _sigterm_handler_kept():
            ray.init(runtime_env=parallel_config.ray_runtime_env)
        connection = RayConnection(
            started=[proc for proc in me.children() if proc.pid not in children_before]
        )
    num_slots = ray.cluster_resources().get(RAY_DEVICE_KEY, 0)
    if num_slots < parallel_config.world_size:
        if connection is not None:
            connection.close()
        raise ValueError(
            f"--distributed-executor-backend ray on CPU: the Ray cluster has "
            f"{num_slots:g} '{RAY_DEVICE_KEY}' slots for {parallel_config.world_size} "
            f"ranks; start it with `ray start --head --resources "
            f"'{{\"{RAY_DEVICE_KEY}\": N}}'` (one per rank), or use "
            f"--distributed-executor-backend mp"
        )
    return connection


def bind_cpu_workers() -> None:
    """Makes vLLM's Ray executors create this module's CPU workers (idempotent).

    The platform gets the ``vllm_cpu`` device key; the executors create their
    actors from the module-level worker names rebound here.
    """
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    CpuPlatform.ray_device_key = RAY_DEVICE_KEY
    ray_executor_v2.RayWorkerProc = CPURayWorkerProc
    v1 = v1_executor_module()
    if v1 is not None:
        v1.bind_cpu_workers()


class _CPURayExecutorMixin:
    """Connects to Ray with CPU slots first, and disconnects at shutdown."""

    ray_connection: RayConnection | None = None

    def _init_executor(self) -> None:
        bind_cpu_workers()  # a spawned engine core has not run create_engine_config
        self.ray_connection = connect_ray(self.parallel_config)
        super()._init_executor()

    def shutdown(self) -> None:
        """Called by the engine core at exit (within the 5 s its parent waits
        before it kills the process), and again by finalizers."""
        super().shutdown()
        connection, self.ray_connection = self.ray_connection, None
        if connection is not None:
            connection.close()


class CPURayExecutorV2(_CPURayExecutorMixin, RayExecutorV2):
    """``RayExecutorV2`` (vLLM's default Ray executor) on the CPU platform."""

    def _join_monitor_thread(self) -> None:
        """Called by ``shutdown`` once ``shutting_down`` is set, before it kills
        the actors. Killing them first ends the monitor's ``ray.wait`` (a 5 s
        poll) at once, which leaves time to stop Ray before vLLM kills the
        engine core; the monitor takes the deaths for the shutdown they are.
        """
        if self.shutting_down:
            for handle in getattr(self, "ray_worker_handles", []):
                with contextlib.suppress(Exception):
                    ray.kill(handle.actor)
        super()._join_monitor_thread()


def v1_executor_module():
    """``ray_executor_v1`` (vLLM's V1 Ray executor on CPU), or None where this
    vLLM has no V1 Ray executor (removed in vLLM 0.33)."""
    if importlib.util.find_spec("vllm.v1.executor.ray_executor") is None:
        return None
    from vllm_infinigen.platforms.cpu import ray_executor_v1

    return ray_executor_v1


def cpu_executor_class(executor_class: type) -> type:
    """The CPU subclass of vLLM's Ray executor ``executor_class`` (others unchanged)."""
    if executor_class is RayExecutorV2:
        return CPURayExecutorV2
    v1 = v1_executor_module()
    if v1 is not None and executor_class is v1.RayDistributedExecutor:
        return v1.CPURayDistributedExecutor
    return executor_class
