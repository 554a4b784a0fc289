# SPDX-License-Identifier: Apache-2.0
"""CPU worker: vLLM's ``CPUWorker`` with InfiniGen (``worker/base.py``) on its model."""

from __future__ import annotations

from collections.abc import Collection
from typing import ContextManager

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.platforms.cpu.memory import split_grant
from vllm_infinigen.platforms.cpu.query_weights import capture_query_weights
from vllm_infinigen.worker.base import InfiniGenWorkerMixin, host_ranks, rank_block_costs

logger = init_logger(__name__)


class InfiniGenCPUWorker(InfiniGenWorkerMixin, CPUWorker):
    """CPUWorker whose attention layers run InfiniGen's selection."""

    def infinigen_device(self) -> torch.device:
        return torch.device("cpu")

    def infinigen_data_path(self, config: InfiniGenConfig) -> CpuDataPath:
        return CpuDataPath(config.transfer)

    def capture_query_weights(self, layers: Collection[int]) -> ContextManager[dict]:
        """The query rows of each sparse layer's ``qkv_proj``, copied before vLLM
        prepacks it (``query_weights.py``)."""
        return capture_query_weights(layers)

    def split_memory(self, available: int) -> tuple[int, int | None, str]:
        """Host and device memory are one: the partial keys and, unless
        ``--infinigen-cpu-pool-gib`` is set, the pool take their share of the
        grant that sized vLLM's KV space (``memory.split_grant``), in
        proportion to what a block id costs in each (``rank_block_costs``).
        """
        import psutil

        setup = self.infinigen
        costs = rank_block_costs(setup, self.cache_config.block_size, self.infinigen_runtime)
        split = split_grant(
            available, costs, explicit_kv=self.cache_config.kv_cache_memory_bytes is not None,
            explicit_pool=setup.config.cpu_pool_gib is not None,
            requested=self.requested_cpu_memory,
            resident=psutil.Process().memory_info().rss,
            free=psutil.virtual_memory().available,
            fraction=self.cache_config.gpu_memory_utilization,
            ranks=host_ranks(self.parallel_config))
        logger.info(
            "InfiniGen: KV space %.3f GiB = %.3f GiB vLLM blocks (%d pages per "
            "block id) + %.3f GiB speculation keys%s",
            available / 2**30, split.kv_space / 2**30, setup.layout.group_size,
            split.partial / 2**30,
            "" if split.pool_budget is None else
            f"; up to {split.pool_budget / 2**30:.3f} GiB for the pool ({split.source})",
        )
        return split.kv_space, split.pool_budget, split.source
