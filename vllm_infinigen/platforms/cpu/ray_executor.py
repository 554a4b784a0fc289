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
import os

import ray
from vllm.logger import init_logger
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

from vllm_infinigen.platforms.cpu.ray_connection import (
    _CPURayExecutorMixin,
    bind_device_key,
    bind_threads,
    omp_cpu_list,
)

logger = init_logger(__name__)


# ---------------------------------------------------------------------------
# Worker side


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


def bind_cpu_workers() -> None:
    """Makes vLLM's Ray executors create this module's CPU workers (idempotent).

    The platform gets the ``vllm_cpu`` device key; the executors create their
    actors from the module-level worker names rebound here.
    """
    from vllm.v1.executor import ray_executor_v2

    bind_device_key()
    ray_executor_v2.RayWorkerProc = CPURayWorkerProc
    v1 = v1_executor_module()
    if v1 is not None:
        v1.bind_cpu_workers()


class CPURayExecutorV2(_CPURayExecutorMixin, RayExecutorV2):
    """``RayExecutorV2`` (vLLM's default Ray executor) on the CPU platform."""

    def bind_workers(self) -> None:
        bind_cpu_workers()

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
