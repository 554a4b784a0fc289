# SPDX-License-Identifier: Apache-2.0
"""Performance harness arithmetic on hand-written inputs (no engine).

KV bytes per step (dense, InfiniGen and baselines from counter values, the
ideal fractions), the KV space sizing, TTFT/TPOT extraction from vLLM's
request metrics and their percentiles, the root-cause line of a failed start,
the GPU projection's arithmetic, and the decode sweep's derived numbers
(achieved GB/s, context-dependent cost, presets, ``--render`` of old results).
"""

from __future__ import annotations

import json
import os
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.harness import models, paths
from benchmarks.perf import (bandwidth, decode_latency, decode_report, decode_windows,
                             kv_math, latency_stats, machine,
                             memory_pressure)
from vllm_infinigen import layout
from vllm_infinigen.config import InfiniGenConfig

SHAPE = kv_math.ModelShape(layers=6, kv_heads=8, head_dim=32, dtype_bytes=4)


def test_kv_bytes_per_token_layer_is_k_plus_v_of_every_kv_head():
    assert SHAPE.kv_bytes_per_token_layer == 2 * 8 * 32 * 4


def test_partial_rank_matches_the_runtime_rounding():
    assert layout.partial_rank(32, 0.2) == 6  # int(6.4)
    assert layout.partial_rank(128, 0.2) == 25
    assert layout.partial_rank(4, 0.1) == 1  # at least one channel


def test_ideal_fraction_is_the_papers_r_over_2_plus_budget_in_sparse_layers():
    sparse = kv_math.ideal_sparse_fraction("infinigen", budget=0.2, partial_ratio=0.2,
                                           speculation_keys="partial")
    assert sparse == pytest.approx(0.3)
    # 2 dense layers read everything, 4 sparse read 0.3 of theirs.
    assert kv_math.ideal_kv_fraction(6, 2, sparse) == pytest.approx((2 + 4 * 0.3) / 6)
    # gutenberg-llama-2k: 8 layers, the README's 0.475.
    assert kv_math.ideal_kv_fraction(8, 2, sparse) == pytest.approx(0.475)
    assert kv_math.ideal_kv_fraction(6, 6, sparse) == 1.0
    with pytest.raises(ValueError):
        kv_math.ideal_kv_fraction(6, 7, sparse)


def test_baseline_ideals_count_their_metadata():
    # Quest: min + max of the keys per 16-token page = 1/16 of K+V.
    assert kv_math.ideal_sparse_fraction("quest", 0.2, shape=SHAPE) == pytest.approx(0.2 + 1 / 16)
    # H2O: one float32 score per token and KV head against 2 * 32 * 4 bytes.
    assert kv_math.ideal_sparse_fraction("h2o", 0.2, shape=SHAPE) == pytest.approx(0.2 + 4 / 256)
    assert kv_math.ideal_sparse_fraction("streaming", 0.2, shape=SHAPE) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        kv_math.ideal_sparse_fraction("quest", 0.2)  # needs the shape
    with pytest.raises(ValueError):
        kv_math.metadata_bytes_per_token("snapkv", SHAPE)


def test_sparse_step_bytes_from_counters():
    # Batch 2, contexts 1000 and 3000, 4 sparse layers, 10 steps; every layer
    # selects 20% of 4000 context tokens per step.
    steps, sparse_layers, context = 10, 4, 4000
    selected_entries = 0.2 * context * SHAPE.kv_heads  # per layer per step
    counters = {
        "candidate_tokens": context * sparse_layers * steps,
        "selected_kv_bytes": selected_entries * 2 * 32 * 4 * sparse_layers * steps,
    }
    step = kv_math.sparse_step_bytes(SHAPE, 2, "infinigen", counters, steps,
                                     speculation_keys="partial")
    per_layer = context * SHAPE.kv_bytes_per_token_layer
    assert step.dense_equivalent == pytest.approx(6 * per_layer)
    assert step.dense_equivalent == pytest.approx(kv_math.dense_step_bytes(SHAPE, context))
    assert step.dense_layers == pytest.approx(2 * per_layer)
    assert step.metadata == pytest.approx(4 * context * 8 * 6 * 4)  # rank 6 partial keys
    assert step.pool_to_attention == pytest.approx(4 * 0.2 * per_layer)
    # (2 + 4 * (6/64 + 0.2)) / 6: the measured rank is 6 of 32 channels, not 6.4.
    assert step.fraction == pytest.approx((2 + 4 * (6 / 64 + 0.2)) / 6)
    assert step.fraction < kv_math.ideal_kv_fraction(6, 2, 0.3)


