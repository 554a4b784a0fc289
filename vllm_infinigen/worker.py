# SPDX-License-Identifier: Apache-2.0
"""The InfiniGen worker: vLLM's worker plus the InfiniGen runtime on its model."""

from __future__ import annotations

import dataclasses

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_infinigen.config import engine_setup
from vllm_infinigen.install import install, layer_sources
from vllm_infinigen.memory import BlockCosts, plan_memory, rows_within
from vllm_infinigen.patch import patch_seeded_sampling
from vllm_infinigen.pool import pool_rows
from vllm_infinigen.query_weights import capture_query_weights
from vllm_infinigen.runtime import InfiniGenRuntime, PromptLengths
from vllm_infinigen.skewing import load_skew_tables, local_model_dir, model_fingerprint
from vllm_infinigen.spec import dense_group_index

logger = init_logger(__name__)


def shard_kv_heads(skew: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The KV heads of one tensor-parallel rank. skew: [H_kv_total, D, R]."""
    total = skew.shape[0]
    if total >= world_size:
        per_rank = total // world_size
        return skew[rank * per_rank : (rank + 1) * per_rank]
    # Fewer KV heads than ranks: vLLM replicates each KV head.
    return skew[rank * total // world_size][None]


def build_runtime(model: torch.nn.Module, vllm_config, device: torch.device,
                  query_weights: dict[int, torch.nn.Module] | None = None,
                  prompt_lens_of: PromptLengths | None = None) -> InfiniGenRuntime:
    """Loads the skew file named in the config and installs InfiniGen on ``model``.

    Args:
        query_weights: {layer_idx: query projection} of the sparse layers, from
            ``capture_query_weights`` (None: speculate with the whole qkv_proj).
        prompt_lens_of: The step's prompt lengths (``InfiniGenRuntime``).
    """
    setup = engine_setup(vllm_config)
    config, layout = setup.config, setup.layout
    tables = load_skew_tables(
        config.skew_file,
        fingerprint=model_fingerprint(local_model_dir(vllm_config.model_config.model)),
        partial_ratio=config.partial_ratio,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
    )
    rank, world_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    skew = [shard_kv_heads(s, rank, world_size) for s in tables.skew]
    uses_rope = any(hasattr(m, "rotary_emb") for m in model.modules())
    sources = layer_sources(model, vllm_config, skew, device, query_weights)
    runtime = InfiniGenRuntime(
        dataclasses.replace(config, alpha=config.resolved_alpha(uses_rope)), sources, device,
        layout=layout, rank=rank, prompt_lens_of=prompt_lens_of)
    install(runtime, sources)
    return runtime


class InfiniGenCPUWorker(CPUWorker):
    """CPUWorker whose attention layers run InfiniGen's selection."""

    def init_device(self) -> None:
        super().init_device()
        patch_seeded_sampling.apply(self.model_runner)

    def load_model(self, *args, **kwargs) -> None:
        self.infinigen = engine_setup(self.vllm_config)
        with capture_query_weights(set(self.infinigen.layout.sparse_layers)) as query_weights:
            super().load_model(*args, **kwargs)
        self.infinigen_runtime = build_runtime(
            self.model_runner.model, self.vllm_config, torch.device("cpu"), query_weights,
            prompt_lens_of=self._prompt_lens)

    def _prompt_lens(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs] prompt lengths of the step's requests (the input batch's
        rows are the attention metadata's rows in a step)."""
        return torch.from_numpy(self.model_runner.input_batch.num_prompt_tokens[:num_reqs])

    def shutdown(self) -> None:
        runtime = getattr(self, "infinigen_runtime", None)
        if runtime is not None:
            runtime.shutdown()
        super().shutdown()

    def set_infinigen_selection(self, **changes) -> None:
        """``LLM.collective_rpc("set_infinigen_selection", kwargs={"budget": 0.1})``.

        Changes alpha, budget or the sink/recent window of the running engine,
        so that a sweep needs one engine start (see ``update_selection``).
        """
        self.infinigen_runtime.update_selection(**changes)

    def determine_available_memory(self) -> int:
        """vLLM's KV space, less the partial keys that InfiniGen keeps beside
        it and, unless ``--infinigen-cpu-pool-gib`` is set, the pool's share
        of the same grant (``memory.plan_memory``).

        The partial keys of every sparse layer cover every token of the dense
        group; per block id vLLM stores one page per layer of a group
        (``group_size`` pages, see ``kv_cache_group_size``).
        """
        import psutil

        available = super().determine_available_memory()
        setup = self.infinigen
        layout = setup.layout
        if not layout.num_sparse:
            return available
        block_size = self.cache_config.block_size
        kv_heads = self.infinigen_runtime.layers[0].num_kv_heads  # of this rank
        costs = BlockCosts(
            pages=layout.group_size * block_size * layout.kv_bytes_per_token_layer(
                setup.dtype_bytes, kv_heads),
            partial=block_size * layout.partial_bytes_per_token(setup.dtype_bytes, kv_heads),
            pool=block_size * layout.pool_bytes_per_token(setup.dtype_bytes, kv_heads))
        plan = plan_memory(
            available, costs, explicit_kv=self.cache_config.kv_cache_memory_bytes is not None,
            explicit_pool=setup.config.cpu_pool_gib is not None,
            requested=self.requested_cpu_memory,
            resident=psutil.Process().memory_info().rss,
            free=psutil.virtual_memory().available,
            fraction=self.cache_config.gpu_memory_utilization)
        self._memory_plan = plan
        logger.info(
            "InfiniGen: KV space %.3f GiB = %.3f GiB vLLM blocks (%d pages per "
            "block id) + %.3f GiB partial keys%s",
            available / 2**30, plan.kv_space / 2**30, layout.group_size, plan.partial / 2**30,
            "" if plan.pool_budget is None else
            f"; up to {plan.pool_budget / 2**30:.3f} GiB for the pool ({plan.source})",
        )
        return int(plan.kv_space)

    def _pool_rows(self, num_slots: int) -> tuple[int, str]:
        """Tokens per (sparse layer, KV head) of the pool, and how they were sized.

        Raises:
            ValueError: When the pool could not hold one step's tokens, naming
                the flags that change it.
        """
        plan = getattr(self, "_memory_plan", None)
        setup = self.infinigen
        if plan is None or plan.pool_budget is None:  # the flag, or a row per slot
            rows = pool_rows(setup.config, setup.pool_bytes_per_token, setup.step_tokens,
                             num_slots)
            return rows, "" if plan is None else plan.source
        kv_heads = self.infinigen_runtime.layers[0].num_kv_heads  # of this rank
        per_token = setup.layout.pool_bytes_per_token(setup.dtype_bytes, kv_heads)
        rows = rows_within(plan.pool_budget, per_token, num_slots)
        step_tokens = setup.step_tokens
        if rows < min(step_tokens, num_slots):
            raise ValueError(
                f"InfiniGen's pool gets {plan.pool_budget / 2**30:.3f} GiB from "
                f"{plan.source}: {rows} tokens, fewer than one step writes ({step_tokens}, "
                "--max-num-batched-tokens). Raise --gpu-memory-utilization, lower "
                "--kv-cache-memory-bytes, or size the pool with --infinigen-cpu-pool-gib"
            )
        return rows, plan.source

    def initialize_from_config(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_from_config(kv_cache_config, *args, **kwargs)
        runtime = self.infinigen_runtime
        block_size = self.cache_config.block_size
        num_slots = kv_cache_config.num_blocks * block_size
        runtime.allocate_pool(
            kv_cache_config.num_blocks, block_size, self.model_config.dtype,
            *self._pool_rows(num_slots),
        )
        self._dense_group = dense_group_index(kv_cache_config.kv_cache_groups)
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise RuntimeError("InfiniGen worker started without its KV connector")
        get_kv_transfer_group().bind_runtime(self.infinigen_runtime)

    def execute_model(self, scheduler_output):
        """Frees the pool rows of requests that finished or were preempted
        since the last step, before this step's tokens take rows."""
        gone = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
        for req_id in gone:
            request = self.model_runner.requests.get(req_id)
            if request is not None:
                self.infinigen_runtime.release_blocks(request.block_ids[self._dense_group])
        return super().execute_model(scheduler_output)
