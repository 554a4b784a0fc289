# SPDX-License-Identifier: Apache-2.0
"""Dense while memory allows (``--infinigen-residency device-first``): the sparse
layers stay in vLLM's device blocks and kernel while they fit, and the engine
moves to the pool and InfiniGen's selection when a step's blocks would not.

The bundled stories260K (2 dense + 3 sparse layers, KV-cache groups of 2
layers: one dense group, two sparse ones; vLLM's CPU blocks of 128 tokens)
with the selection taking every token (``SELECT_ALL``): greedy output equals
stock vLLM's whether the engine stays resident, moves while admitting a
batch, moves in the middle of a request's decode, or returns while requests
over the pool are live (their K/V copied back from the pool). A resident request
holds its blocks in each of the 3 groups; a moved one in the dense group
alone. Each case runs with the CPU build's data path and with the CUDA
platform's (``cuda_path_worker.py``: its block cache, block rule and
device-planned decode steps on CPU tensors); the CUDA build's graphs of both
residencies: ``tests/unit/test_cuda_residency.py``.
"""

from __future__ import annotations

import pytest

import contextlib

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.cuda_path_worker import with_cuda_data_path
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

PROMPTS = random_prompts([300, 290, 280, 270], seed=31)
LONG = random_prompts([200], seed=32)  # 2 blocks per group; a 3rd at token 257
MAX_TOKENS = 40
# The long request beside four short ones of a block each: their prompts move the
# engine, and once they have finished it returns while the long one is still decoding.
MIXED = LONG + random_prompts([100, 110, 120, 105], seed=33)
MIXED_TOKENS = [100, 8, 8, 8, 8]
DEVICE_FIRST = {**SELECT_ALL, "infinigen_residency": "device-first"}
# KV space per block id: 2 dense pages of 128 tokens x 4 KV heads x 32 x K|V in
# float32 (256 KiB) + the bounds of 3 sparse layers x 4 KV heads x 8 units x 66 B
# (6,336 B) = 268,480 B.
BATCH_MOVES = 4_700_000  # 17 blocks
DECODE_MOVES = 2_300_000  # 8 blocks


@pytest.fixture(scope="module")
def stock(shared_engine) -> dict[str, list[list[int]]]:
    llm = shared_engine(BUNDLED_MODEL)
    return {"batch": greedy_tokens(llm, PROMPTS, MAX_TOKENS),
            "long": greedy_tokens(llm, LONG, 100),
            "mixed": greedy_tokens(llm, MIXED, MIXED_TOKENS)}


DATA_PATHS = pytest.mark.parametrize("data_path", ["cpu", "cuda"])


def _run(kv_bytes: int, prompts, max_tokens: int,
         data_path: str) -> tuple[list[list[int]], dict, float]:
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with worker, engine(str(BUNDLED_MODEL), kv_cache_memory_bytes=kv_bytes,
                        **DEVICE_FIRST) as llm:
        outputs = greedy_tokens(llm, prompts, max_tokens)
        metrics = llm.get_metrics()
    preemptions = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
    return outputs, summarize(metrics), preemptions


@DATA_PATHS
def test_a_resident_engine_attends_with_vllms_kernel_and_equals_stock(stock, data_path):
    outputs, counters, preemptions = _run(32 << 20, PROMPTS, MAX_TOKENS, data_path)
    assert outputs == stock["batch"]
    assert counters["resident"] == {"": 1.0}
    assert sum(counters.get("selected_tokens", {}).values()) == 0  # no InfiniGen step
    assert preemptions == 0


@DATA_PATHS
def test_a_batch_the_blocks_cannot_hold_resident_moves_and_equals_stock(stock, data_path):
    """17 blocks of KV space: one request resident (3 blocks in each of 3
    groups), the second's prompt moves the engine; once one of the two has
    finished, the other's blocks in the sparse groups fit in half the free ones
    and it comes back (its K/V copied from the pool), and so do the next."""
    outputs, counters, preemptions = _run(BATCH_MOVES, PROMPTS, MAX_TOKENS, data_path)
    assert outputs == stock["batch"]
    assert counters["residency_moves"] == {"pool": 1, "device": 1}
    assert counters["resident"] == {"": 1.0}
    assert sum(counters["selected_tokens"].values()) > 0  # InfiniGen after the move
    _check_data_path(counters, data_path)
    assert preemptions == 0


