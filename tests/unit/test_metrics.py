# SPDX-License-Identifier: Apache-2.0
"""InfiniGen stats and their Prometheus counters, in a private registry."""

from __future__ import annotations

import functools

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import ModelConfig, VllmConfig
from vllm.v1.metrics import reader

from benchmarks.harness.paths import BUNDLED_MODEL
from vllm_infinigen.scheduler.metrics import (
    COUNTERS,
    ENGINE_COUNTERS,
    GAUGES,
    InfiniGenPromMetrics,
    InfiniGenStats,
    summarize,
)

STORIES_DIR = str(BUNDLED_MODEL)
LABELNAMES = ["model_name", "engine"]
PER_ENGINE = {0: ["tiny", "0"], 1: ["tiny", "1"]}


def step_stats():
    return {
        "selected_tokens.2": 10, "candidate_tokens.2": 40, "selected_kv_bytes.2": 1280,
        "selected_tokens.3": 6, "candidate_tokens.3": 40, "selected_kv_bytes.3": 768,
    }


def test_reduce_exact():
    assert InfiniGenStats(data=step_stats()).reduce() == {
        "selected_tokens": 16,
        "candidate_tokens": 80,
        "selected_kv_bytes": 2048,
        "fetch_wait_us": 0,
        "evictions": 0,
        "cache_hits": 0,
        "cache_misses": 0,
        "pcie_bytes": 0,
        "selected_fraction": 0.2,
    }


def test_reduce_gives_the_block_caches_hit_rate():
    stats = InfiniGenStats(data={"cache_hits.2": 3, "cache_misses.2": 1, "cache_hits.3": 3,
                                 "cache_misses.3": 1, "pcie_bytes.3": 8192})
    reduced = stats.reduce()
    assert (reduced["cache_hits"], reduced["cache_misses"], reduced["pcie_bytes"]) == (6, 2, 8192)
    assert reduced["cache_hit_rate"] == 0.75
    assert "cache_hit_rate" not in InfiniGenStats().reduce()


def test_worker_gauges_sum_over_ranks_and_keep_the_latest_step():
    stats = InfiniGenStats(data={"pool_used_bytes.0": 100, "pool_used_bytes.1": 50,
                                 "evictions.2": 3})
    stats.aggregate(InfiniGenStats(data={"pool_used_bytes.0": 70, "evictions.2": 4}))
    assert stats.data == {"pool_used_bytes.0": 70, "pool_used_bytes.1": 50, "evictions.2": 7}
    reduced = stats.reduce()
    assert reduced["pool_used_bytes"] == 120 and reduced["evictions"] == 7
    assert not InfiniGenStats(data={"pool_used_bytes.1": 0}).is_empty()


def test_reduce_without_candidates():
    assert InfiniGenStats().reduce() == {name: 0 for name in COUNTERS}
    assert "selected_fraction" not in InfiniGenStats(data={"selected_kv_bytes.2": 5}).reduce()


def test_reduce_rounds_fraction():
    stats = InfiniGenStats(data={"selected_tokens.2": 1, "candidate_tokens.2": 3})
    assert stats.reduce()["selected_fraction"] == 0.3333


def test_aggregate_sums_per_key():
    first = InfiniGenStats(data=step_stats())
    second = InfiniGenStats(data={"selected_tokens.2": 5, "candidate_tokens.2": 41,
                                  "selected_tokens.4": 7})
    result = first.aggregate(second)
    assert result is first
    assert first.data == {
        "selected_tokens.2": 15, "candidate_tokens.2": 81, "selected_kv_bytes.2": 1280,
        "selected_tokens.3": 6, "candidate_tokens.3": 40, "selected_kv_bytes.3": 768,
        "selected_tokens.4": 7,
    }
    assert second.data == {"selected_tokens.2": 5, "candidate_tokens.2": 41,
                           "selected_tokens.4": 7}


def test_is_empty_and_reset():
    assert InfiniGenStats().is_empty()
    assert InfiniGenStats(data={"selected_tokens.2": 0, "selected_kv_bytes.2": 0}).is_empty()
    stats = InfiniGenStats(data={"selected_tokens.2": 0, "selected_kv_bytes.2": 1})
    assert not stats.is_empty()
    stats.reset()
    assert stats.data == {} and stats.is_empty()


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig()


@pytest.fixture
def registry():
    return CollectorRegistry()


def metric_types(registry) -> dict:
    return {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }


@pytest.fixture
def prom(vllm_config, registry):
    """InfiniGen off in this config: no layer is known, no series exists before
    an increment."""
    return InfiniGenPromMetrics(vllm_config, metric_types(registry), LABELNAMES, PER_ENGINE)