def test_int_keys_count_their_codes_and_scales():
    """The default int keys: head_dim x bits / 8 + 2 B per channel per 16 tokens."""
    assert kv_math.DEFAULT_KEYS == InfiniGenConfig.speculation_keys
    assert kv_math.speculation_key_bytes(SHAPE, 0.2, "int") == pytest.approx(32 * 4 / 8 + 32 * 2 / 16)
    bf16 = kv_math.ModelShape(layers=6, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert kv_math.speculation_key_bytes(bf16, 0.2, "int") == pytest.approx(
        128 * 2 / 8 + 128 * 2 / 16)
    assert kv_math.speculation_key_bytes(bf16, 0.2, "partial") == 25 * 2
    # Ideal of a sparse layer: 20 B of 256 B of K+V per KV head, plus the budget.
    assert kv_math.ideal_sparse_fraction("infinigen", 0.2, shape=SHAPE,
                                         speculation_keys="int") == pytest.approx(0.2 + 20 / 256)
    with pytest.raises(ValueError):  # the int keys' bytes need the shape
        kv_math.ideal_sparse_fraction("infinigen", 0.2, speculation_keys="int")
    counters = {"candidate_tokens": 4000.0, "selected_kv_bytes": 0.0}
    step = kv_math.sparse_step_bytes(SHAPE, 2, "infinigen", counters, 1,
                                     speculation_keys="int")
    assert step.metadata == pytest.approx(4000 * 8 * 20)  # every candidate's int keys


def test_decode_benchmark_engines_name_their_keys():
    assert decode_latency.speculation_keys("in-place") == kv_math.DEFAULT_KEYS
    assert decode_latency.speculation_keys("int-keys") == "int"
    assert decode_latency.speculation_keys("partial-keys") == "partial"
    assert decode_latency.speculation_keys("dense") == kv_math.DEFAULT_KEYS
    args = SimpleNamespace(budget=0.2, dense_layers=2, partial_ratio=0.2)
    assert decode_latency.infinigen_settings("int-keys", args)["speculation_keys"] == "int"
    assert decode_latency.infinigen_settings("partial-keys", args)["speculation_keys"] == "partial"
    assert "speculation_keys" not in decode_latency.infinigen_settings("in-place", args)
    # The partial ratio only where the keys are partial (the others refuse it).
    args.partial_ratio = 0.3
    assert decode_latency.infinigen_settings("partial-keys", args)["partial_ratio"] == 0.3
    for engine in ("int-keys", "in-place"):
        assert "partial_ratio" not in decode_latency.infinigen_settings(engine, args)


def test_streaming_reads_no_metadata_and_bad_inputs_fail():
    counters = {"candidate_tokens": 400.0, "selected_kv_bytes": 0.0}
    assert kv_math.sparse_step_bytes(SHAPE, 2, "streaming", counters, 1).metadata == 0
    with pytest.raises(ValueError):
        kv_math.sparse_step_bytes(SHAPE, 2, "streaming", counters, 0)
    with pytest.raises(ValueError):
        kv_math.sparse_step_bytes(SHAPE, 6, "streaming", counters, 1)


def test_counter_totals_and_delta():
    before = kv_math.counter_totals({"selected_kv_bytes": {"2": 10, "3": 5}})
    after = kv_math.counter_totals({"selected_kv_bytes": {"2": 30, "3": 5},
                                   "candidate_tokens": {"2": 7}})
    assert kv_math.counter_delta(before, after) == {"selected_kv_bytes": 20.0, "candidate_tokens": 7.0}


def test_kv_space_holds_the_tokens_for_each_manager():
    tokens = 1000
    dense = kv_math.kv_space_bytes(SHAPE, tokens, "vllm", margin=1.0)
    assert dense == tokens * 6 * 2048
    # InfiniGen, partial keys: 2 pages per block id + 4 sparse layers x 8 heads x
    # 6 channels x 4 B.
    infinigen = kv_math.kv_space_bytes(SHAPE, tokens, "infinigen", group_size=2, margin=1.0,
                                       speculation_keys="partial")
    assert infinigen == tokens * (2 * 2048 + 4 * 8 * 6 * 4)
    # The int keys: 32 channels x 4 bits + a float16 scale per channel and 16
    # tokens = 20 B per token and KV head.
    int_keys = kv_math.kv_space_bytes(SHAPE, tokens, "infinigen", group_size=2, margin=1.0,
                                      speculation_keys="int")
    assert int_keys == tokens * (2 * 2048 + 4 * 8 * 20)
    # Resident (device-first): a block id in each of the 3 groups of 2 layers.
    resident = kv_math.kv_space_bytes(SHAPE, tokens, "infinigen", group_size=2, margin=1.0,
                                      speculation_keys="int", resident=True)
    assert resident == tokens * (6 * 2048 + 4 * 8 * 20)
    assert kv_math.kv_space_bytes(SHAPE, tokens, "vllm") > dense  # margin
    with pytest.raises(ValueError):
        kv_math.kv_space_bytes(SHAPE, tokens, "lmcache")


def _metrics(**fields):
    base = dict(num_generation_tokens=5, first_token_latency=0.5, first_token_ts=100.0,
                last_token_ts=100.8, num_preemptions=1, arrival_time=1.7e9)
    return SimpleNamespace(**{**base, **fields})


def test_request_latency_uses_engine_stamps_for_tpot():
    latency = latency_stats.request_latency(_metrics())
    assert latency.ttft_s == 0.5
    assert latency.tpot_s == pytest.approx(0.2)  # 0.8 s over 4 tokens after the first
    assert latency.e2e_s == pytest.approx(1.3)
    assert latency.output_tokens == 5 and latency.preemptions == 1
    single = latency_stats.request_latency(_metrics(num_generation_tokens=1, last_token_ts=100.0))
    assert single.tpot_s is None and single.e2e_s == 0.5


def test_percentiles_interpolate_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert latency_stats.percentile(values, 0) == 1.0
    assert latency_stats.percentile(values, 50) == 2.5
    assert latency_stats.percentile(values, 100) == 4.0
    assert latency_stats.percentile(values, 90) == pytest.approx(3.7)
    assert latency_stats.percentile([7.0], 99) == 7.0
    assert math.isnan(latency_stats.percentile([], 50))
    with pytest.raises(ValueError):
        latency_stats.percentile(values, 101)


def test_latency_summary_throughput_and_tpot_skip_single_token_requests():
    latencies = [latency_stats.request_latency(_metrics()),
                 latency_stats.request_latency(_metrics(num_generation_tokens=1, last_token_ts=100.0,
                                                 first_token_latency=1.5))]
    summary = latency_stats.latency_summary(latencies, wall_s=2.0)
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
    assert latency_stats.metric_value(metrics, "vllm:num_preemptions") == 5.0
    assert latency_stats.metric_value(metrics, "vllm:absent") == 0.0


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


def test_cpu_meter_counts_our_time_and_never_negative_others():
    import time

    with machine.CpuMeter() as meter:
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
    assert meter.wall >= 0.2
    assert 0 < meter.own <= meter.wall * 1.5  # one busy thread (clock ticks are coarse)
    assert meter.busy is not None and meter.other_cores >= 0  # Linux: /proc/stat
    # Others' cores: machine busy time less ours, per wall second, clamped at 0
    # (the two clocks tick apart, so ours can exceed the machine's).
    meter.wall, meter.own = 2.0, 1.0
    for busy, others in ((3.0, 1.0), (1.0, 0.0), (0.5, 0.0), (None, None)):
        meter.busy = busy
        assert meter.other_cores == others


def test_wait_for_quiet_gives_up_at_the_timeout():
    import time

    start = time.monotonic()
    other = machine.wait_for_quiet(max_cores=-1.0, timeout_s=0.1, interval_s=0.05)  # never quiet
    assert 0.1 <= time.monotonic() - start < 2  # kept measuring until the timeout
    assert other is not None and other >= 0  # the last measurement (Linux: /proc/stat)


# -- decode sweep: models, presets, derived numbers ----------------------------------

def test_model_cache_names_keep_the_long_model_and_tell_the_gqa128_model_apart():
    assert models.model_cache_name(models.LONG_MODEL) == "llama-l6-h256-q8-kv8-p17408-s0"
    assert (models.model_cache_name(models.GQA128_MODEL)
            == "llama-l16-h512-q8-kv2-d128-i512-p17408-s0")
    # head_dim given but equal to hidden / heads, MLP 2 x hidden: the old name.
    assert models.model_cache_name({**models.LONG_MODEL, "head_dim": 32,
                                    "intermediate_size": 512}) == models.model_cache_name(
        models.LONG_MODEL)


def test_build_tiny_llama_head_dim_and_mlp_keywords(tmp_path):
    from benchmarks.harness.models import build_tiny_llama

    out = build_tiny_llama(tmp_path / "m", num_kv_heads=2, num_layers=1, num_heads=4,
                           hidden_size=64, head_dim=128, intermediate_size=32)
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["intermediate_size"]) == (128, 32)
    assert kv_math.model_shape(out) == kv_math.ModelShape(layers=1, kv_heads=2, head_dim=128)
    default = build_tiny_llama(tmp_path / "d", num_kv_heads=2, num_layers=1)
    config = json.loads((default / "config.json").read_text())
    assert (config["head_dim"], config["intermediate_size"]) == (32, 256)  # as before


