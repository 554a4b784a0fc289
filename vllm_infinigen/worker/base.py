# SPDX-License-Identifier: Apache-2.0
"""Worker side, platform-neutral: what InfiniGen adds to vLLM's worker.

A platform's worker class mixes ``InfiniGenWorkerMixin`` in before vLLM's own
worker of that platform (CPU: ``platforms/cpu/worker.py``) and supplies::

    infinigen_device()          where the partial keys live
    infinigen_data_path(config) its ``DataPath`` (``data_path.py``)
    capture_query_weights(ids)  a context in which the model loads, yielding
                                {layer_idx: query projection} (or nothing)
    split_memory(available)     vLLM's KV space, the pool's byte budget (None:
                                a row per slot, or --infinigen-cpu-pool-gib)
                                and the setting that decided it, from what a
                                block id costs (``rank_block_costs``)

The mixin refuses vLLM's Model Runner V2 and applies the run-time patches
of the model runner (``patch/``: each decides on which platform it applies),
loads the skew, builds the runtime on the loaded model, plans the pool once
vLLM has made its blocks (``memory.plan_pool``), frees a finished request's
pool rows, and answers ``set_infinigen_selection``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection
from typing import ContextManager

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

from vllm_infinigen.config import V1_RUNNER_REFUSAL, InfiniGenConfig, flag, runtime_settings
from vllm_infinigen.engine_setup import EngineSetup, engine_setup
from vllm_infinigen.layout import kv_dtype
from vllm_infinigen.memory import BlockCosts, block_costs, cap_rows, plan_pool
from vllm_infinigen.patch import patch_seeded_sampling
from vllm_infinigen.policies import FP8_KV_REFUSAL, POLICY_TRAITS
from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec, dense_group_index
from vllm_infinigen.skewing.tables import load_skew_tables, model_files, model_fingerprint
from vllm_infinigen.worker import restore
from vllm_infinigen.worker.attention import install, layer_sources
from vllm_infinigen.worker.data_path import DataPath
from vllm_infinigen.worker.runtime import InfiniGenRuntime, PromptLengths


def skip_sparse_slot_mappings(model_runner, kv_cache_groups) -> list[int]:
    """Stops vLLM's runner computing a slot mapping per step for the sparse
    layers' KV-cache groups (pool residency; ``docs/short_path.md``, option a).

    Their groups hold no blocks and the sparse layers write by the dense
    group's slots (``runtime.reference_layer``), so the per-group slot mapping
    is never read; vLLM's mode for groups without one (Mamba's,
    ``SlotMappingMode.NONE``) makes ``BlockTable.compute_slot_mapping`` return
    at once. Their buffers keep zeros (-1 in a padded tail), which the sparse
    layers' KV update receives and ignores. Not with
    ``--infinigen-residency device-first``: the resident layers write vLLM's
    blocks by it.

    Returns:
        The KV-cache group ids changed.
    """
    from vllm.v1.worker.block_table import SlotMappingMode

    changed = []
    for gid, group in enumerate(kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, InfiniGenSparseSpec) and not spec.device_first:
            model_runner.input_batch.block_table[gid].slot_mapping_mode = SlotMappingMode.NONE
            changed.append(gid)
    return changed


def shard_kv_heads(skew: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The KV heads of one tensor-parallel rank. skew: [H_kv_total, D, R]."""
    total = skew.shape[0]
    if total >= world_size:
        per_rank = total // world_size
        return skew[rank * per_rank : (rank + 1) * per_rank]
    # Fewer KV heads than ranks: vLLM replicates each KV head.
    return skew[rank * total // world_size][None]


def rank_kv_heads(runtime: InfiniGenRuntime) -> int:
    """KV heads of this tensor-parallel rank (every sparse layer has as many)."""
    return runtime.sparse_layers[0].num_kv_heads


def rank_block_costs(setup: EngineSetup, block_size: int,
                     runtime: InfiniGenRuntime) -> BlockCosts:
    """What one block id of the dense group costs this rank (``memory.block_costs``)."""
    return block_costs(setup.layout, setup.dtype_bytes, block_size, rank_kv_heads(runtime),
                       setup.kv_dtype_bytes)


def host_ranks(parallel_config) -> int:
    """Workers of this engine on this host, each planning its pool at the same
    time against the same free memory: vLLM's local world (Ray places its
    workers itself, on hosts this worker does not see: 1, each rank alone)."""
    if parallel_config.distributed_executor_backend == "ray":
        return 1
    return max(1, parallel_config.local_world_size)


def build_runtime(model: torch.nn.Module, vllm_config, device: torch.device,
                  data_path: DataPath,
                  query_weights: dict[int, torch.nn.Module] | None = None,
                  prompt_lens_of: PromptLengths | None = None) -> InfiniGenRuntime:
    """Loads the skew file named in the config (partial keys) and installs
    InfiniGen on ``model``.

    Args:
        query_weights: {layer_idx: query projection} of the sparse layers
            (None: speculate with the whole qkv_proj).
        prompt_lens_of: The step's prompt lengths (``InfiniGenRuntime``).
    """
    setup = engine_setup(vllm_config)
    config, layout = setup.config, setup.layout
    rank, world_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    skew: list[torch.Tensor | None] = [None] * layout.num_layers  # int keys: no skew
    if config.speculation_keys == "partial":
        model_config = vllm_config.model_config  # the files the front end calibrated on
        tables = load_skew_tables(
            config.skew_file,
            fingerprint=model_fingerprint(model_files(
                model_config.model, model_config.revision, vllm_config.load_config.download_dir)),
            partial_ratio=config.partial_ratio,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
        )
        skew = [shard_kv_heads(s, rank, world_size) for s in tables.skew]
    sources = layer_sources(model, vllm_config, skew, device, query_weights)
    runtime = InfiniGenRuntime(
        dataclasses.replace(config, alpha=config.resolved_alpha()), sources, device,
        data_path, layout=layout, rank=rank, prompt_lens_of=prompt_lens_of)
    # vLLM sums the ranks' counters: a head replicated on several ranks counts on each
    runtime.total_kv_heads = setup.kv_heads_all_ranks
    install(runtime, sources)
    return runtime


class InfiniGenWorkerMixin:
    """Mixed in before a platform's vLLM worker; see the module docstring."""

    infinigen: EngineSetup
    infinigen_runtime: InfiniGenRuntime

    # -- what a platform supplies

    # It takes --infinigen-cpu-pool-gib (CUDA's pool has a row per slot: refused there).
    infinigen_pool_cappable = True
    # Its speculation keys are in host memory beside the pool (CUDA: on the device).
    infinigen_keys_in_host_memory = True

    def infinigen_device(self) -> torch.device:
        raise NotImplementedError

    def infinigen_data_path(self, config: InfiniGenConfig) -> DataPath:
        raise NotImplementedError

    def capture_query_weights(self, layers: Collection[int]) -> ContextManager[dict]:
        """Default: no separate query projection (speculate through qkv_proj)."""
        return contextlib.nullcontext({})

    def split_memory(self, available: int) -> tuple[int, int | None, str]:
        """(vLLM's KV space, the pool's byte budget or None, what sized it)."""
        raise NotImplementedError

    # -- vLLM's worker interface

    def init_device(self) -> None:
        if self.use_v2_model_runner:  # the front end keeps V1 (checks.keep_v1_model_runner)
            raise RuntimeError(V1_RUNNER_REFUSAL)
        super().init_device()
        patch_seeded_sampling.apply(self.model_runner)  # the CPU platform's only

    def load_model(self, *args, **kwargs) -> None:
        self.infinigen = engine_setup(self.vllm_config)
        self._pool_budget: tuple[int | None, str] = (None, "")
        # Requests whose blocks went at their preemption, not yet resumed or finished.
        self._released_at_preemption: set[str] = set()
        sparse = set(self.infinigen.layout.sparse_layers)
        with self.capture_query_weights(sparse) as query_weights:
            super().load_model(*args, **kwargs)
        device = self.infinigen_device()
        self.infinigen_runtime = build_runtime(
            self.model_runner.model, self.vllm_config, device,
            self.infinigen_data_path(self.infinigen.config), query_weights or None,
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

        Changes the selection settings of the running engine, so that a sweep
        needs one engine start (``InfiniGenRuntime.update_selection``). With
        prefix caching, blocks cached before the change keep the K/V the old
        selection computed for generated tokens (prompts are prefilled densely,
        the same under any selection): ``LLM.reset_prefix_cache()`` drops them.

        Raises:
            ValueError: On a setting prefix caching cannot run with, when on.
        """
        policy = changes.get("policy")
        if (policy in POLICY_TRAITS and not POLICY_TRAITS[policy].supports_fp8_kv
                and self.infinigen.kv_dtype_bytes == 1):
            raise ValueError(f"{flag('policy')} {policy} {FP8_KV_REFUSAL}, and this engine's "
                             "K/V is FP8 (--kv-cache-dtype); start the engine without "
                             f"--kv-cache-dtype to run {policy}")
        uncapped = _uncapped_only(policy) if policy in POLICY_TRAITS else None
        if uncapped and self.infinigen_runtime.pool_index.row_map_of(0) is not None:
            raise ValueError(f"{uncapped} runs on an uncapped pool, and this engine's pool "
                             f"evicts (sized at start-up); start the engine with {uncapped}")
        if self.cache_config.enable_prefix_caching:
            known = {name: value for name, value in changes.items()
                     if name in runtime_settings() - {"alpha"}}
            reason = dataclasses.replace(self.infinigen_runtime.config,
                                         **known).prefix_caching_refusal()
            if reason is not None:
                raise ValueError(f"{reason}; start the engine with --no-enable-prefix-caching "
                                 "(enable_prefix_caching=False) to change it at run time")
        self.infinigen_runtime.update_selection(**changes)

    def determine_available_memory(self) -> int:
        """vLLM's KV space, less what the platform keeps beside it (the
        partial keys, and on the CPU build the pool's share of the grant)."""
        available = super().determine_available_memory()
        if not self.infinigen.layout.num_sparse:
            return available
        kv_space, budget, sized_by = self.split_memory(available)
        self._pool_budget = (budget, sized_by)
        return int(kv_space)

    def initialize_from_config(self, kv_cache_config, *args, **kwargs) -> None:
        import psutil

        super().initialize_from_config(kv_cache_config, *args, **kwargs)
        runtime, setup = self.infinigen_runtime, self.infinigen
        budget, sized_by = self._pool_budget
        kv_heads = rank_kv_heads(runtime)
        # the speculation keys, allocated with the pool
        keys = (kv_cache_config.num_blocks
                * rank_block_costs(setup, self.cache_config.block_size, runtime).partial
                if self.infinigen_keys_in_host_memory else 0)
        plan = plan_pool(
            num_blocks=kv_cache_config.num_blocks, block_size=self.cache_config.block_size,
            bytes_per_token=setup.layout.pool_bytes_per_token(setup.kv_dtype_bytes, kv_heads),
            step_tokens=setup.step_tokens,
            cap=cap_rows(setup.config.cpu_pool_gib, setup.pool_bytes_per_token,
                         setup.step_tokens),
            budget=budget, sized_by=sized_by, free=psutil.virtual_memory().available,
            uncapped_only=_uncapped_only(setup.config.policy),
            cappable=self.infinigen_pool_cappable,
            entries_per_token=setup.layout.num_sparse * kv_heads, beside=keys,
            ranks=host_ranks(self.parallel_config))
        runtime.allocate_pool(plan, kv_cache_config.num_blocks, self.model_config.dtype,
                              kv_dtype(self.cache_config.cache_dtype, self.model_config.dtype))
        if not runtime.data_path.plans_on_device:  # (the CPU's; CUDA's graphs left as they are)
            skip_sparse_slot_mappings(self.model_runner, kv_cache_config.kv_cache_groups)
        self._dense_group = dense_group_index(kv_cache_config.kv_cache_groups)
        groups = kv_cache_config.kv_cache_groups
        self._sparse_groups = {name: gid for gid, group in enumerate(groups)
                               if isinstance(group.kv_cache_spec, InfiniGenSparseSpec)
                               for name in group.layer_names}
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise RuntimeError("InfiniGen worker started without its KV connector")
        get_kv_transfer_group().bind_runtime(runtime, restore=self._copy_restored)

    def _copy_restored(self, requests: tuple[str, ...],
                       spans: tuple[tuple[int, int], ...] | None = None) -> None:
        """The K/V of requests back from the pool into their sparse blocks, or into
        their blocks ``spans`` (first, end) each, a prefix-cache hit's uncached ones
        (``worker/restore.py``; the connector, before the step's forward)."""
        runtime = self.infinigen_runtime
        restore.copy_from_pool(runtime.sparse_layers, self.model_runner, self._dense_group,
                               self._sparse_groups, requests, self.model_config.dtype,
                               runtime.device, spans)

    def execute_model(self, scheduler_output):
        """Frees the pool rows of requests that finished or were preempted
        since the last step, before this step's tokens take rows (with prefix
        caching keeps them: ``_keep_cached_rows``); empties the sparse rows of
        requests whose blocks come back (``worker/restore.py``) before the
        runner appends them."""
        gone, stale = self._gone_since_last_step(scheduler_output)
        if self.cache_config.enable_prefix_caching:
            self._keep_cached_rows(scheduler_output, gone, stale)
        else:
            for req_id in gone:
                request = self.model_runner.requests.get(req_id)
                if request is not None:
                    self.infinigen_runtime.release_blocks(request.block_ids[self._dense_group])
        metadata = getattr(scheduler_output, "kv_connector_metadata", None)
        if getattr(metadata, "cleared", ()):  # their rows still name the blocks of a move
            restore.clear_rows(self.model_runner, set(self._sparse_groups.values()),
                               metadata.cleared)
        return super().execute_model(scheduler_output)

    def _gone_since_last_step(self, scheduler_output) -> tuple[set[str], set[str]]:
        """The requests whose blocks went since the last step (finished or
        preempted), and those whose block ids in the runner's state are not
        theirs in this step. A preempted request keeps its old ids there until
        it resumes (the runner takes the new ones inside the step); finished
        (aborted) before that, its blocks went at the preemption and may be
        another request's now: not again."""
        released = self._released_at_preemption
        preempted = scheduler_output.preempted_req_ids or set()
        finished = scheduler_output.finished_req_ids
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        # (preempted and resumed in one step: vLLM's reset_prefix_cache of running requests)
        resumed = set(getattr(cached, "resumed_req_ids", ()))
        stale = released | resumed | finished | preempted
        gone = (finished - released) | preempted
        released.difference_update(finished | resumed)
        released.update(preempted - finished - resumed)
        return gone, stale

    def _keep_cached_rows(self, scheduler_output, gone: set[str], stale: set[str]) -> None:
        """With prefix caching vLLM keeps a freed block's K/V for a later hit, and
        the pool's rows of it stay too: a capped pool retires those no live
        request holds (first to go) and revives those a request of this step
        hit, before the step's tokens take rows. The data path's copies of the
        freed blocks go as without prefix caching."""
        runtime, requests, group = self.infinigen_runtime, self.model_runner.requests, \
            self._dense_group
        freed = [block for req_id in gone if (request := requests.get(req_id)) is not None
                 for block in request.block_ids[group]]
        if freed:
            runtime.data_path.release_blocks(freed)
        if runtime.pool_index.row_map_of(0) is None:
            return  # a slot's row is the slot id: nothing to keep or revive
        if freed:  # (a resumed request's hit blocks are revived below)
            live = {block for req_id, request in requests.items() if req_id not in stale
                    for block in request.block_ids[group]}
            runtime.pool_index.retire_blocks([block for block in freed if block not in live])
        hits = [(new.block_ids, new.num_computed_tokens)
                for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        hits += [(block_ids, computed) for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
            if req_id in cached.resumed_req_ids and block_ids is not None]
        block_size = self.cache_config.block_size
        revived = [block for block_ids, computed in hits
                   for block in block_ids[group][:computed // block_size]]
        if revived:
            runtime.pool_index.revive_blocks(revived)


def _uncapped_only(policy: str) -> str | None:
    """``--infinigen-policy NAME`` where that policy cannot run on a pool that evicts."""
    return None if POLICY_TRAITS[policy].supports_capped_pool else f"{flag('policy')} {policy}"
