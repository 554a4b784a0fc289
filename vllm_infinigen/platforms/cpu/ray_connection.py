# SPDX-License-Identifier: Apache-2.0
"""Ray on the CPU platform, what both of vLLM's Ray executors share: the
``vllm_cpu`` resource, each rank's thread binding, the connection to a Ray the
engine starts (and stops: nothing of it outlives the engine), and the
executors' CPU mixin. Importing this module imports Ray.
"""

from __future__ import annotations

import contextlib
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

logger = init_logger(__name__)


RAY_DEVICE_KEY = "vllm_cpu"


RAY_RESOURCES_ENV = "RAY_OVERRIDE_RESOURCES"


def omp_cpu_list(vllm_config, local_rank: int) -> list[int] | None:
    """The cores vLLM's mp executor gives this rank's OpenMP threads.

    Same source as ``MultiprocExecutor`` (``OMPProcessManager``, driven by
    ``VLLM_CPU_OMP_THREADS_BIND``); None with ``nobind``. A Ray worker asks before
    vLLM's ``init_worker`` loads the general plugins, so they are loaded here first:
    the manager then counts InfiniGen's connector as stock vLLM counts no connector
    (``patch/patch_omp_reservation.py``).
    """
    from vllm.plugins import load_general_plugins
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    load_general_plugins()

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


def bind_device_key() -> None:
    """Gives vLLM's CPU platform the ``vllm_cpu`` Ray device key (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = RAY_DEVICE_KEY


class _CPURayExecutorMixin:
    """Connects to Ray with CPU slots first, and disconnects at shutdown."""

    ray_connection: RayConnection | None = None

    def bind_workers(self) -> None:
        """Makes the executor create CPU workers (each executor class's own)."""
        raise NotImplementedError

    def _init_executor(self) -> None:
        self.bind_workers()  # a spawned engine core has not run create_engine_config
        self.ray_connection = connect_ray(self.parallel_config)
        super()._init_executor()

    def shutdown(self) -> None:
        """Called by the engine core at exit (within the 5 s its parent waits
        before it kills the process), and again by finalizers."""
        super().shutdown()
        connection, self.ray_connection = self.ray_connection, None
        if connection is not None:
            connection.close()
