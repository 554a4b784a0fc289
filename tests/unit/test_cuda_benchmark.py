# SPDX-License-Identifier: Apache-2.0
"""The GPU benchmark on the CPU: its self-test, the trace file and its replay, no vLLM needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu import selection_trace

REPO = Path(__file__).resolve().parents[2]


def test_self_test_select_all_equals_dense_and_the_cache_changes_no_output():
    from benchmarks.gpu import checks

    result = checks.self_test(out=None)
    assert result["select_all"]["passed"], result["select_all"]
    # the data path's own check: the same attention kernel as dense_units, every block
    assert set(result["select_all"]["relative_l2_vs_dense_units"]) == {"full", "infinigen"}
    assert result["select_all"]["keys"] == "bounds"  # the product's default
    assert result["select_all_int_keys"]["passed"], result["select_all_int_keys"]
    assert result["select_all_partial_keys"]["passed"], result["select_all_partial_keys"]
    assert result["replay"]["passed"], result["replay"]
    assert 0 < result["replay"]["hit_rate"] < 1
    assert result["kernel_limits_rows"] == 8  # every kernel's row ran (timings: none on CPU)


def test_the_benchmark_drives_the_products_runtime_and_data_path():
    """InfiniGen in the benchmark is the product's runtime over ``CudaDataPath``
    (the variants module keeps only what is not the product)."""
    from benchmarks.gpu import product, variants
    from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
    from vllm_infinigen.worker.runtime import InfiniGenRuntime

    assert product.Product.__init__.__code__.co_names.count("InfiniGenRuntime") == 1
    assert product.Product.__init__.__code__.co_names.count("CudaDataPath") == 1
    assert product.InfiniGenRuntime is InfiniGenRuntime and product.CudaDataPath is CudaDataPath
    assert not {"InfiniGen", "DeviceBlockCache", "block_rule"} & set(vars(variants))


def test_the_recorded_traces_are_the_products_rule_on_the_4k_recall_model():
    """Every committed trace: recall-llama-12l-4k's selections at 4K with the
    product's defaults (bound keys, 1 sink block, 16 recent tokens: the own block
    and the one before it), each step keeping exactly the budget's blocks of the
    setting it names, with its provenance."""
    traces = selection_trace.recorded_traces()
    assert len(traces) >= 4
    fractions = []
    for path in traces:
        masks, provenance = selection_trace.load_trace(path)
        steps, layers, heads, max_blocks = masks.shape
        context = provenance["context_tokens"]
        assert provenance["model"] == selection_trace.TRACE_MODEL and provenance["keys"] == "bounds"
        assert (layers, heads, provenance["recent_tokens"]) == (10, 2, 16)
        assert context >= 4000 and max_blocks == (context + steps - 1) // 16 + 1
        assert provenance["command"] and provenance["repo_commit"] and provenance["date_utc"]
        assert path.stat().st_size < 64 * 1024
        budget, cap = provenance["budget"], provenance["token_cap"]
        assert provenance["selection_fraction"] == (budget if cap is None
                                                    else min(budget, cap / context))
        fractions.append(provenance["selection_fraction"])
        assert masks[:, :, :, 0].all()  # the sink block
        for step in range(steps):
            position = context + step
            own = position // 16
            assert masks[step, :, :, own - 1: own + 1].all()  # the recent window
            assert not masks[step, :, :, own + 1:].any()
            tokens = min(int(position * budget), cap or position)
            forced = 3  # sink, the block before the own one, the own one
            assert (masks[step].sum(axis=-1) == -(-tokens // 16) + forced).all()
    assert len(set(fractions)) == len(fractions)  # one trace per setting


def test_a_replay_takes_the_trace_recorded_at_the_smallest_fraction_it_can_thin(tmp_path):
    provenance = {"model": "m", "context_tokens": 4000}
    masks = np.ones((2, 1, 1, 4), bool)
    paths = [selection_trace.save_recorded(tmp_path, masks, provenance, budget=0.2, cap=cap,
                                           command="c")
             for cap in (None, 100, 400)]
    assert [p.name for p in paths] == ["m_budget0.2.json", "m_budget0.2_cap100.json",
                                       "m_budget0.2_cap400.json"]
    assert selection_trace.recorded_traces(tmp_path, "m") == sorted(paths)
    assert [selection_trace.selection_fraction(p) for p in paths] == [0.2, 0.025, 0.1]
    pick = lambda fraction: selection_trace.trace_for(fraction, paths).name  # noqa: E731
    assert pick(0.02) == pick(0.025) == "m_budget0.2_cap100.json"
    assert pick(0.03) == pick(0.1) == "m_budget0.2_cap400.json"
    assert pick(0.15) == pick(0.2) == pick(0.5) == "m_budget0.2.json"  # the widest
    with pytest.raises(ValueError, match="record_selections"):
        selection_trace.trace_for(0.1, [])
    # thinned by the recorded setting's fraction, not the blocks it kept
    assert selection_trace.per_block_for(masks, 32, 0.0125, recorded=0.025) == 4
    assert selection_trace.per_block_for(masks, 32, 0.025, recorded=0.025) == 8


def test_the_gpu_runs_checks_replay_the_traces_at_a_context_they_fit():
    """The decode-step run's graph check replays a trace at its small context: at
    2,048 tokens the 8B shape has 128 blocks, fewer than the 4K traces' 256, and
    the run stopped there (H200, 2026-11-29); the check's context now fits them."""
    import torch

    from benchmarks.gpu import checks
    from benchmarks.gpu.decoder import LLAMA_31_8B
    from benchmarks.gpu.measure import replay_for

    traces, cpu = selection_trace.recorded_traces(), torch.device("cpu")
    context = checks.check_context(LLAMA_31_8B, traces)
    assert context // LLAMA_31_8B.block_size >= selection_trace.recorded_blocks(traces)
    replay, info = replay_for(traces, LLAMA_31_8B, 2, context, 8, cpu, 0.2)
    assert info["trace"] == "recall-llama-12l-4k_budget0.2.json" and (replay >= 0).any()
    with pytest.raises(ValueError, match="shorter than the trace"):
        replay_for(traces, LLAMA_31_8B, 2, checks.CHECK_CONTEXT, 8, cpu, 0.2)