def test_gqa128_preset_and_min_context_passthrough():
    args = decode_latency.parse_args(["--preset", "gqa128"])
    assert args.contexts == [256, 1024, 4096, 16384] and args.batch_sizes == [1, 4]
    assert args.engines == ["dense", "in-place"] and args.policies == ["infinigen"]
    assert args.out.name == "decode_latency_gqa128"
    assert args.model is None and args.model_spec == models.GQA128_MODEL
    assert args.min_context is None
    assert decode_latency.infinigen_settings("dense", args) is None
    assert "min_context" not in decode_latency.infinigen_settings("in-place", args)
    args = decode_latency.parse_args(["--min-context", "512", "--engines", "copy"])
    assert args.model_spec is None  # long preset: LONG_MODEL
    assert decode_latency.infinigen_settings("copy", args) == {
        "transfer": "copy", "budget": 0.2, "dense_layers": 2, "min_context": 512}


def test_gqa128_kv_space_for_16k_by_4():
    args = decode_latency.parse_args(["--preset", "gqa128"])
    shape = kv_math.ModelShape(layers=16, kv_heads=2, head_dim=128)
    _, max_tokens, tokens, kv_bytes = decode_latency.sizing("dense", shape, args)
    block = decode_windows.VLLM_BLOCK_TOKENS
    assert tokens == 4 * (16384 + max_tokens + 64 + block) + block
    assert kv_bytes == math.ceil(tokens * 16 * 2048 * 1.15)
    assert 2.0 * 2**30 < kv_bytes < 2.6 * 2**30


