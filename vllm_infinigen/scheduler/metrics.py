# SPDX-License-Identifier: Apache-2.0
"""InfiniGen counters: per-step stats from the workers, Prometheus on the frontend.

Stats travel as a flat ``{"<counter>.<layer_idx>": int}`` dict (gauges:
``"<gauge>"`` from the scheduler, ``"<gauge>.<rank>"`` from each worker, summed
over ranks): the workers drain their counters once per step, vLLM sums the ranks and hands the dict to
``InfiniGenPromMetrics.observe`` in the API server (``/metrics``) or in the
``LLM`` process (``LLM.get_metrics()`` with ``disable_log_stats=False``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_infinigen.engine_setup import engine_setup

COUNTERS = {
    "selected_tokens": "Context tokens that InfiniGen's sparse layers attended to.",
    "candidate_tokens": "Context tokens that dense attention would have read "
    "in the same sparse layers.",
    "selected_kv_bytes": "Bytes of the selected K/V entries the sparse layers' attention read, "
    "where they lie (on the CPU build in place in the host pool; copies are pcie_bytes).",
    "fetch_wait_us": "Microseconds sparse layers waited for their selected K/V.",
    "evictions": "K/V entries (one layer, one KV head) a capped pool evicted.",
    # The CUDA platform's device block cache (``platforms/cuda/block_cache.py``;
    # 0 on the CPU build, where the pool is read in place).
    "cache_hits": "Selected K/V blocks (one layer, one KV head) found in the device "
    "block cache.",
    "cache_misses": "K/V blocks (one layer, one KV head) fetched from the host pool into "
    "the device block cache: selected, or a prompt's earlier chunks.",
    "pcie_bytes": "Bytes of K/V blocks copied from the host pool to the device: fetched "
    "into the device block cache, or staged for rows attended beside it (contexts below "
    "the min context, prompts the cache cannot hold).",
}


# Engine-wide counters, keyed ``"<counter>.<label>"`` like the per-layer ones.
ENGINE_COUNTERS = {
    "residency_moves": ("to", "Moves of --infinigen-residency device-first between the "
                        "device blocks and the pool, by destination (to: pool, device)."),
}


GAUGES = {
    "pool_used_bytes": "Bytes of InfiniGen's host pool held by running requests.",
    "pool_capacity_bytes": "Capacity of InfiniGen's host pool in bytes.",
    "device_blocks": "KV-cache blocks on the device held by InfiniGen requests.",
    "resident": "1 while the sparse layers' K/V is in the device blocks "
    "(--infinigen-residency device-first), 0 while the engine runs over the pool.",
}


@dataclass
class InfiniGenStats(KVConnectorStats):
    """Counter increments since the last step, keyed ``"<counter>.<layer_idx>"``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters add up (ranks, steps); a gauge keeps its latest value."""
        for key, value in other.data.items():
            self.data[key] = value if is_gauge(key) else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        totals = {name: 0 for name in COUNTERS}
        totals.update(gauge_totals(self.data))
        for key, value in self.data.items():
            name = key.split(".", 1)[0]
            if name in COUNTERS:
                totals[name] += value
            elif name in ENGINE_COUNTERS:
                totals[key] = totals.get(key, 0) + value
        if totals["candidate_tokens"]:
            totals["selected_fraction"] = round(
                totals["selected_tokens"] / totals["candidate_tokens"], 4
            )
        looked_up = totals["cache_hits"] + totals["cache_misses"]
        if looked_up:
            totals["cache_hit_rate"] = round(totals["cache_hits"] / looked_up, 4)
        return totals

    def is_empty(self) -> bool:
        # A gauge counts even at zero: /metrics must fall back to 0.
        return not any(value or is_gauge(key) for key, value in self.data.items())


@functools.lru_cache(maxsize=4096)  # the keys are few (counters x layers, gauges x ranks)
def is_gauge(key: str) -> bool:
    return key.split(".", 1)[0] in GAUGES


def gauge_totals(data: dict[str, Any]) -> dict[str, int | float]:
    """Each gauge's value: the sum of its per-rank latest values.

    The workers' per-rank values (``"<gauge>.<rank>"``) win over the
    scheduler's own (``"<gauge>"``): only the workers know a pool they capped
    themselves, and both may arrive in the same interval.
    """
    by_rank: dict[str, int | float] = {}
    scheduler: dict[str, int | float] = {}
    for key, value in data.items():
        if is_gauge(key):
            name, dot, _ = key.partition(".")
            if dot:
                by_rank[name] = by_rank.get(name, 0) + value
            else:
                scheduler[name] = value
    return {**scheduler, **by_rank}


class InfiniGenPromMetrics(KVConnectorPromMetrics):
    """``vllm:infinigen_<counter>_total{model_name, engine, layer}`` and gauges."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:infinigen_{name}",
                documentation=doc,
                labelnames=[*labelnames, "layer"],
            )
            for name, doc in COUNTERS.items()
        }
        self._counters.update({
            name: self._counter_cls(name=f"vllm:infinigen_{name}", documentation=doc,
                                    labelnames=[*labelnames, label])
            for name, (label, doc) in ENGINE_COUNTERS.items()})

        self._gauges = {
            name: self._gauge_cls(
                name=f"vllm:infinigen_{name}", documentation=doc,
                labelnames=labelnames, multiprocess_mode="mostrecent",
            )
            for name, doc in GAUGES.items()
        }
        # (engine, "<counter>.<layer>") -> the labelled counter: looked up
        # once, not at every step.
        self._children: dict[tuple[int, str], Any] = {}
        self._export_counters_at_zero(vllm_config)

    def _export_counters_at_zero(self, vllm_config) -> None:
        """Every counter of every sparse layer exists from start-up, at 0: /metrics
        shows ``vllm:infinigen_evictions_total`` before the first eviction."""
        setup = engine_setup(vllm_config)
        if setup is None:
            return
        for name, counter in self._counters.items():
            values = ([str(layer_idx) for layer_idx in setup.layout.sparse_layers]
                      if name in COUNTERS else ["pool", "device"] if setup.config.device_first
                      else [])
            for engine_labels in self.per_engine_labelvalues.values():
                for value in values:
                    counter.labels(*engine_labels, value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for name, value in gauge_totals(transfer_stats_data).items():
            self._gauges[name].labels(*engine_labels).set(value)
        children = self._children
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            child = children.get((engine_idx, key))
            if child is None:
                name, _, layer = key.partition(".")
                counter = self._counters.get(name)
                if counter is None:
                    continue
                child = children[engine_idx, key] = counter.labels(*engine_labels, layer)
            child.inc(value)


def summarize(metrics: list) -> dict[str, dict[str, float]]:
    """InfiniGen counters from ``LLM.get_metrics()``, as {counter: {layer: value}}."""
    out: dict[str, dict[str, float]] = {}
    for metric in metrics:
        name = getattr(metric, "name", "")
        if not name.startswith("vllm:infinigen_"):
            continue
        counter = name[len("vllm:infinigen_") :].removesuffix("_total")
        label = ENGINE_COUNTERS[counter][0] if counter in ENGINE_COUNTERS else "layer"
        layer = metric.labels.get(label, "")
        out.setdefault(counter, {})
        out[counter][layer] = out[counter].get(layer, 0) + metric.value
    return out
