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
                  kernels (``kernels/csrc/cpu/``)
    cuda/         vLLM's CUDA build: a pinned host pool, a device block cache
                  filled by a gather issued one layer ahead, Triton kernels,
                  InfiniGen's rule in blocks (eager mode; what it refuses:
                  ``frontend/checks.platform_refusal``)

A new platform is a folder beside ``cpu/`` and its line in ``WORKERS``; the
runtime, the policies, the pool index, the step plan, the scheduler side and
the front end do not change (docs/design.md, "Where CUDA goes").
"""

from __future__ import annotations

# The workers extend vLLM's V1 model runner (its input batch, requests, _sample,
# _bookkeeping_sync): the front end keeps the engine on it (frontend/checks.py).
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER_REFUSAL = (
    "--kv-manager infinigen runs on vLLM's V1 model runner (its input batch, "
    "_sample and _bookkeeping_sync), not on Model Runner V2; set "
    f"{V2_RUNNER_ENV}=0")

# vLLM's device type -> the InfiniGen worker class of that platform.
WORKERS = {
    "cpu": "vllm_infinigen.platforms.cpu.worker.InfiniGenCPUWorker",
    "cuda": "vllm_infinigen.platforms.cuda.worker.InfiniGenCUDAWorker",
}


def worker_cls_for(device_type: str) -> str:
    """The InfiniGen worker class (dotted path) for vLLM's ``device_type``.

    Raises:
        ValueError: On a platform InfiniGen does not run on, naming the flag.
    """
    if device_type not in WORKERS:
        raise ValueError(
            f"--kv-manager infinigen: vLLM's {device_type!r} platform is not supported in "
            f"this release (supported: {', '.join(WORKERS)}); use --kv-manager vllm"
        )
    return WORKERS[device_type]
