# SPDX-License-Identifier: Apache-2.0
"""Patch of vLLM's Ray executors: ``--distributed-executor-backend ray`` on the CPU backend."""

from __future__ import annotations

from typing import Any

from vllm.engine.arg_utils import EngineArgs

RAY_EXTRA_HINT = ("pip install 'vllm-infinigen[ray]', or use "
                  "--distributed-executor-backend mp")

_original_create_engine_config = None
_original_get_class = None


def uses_ray_on_cpu(distributed_executor_backend: Any) -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and distributed_executor_backend == "ray"


def require_ray() -> None:
    """Raises:
        ValueError: Ray is not importable, naming the extra and the mp backend.
    """
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"--distributed-executor-backend ray needs Ray ({e}): {RAY_EXTRA_HINT}"
        ) from None


def enable() -> None:
    """Lets vLLM's Ray executors run CPU workers; a second call changes nothing.

    Called from ``create_engine_config`` (driver); a spawned engine core
    gets the executor class from the driver, and the executor binds the CPU
    workers itself (``platforms.cpu.ray_executor.bind_cpu_workers``).
    """
    global _original_get_class
    if _original_get_class is not None:
        return
    from vllm.v1.executor.abstract import Executor

    from vllm_infinigen import platforms

    platforms.load(platforms.RAY_CPU_BINDING)()
    _original_get_class = Executor.get_class
    Executor.get_class = staticmethod(_get_class)


def _get_class(vllm_config) -> type:
    from vllm_infinigen import platforms

    return platforms.load(platforms.RAY_CPU_EXECUTOR)(_original_get_class(vllm_config))


def _create_engine_config(self, *args: Any, **kwargs: Any):
    if uses_ray_on_cpu(self.distributed_executor_backend):
        require_ray()  # before vLLM's own, less helpful, error
        enable()
    vllm_config = _original_create_engine_config(self, *args, **kwargs)
    if uses_ray_on_cpu(vllm_config.parallel_config.distributed_executor_backend):
        enable()  # vLLM chose Ray itself (e.g. inside a Ray placement group)
    return vllm_config


def apply() -> None:
    """Wraps ``EngineArgs.create_engine_config``; a second call changes nothing.

    Nothing else changes (and Ray is not imported) until an engine on the CPU
    platform is configured with the Ray backend.
    """
    global _original_create_engine_config
    if _original_create_engine_config is not None:
        return
    _original_create_engine_config = EngineArgs.create_engine_config
    EngineArgs.create_engine_config = _create_engine_config
