# SPDX-License-Identifier: Apache-2.0
"""vLLM's V1 Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) and its workers on CPU.

Imported only through ``ray_executor.v1_executor_module()``, where this vLLM
still has ``vllm/v1/executor/ray_executor.py`` (0.32; vLLM 0.33 removes it,
and this file goes with it).
"""

from __future__ import annotations

from concurrent.futures import Future

import ray
from vllm.v1.executor.ray_executor import RayDistributedExecutor
from vllm.v1.executor.ray_utils import FutureWrapper, RayWorkerWrapper

from vllm_infinigen.platforms.cpu.ray_connection import (
    _CPURayExecutorMixin,
    bind_device_key,
    bind_threads,
    omp_cpu_list,
    termination_deferred,
)


class CPURayWorkerWrapper(RayWorkerWrapper):
    """Ray worker of ``RayDistributedExecutor`` (V1) on the CPU platform."""

    omp_cpus: list[int] | None = None

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        """Called by the executor after placement: CPU workers have no device ids."""
        return ray.get_runtime_context().get_node_id(), []

    def init_worker(self, all_kwargs: list[dict]) -> None:
        """Binds threads before the worker exists (the executor has already
        copied the driver's environment here)."""
        kwargs = all_kwargs[self.rpc_rank]
        self.omp_cpus = omp_cpu_list(kwargs["vllm_config"], kwargs["local_rank"])
        bind_threads(self.omp_cpus)
        super().init_worker(all_kwargs)

    def setup_device_if_necessary(self) -> None:
        """Called first on the compiled graph's own thread, which has stock
        OpenMP settings."""
        if not self.compiled_dag_cuda_device_set:
            bind_threads(self.omp_cpus)
        super().setup_device_if_necessary()


class CPURayDistributedExecutor(_CPURayExecutorMixin, RayDistributedExecutor):
    """``RayDistributedExecutor`` (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) on the CPU platform."""

    def bind_workers(self) -> None:
        bind_device_key()
        bind_cpu_workers()

    def _execute_dag(self, scheduler_output, grammar_output, non_block: bool = False):
        """Called by ``execute_model`` and ``sample_tokens`` in the engine core's
        busy loop: the compiled graph's channel writes and reads run with
        SIGTERM and SIGINT deferred (``termination_deferred``)."""
        with termination_deferred():
            output = super()._execute_dag(scheduler_output, grammar_output, non_block)
        if isinstance(output, FutureWrapper):
            return _TerminationDeferredFuture(output)
        return output


class _TerminationDeferredFuture(Future):
    """A ``FutureWrapper`` whose ``result`` (a channel read) defers SIGTERM and SIGINT."""

    def __init__(self, wrapped: FutureWrapper):
        super().__init__()
        self._wrapped = wrapped

    def result(self, timeout=None):
        with termination_deferred():
            return self._wrapped.result(timeout)


def bind_cpu_workers() -> None:
    """Makes the V1 executor create ``CPURayWorkerWrapper`` actors (idempotent)."""
    from vllm.v1.executor import ray_executor

    ray_executor.RayWorkerWrapper = CPURayWorkerWrapper
