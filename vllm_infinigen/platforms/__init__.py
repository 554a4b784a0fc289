# SPDX-License-Identifier: Apache-2.0
"""The platforms InfiniGen runs on: one folder each, beside the neutral parts.

A platform supplies what depends on where memory lives and which kernels
run, and nothing else::

    worker.py     vLLM's worker of the platform with ``InfiniGenWorkerMixin``
                  (``worker/base.py``): device, memory split, query weights
    data_path.py  the ``DataPath`` (``worker/data_path.py``): pool and partial
                  key storage, the writes, fetching, the attention kernels
    memory.py     how the platform's memory grant is split (the pool itself
                  is planned by ``memory.plan_pool``)

    cpu/          vLLM's CPU build: host and device memory are one, C++
                  kernels (``platforms/cpu/kernels/csrc/``)
    cuda/         vLLM's CUDA build: a pinned host pool, a device block cache
                  filled by a gather issued one layer ahead, Triton kernels,
                  InfiniGen's rule in blocks (what it refuses: ``cuda/refusals.py``)

A new platform is a folder beside ``cpu/`` and its line in ``WORKERS`` (and in
``REFUSALS`` if it cannot run some settings); only these tables name a
platform's folder (``tests/unit/test_structure.py``); the
runtime, the policies, the pool index, the step plan, the scheduler side and
the front end do not change (docs/design.md, "Where CUDA goes").
"""

from __future__ import annotations

import functools
import importlib

def platform_name(platform) -> str:
    """vLLM's platform as these tables key it: "cuda" (NVIDIA), "rocm", "cpu",
    "tpu", "xpu", or its device type for another (an out-of-tree platform).
    Not its ``device_type``: ROCm's is "cuda"."""
    for name in ("cuda", "rocm", "cpu", "tpu", "xpu"):
        if getattr(platform, f"is_{name}")():
            return name
    return platform.device_type


# vLLM's platform (``platform_name``) -> the InfiniGen worker class of that platform.
WORKERS = {
    "cpu": "vllm_infinigen.platforms.cpu.worker.InfiniGenCPUWorker",
    "cuda": "vllm_infinigen.platforms.cuda.worker.InfiniGenCUDAWorker",
}


def worker_cls_for(name: str) -> str:
    """The InfiniGen worker class (dotted path) for vLLM's platform ``name``.

    Raises:
        ValueError: On a platform InfiniGen does not run on, naming the flag.
    """
    if name not in WORKERS:
        raise ValueError(
            f"--kv-manager infinigen: vLLM's {name!r} platform is not supported in "
            f"this release (supported: {', '.join(WORKERS)}); use --kv-manager vllm"
        )
    return WORKERS[name]


# vLLM's platform -> what that platform cannot run: ``refusal(args, config)``,
# a reason naming the flag to change, or None. A platform without a line
# refuses nothing beyond the neutral checks (``frontend/checks.py``).
REFUSALS = {
    "cuda": "vllm_infinigen.platforms.cuda.refusals.refusal",
}


def refusal_for(name: str, args, config) -> str | None:
    """Why vLLM's platform ``name`` cannot run ``args`` (EngineArgs) with
    ``config`` (InfiniGenConfig); None: nothing it refuses. Imports the
    platform's module only when it has a line in ``REFUSALS``."""
    path = REFUSALS.get(name)
    if path is None:
        return None
    return load(path)(args, config)


# What the Ray executor patch (``patch/patch_ray.py``) runs on the CPU platform:
# the executor class for the CPU workers, and their binding.
RAY_CPU_EXECUTOR = "vllm_infinigen.platforms.cpu.ray_executor.cpu_executor_class"
RAY_CPU_BINDING = "vllm_infinigen.platforms.cpu.ray_executor.bind_cpu_workers"


@functools.cache
def load(path: str):
    """The object at dotted ``path`` of a platform's module (imported then)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
