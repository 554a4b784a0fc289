# SPDX-License-Identifier: Apache-2.0
"""The KV connector that carries InfiniGen's stats out of the workers.

vLLM runs one instance in the scheduler (role SCHEDULER) and one per worker
(role WORKER). The worker-side instance is bound to the worker's
``InfiniGenRuntime`` and drains its counters every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_infinigen.metrics import InfiniGenPromMetrics, InfiniGenStats

if TYPE_CHECKING:
    from vllm_infinigen.runtime import InfiniGenRuntime


class InfiniGenConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._runtime: InfiniGenRuntime | None = None

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ==============================
    # Worker-side methods
    # ==============================

    def bind_runtime(self, runtime: InfiniGenRuntime) -> None:
        """Called by the InfiniGen worker once its runtime is installed."""
        self._runtime = runtime

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_kv_connector_stats(self) -> InfiniGenStats | None:
        """Called by the model runner every step, on every rank."""
        if self.role != KVConnectorRole.WORKER or self._runtime is None:
            return None
        stats = InfiniGenStats(data=self._runtime.take_counters())
        return None if stats.is_empty() else stats

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    # ==============================
    # Frontend-side (class) methods
    # ==============================

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> InfiniGenStats:
        return InfiniGenStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return InfiniGenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