def test_fp8_kv_cache_halves_the_bf16_kv_space_and_reaches_the_engines(monkeypatch, tmp_path):
    """``--kv-cache-dtype fp8``: one byte a K/V element in the sizing and the KV bytes
    (the speculation keys stay in the model's dtype), and every engine gets the flag."""
    args = decode_latency.parse_args(["--preset", "gqa128", "--dtype", "bfloat16",
                                      "--contexts", "16384", "--batch-sizes", "1"])
    assert args.kv_cache_dtype == "auto"
    fp8 = decode_latency.parse_args(["--preset", "gqa128", "--dtype", "bfloat16",
                                     "--contexts", "16384", "--batch-sizes", "1",
                                     "--kv-cache-dtype", "fp8"])
    shapes = {}
    for name, run in (("auto", args), ("fp8", fp8)):
        shape = kv_math.ModelShape(layers=16, kv_heads=2, head_dim=128, dtype_bytes=2,
                                   kv_element_bytes=decode_windows.KV_CACHE_DTYPES[
                                       run.kv_cache_dtype])
        shapes[name] = (shape, decode_latency.sizing("dense", shape, run)[3],
                        decode_latency.sizing("in-place", shape, run)[3])
    assert shapes["fp8"][0].kv_bytes_per_token_layer * 2 == \
        shapes["auto"][0].kv_bytes_per_token_layer
    assert abs(shapes["fp8"][1] * 2 - shapes["auto"][1]) <= 2  # dense: K/V alone
    # InfiniGen: its dense layers' K/V halve, its speculation keys do not
    assert shapes["auto"][2] / 2 < shapes["fp8"][2] < shapes["auto"][2]
    taken = {}
    monkeypatch.setattr(decode_windows, "engine", lambda model, **kwargs: taken.update(kwargs))
    decode_windows.engine_of("in-place", tmp_path, fp8, 8, 1 << 20)
    assert taken["kv_cache_dtype"] == "fp8" and taken["dtype"] == "bfloat16"
    decode_windows.engine_of("dense", tmp_path, args, 8, 1 << 20)
    assert taken["kv_cache_dtype"] == "auto"


