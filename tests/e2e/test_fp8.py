# SPDX-License-Identifier: Apache-2.0
"""``--kv-cache-dtype fp8`` (``fp8_e4m3``, ``fp8_e5m2``) with InfiniGen on the
CPU build: the dense layers in vLLM's FP8 pages, the sparse layers' pool in
the same format (K / k_scale, V / v_scale, rounded in the kernels' write),
their attention widening it inside the kernels.

With everything selected the greedy output equals stock vLLM's in the same
format, with an uncapped pool, a capped one that holds the working set, and
``device-first`` moving to the pool in the middle of a batch; on the CPU
platform's data path and on the CUDA platform's (``cuda_path_worker.py``:
its FP8 pool and device block cache, on CPU tensors). Stock vLLM's
FP8 attention needs AVX-512 or AMX: on every host both sides run vLLM's
attention through ``fp8_attention.py``'s double (what it is and is not:
that module's docstring), rounding as vLLM's CPU build does (toward zero) or,
beside the CUDA platform's data path, as its CUDA build does (to nearest); on a
host with vLLM's own FP8 kernel select-all is compared with it too.
"""

from __future__ import annotations

import contextlib

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL
from benchmarks.harness import fp8_attention
from tests.e2e.cuda_path_worker import with_cuda_data_path
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([3, 40, 150, 333], seed=41)
MAX_TOKENS = 40
# llama-gqa: 2 sparse layers x 2 KV heads x K|V of 32 channels, one byte each.
POOL_TOKEN_BYTES = 2 * 2 * 2 * 32
# Holds the 526 prompt and 160 generated tokens of PROMPTS.
FITTING_POOL_GIB = 1024 * POOL_TOKEN_BYTES / 2**30
# stories260K device-first (tests/e2e/test_residency.py's batch), its pages in
# FP8: 2 dense pages of 128 tokens x 4 KV heads x 32 x K|V x 1 B (65,536 B) +
# the bounds of 3 sparse layers x 4 KV heads x 8 units x 66 B (6,336 B) per
# block id: 17 blocks, fewer than the batch needs.
BURST = random_prompts([300, 290, 280, 270], seed=31)
BURST_MOVES = 17 * (65_536 + 6_336) + 20_000


def _pages(data_path: str):
    """vLLM's FP8 pages as the data path's platform writes them (the double)."""
    return fp8_attention.emulated("nearest" if data_path == "cuda" else "toward-zero")


def _pool_formats(worker) -> list[str]:
    """The dtype of each sparse layer's pool (run in the worker)."""
    return sorted({str(state.kv_pool.dtype) for state in worker.infinigen_runtime.sparse_layers})


def _data_path(worker) -> str:
    return type(worker.infinigen_runtime.data_path).__name__


def _first_logprobs(llm, prompts) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [next(iter(out.outputs[0].logprobs[0].values())).logprob for out in outputs]


def _select_all_runs(model: str, fmt: str, runs: dict, stock, stock_logprobs) -> None:
    """Select-all engines of ``runs`` (name: settings) against the stock tokens and
    first logprobs, each on the data path its name says."""
    for name, settings in runs.items():
        worker = with_cuda_data_path() if name == "CUDA data path" else contextlib.nullcontext()
        with worker, engine(model, kv_cache_dtype=fmt, **SELECT_ALL, **settings) as llm:
            assert llm.collective_rpc(_pool_formats) == [
                [str(fp8_attention.FORMATS[fmt])]], name
            assert llm.collective_rpc(_data_path) == [
                "CudaDataPath" if name == "CUDA data path" else "CpuDataPath"], name
            assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == stock, name
            ours_logprobs = _first_logprobs(llm, PROMPTS)
            counters = summarize(llm.get_metrics())
        assert sum(counters["selected_tokens"].values()) > 0, name
        assert ours_logprobs == pytest.approx(stock_logprobs, abs=1e-4), name


def _stock(model: str, fmt: str) -> tuple[list, list[float]]:
    with engine(model, kv_cache_dtype=fmt) as llm:
        return greedy_tokens(llm, PROMPTS, MAX_TOKENS), _first_logprobs(llm, PROMPTS)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_select_all_equals_stock_in_fp8(fmt, tiny_models, shared_engine):
    model = tiny_models["llama-gqa"]
    unquantized = _first_logprobs(shared_engine(model), PROMPTS)
    with _pages("cpu"):
        stock, stock_logprobs = _stock(model, fmt)
        runs = {"uncapped": {}}
        if fmt == "fp8":
            runs["capped, holding everything"] = {"infinigen_cpu_pool_gib": FITTING_POOL_GIB}
        _select_all_runs(model, fmt, runs, stock, stock_logprobs)
    with _pages("cuda"):
        nearest, nearest_logprobs = _stock(model, fmt)
        _select_all_runs(model, fmt, {"CUDA data path": {}}, nearest, nearest_logprobs)
    # FP8 took effect: the 333-token prompt's first logprob moved (the K/V rounded),
    # and the two roundings differ.
    assert stock_logprobs != pytest.approx(unquantized, abs=1e-6)
    assert stock_logprobs != pytest.approx(nearest_logprobs, abs=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_select_all_equals_stock_with_vllms_own_fp8_kernel(fmt, tiny_models):
    """No double: the dense layers and stock vLLM on vLLM's CPU FP8 kernel (before
    the pool rounded toward zero as vLLM's pages do, every prompt's first logprob
    differed, by up to 0.21)."""
    if not fp8_attention.native():
        pytest.skip("this host's vLLM has no CPU FP8 kernel (it needs AVX-512 or AMX): "
                    "select-all is compared with the double only")
    model = tiny_models["llama-gqa"]
    stock, stock_logprobs = _stock(model, fmt)
    runs = {"uncapped": {}, "capped, holding everything": {
        "infinigen_cpu_pool_gib": FITTING_POOL_GIB}}
    _select_all_runs(model, fmt, runs, stock, stock_logprobs)


@pytest.mark.parametrize("data_path", ["cpu", "cuda"])
def test_device_first_moves_in_fp8_and_equals_stock(data_path):
    """The residency switch with FP8 pages on both sides of the move, and back:
    the last request over the pool returns to the device blocks, its FP8 K/V
    read from the pool and written by vLLM's own update (scales of 1.0 here: the
    scaling itself, tests/unit/test_restore.py)."""
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with _pages(data_path), engine(str(BUNDLED_MODEL), kv_cache_dtype="fp8") as llm:
        stock = greedy_tokens(llm, BURST, MAX_TOKENS)
    with _pages(data_path), worker, engine(str(BUNDLED_MODEL), kv_cache_dtype="fp8",
                        kv_cache_memory_bytes=BURST_MOVES, infinigen_residency="device-first",
                        **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, BURST, MAX_TOKENS)
        metrics = llm.get_metrics()
    moves = [m for m in metrics if m.name == "vllm:infinigen_residency_moves"]
    assert sum(m.value for m in moves if m.labels.get("to") == "pool") >= 1
    assert sum(m.value for m in moves if m.labels.get("to") == "device") >= 1
    assert ours == stock