@DATA_PATHS
def test_a_request_that_outgrows_the_blocks_moves_mid_decode_and_equals_stock(stock, data_path):
    """8 blocks (7 free): the prompt's 2 blocks in each of the 3 groups fit,
    the 3rd block its decode needs at token 257 does not: the move is
    mid-decode, and the tokens after it are InfiniGen's over the pool (its 3
    blocks in each of the 2 sparse groups never fit in half the 4 free ones, so
    it stays there). Once it has finished, the next request (a block in each
    group) is resident again: the return after a lull."""
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with worker, engine(str(BUNDLED_MODEL), kv_cache_memory_bytes=DECODE_MOVES,
                        **DEVICE_FIRST) as llm:
        assert greedy_tokens(llm, LONG, 100) == stock["long"]
        moved = summarize(llm.get_metrics())
        assert greedy_tokens(llm, MIXED[1:2], 8) == stock["mixed"][1:2]
        back = summarize(llm.get_metrics())
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert moved["resident"] == {"": 0.0}
    assert moved["residency_moves"] == {"pool": 1, "device": 0}
    assert sum(moved["selected_tokens"].values()) > 0
    _check_data_path(moved, data_path)
    assert back["resident"] == {"": 1.0}
    assert back["residency_moves"] == {"pool": 1, "device": 1}
    assert back["selected_tokens"] == moved["selected_tokens"]  # none while resident
    assert preemptions == 0


def _check_data_path(counters: dict, data_path: str) -> None:
    """The CUDA data path's block cache filled from the pool after the move."""
    misses = sum(counters.get("cache_misses", {}).values())
    assert (misses > 0) == (data_path == "cuda")


@DATA_PATHS
def test_after_the_burst_the_next_request_is_resident_again_and_every_phase_equals_stock(
        stock, data_path):
    """17 blocks: the batch moves the engine and comes back before its end (as
    above); the lone request then runs resident (3 blocks in each of 3 groups),
    with vLLM's kernel (no InfiniGen step); the batch again moves it and brings it
    back again."""
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with worker, engine(str(BUNDLED_MODEL), kv_cache_memory_bytes=BATCH_MOVES,
                        **DEVICE_FIRST) as llm:
        assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == stock["batch"]
        moved = summarize(llm.get_metrics())
        assert greedy_tokens(llm, LONG, 100) == stock["long"]
        back = summarize(llm.get_metrics())
        assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == stock["batch"]
        again = summarize(llm.get_metrics())
    assert moved["resident"] == {"": 1.0}
    assert moved["residency_moves"] == {"pool": 1, "device": 1}
    assert back["resident"] == {"": 1.0}
    assert back["residency_moves"] == {"pool": 1, "device": 1}
    selected = [sum(c["selected_tokens"].values()) for c in (moved, back, again)]
    assert 0 < selected[0] == selected[1] < selected[2]  # none while resident
    assert again["resident"] == {"": 1.0}
    assert again["residency_moves"] == {"pool": 2, "device": 2}


@DATA_PATHS
def test_a_request_over_the_pool_comes_back_to_the_device_blocks_and_equals_stock(
        stock, data_path):
    """17 blocks (16 free): the long request (2 blocks in each of 3 groups) and
    three short ones (1 each) fit, the fourth moves the engine. Once the short
    ones have finished, the long one's blocks in the 2 sparse groups (2 each) fit
    in half the free blocks: it gets them back, its K/V is copied there from the
    pool, and it decodes its last tokens resident, with vLLM's kernel (its 3rd
    block at token 257 fits too). Its tokens equal stock vLLM's before, over and
    after the pool, which a missing or misplaced copy would break."""
    outputs, counters, preemptions = _run(BATCH_MOVES, MIXED, MIXED_TOKENS, data_path)
    assert outputs == stock["mixed"]
    assert counters["residency_moves"] == {"pool": 1, "device": 1}
    assert counters["resident"] == {"": 1.0}
    assert sum(counters["selected_tokens"].values()) > 0  # InfiniGen while over the pool
    assert preemptions == 0