def _args(**overrides):
    base = dict(dense_layers=2, budget=0.2, partial_ratio=0.2, dtype="float32")
    return SimpleNamespace(**{**base, **overrides})


def test_measure_row_records_achieved_bandwidth():
    times = [0.010, 0.012, 0.011]  # median 11 ms
    dense = decode_latency.measure_row(
        engine_name="dense", policy=None, context=1000, batch=2, mean_context=1000.0,
        times=times, full=True, prefill_s=1.0, delta={}, shape=SHAPE, args=_args())
    assert dense["achieved_gb_s"] == pytest.approx(6 * 2048 * 2000 / 0.011 / 1e9)
    counters = {"candidate_tokens": 2000 * 4 * 3, "selected_kv_bytes": 3 * 1e6}
    sparse = decode_latency.measure_row(
        engine_name="in-place", policy="infinigen", context=1000, batch=2,
        mean_context=1000.0, times=times, full=True, prefill_s=1.0, delta=counters,
        shape=SHAPE, args=_args())
    assert sparse["achieved_gb_s"] == pytest.approx(sparse["kv_bytes_per_step"] / 0.011 / 1e9)
    assert decode_report.achieved_gb_s(sparse) == sparse["achieved_gb_s"]
    # Old rows without the field: from kv_bytes_per_step and decode_ms_per_step.
    assert decode_report.achieved_gb_s({"kv_bytes_per_step": 2e9, "decode_ms_per_step": 500}) \
        == pytest.approx(4.0)
    assert decode_report.achieved_gb_s({"kv_bytes_per_step": 2e9}) is None


def _row(config, context, batch, ms, fastest=None):
    return {"config": config, "context": context, "batch": batch, "decode_ms_per_step": ms,
            "decode_ms_per_step_min": ms if fastest is None else fastest}


def test_context_cost_is_long_minus_short_and_dense_over_config():
    rows = [_row("dense", 256, 1, 10.0), _row("dense", 4096, 1, 20.0),
            _row("dense", 16384, 1, 50.0, fastest=46.0),
            _row("infinigen", 256, 1, 14.0), _row("infinigen", 16384, 1, 30.0, fastest=22.0),
            _row("quest", 256, 1, 15.0), _row("quest", 16384, 1, 12.0),  # no growth
            _row("h2o", 256, 1, 15.0),  # no row at the longest context
            _row("dense", 256, 4, 12.0), _row("dense", 16384, 4, 112.0),
            _row("infinigen", 256, 4, 20.0), _row("infinigen", 16384, 4, 60.0)]
    cost = {(e["batch"], e["config"]): e for e in decode_report.context_cost(rows)}
    dense = cost[(1, "dense")]
    assert (dense["short_context"], dense["long_context"]) == (256, 16384)
    assert dense["context_ms"] == pytest.approx(40.0) and dense["dense_over_config"] is None
    assert dense["context_ms_per_1k"] == pytest.approx(40.0 * 1000 / (16384 - 256))
    assert cost[(1, "infinigen")]["context_ms"] == pytest.approx(16.0)
    assert cost[(1, "infinigen")]["dense_over_config"] == pytest.approx(2.5)
    assert math.isinf(cost[(1, "quest")]["dense_over_config"])
    assert cost[(1, "h2o")]["context_ms"] is None
    assert cost[(1, "h2o")]["dense_over_config"] is None
    assert cost[(4, "infinigen")]["dense_over_config"] == pytest.approx(100.0 / 40.0)
    fastest = {(e["batch"], e["config"]): e
               for e in decode_report.context_cost(rows, "decode_ms_per_step_min")}
    assert fastest[(1, "infinigen")]["dense_over_config"] == pytest.approx(36.0 / 8.0)
    # One context only: no cost.
    single = decode_report.context_cost([_row("dense", 256, 1, 10.0), _row("x", 256, 1, 9.0)])
    assert all(e["context_ms"] is None and e["dense_over_config"] is None for e in single)