def test_packing_round_trips():
    masks = np.random.default_rng(0).random((3, 2, 2, 13)) < 0.3
    packed = selection_trace.pack_masks(masks)
    assert (selection_trace.unpack_masks(packed, list(masks.shape)) == masks).all()


def test_step_reuse_counts_blocks_selected_in_the_previous_step():
    masks = np.zeros((3, 1, 1, 6), bool)
    masks[0, 0, 0, [0, 1, 2]] = True
    masks[1, 0, 0, [0, 1, 4, 5]] = True  # 2 of 4 reused
    masks[2, 0, 0, [0, 4]] = True  # 2 of 2
    assert selection_trace.step_reuse(masks)[:, 0, 0].tolist() == [0.5, 1.0]
    skip = np.zeros((3, 6), bool)
    skip[:, 0] = True
    assert selection_trace.step_reuse(masks, skip)[:, 0, 0].tolist() == [1 / 3, 1.0]


def test_replay_scales_blocks_into_groups_and_adds_the_own_block():
    masks = np.zeros((3, 1, 1, 4), bool)
    masks[0, 0, 0, [0, 2]] = True
    masks[1, 0, 0, [0, 3]] = True
    masks[2, 0, 0, [1]] = True
    replay = selection_trace.replay_blocks(masks, num_layers=1, num_kv_heads=1, num_rows=1,
                                           context_blocks=13, num_steps=4)
    # group = 13 // 4 = 3; own block 13; steps 0, 1, 2, 1 (back and forth)
    assert replay[0, 0, 0, 0].tolist() == [0, 1, 2, 6, 7, 8, 13]
    assert replay[1, 0, 0, 0].tolist() == [0, 1, 2, 9, 10, 11, 13]
    assert replay[2, 0, 0, 0].tolist() == [3, 4, 5, 13, -1, -1, -1]
    assert replay[3, 0, 0, 0].tolist() == replay[1, 0, 0, 0].tolist()
    with pytest.raises(ValueError, match="shorter"):
        selection_trace.replay_blocks(masks, num_layers=1, num_kv_heads=1, num_rows=1,
                                      context_blocks=3, num_steps=1)


