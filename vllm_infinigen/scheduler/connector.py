# SPDX-License-Identifier: Apache-2.0
"""Scheduler side: the KV connector that carries InfiniGen's stats out of the workers.

vLLM runs one instance in the scheduler (role SCHEDULER) and one per worker
(role WORKER). The worker-side instance is bound to the worker's
``InfiniGenRuntime`` and drains its counters every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_infinigen.engine_setup import engine_setup
from vllm_infinigen.memory import cap_rows
from vllm_infinigen.scheduler.metrics import InfiniGenPromMetrics, InfiniGenStats
from vllm_infinigen.scheduler.residency import residency_of
from vllm_infinigen.scheduler.spec import dense_group_index

if TYPE_CHECKING:
    from vllm_infinigen.worker.runtime import InfiniGenRuntime


class InfiniGenMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step (``--infinigen-residency
    device-first``): whether the sparse layers are in the device blocks, and
    the requests over the pool whose sparse blocks came back in this step
    (``restored``: the workers copy their K/V there from the pool), and the new
    resident requests with a prefix-cache hit that the sparse groups had not all
    cached (``filled``: request, and the first and the end of the hit's blocks
    whose sparse blocks the workers fill from the pool)."""

    def __init__(self, resident: bool, restored: tuple[str, ...] = (),
                 cleared: tuple[str, ...] = (),
                 filled: tuple[tuple[str, int, int], ...] = ()) -> None:
        self.resident = resident
        self.restored = restored
        # The requests whose sparse rows the workers empty before the step's blocks
        # (``restored``, and any whose blocks a move in the same step freed again).
        self.cleared = cleared
        self.filled = filled


def _blocks_in_use(requests_blocks) -> int:
    """Distinct blocks held by the requests of a full-attention group.

    A block two requests share (a prefix-cache hit) has ``ref_cnt`` > 1, and a
    hit takes the longest cached prefix, so a request's shared blocks are a
    run at the start of its list: each is counted once, walking those runs only.
    """
    total, shared = 0, {}
    for blocks in requests_blocks:
        total += len(blocks)
        for block in blocks:
            if block.ref_cnt <= 1:
                break
            shared[block.block_id] = block.ref_cnt
    return total - sum(count - 1 for count in shared.values())


class InfiniGenConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._runtime: InfiniGenRuntime | None = None
        self._restore: Callable[[tuple[str, ...]], None] | None = None
        self._setup = engine_setup(vllm_config)
        # Set once a worker reports a capped pool's capacity: the workers size
        # the pool (memory.plan_pool), the scheduler cannot tell on its own.
        self._workers_report_pool = False

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @property
    def supports_sleep_mode(self) -> bool:
        """Asked by vLLM 0.33+ (the base answers True): sleep would release the
        KV cache but not remap InfiniGen's pool and partial keys."""
        return False

    # ==============================
    # Worker-side methods
    # ==============================

    def bind_runtime(self, runtime: InfiniGenRuntime,
                     restore: Callable[[tuple[str, ...]], None] | None = None) -> None:
        """Called by the InfiniGen worker once its runtime is installed; ``restore``
        copies the K/V of requests back from the pool into their sparse blocks."""
        self._runtime = runtime
        self._restore = restore

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Each step, before the forward (after the runner's block tables took the
        step's blocks): the step's residency to the runtime, and the K/V of the
        requests whose blocks came back copied into them."""
        super().bind_connector_metadata(connector_metadata)
        if self._runtime is not None and isinstance(connector_metadata, InfiniGenMetadata):
            self._runtime.set_resident(connector_metadata.resident)
            if connector_metadata.restored or connector_metadata.filled:
                if self._restore is None:
                    raise RuntimeError("InfiniGen: requests came back from the pool to a "
                                       "worker that cannot copy their K/V")
                if connector_metadata.restored:
                    self._restore(connector_metadata.restored)
                if connector_metadata.filled:  # only the hit's uncached blocks
                    requests, *spans = zip(*connector_metadata.filled)
                    self._restore(requests, tuple(zip(*spans)))

    def has_connector_metadata(self) -> bool:
        """False: InfiniGen has no work per layer (``wait_for_layer_load`` and
        ``save_kv_layer`` do nothing), so vLLM's attention wrapper
        (``maybe_transfer_kv_layer``, the only caller) skips both calls and its
        lookups in every layer of every step. The step's metadata is read in
        ``bind_connector_metadata``."""
        return False

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_kv_connector_stats(self) -> InfiniGenStats | None:
        """Called every step: by the model runner on every rank (counters),
        and by the scheduler (gauges of the pool and the device blocks)."""
        if self.role == KVConnectorRole.SCHEDULER:
            return self._scheduler_gauges()
        if self._runtime is None:
            return None
        counters = self._runtime.take_counters()
        return InfiniGenStats(data=counters) if counters else None

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """vLLM's, and the number of KV-cache groups to the residency: a move is
        decided on the blocks of all of them (``Residency.groups``)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        residency_of(kv_cache_manager.block_pool).num_groups = len(
            kv_cache_manager.coordinator.single_type_managers)

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        stats = connector_output.kv_connector_stats
        if stats is not None and any(key.startswith("pool_capacity_bytes.")
                                     for key in stats.data):
            self._workers_report_pool = True
            if self._kv_cache_manager is not None:  # (before the next step's allocations)
                residency_of(self._kv_cache_manager.block_pool).pool_capped = True

    def _scheduler_gauges(self) -> InfiniGenStats | None:
        """Pool and device usage, from vLLM's block pool.

        Uncapped, the pool's rows are the slots of the dense layers' blocks, so
        both are the blocks in use, at block granularity. Capped, the workers
        report the pool's use and capacity (each layer and head evicts on its
        own).
        """
        manager = self._kv_cache_manager
        if manager is None:
            return None
        block_pool = manager.block_pool
        block_size = self._vllm_config.cache_config.block_size
        # Every step: O(requests), not O(blocks) (at 128K tokens and blocks of
        # 16 a batch of 32 holds 262K blocks), plus the prefixes shared through
        # vLLM's prefix cache (``_blocks_in_use``). The device blocks in use are
        # those not free, less vLLM's null block (a block kept only by the
        # prefix cache is free).
        used = _blocks_in_use(self._dense_manager().req_to_blocks.values())
        gauges = {"device_blocks": block_pool.num_gpu_blocks - 1 - block_pool.get_num_free_blocks()}
        if self._setup.config.device_first:
            gauges["resident"] = int(self._resident())
            for to, count in residency_of(block_pool).take_moves().items():
                if count:
                    gauges[f"residency_moves.{to}"] = count  # a counter (metrics.py)
        setup = self._setup
        if not self._pool_capped():
            block_bytes = block_size * setup.pool_bytes_per_token
            gauges["pool_used_bytes"] = used * block_bytes
            gauges["pool_capacity_bytes"] = (block_pool.num_gpu_blocks - 1) * block_bytes
        return InfiniGenStats(data=gauges)

    def _dense_manager(self):
        """The dense group's manager: its requests' blocks address the pool's rows."""
        managers = self._kv_cache_manager.coordinator.single_type_managers
        return managers[dense_group_index(self._kv_cache_config.kv_cache_groups)]

    def _pool_capped(self) -> bool:
        """Whether the pool holds fewer rows than the dense group's slots (it evicts)."""
        setup = self._setup
        cap = cap_rows(setup.config.cpu_pool_gib, setup.pool_bytes_per_token, setup.step_tokens)
        num_slots = (self._kv_cache_manager.block_pool.num_gpu_blocks
                     * self._vllm_config.cache_config.block_size)
        return self._workers_report_pool or (cap is not None and cap < num_slots)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """After the step's allocations: whether the engine is resident in this
        step, and the requests whose sparse blocks came back in it. Then, over
        the pool, whether the next step returns (``_maybe_restore``)."""
        manager = self._kv_cache_manager
        if not self._setup.config.device_first or manager is None:
            return InfiniGenMetadata(resident=False)
        residency = residency_of(manager.block_pool)
        residency.tick()
        cleared, restored = residency.take_returns()
        metadata = InfiniGenMetadata(resident=not residency.moved, restored=restored,
                                     cleared=cleared, filled=residency.take_fills())
        residency.pool_capped = self._pool_capped()  # (the config's cap, from the first)
        if residency.moved:
            self._maybe_restore(residency)
        return metadata

    def _maybe_restore(self, residency) -> None:
        """Resident again from the next step when the live requests over the pool
        need at most half the free blocks in every sparse group (as many blocks
        as each holds in the dense group, whose slots address the pool), for
        ``residency.patience`` steps in a row: the other half keeps new requests
        and growth from moving the engine straight back, the patience grows where
        they did. Never from a capped pool (its evicted entries are gone)."""
        live = residency.live_requests()
        if not live or self._pool_capped():
            residency.step(False)
            return
        dense = self._dense_manager()
        blocks = len(residency.managers) * sum(len(dense.req_to_blocks.get(request_id, ()))
                                               for request_id in live)
        free = self._kv_cache_manager.block_pool.get_num_free_blocks()
        if residency.step(blocks <= free // 2):
            residency.restore(live, blocks, free)

    def _resident(self) -> bool:
        manager = self._kv_cache_manager
        if not self._setup.config.device_first or manager is None:
            return False
        return not residency_of(manager.block_pool).moved

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, None]:
        """The pool's slots are the dense group's: vLLM frees both at once."""
        return False, None

    # ==============================
    # Frontend-side (class) methods
    # ==============================

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> InfiniGenStats:
        return InfiniGenStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return InfiniGenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
