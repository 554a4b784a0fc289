# SPDX-License-Identifier: Apache-2.0
"""CUDA worker: vLLM's GPU ``Worker`` with InfiniGen (``worker/base.py``) on its model.

``platforms.WORKERS["cuda"]``; the front end keeps the engine eager
(``frontend/checks.platform_refusal``). It imports on the CPU build, whose own
worker extends the same ``vllm.v1.worker.gpu_worker.Worker``; it has not run
inside vLLM on a GPU (docs/design.md, "Where CUDA goes").
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu_worker import Worker

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.platforms import V1_RUNNER_REFUSAL
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.platforms.cuda.memory import (
    BLOCK_BOOKKEEPING_BYTES,
    cache_bytes,
    cache_slots_per_head,
    split_device_grant,
)
from vllm_infinigen.worker.base import InfiniGenWorkerMixin

logger = init_logger(__name__)


class InfiniGenCUDAWorker(InfiniGenWorkerMixin, Worker):
    """vLLM's GPU worker whose sparse layers attend over a device block cache
    filled from a pinned host pool (``data_path.py``)."""

    def init_device(self) -> None:
        if self.use_v2_model_runner:  # the front end keeps V1 (checks.keep_v1_model_runner)
            raise RuntimeError(V1_RUNNER_REFUSAL)
        super().init_device()

    def infinigen_device(self) -> torch.device:
        return self.device

    def infinigen_data_path(self, config: InfiniGenConfig) -> CudaDataPath:
        return CudaDataPath(self.device, self._cache_slots_per_head(config))

    def _cache_slots_per_head(self, config: InfiniGenConfig) -> int:
        return cache_slots_per_head(
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            block_size=self.cache_config.block_size, budget=config.budget,
            sink_tokens=config.sink_tokens, recent_tokens=config.recent_tokens)

    def split_memory(self, available: int) -> tuple[int, int | None, str]:
        """The speculation keys and the device block cache come out of vLLM's
        GPU grant; the pool is host memory, a row per slot of the dense group
        (``plan_pool`` checks that free host memory holds it)."""
        setup = self.infinigen
        layout = setup.layout
        block_size = self.cache_config.block_size
        kv_heads = self.infinigen_runtime.sparse_layers[0].num_kv_heads  # of this rank
        slots = self.infinigen_runtime.data_path.slots_per_head
        cache = cache_bytes(num_sparse=layout.num_sparse, kv_heads=kv_heads,
                            slots_per_head=slots, block_size=block_size,
                            head_size=layout.head_dim, dtype_bytes=setup.dtype_bytes)
        speculation = block_size * layout.partial_bytes_per_token(setup.dtype_bytes, kv_heads)
        speculation += layout.num_sparse * kv_heads * BLOCK_BOOKKEEPING_BYTES  # cache lookup
        pages = layout.group_size * block_size * layout.kv_bytes_per_token_layer(
            setup.dtype_bytes, kv_heads)
        split = split_device_grant(available, pages=pages, speculation=speculation,
                                   cache=cache)
        logger.info(
            "InfiniGen: KV space %.3f GiB = %.3f GiB vLLM blocks (%d pages per block id) "
            "+ %.3f GiB speculation keys + %.3f GiB device block cache (%d blocks per "
            "layer and KV head); the pool is host memory",
            available / 2**30, split.kv_space / 2**30, layout.group_size,
            split.speculation / 2**30, split.cache / 2**30, slots)
        return split.kv_space, None, "host memory, a row per slot of the dense group"
