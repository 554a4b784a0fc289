# SPDX-License-Identifier: Apache-2.0
"""Performance harness arithmetic on hand-written inputs (no engine).

KV bytes per step (dense, InfiniGen and baselines from counter values, the
ideal fractions), the KV space sizing, TTFT/TPOT extraction from vLLM's
request metrics and their percentiles, the root-cause line of a failed start,
and the GPU projection's arithmetic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from benchmarks.perf import common, gpu_projection, memory_pressure

SHAPE = common.ModelShape(layers=6, kv_heads=8, head_dim=32, dtype_bytes=4)


def test_kv_bytes_per_token_layer_is_k_plus_v_of_every_kv_head():
    assert SHAPE.kv_bytes_per_token_layer == 2 * 8 * 32 * 4


def test_partial_rank_matches_the_runtime_rounding():
    assert common.partial_rank(32, 0.2) == 6  # int(6.4)
    assert common.partial_rank(128, 0.2) == 25
    assert common.partial_rank(4, 0.1) == 1  # at least one channel


def test_ideal_fraction_is_the_papers_r_over_2_plus_budget_in_sparse_layers():
    sparse = common.ideal_sparse_fraction("infinigen", budget=0.2, partial_ratio=0.2)
    assert sparse == pytest.approx(0.3)
    # 2 dense layers read everything, 4 sparse read 0.3 of theirs.
    assert common.ideal_kv_fraction(6, 2, sparse) == pytest.approx((2 + 4 * 0.3) / 6)
    # gutenberg-llama-2k: 8 layers, the README's 0.475.
    assert common.ideal_kv_fraction(8, 2, sparse) == pytest.approx(0.475)
    assert common.ideal_kv_fraction(6, 6, sparse) == 1.0
    with pytest.raises(ValueError):
        common.ideal_kv_fraction(6, 7, sparse)


def test_baseline_ideals_count_their_metadata():
    # Quest: min + max of the keys per 16-token page = 1/16 of K+V.
    assert common.ideal_sparse_fraction("quest", 0.2, shape=SHAPE) == pytest.approx(0.2 + 1 / 16)
    # H2O: one float32 score per token and KV head against 2 * 32 * 4 bytes.
    assert common.ideal_sparse_fraction("h2o", 0.2, shape=SHAPE) == pytest.approx(0.2 + 4 / 256)
    assert common.ideal_sparse_fraction("streaming", 0.2, shape=SHAPE) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        common.ideal_sparse_fraction("quest", 0.2)  # needs the shape
    with pytest.raises(ValueError):
        common.metadata_bytes_per_token("snapkv", SHAPE)


def test_sparse_step_bytes_from_counters():
    # Batch 2, contexts 1000 and 3000, 4 sparse layers, 10 steps; every layer
    # selects 20% of 4000 context tokens per step.
    steps, sparse_layers, context = 10, 4, 4000
    selected_entries = 0.2 * context * SHAPE.kv_heads  # per layer per step
    counters = {
        "candidate_tokens": context * sparse_layers * steps,
        "swap_bytes": selected_entries * 2 * 32 * 4 * sparse_layers * steps,
    }
    step = common.sparse_step_bytes(SHAPE, 2, "infinigen", counters, steps)
    per_layer = context * SHAPE.kv_bytes_per_token_layer
    assert step.dense_equivalent == pytest.approx(6 * per_layer)
    assert step.dense_equivalent == pytest.approx(common.dense_step_bytes(SHAPE, context))
    assert step.dense_layers == pytest.approx(2 * per_layer)
    assert step.metadata == pytest.approx(4 * context * 8 * 6 * 4)  # rank 6 partial keys
    assert step.pool_to_attention == pytest.approx(4 * 0.2 * per_layer)
    # (2 + 4 * (6/64 + 0.2)) / 6: the measured rank is 6 of 32 channels, not 6.4.
    assert step.fraction == pytest.approx((2 + 4 * (6 / 64 + 0.2)) / 6)
    assert step.fraction < common.ideal_kv_fraction(6, 2, 0.3)


def test_streaming_reads_no_metadata_and_bad_inputs_fail():
    counters = {"candidate_tokens": 400.0, "swap_bytes": 0.0}
    assert common.sparse_step_bytes(SHAPE, 2, "streaming", counters, 1).metadata == 0
    with pytest.raises(ValueError):
        common.sparse_step_bytes(SHAPE, 2, "streaming", counters, 0)
    with pytest.raises(ValueError):
        common.sparse_step_bytes(SHAPE, 6, "streaming", counters, 1)


def test_counter_totals_and_delta():
    before = common.counter_totals({"swap_bytes": {"2": 10, "3": 5}})
    after = common.counter_totals({"swap_bytes": {"2": 30, "3": 5},
                                   "candidate_tokens": {"2": 7}})
    assert common.counter_delta(before, after) == {"swap_bytes": 20.0, "candidate_tokens": 7.0}


def test_kv_space_holds_the_tokens_for_each_manager():
    tokens = 1000
    dense = common.kv_space_bytes(SHAPE, tokens, "vllm", margin=1.0)
    assert dense == tokens * 6 * 2048
    # InfiniGen: 2 pages per block id + 4 sparse layers x 8 heads x 6 channels x 4 B.
    infinigen = common.kv_space_bytes(SHAPE, tokens, "infinigen", group_size=2, margin=1.0)
    assert infinigen == tokens * (2 * 2048 + 4 * 8 * 6 * 4)
    assert common.kv_space_bytes(SHAPE, tokens, "vllm") > dense  # margin
    with pytest.raises(ValueError):
        common.kv_space_bytes(SHAPE, tokens, "lmcache")


def _metrics(**fields):
    base = dict(num_generation_tokens=5, first_token_latency=0.5, first_token_ts=100.0,
                last_token_ts=100.8, num_preemptions=1, arrival_time=1.7e9)
    return SimpleNamespace(**{**base, **fields})


def test_request_latency_uses_engine_stamps_for_tpot():
    latency = common.request_latency(_metrics())
    assert latency.ttft_s == 0.5
    assert latency.tpot_s == pytest.approx(0.2)  # 0.8 s over 4 tokens after the first
    assert latency.e2e_s == pytest.approx(1.3)
    assert latency.output_tokens == 5 and latency.preemptions == 1
    single = common.request_latency(_metrics(num_generation_tokens=1, last_token_ts=100.0))
    assert single.tpot_s is None and single.e2e_s == 0.5


def test_percentiles_interpolate_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert common.percentile(values, 0) == 1.0
    assert common.percentile(values, 50) == 2.5
    assert common.percentile(values, 100) == 4.0
    assert common.percentile(values, 90) == pytest.approx(3.7)
    assert common.percentile([7.0], 99) == 7.0
    assert math.isnan(common.percentile([], 50))
    with pytest.raises(ValueError):
        common.percentile(values, 101)


def test_latency_summary_throughput_and_tpot_skip_single_token_requests():
    latencies = [common.request_latency(_metrics()),
                 common.request_latency(_metrics(num_generation_tokens=1, last_token_ts=100.0,
                                                 first_token_latency=1.5))]
    summary = common.latency_summary(latencies, wall_s=2.0)
    assert summary["requests_per_s"] == 1.0
    assert summary["output_tokens"] == 6 and summary["output_tokens_per_s"] == 3.0
    assert summary["ttft_s_mean"] == pytest.approx(1.0)
    assert summary["tpot_s_p50"] == pytest.approx(0.2)  # one request has a TPOT
    assert summary["request_preemptions"] == 2


def test_metric_value_sums_label_sets():
    metrics = [SimpleNamespace(name="vllm:num_preemptions", value=2.0),
               SimpleNamespace(name="vllm:num_preemptions", value=3.0),
               SimpleNamespace(name="vllm:other", value=9.0),
               SimpleNamespace(name="vllm:num_preemptions")]  # a histogram: no value
    assert common.metric_value(metrics, "vllm:num_preemptions") == 5.0
    assert common.metric_value(metrics, "vllm:absent") == 0.0


def test_root_cause_skips_the_wrapper_error():
    log = "\n".join([
        "(EngineCore pid=12) Traceback (most recent call last):",
        "(EngineCore pid=12) Exception: CPU Offloading is currently only supported on "
        "CUDA-alike and XPU GPUs",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ])
    assert memory_pressure.root_cause(log) == (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs")
    assert memory_pressure.root_cause("all fine") is None


def test_gpu_projection_bytes_and_times():
    setting = gpu_projection.PAPER_SETTING
    # OPT-13B fp16: K+V per token per layer = 2 x 5120 x 2 bytes.
    assert setting.kv_bytes_per_token_layer == 20480
    # Full KV of batch 20 at 1984 tokens (mid-generation), 40 layers.
    full = gpu_projection.kv_bytes(setting, context=1984)
    assert full == 20 * 1984 * 40 * 20480
    parts = gpu_projection.infinigen_step_bytes(setting, context=1984, selected_fraction=0.2)
    sparse_full = full * 38 / 40
    assert parts["pcie"] == pytest.approx(0.2 * sparse_full)
    # Partial keys: r of K = r/2 of K+V of every sparse layer, read from HBM.
    assert parts["hbm_partial"] == pytest.approx(0.1 * sparse_full)
    # 2 dense layers: full K/V over PCIe as well (in the pool like the rest).
    assert parts["pcie_dense_layers"] == pytest.approx(full * 2 / 40)
    time_s = gpu_projection.transfer_seconds(12e9, 12e9)
    assert time_s == pytest.approx(1.0)


def test_cpu_meter_counts_our_time_and_never_negative_others():
    import time

    with common.CpuMeter() as meter:
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
    assert meter.wall >= 0.2
    assert 0 < meter.own <= meter.wall * 1.5  # one busy thread (clock ticks are coarse)
    assert meter.other_cores is None or meter.other_cores >= 0


def test_wait_for_quiet_gives_up_at_the_timeout():
    import time

    start = time.monotonic()
    other = common.wait_for_quiet(max_cores=-1.0, timeout_s=0.1, interval_s=0.05)  # never quiet
    assert time.monotonic() - start < 2
    assert other is None or other >= 0