def sample(registry, name, layer, engine="0"):
    return registry.get_sample_value(
        f"vllm:infinigen_{name}_total",
        {"model_name": "tiny", "engine": engine, "layer": layer},
    )


def test_observe_counts_per_layer_and_engine(prom, registry):
    prom.observe(step_stats())
    prom.observe({"selected_tokens.2": 4, "candidate_tokens.2": 40}, engine_idx=0)
    prom.observe({"selected_tokens.2": 9, "candidate_tokens.2": 0}, engine_idx=1)
    assert sample(registry, "selected_tokens", "2") == 14.0
    assert sample(registry, "candidate_tokens", "2") == 80.0
    assert sample(registry, "selected_kv_bytes", "2") == 1280.0
    assert sample(registry, "selected_tokens", "3") == 6.0
    assert sample(registry, "selected_kv_bytes", "3") == 768.0
    assert sample(registry, "selected_tokens", "2", engine="1") == 9.0
    # A zero increment creates no series.
    assert sample(registry, "candidate_tokens", "2", engine="1") is None
    text = generate_latest(registry).decode()
    assert ('\nvllm:infinigen_selected_tokens_total{engine="0",layer="2",'
            'model_name="tiny"} 14.0\n') in text


def test_every_counter_of_every_sparse_layer_is_exported_at_zero_from_start_up(registry):
    """stories260K with InfiniGen on: sparse layers 2, 3 and 4 (the first two are dense)."""
    config = VllmConfig(model_config=ModelConfig(model=STORIES_DIR),
                        additional_config={"kv_manager": "infinigen"})
    prom = InfiniGenPromMetrics(config, metric_types(registry), LABELNAMES, PER_ENGINE)
    for name in COUNTERS:
        for engine in ("0", "1"):
            for layer in ("0", "1", "2", "3", "4"):
                expected = 0.0 if layer in ("2", "3", "4") else None
                assert sample(registry, name, layer, engine=engine) == expected, (name, layer)
    text = generate_latest(registry).decode()
    assert ('\nvllm:infinigen_evictions_total{engine="1",layer="4",'
            'model_name="tiny"} 0.0\n') in text
    prom.observe({"evictions.3": 5})
    assert [sample(registry, "evictions", layer) for layer in ("2", "3", "4")] == [0.0, 5.0, 0.0]


def test_observe_ignores_unknown_counters(prom, registry):
    prom.observe({"something_else.2": 3, "selected_tokens.5": 2})
    assert sample(registry, "selected_tokens", "5") == 2.0
    names = {metric.name for metric in registry.collect()}
    assert names == {f"vllm:infinigen_{name}" for name in [*COUNTERS, *ENGINE_COUNTERS, *GAUGES]}


def test_moves_count_by_destination_and_add_up_over_steps(prom, registry):
    """``residency_moves`` (the scheduler's, engine-wide): a counter labelled by
    where the engine went, not a gauge; reduce keeps the label."""
    stats = InfiniGenStats(data={"residency_moves.pool": 1, "resident": 0})
    stats.aggregate(InfiniGenStats(data={"residency_moves.device": 1, "resident": 1}))
    stats.aggregate(InfiniGenStats(data={"residency_moves.pool": 1, "resident": 0}))
    totals = stats.reduce()
    assert totals["residency_moves.pool"] == 2 and totals["residency_moves.device"] == 1
    assert totals["resident"] == 0
    prom.observe(stats.data)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:infinigen_residency_moves_total",
                                     {**labels, "to": "pool"}) == 2
    assert registry.get_sample_value("vllm:infinigen_residency_moves_total",
                                     {**labels, "to": "device"}) == 1
    assert summarize([reader.Counter(name="vllm:infinigen_residency_moves_total",
                                     labels={**labels, "to": "device"}, value=1)]) == {
        "residency_moves": {"device": 1}}


def test_metrics_stay_out_of_the_global_registry(prom):
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value(
        "vllm:infinigen_selected_tokens_total",
        {"model_name": "tiny", "engine": "0", "layer": "2"},
    ) is None


def test_summarize():
    metrics = [
        reader.Counter(name="vllm:infinigen_selected_tokens_total",
                       labels={"engine": "0", "layer": "2"}, value=10),
        reader.Counter(name="vllm:infinigen_selected_tokens_total",
                       labels={"engine": "1", "layer": "2"}, value=5),
        reader.Counter(name="vllm:infinigen_selected_tokens_total",
                       labels={"engine": "0", "layer": "3"}, value=7),
        reader.Counter(name="vllm:infinigen_candidate_tokens",
                       labels={"engine": "0", "layer": "2"}, value=40),
        reader.Counter(name="vllm:prompt_tokens_total", labels={"engine": "0"}, value=99),
        reader.Gauge(name="vllm:num_requests_running", labels={"engine": "0"}, value=1.0),
    ]
    assert summarize(metrics) == {
        "selected_tokens": {"2": 15, "3": 7},
        "candidate_tokens": {"2": 40},
    }
    assert summarize([]) == {}