def test_a_thinned_replay_keeps_the_first_blocks_of_each_group_and_the_overlaps():
    """A token cap's replay: each kept recorded block becomes the first
    ``per_block`` blocks of its group, so a block kept in two steps replays
    the same blocks in both (the recorded reuse) at a smaller fraction."""
    masks = np.zeros((3, 1, 1, 4), bool)
    masks[0, 0, 0, [0, 2]] = True
    masks[1, 0, 0, [0, 3]] = True
    masks[2, 0, 0, [1]] = True
    replay = selection_trace.replay_blocks(masks, num_layers=1, num_kv_heads=1, num_rows=1,
                                           context_blocks=16, num_steps=3, per_block=2)
    # group = 16 // 4 = 4: block b -> 4b, 4b + 1; own block 16
    assert replay[0, 0, 0, 0].tolist() == [0, 1, 8, 9, 16]
    assert replay[1, 0, 0, 0].tolist() == [0, 1, 12, 13, 16]
    assert replay[2, 0, 0, 0].tolist() == [4, 5, 16, -1, -1]
    # recorded: 5 of 12 blocks kept; wanted 1/8 of 16 blocks per group of 4 -> 1 block
    assert selection_trace.kept_fraction(masks) == 5 / 12
    assert selection_trace.per_block_for(masks, 16, 5 / 12) == 4  # the whole group
    assert selection_trace.per_block_for(masks, 16, 5 / 24) == 2
    assert selection_trace.per_block_for(masks, 16, 1e-6) == 1  # at least one block
    assert selection_trace.per_block_for(masks, 16, 1.0) == 4  # at most the group
    for bad in (0, 5):
        with pytest.raises(ValueError, match="per_block"):
            selection_trace.replay_blocks(masks, num_layers=1, num_kv_heads=1, num_rows=1,
                                          context_blocks=16, num_steps=1, per_block=bad)


def test_replay_order_runs_back_and_forth():
    assert selection_trace.replay_order(3, 7, 0) == [0, 1, 2, 1, 0, 1, 2]
    assert selection_trace.replay_order(3, 3, 8) == [0, 1, 2]