def test_the_load_benchmark_stays_resident_only_where_the_engine_returns_under_load(tmp_path):
    """``benchmarks/perf/residency_load.py`` (its own process: it drives engines in
    it): after the burst's move, its steady arrivals never leave the engine idle, so
    only the return under load brings it back; its results name their command."""
    import json
    import subprocess
    import sys

    from benchmarks.harness.paths import REPO

    out = tmp_path / "residency_load"
    done = subprocess.run([sys.executable, "-m", "benchmarks.perf.residency_load",
                           "--steps", "60", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    under_load, lull = rows["return under load"], rows["after a lull only"]
    assert under_load["first_move"] is not None and lull["first_move"] is not None
    assert under_load["moves_to_device"] >= 1 and under_load["resident_after_move"] > 0
    assert lull["moves_to_device"] == 0 and lull["resident_after_move"] == 0
    assert under_load["requests"] == lull["requests"] == 8  # 6 in the burst, 2 after
    assert "- command: `python -m benchmarks.perf.residency_load --steps 60" in (
        out.with_suffix(".md").read_text())


# A 256-token prefix (2 blocks) shared by requests of 1 block of their own each.
SHARED = [{"prompt_token_ids": random_prompts([256], seed=34)[0]["prompt_token_ids"]
           + suffix["prompt_token_ids"][1:]}
          for suffix in random_prompts([21, 61, 101, 41, 81], seed=35)]
SHARED_TOKENS = [60, 8, 30, 8, 16]


@DATA_PATHS
def test_requests_sharing_a_prefix_through_a_move_and_a_return_equal_stock(
        shared_engine, data_path):
    """17 blocks, with vLLM's prefix caching: resident, the requests after the first
    share its 2 sparse blocks of the prefix in each group (a block of their own each),
    until the blocks run short and the engine moves (every sparse block freed and
    uncached, the dense ones still shared); once the short ones have finished, the
    others come back with their K/V copied from the pool; the same prompts again hit
    every cached block of theirs. Stock vLLM's tokens throughout."""
    stock_llm = shared_engine(BUNDLED_MODEL)
    stock_llm.reset_prefix_cache()
    stock = greedy_tokens(stock_llm, SHARED, SHARED_TOKENS)
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with worker, engine(str(BUNDLED_MODEL), kv_cache_memory_bytes=BATCH_MOVES,
                        **DEVICE_FIRST) as llm:
        first = greedy_tokens(llm, SHARED, SHARED_TOKENS)
        moved = summarize(llm.get_metrics())
        again = greedy_tokens(llm, SHARED, SHARED_TOKENS)
        counters = summarize(llm.get_metrics())
        hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    assert first == stock and again == stock
    assert moved["residency_moves"] == {"pool": 1, "device": 1}
    assert counters["residency_moves"] == {"pool": 2, "device": 2}
    assert counters["resident"] == {"": 1.0}
    assert hits == (2 * len(SHARED) - 1) * 256  # the prefix, then each whole prompt's blocks


def test_a_move_in_the_step_that_cached_a_prompts_sparse_blocks_leaves_none_to_hit():
    """Steps of 1,024 tokens, 17 blocks: a 300-token prompt's blocks are allocated and
    cached, then a 400-token prompt in the same step moves the engine, so that step
    runs over the pool and never writes them (the engine returns once the second has
    finished, the first's K/V copied into new blocks). The first prompt again is
    resident: its hit must not share the unwritten blocks (the move uncached them).
    Stock vLLM's tokens (without the move's uncaching, others)."""
    first, second = random_prompts([300, 400], seed=36)
    with engine(str(BUNDLED_MODEL), max_num_batched_tokens=1024) as llm:
        stock = greedy_tokens(llm, [first, second], [40, 8])
    with engine(str(BUNDLED_MODEL), max_num_batched_tokens=1024,
                kv_cache_memory_bytes=BATCH_MOVES, **DEVICE_FIRST) as llm:
        both = greedy_tokens(llm, [first, second], [40, 8])
        moved = summarize(llm.get_metrics())
        again = greedy_tokens(llm, [first], 40)
        counters = summarize(llm.get_metrics())
        hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    assert moved["residency_moves"]["pool"] == 1
    assert counters["residency_moves"]["pool"] == 1  # the hit resident, no new move
    assert counters["resident"] == {"": 1.0} and hits == 256
    assert both == stock and again == stock[:1]