def test_gauges_are_not_empty_at_zero_and_keep_their_value():
    stats = InfiniGenStats(data={"pool_used_bytes": 0, "device_blocks": 0})
    assert not stats.is_empty()
    stats.aggregate(InfiniGenStats(data={"selected_tokens.2": 5}))
    assert stats.reduce()["pool_used_bytes"] == 0
    assert stats.reduce()["selected_tokens"] == 5


def test_aggregate_keeps_the_latest_gauge():
    stats = InfiniGenStats(data={"pool_capacity_bytes": 100, "selected_tokens.2": 1})
    stats.aggregate(InfiniGenStats(data={"pool_capacity_bytes": 100, "selected_tokens.2": 2}))
    assert stats.data == {"pool_capacity_bytes": 100, "selected_tokens.2": 3}


def test_worker_gauges_win_over_the_schedulers_in_one_interval():
    """A worker that capped its pool reports it; the scheduler, not knowing
    yet, reported the uncapped value in the same interval: not a sum."""
    stats = InfiniGenStats(data={"pool_used_bytes": 500, "pool_capacity_bytes": 900,
                                 "device_blocks": 3})
    stats.aggregate(InfiniGenStats(data={"pool_used_bytes.0": 100, "pool_used_bytes.1": 20,
                                         "pool_capacity_bytes.0": 400}))
    reduced = stats.reduce()
    assert reduced["pool_used_bytes"] == 120 and reduced["pool_capacity_bytes"] == 400
    assert reduced["device_blocks"] == 3


def test_the_worker_connector_spares_vllm_its_per_layer_calls():
    """vLLM's attention wrapper calls ``wait_for_layer_load``/``save_kv_layer``
    in every layer while the connector says it has metadata; InfiniGen has no
    per-layer work, so it says no, and keeps the step's metadata all the same."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.model_executor.layers.attention import kv_transfer_utils

    from vllm_infinigen.scheduler.connector import InfiniGenConnector, InfiniGenMetadata

    connector = object.__new__(InfiniGenConnector)
    connector._runtime = None
    connector._connector_metadata = None
    metadata = InfiniGenMetadata(resident=False)
    connector.bind_connector_metadata(metadata)
    assert KVConnectorBase_V1.has_connector_metadata(connector)  # the base would say yes
    assert not connector.has_connector_metadata()
    assert connector._get_connector_metadata() is metadata

    calls = []
    connector.wait_for_layer_load = lambda name: calls.append(("wait", name))
    connector.save_kv_layer = lambda *args, **kwargs: calls.append(("save", args[0]))
    import vllm.model_executor.layers.attention.attention as attention_module

    # A layer's step as vLLM runs it with a v1 connector and attention metadata.
    patches = {(kv_transfer_utils, "has_kv_transfer_group"): lambda: True,
               (kv_transfer_utils, "is_v1_kv_transfer_group"): lambda: True,
               (kv_transfer_utils, "get_kv_transfer_group"): lambda: connector,
               (kv_transfer_utils, "_resolve_layer_name"): lambda name: name,
               (attention_module, "get_attention_context"):
                   lambda name: (object(), None, None, None)}
    saved = {key: getattr(*key) for key in patches}
    try:
        for (module, name), value in patches.items():
            setattr(module, name, value)

        @kv_transfer_utils.maybe_transfer_kv_layer
        def attention(query: torch.Tensor, layer_name: str) -> torch.Tensor:
            return query

        query = torch.zeros(1)
        assert attention(query, "layers.2.attn") is query
        assert calls == []
        connector.has_connector_metadata = lambda: True  # the base's answer: both calls
        assert attention(query, "layers.2.attn") is query
        assert calls == [("wait", "layers.2.attn"), ("save", "layers.2.attn")]
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def test_the_pool_counts_a_shared_prefix_once():
    """Uncapped, the pool's rows in use are the dense group's distinct blocks:
    two requests that hit a third one's cached prefix hold its blocks once."""
    from types import SimpleNamespace

    from vllm_infinigen.scheduler.connector import _blocks_in_use

    def blocks(*ids):
        return [SimpleNamespace(block_id=block_id, ref_cnt=0) for block_id in ids]

    prefix, first, second, third = blocks(1, 2, 3), blocks(4), blocks(5, 6), blocks(7)
    requests = [prefix + first, prefix[:2] + second, prefix + third, blocks(8, 9)]
    for request in requests:
        for block in request:
            block.ref_cnt += 1
    assert _blocks_in_use(requests) == 9
    assert _blocks_in_use(requests[3:]) == 2