def test_bytes_bound_is_the_fixed_step_plus_the_configs_bytes():
    """fixed = dense at the shortest context; its context cost scaled by the
    config's reads (dense's rate) and, given the limit, bytes at streaming."""
    def row(config, context, ms, reads=None, kv_bytes=None):
        return {**_row(config, context, 1, ms), "kv_read_vs_dense": reads,
                "kv_bytes_per_step": kv_bytes}

    rows = [row("dense", 256, 10.0, 1.0, 8e6), row("dense", 16384, 50.0, 1.0, 512e6),
            row("infinigen", 256, 12.0, 1.07, 8.5e6),
            row("infinigen", 16384, 30.0, 0.25, 128e6),
            row("old", 16384, 30.0)]  # a row without the bytes: left out
    (entry,) = decode_report.bytes_bound(rows, streaming_gb_s=16.0)
    assert (entry["batch"], entry["context"], entry["config"]) == (1, 16384, "infinigen")
    assert entry["fixed_ms"] == 10.0 and entry["dense_context_ms"] == pytest.approx(40.0)
    assert entry["bound_ms"] == pytest.approx(10.0 + 40.0 * 0.25)
    assert entry["bound_vs_dense"] == pytest.approx(20.0 / 50.0)
    assert entry["streaming_ms"] == pytest.approx(10.0 + 128e6 / 16e9 * 1e3)
    assert entry["streaming_vs_dense"] == pytest.approx(18.0 / 50.0)
    assert entry["measured_vs_dense"] == pytest.approx(0.6)
    assert entry["measured_vs_bound"] == pytest.approx(1.5)
    assert decode_report.bytes_bound(rows)[0]["streaming_ms"] is None  # no limit measured
    assert entry["bytes_vs_dense"] is None  # no weights given
    rows[3]["dense_kv_bytes_per_step"] = 512e6
    (weighed,) = decode_report.bytes_bound(rows, weight_bytes=100e6)
    assert weighed["bytes_vs_dense"] == pytest.approx((100e6 + 128e6) / (100e6 + 512e6))
    # One context, or no dense row: nothing to bound.
    assert decode_report.bytes_bound([row("dense", 256, 10.0, 1.0, 8e6),
                                      row("infinigen", 256, 12.0, 1.07, 8.5e6)]) == []
    assert decode_report.bytes_bound([r for r in rows if r["config"] != "dense"]) == []


def test_measure_bandwidth_returns_positive_rates():
    result = bandwidth.measure_bandwidth(mib=4, reps=2)
    for key in ("read_gb_s_1_thread", "read_gb_s_all_threads", "copy_gb_s_1_thread",
                "copy_gb_s_all_threads"):
        assert result[key] > 0
    assert result["threads"] >= 1 and (result["mib"], result["reps"]) == (4, 2)
    assert "GB/s" in decode_report.bandwidth_text(result)
    assert decode_report.bandwidth_text(None).startswith("n/a")
    with pytest.raises(ValueError):
        bandwidth.measure_bandwidth(mib=0)


def _old_decode_result(path):
    """A decode-latency result as the scripts wrote them before the kernels: no
    bandwidth measurement, no min_context setting, no achieved_gb_s in the rows."""
    def row(config, policy, context, ms, kv_bytes, dense_bytes, ideal):
        return {"config": config, "engine": "dense" if policy is None else "in-place",
                "policy": policy, "context": context, "batch": 1,
                "mean_context": context + 9.5, "decode_ms_per_step": ms,
                "decode_ms_per_step_mean": ms * 1.05, "decode_ms_per_step_min": ms * 0.95,
                "decode_ms_per_token": ms, "tokens_per_s": 1000 / ms, "steps": 16,
                "all_steps_full_batch": True, "step_ms": [ms] * 16, "prefill_s": 1.0,
                "dense_kv_bytes_per_step": dense_bytes, "kv_bytes_per_step": kv_bytes,
                "kv_read_vs_dense": kv_bytes / dense_bytes, "ideal_kv_read_vs_dense": ideal,
                "pool_bytes_per_step": 0.0 if policy is None else kv_bytes / 2,
                "other_cores_busy": 0.036, "attempts": 1}

    dense_16k = 201443328.0  # 6 layers x 8 KV heads x 32 x 2 x 4 B x 16393.5 tokens
    rows = [row("dense", None, 1024, 4.5, dense_16k / 16, dense_16k / 16, 1.0),
            row("dense", None, 16384, 16.237167499639327, dense_16k, dense_16k, 1.0),
            row("infinigen", "infinigen", 1024, 11.0, 0.5 * dense_16k / 16, dense_16k / 16,
                0.533),
            row("infinigen", "infinigen", 16384, 56.5, 0.455 * dense_16k, dense_16k, 0.533)]
    settings = {"preset": "long", "model": "/models/llama-l6-h256-q8-kv8-p17408-s0",
                "contexts": [1024, 16384], "batch_sizes": [1], "policies": ["infinigen"],
                "engines": ["dense", "in-place"], "budget": 0.2, "partial_ratio": 0.2,
                "dense_layers": 2, "decode_steps": 16, "warmup_steps": 2, "retries": 3,
                "contention_cores": 0.25, "quiet_wait": 20, "max_num_batched_tokens": 2048,
                "max_batch_tokens": 65536, "enforce_eager": False, "render": None,
                "out": "benchmarks/results/decode_latency_long", "model_default": True,
                "model_shape": {"layers": 6, "kv_heads": 8, "head_dim": 32, "dtype_bytes": 4}}
    meta = {"command": "python benchmarks/perf/decode_latency.py",
            "date_utc": "2026-11-22T10:15:35+00:00", "machine": "Linux", "cpus": 2,
            "repo_commit": "7778908e3d8fc09149a9d5b56499a87ab9068f6f", "wall_s": 900.0}
    path.write_text(json.dumps({"meta": meta, "settings": settings, "results": rows}))
    return path


