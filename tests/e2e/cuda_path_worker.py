# SPDX-License-Identifier: Apache-2.0
"""The CPU build's worker with the CUDA platform's data path, on CPU tensors.

vLLM's CUDA wheel cannot run here, so the tests put the CUDA data path
(``platforms/cuda/data_path.py``: device block cache, block-granular
selection, decode steps planned on the device) inside a real vLLM engine of
the CPU build: ``with_cuda_data_path`` makes the platform table name this
worker for the engine it starts; ``server_env`` does it for a ``vllm serve``
process (a ``sitecustomize`` on its path). Everything CUDA-only (pinned pool, side
stream, Triton) is replaced by the torch references the data path runs on
any device."""

from __future__ import annotations

import contextlib
from pathlib import Path

from vllm_infinigen import platforms
from vllm_infinigen.platforms.cpu.worker import InfiniGenCPUWorker
from vllm_infinigen.platforms.cuda.worker import InfiniGenCUDAWorker

WORKER = f"{__name__}.CudaDataPathCPUWorker"


class CudaDataPathCPUWorker(InfiniGenCPUWorker):
    """``InfiniGenCPUWorker`` whose data path is the CUDA worker's own (its
    ``infinigen_data_path`` and cache sizing), on the CPU worker's device."""

    infinigen_data_path = InfiniGenCUDAWorker.infinigen_data_path
    _cache_slots_per_head = InfiniGenCUDAWorker._cache_slots_per_head


@contextlib.contextmanager
def with_cuda_data_path():
    """Engines created inside run ``CudaDataPathCPUWorker`` (the worker class
    is fixed when the engine's configuration is made)."""
    original = platforms.WORKERS["cpu"]
    platforms.WORKERS["cpu"] = WORKER
    try:
        yield
    finally:
        platforms.WORKERS["cpu"] = original


REPO = Path(__file__).resolve().parents[2]


def server_env(folder: Path) -> dict[str, str]:
    """The environment of a ``vllm serve`` whose engine runs ``CudaDataPathCPUWorker``:
    a ``sitecustomize`` in ``folder`` names it in the platform table at the
    start of each process (the API server's, where the engine's configuration
    is made), the repository on the path for the worker processes to import it."""
    import os

    (folder / "sitecustomize.py").write_text(
        "from vllm_infinigen import platforms\n"
        f"platforms.WORKERS['cpu'] = {WORKER!r}\n")
    path = [str(folder), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}