def test_the_benchmark_imports_without_vllm():
    code = ("import sys\nsys.modules['vllm'] = None\n"
            "import benchmarks.gpu.decode_step, benchmarks.gpu.record_selections\n"
            "import benchmarks.gpu.checks, benchmarks.gpu.product\n"
            "import benchmarks.gpu.throughput, benchmarks.gpu.prefill\n"
            "import benchmarks.gpu.continue_recall, benchmarks.gpu.kernel_candidates\n"
            "import benchmarks.gpu.sass_mix\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr


def test_the_resident_variant_attends_densely_and_writes_through_to_the_pool():
    """``infinigen_resident`` (device-first before the move): dense's logits, its
    sparse layers' new K/V in the pool after a step, nothing fetched."""
    import torch

    from benchmarks.gpu.decoder import TINY, Decoder, random_weights
    from benchmarks.gpu.measure import build_variant, make_pool
    from benchmarks.gpu.variants import KVSetup, Streams

    torch.manual_seed(0)
    device, dtype = torch.device("cpu"), torch.float32
    layers, lm_head = random_weights(TINY, device, dtype)
    batch, context = 2, 8 * TINY.block_size + 5
    pool, _ = make_pool(TINY, TINY.num_layers * TINY.layer_kv_bytes(batch, context, dtype),
                        device, dtype)
    setup, streams = KVSetup(TINY, batch, context, pool, device), Streams(device)
    decoder = Decoder(TINY, layers, lm_head)
    x = torch.randn(batch, TINY.hidden)
    dense = decoder.step(x, build_variant("dense", setup, streams, layers, budget=0.2,
                                          replay=None, cache_factor=1.0))
    resident = build_variant("infinigen_resident", setup, streams, layers, budget=0.2,
                             replay=None, cache_factor=1.0)
    sparse = resident.runtime.sparse_layers[0]
    slot = resident.slot_mapping[0]
    block, offset = int(slot) // TINY.block_size, int(slot) % TINY.block_size
    sparse.kv_pool[block, :, offset].zero_()
    assert torch.equal(decoder.step(x, resident), dense)
    assert sparse.kv_pool[block, :, offset].abs().sum() > 0  # written through
    assert resident.runtime.resident and resident.take_fetched_units() == (0, 0)


def test_the_profile_adds_device_time_by_kernel_and_the_report_shows_it():
    """``--profile`` on a GPU: device kernel events summed per name, per step (CPU
    events left out), the largest first; the Markdown lists them per InfiniGen step."""
    from types import SimpleNamespace

    from benchmarks.gpu.measure import _device_kernels
    from benchmarks.gpu.report import kernel_breakdown

    def event(name, us, device):
        return SimpleNamespace(name=name, device_time_total=us, device_type=device)

    prof = SimpleNamespace(events=lambda: [
        event("_int_scores", 300.0, "DeviceType.CUDA"), event("gemv", 100.0, "DeviceType.CUDA"),
        event("_int_scores", 300.0, "DeviceType.CUDA"), event("aten::mm", 5e3, "DeviceType.CPU")])
    got = _device_kernels(prof, steps=2)
    assert got["device_ms_per_step"] == 0.35
    assert got["top_kernels"] == [
        {"kernel": "_int_scores", "ms_per_step": 0.3, "calls_per_step": 1.0},
        {"kernel": "gemv", "ms_per_step": 0.05, "calls_per_step": 0.5}]
    configs = [{"context": 32768, "batch": 8, "variants": {
        "dense (graph)": {"ms_per_step": 14.0},
        "infinigen (graph)": {"ms_per_step": 35.7, **got}}}]
    text = kernel_breakdown(configs)
    assert "32K x 8, infinigen (graph): 0.35 ms of kernels" in text and "| _int_scores |" in text
    assert "Streams per step" not in text  # a profile without streams (before issue 44)
    streams = [{"stream": 7, "gather": False, "busy_ms_per_step": 30.0, "idle_ms_per_step": 5.7},
               {"stream": 9, "gather": True, "busy_ms_per_step": 9.1, "idle_ms_per_step": 26.6}]
    configs[0]["variants"]["infinigen (graph)"]["streams"] = streams
    assert ("Streams per step: stream 7 busy 30.00 ms, idle 5.70 ms; stream 9 (gather) busy "
            "9.10 ms, idle 26.60 ms.") in kernel_breakdown(configs)
    assert kernel_breakdown([{"context": 32768, "batch": 1, "variants": {
        "infinigen (eager)": {"ms_per_step": 50.0}}}]) == ""


def test_kernel_candidates_self_test_checks_every_form_against_its_reference(tmp_path):
    """``kernel_candidates --self-test``: every scoring form (int keys and bounds),
    both block searches, the placement's victims' searches and the attention's
    launch forms run in Triton's interpreter and agree with the references (its
    exit status); the results name their command and commit."""
    out = tmp_path / "candidates"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.kernel_candidates",
                           "--self-test", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = out.with_suffix(".md").read_text()
    assert "- command: `python -m benchmarks.gpu.kernel_candidates --self-test" in text
    assert "repository commit:" in text
    forms = [line for line in text.splitlines() if line.startswith("| int_scores")]
    assert len(forms) == 24 and all("| True |" in line for line in forms)
    selects = [line for line in text.splitlines() if line.startswith("| select")]
    assert len(selects) == 16 and all("| True |" in line for line in selects)
    bounds = [line for line in text.splitlines() if line.startswith("| bound_scores")]
    assert len(bounds) == 18 and all("| True |" in line for line in bounds)
    assert sum("| dot, tile" in line for line in bounds) == 14
    # lookup: 7 forms at 2 ticks; attend: 7 forms at 2 batches
    for kernel, count in (("lookup", 14), ("attend", 14)):
        rows = [line for line in text.splitlines() if line.startswith(f"| {kernel} |")]
        assert len(rows) == count and all("| True |" in line for line in rows), kernel
    attends = [line for line in text.splitlines() if line.startswith("| attend |")]
    assert sum("merged by a second launch" in line for line in attends) == 4


def test_the_recorded_bound_scores_rank_the_block_the_query_points_at():
    """``record_selections``' bound keys: each complete block scores an upper
    bound of its best q . k (at least the exact best, within the codes'
    rounding), the open block -inf, and the block holding a key aligned with
    the query ranks first."""
    from benchmarks.gpu.record_selections import bound_block_scores

    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    heads, context, dim = 2, 16 * 5 + 7, 32
    keys = torch.randn(heads, context, dim, generator=generator) * 0.1
    query = torch.randn(1, heads, 2, dim, generator=generator)
    keys[0, 2 * 16 + 5] = 3 * query[0, 0, 0]  # head 0: block 2
    keys[1, 4 * 16 + 9] = 3 * query[0, 1, 1]  # head 1: block 4
    scores = bound_block_scores(query, keys, 16)
    assert scores.shape == (1, heads, 6)
    assert scores[0, :, 5].eq(float("-inf")).all()  # the open block
    assert scores[0, 0].argmax() == 2 and scores[0, 1].argmax() == 4
    exact = torch.einsum("hgd,htd->hgt", query[0], keys[:, : 5 * 16]) / dim ** 0.5
    best = exact.view(heads, 2, 5, 16).amax(dim=(1, 3))
    assert (scores[0, :, :5] >= best - 1e-3 * best.abs().amax()).all()


def test_the_sass_mix_counts_the_conversions_each_bound_form_issues():
    """``sass_mix``: the bound scoring compiled for sm_90 on the CPU. The tensor-core form
    widens its codes without a quarter-rate conversion (I2F / F2F), so at 64 units a tile
    it issues fewer instructions per byte than the float32 sums (at their default 32) and
    its issue ceiling passes the H200's streaming read; the sums' stays below half of it."""
    pytest.importorskip("triton")
    from benchmarks.gpu import sass_mix

    try:
        sass_mix._nvdisasm()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    sums, dot = sass_mix.form_row("sums", 8, 32), sass_mix.form_row("dot", 8, 64)
    assert dot["mix"]["I2F"] == dot["mix"]["F2F"] == dot["conversion_cycles"] == 0
    assert dot["mix"]["HGMMA"] > 0 and sums["mix"]["HGMMA"] == 0
    assert dot["instructions_per_byte"] < sums["instructions_per_byte"] / 1.5
    assert dot["ceiling_TBps"] > sass_mix.STREAMING_TBPS > 2 * sums["ceiling_TBps"]


def test_record_selections_takes_a_recall_model_of_the_project(tmp_path):
    """``--recall-model`` / ``--recall-prompts``: the reuse of a model this project
    trained (the committed checkpoint) under its folder's name, from a prompts file."""
    from benchmarks.gpu import record_selections
    from tests.shared_data import require_shared

    prompts = require_shared("data/recall/recall-1k.jsonl")
    model = REPO / "benchmarks" / "models" / "recall-llama-12l-toward-16k"
    out = tmp_path / "reuse"
    assert record_selections.main([
        "--recall-model", str(model), "--recall-prompts", str(prompts), "--context", "256",
        "--steps", "4", "--budgets", "0.2", "--trace-model", "none", "--out", str(out)]) == 0
    import json

    saved = json.loads(out.with_suffix(".json").read_text())
    assert list(saved["results"]) == [model.name]
    assert saved["settings"][model.name]["model"] == model.name
    with pytest.raises(SystemExit):
        record_selections.main(["--recall-prompts", str(prompts)])


def test_record_selections_reads_gzipped_prompts_and_interpolated_positions(tmp_path,
                                                                            monkeypatch):
    """The committed 8K prompts (``benchmarks/data``, gzipped) as the request, the model
    read with ``--rope-linear-factor`` (named in the trace's provenance, which the GPU
    benchmarks' results quote); the factor needs ``--recall-model``."""
    import json

    from benchmarks.gpu import record_selections, selection_trace

    prompts = REPO / "benchmarks" / "data" / "recall-8192.jsonl.gz"
    model = REPO / "benchmarks" / "models" / "recall-llama-12l-toward-16k"
    out, traces = tmp_path / "reuse", tmp_path / "traces"
    from transformers import AutoModelForCausalLM

    loaded, load = [], AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        loaded.append(kwargs["config"].rope_parameters)
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    assert record_selections.main([
        "--recall-model", str(model), "--recall-prompts", str(prompts), "--context", "256",
        "--steps", "4", "--budgets", "0.2", "--rope-linear-factor", "2", "--trace-model",
        model.name, "--trace-dir", str(traces), "--out", str(out)]) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["settings"][model.name]["rope_linear_factor"] == 2.0
    assert loaded == [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}]
    [trace] = selection_trace.recorded_traces(traces, model.name)
    masks, provenance = selection_trace.load_trace(trace)
    assert provenance["rope_linear_factor"] == 2.0 and provenance["context_tokens"] == 256
    assert masks.shape[0] == 4 and masks.any()
    with pytest.raises(SystemExit):
        record_selections.main(["--rope-linear-factor", "2"])
    with pytest.raises(SystemExit):  # named as a shared model: its results would be replaced
        record_selections.main(["--recall-model", str(tmp_path / "recall-llama-12l-4k"),
                                "--recall-prompts", str(prompts)])