def test_render_of_an_old_result_file_adds_the_new_tables(tmp_path, capsys):
    # Rendering a file elsewhere writes nothing under benchmarks/results/.
    guarded = [paths.RESULTS / f"decode_latency_long{suffix}" for suffix in (".json", ".md",
                                                                             ".png")]
    before = {p: p.read_bytes() if p.is_file() else None for p in guarded}
    path = _old_decode_result(tmp_path / "decode_latency_long.json")
    assert decode_latency.main(["--render", str(path)]) == 0
    assert {p: p.read_bytes() if p.is_file() else None for p in guarded} == before
    markdown = (tmp_path / "decode_latency_long.md").read_text()
    for heading in ("## Decode ms per step (batch TPOT)", "fastest step of each window",
                    "## Achieved GB/s (KV bytes read / step time)",
                    "## Context-dependent cost", "## What the bytes allow",
                    "## KV bytes read per decode step", "## Notes"):
        assert heading in markdown
    assert "Streaming limit of this machine: n/a" in markdown
    assert "min_context engine default" in markdown
    # dense 16384 x 1: 192 MiB-ish over 16.2 ms, from the old row's fields.
    data = json.loads(path.read_text())
    row = next(r for r in data["results"]
               if (r["config"], r["context"], r["batch"]) == ("dense", 16384, 1))
    expected = row["kv_bytes_per_step"] / row["decode_ms_per_step"] * 1000 / 1e9
    achieved = markdown.split("## Achieved GB/s")[1].split("\n## ")[0]
    line = next(li for li in achieved.splitlines() if li.startswith("| 16384 | 1 | "))
    assert line.split("|")[3].strip() == f"{expected:.2f}" == "12.41"  # context, batch, dense
    assert "Decode latency" in capsys.readouterr().out


def test_vllm_bench_files_get_the_provenance_of_their_txt(tmp_path):
    from benchmarks.perf import vllm_bench_report

    (tmp_path / "vllm_bench_latency_vllm.json").write_text(json.dumps({"avg_latency": 0.5}))
    (tmp_path / "vllm_bench_latency_vllm.txt").write_text(
        "# date (UTC): 2026-11-24T03:00:00+00:00\n# repository commit: abc123\n"
        "# machine: Linux 6.18 x86_64, 2 CPUs\n$ vllm bench latency --model m\n"
        "exit code: 0\nAvg latency: 0.5 seconds\n")
    meta = vllm_bench_report.stamp(tmp_path, "latency", "vllm")
    assert meta == {"date_utc": "2026-11-24T03:00:00+00:00", "repo_commit": "abc123",
                    "machine": "Linux 6.18 x86_64, 2 CPUs",
                    "command": "vllm bench latency --model m"}
    data = json.loads((tmp_path / "vllm_bench_latency_vllm.json").read_text())
    assert data["avg_latency"] == 0.5 and data["meta"]["repo_commit"] == "abc123"
    assert vllm_bench_report.stamp(tmp_path, "serve", "vllm") is None  # nothing written
    assert vllm_bench_report.exit_line(tmp_path, "vllm_bench_latency_vllm") == "exit code: 0"


