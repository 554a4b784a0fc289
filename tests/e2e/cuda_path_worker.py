# SPDX-License-Identifier: Apache-2.0
"""The CPU build's worker with the CUDA platform's data path, on CPU tensors.

vLLM's CUDA wheel cannot run here, so the tests put the CUDA data path
(``platforms/cuda/data_path.py``: device block cache, block-granular
selection, decode steps planned on the device) inside a real vLLM engine of
the CPU build: ``with_cuda_data_path`` makes the platform table name this
worker for the engine it starts. Everything CUDA-only (pinned pool, side
stream, Triton) is replaced by the torch references the data path runs on
any device."""

from __future__ import annotations

import contextlib

from vllm_infinigen import platforms
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.platforms.cpu.worker import InfiniGenCPUWorker
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.platforms.cuda.memory import cache_slots_per_head

WORKER = f"{__name__}.CudaDataPathCPUWorker"


class CudaDataPathCPUWorker(InfiniGenCPUWorker):
    """``InfiniGenCPUWorker`` whose data path is CUDA's, on the CPU."""

    def infinigen_data_path(self, config: InfiniGenConfig) -> CudaDataPath:
        slots = cache_slots_per_head(
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            block_size=self.cache_config.block_size, budget=config.budget,
            min_context=config.min_context, sink_tokens=config.sink_tokens,
            recent_tokens=config.recent_tokens, budget_tokens=config.budget_tokens)
        return CudaDataPath("cpu", slots)


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
