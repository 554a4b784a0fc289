# SPDX-License-Identifier: Apache-2.0
"""CUDA worker: vLLM's GPU ``Worker`` with InfiniGen (``worker/base.py``) on its model.

``platforms.WORKERS["cuda"]``; what CUDA refuses: ``refusals.py``. Runs with
vLLM's CUDA graphs (the decode step is device-only: ``data_path.py``). It
imports on the CPU build, whose own worker extends the same
``vllm.v1.worker.gpu_worker.Worker``; it has not run inside vLLM on a GPU
(docs/design.md, "Where CUDA goes").
"""

from __future__ import annotations

import inspect

import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu_worker import Worker

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.platforms.cuda.residency import ResidencyGraphs
from vllm_infinigen.platforms.cuda.memory import (
    BLOCK_BOOKKEEPING_BYTES,
    cache_bytes,
    cache_slots_per_head,
    split_device_grant,
)
from vllm_infinigen.worker.base import InfiniGenWorkerMixin, rank_block_costs, rank_kv_heads

logger = init_logger(__name__)


class InfiniGenCUDAWorker(InfiniGenWorkerMixin, Worker):
    """vLLM's GPU worker whose sparse layers attend over a device block cache
    filled from a pinned host pool (``data_path.py``)."""

    infinigen_pool_cappable = False  # platforms/cuda/refusals.py
    infinigen_keys_in_host_memory = False  # (out of vLLM's GPU grant: split_memory)

    def infinigen_device(self) -> torch.device:
        return self.device

    def infinigen_data_path(self, config: InfiniGenConfig) -> CudaDataPath:
        return CudaDataPath(self.device, self._cache_slots_per_head(config))

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        dispatch_prompt_rows_as_prompts(self.model_runner, self.infinigen_runtime)

    def compile_or_warm_up_model(self):
        """vLLM's, with ``--infinigen-residency device-first`` capturing the
        full CUDA graphs of both residencies (``residency.py``). Its warm-up and
        captures run the layers on dummy rows (every row selecting vLLM's null
        block): their counts are dropped, or the first stats would report them."""
        result = self._warm_up()
        self.infinigen_runtime.take_counters(wait=True, full=True)
        return result

    def _warm_up(self):
        if not self.infinigen.config.device_first or not self.infinigen.layout.num_sparse:
            return super().compile_or_warm_up_model()
        runner = self.model_runner
        graphs = ResidencyGraphs(self.infinigen_runtime, lambda: runner.model)
        capture = runner.capture_model
        runner.capture_model = lambda: graphs.capture_both(capture)
        try:
            return super().compile_or_warm_up_model()
        finally:
            del runner.capture_model  # the class's again

    def _cache_slots_per_head(self, config: InfiniGenConfig) -> int:
        return cache_slots_per_head(
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            block_size=self.cache_config.block_size, budget=config.budget,
            min_context=config.min_context, sink_tokens=config.sink_tokens,
            recent_tokens=config.recent_tokens, budget_tokens=config.budget_tokens)

    def split_memory(self, available: int) -> tuple[int, int | None, str]:
        """The speculation keys and the device block cache come out of vLLM's
        GPU grant; the pool is host memory, a row per slot of the dense group
        (``plan_pool`` checks that free host memory holds it)."""
        setup, runtime = self.infinigen, self.infinigen_runtime
        layout = setup.layout
        block_size = self.cache_config.block_size
        kv_heads = rank_kv_heads(runtime)
        slots = runtime.data_path.slots_per_head
        cache = cache_bytes(num_sparse=layout.num_sparse, kv_heads=kv_heads,
                            slots_per_head=slots, block_size=block_size,
                            head_size=layout.head_dim, dtype_bytes=setup.kv_dtype_bytes)
        costs = rank_block_costs(setup, block_size, runtime)  # its pool: host memory
        # the speculation keys and the cache's lookup of each block
        speculation = costs.partial + layout.num_sparse * kv_heads * BLOCK_BOOKKEEPING_BYTES
        split = split_device_grant(
            available, pages=costs.pages, speculation=speculation, cache=cache,
            rows=self.scheduler_config.max_num_seqs,
            row_blocks=-(-self.model_config.max_model_len // block_size))
        logger.info(
            "InfiniGen: KV space %.3f GiB = %.3f GiB vLLM blocks (%d pages per block id) "
            "+ %.3f GiB speculation keys + %.3f GiB device block cache (%d blocks per "
            "layer and KV head); the pool is host memory",
            available / 2**30, split.kv_space / 2**30, layout.group_size,
            split.speculation / 2**30, split.cache / 2**30, slots)
        return split.kv_space, None, "host memory, a row per slot of the dense group"


def dispatch_prompt_rows_as_prompts(runner, runtime) -> None:
    """vLLM calls a step a uniform decode by its query lengths alone, so a prompt
    whose last chunk is one token (a chunked prefill's remainder, or a prefix-cache
    hit of all but its last token) beside decode rows would replay the full decode
    graph, whose device plan attends every row over a selection. Such a step is
    dispatched as a mixed batch instead (``force_uniform_decode=False``: vLLM's
    piecewise graphs, or eager) and planned on the host (``runtime.plan_on_host``),
    where the row is a prompt row and attends the whole prompt. The input batch's
    computed counts are the step's, host arrays (no device read)."""
    decide = runner._determine_batch_execution_and_padding
    signature = inspect.signature(decide)

    def determine(*args, **kwargs):
        step = signature.bind(*args, **kwargs).arguments
        num_reqs = step["num_reqs"]
        batch = runner.input_batch
        runtime.plan_on_host = (
            step.get("force_uniform_decode") is None  # (vLLM's captures force it)
            and step["max_num_scheduled_tokens"] == 1
            and bool((batch.num_computed_tokens_cpu[:num_reqs]
                      < batch.num_prompt_tokens[:num_reqs]).any()))
        if runtime.plan_on_host:
            kwargs = {**step, "force_uniform_decode": False}
            args = ()
        return decide(*args, **kwargs)

    runner._determine_batch_execution_and_padding = determine