def test_decode_benchmark_windows_at_each_alpha_for_infinigen_only():
    args = decode_latency.parse_args(["--preset", "gqa128"])
    assert args.alphas == ["default", "5"] and args.dtype == "float32"
    assert decode_latency.windows(["infinigen", "streaming"], ["default", "10000"]) == [
        ("infinigen", "default"), ("infinigen", "10000"), ("streaming", "default")]
    assert decode_latency.windows([None], ["default", "10000"]) == [(None, "default")]
    assert decode_latency.config_label("in-place", "infinigen", "10000") == \
        "infinigen, alpha 10000"
    assert decode_latency.config_label("copy", "infinigen") == "infinigen (copy)"
    assert decode_latency.config_label("in-place", "streaming", "10000") == "streaming"
    assert decode_latency.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.skipif("avx512_vnni" not in open("/proc/cpuinfo").read().split()
                    if os.path.exists("/proc/cpuinfo") else True,
                    reason="int_scoring_micro needs AVX-512 VNNI (avx512_vnni in /proc/cpuinfo)")
def test_the_int_scoring_micro_benchmark_builds_and_its_forms_agree(capfd):
    """The micro-benchmark behind benchmarks/README.md's int8 finding: it
    compiles against the product's header, and its VNNI form scores as the
    float form within the int8 rounding of the weights."""
    import re
    import shutil

    from benchmarks.perf import int_scoring_micro

    if shutil.which("g++") is None:
        pytest.skip("int_scoring_micro needs g++")
    assert int_scoring_micro.main(["--groups", "128"]) == 0
    out = capfd.readouterr().out
    for bits in (4, 2):
        diff, largest = map(float, re.search(
            rf"bits {bits}: max \|base - vnni\| (\S+) of max \|score\| (\S+)", out).groups())
        assert 0 < diff < 0.02 * largest
        assert len(re.findall(rf"bits {bits} .* ns per group", out)) == 3


@pytest.mark.parametrize("keys", ["bounds", "int"])
def test_the_select_micro_benchmark_times_the_products_kernels(keys):
    """select_micro calls the product's kernels on keys its write kernels
    wrote (a wrong shape fails their checks), and counts the bytes a call's
    keys hold: per token and KV head, the bounds' 16.1 B (2 x 128 codes and a
    float16 scale per 16 tokens), the 2-bit int keys' 48 B."""
    from benchmarks.perf import select_micro

    row = select_micro.time_calls(keys, context=512, batch=2, calls=3)
    assert 0 < row["min_us"] <= row["median_us"]
    per_token = {"bounds": (2 * 128 + 2) / 16, "int": 48}[keys]
    assert row["key_bytes"] == pytest.approx(2 * 512 * 2 * per_token)


def test_weight_bytes_are_the_weights_in_the_runs_dtype(tmp_path):
    """Floating tensors at the run's bytes per value, others as stored; read
    from the safetensors header alone."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16),
               "ids": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    assert kv_math.weight_bytes(tmp_path, 4) == (12 + 5) * 4 + 2 * 8
    assert kv_math.weight_bytes(tmp_path, 2) == (12 + 5) * 2 + 2 * 8
    assert kv_math.weight_bytes(tmp_path / "absent", 2) is None


def test_the_prefill_micro_benchmark_times_both_paths_and_they_agree(tmp_path):
    """``benchmarks/perf/prefill_micro``: both paths over the same capped pool (a third
    of the earlier entries evicted), a row per dtype and eviction, and the file."""
    from benchmarks.perf import prefill_micro

    out = tmp_path / "prefill_micro"
    assert prefill_micro.main(["--context", "300", "--rows", "100", "--rounds", "1",
                               "--dtypes", "float32", "--evict", "0", "0.3",
                               "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [row["evict"] for row in rows] == [0.0, 0.3]
    assert all(row["max_abs_difference"] < 1e-4 for row in rows)
    c = prefill_micro.case(300, 100, 2, 4, 128, 0.3, torch.float32)
    earlier = c["row_map"].transpose(1, 2).reshape(-1, 2)[:200]
    assert 0.2 < float((earlier < 0).float().mean()) < 0.4  # evicted, earlier entries only
    assert bool((c["row_map"].transpose(1, 2).reshape(-1, 2)[200:300] >= 0).all())
