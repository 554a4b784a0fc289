# SPDX-License-Identifier: Apache-2.0
"""With the device KV space fixed, InfiniGen runs >= 3x the 2K-token requests of stock vLLM.

Footprint per token of the 16-layer model below (fp32, 1 KV head of 32):
stock: 16 layers x K+V 256 B = 4,096 B. InfiniGen: vLLM keeps blocks for the
2 dense layers only (2 x 256 = 512 B) and the speculation keys of the 14 sparse
layers sit beside them (the bounds, the default: per 16 tokens each channel's
max and min as 8-bit codes, 2 x 32 B, and one fp16 scale = 66 B, 4.125 B per
token; 14 x 4.125 B = 57.75 B): 569.75 B, 7.2x less. A 2,048-token request is
16 blocks of 128 tokens: 8 MiB stock, 1.11 MiB InfiniGen.
With 36 MiB of KV space, stock holds 72 blocks (4 requests), InfiniGen 36 MiB x
512 / 569.75 = 32.4 MiB of blocks (517 blocks of 64 KiB: 32 requests).
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from benchmarks.harness import models
from tests.e2e.engines import engine, random_prompts

pytestmark = pytest.mark.slow
KV_SPACE = 36 << 20
PROMPT_TOKENS, OUTPUT_TOKENS = 1984, 64
NUM_REQUESTS = 12
STOCK_CAPACITY = 4  # 36 MiB / 8 MiB


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("deep") / "llama-16"
    return str(models.build_tiny_llama(out, num_kv_heads=1, num_layers=16, num_heads=2,
                                       hidden_size=64, max_positions=2304))


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def run_all(llm) -> dict:
    """Submits every request at once and steps the engine, watching the scheduler."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    engine_ = llm.llm_engine
    for idx, prompt in enumerate(random_prompts([PROMPT_TOKENS] * NUM_REQUESTS, seed=5)):
        engine_.add_request(str(idx), prompt, params)
    max_running, outputs = 0, {}
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                outputs[out.request_id] = len(out.outputs[0].token_ids)
        max_running = max(max_running, _metric(llm, "vllm:num_requests_running"))
    return {"max_running": max_running, "outputs": outputs,
            "preemptions": _metric(llm, "vllm:num_preemptions"),
            "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}


@pytest.fixture(scope="module")
def runs(deep_model) -> dict:
    common = dict(max_model_len=2048, kv_cache_memory_bytes=KV_SPACE,
                  max_num_batched_tokens=2048, max_num_seqs=NUM_REQUESTS)
    with engine(deep_model, **common) as llm:
        stock = run_all(llm)
    with engine(deep_model, kv_manager="infinigen", infinigen_budget=0.2, **common) as llm:
        ours = run_all(llm)
    return {"stock": stock, "infinigen": ours}


def test_block_counts_follow_the_footprint_arithmetic(runs):
    # Stock: 16 layers x 128 tokens x 256 B = 512 KiB per block id.
    assert runs["stock"]["num_blocks"] == KV_SPACE // (16 * 128 * 256)
    # InfiniGen: 2 dense pages (64 KiB) per block id, plus the bounds of 14
    # sparse layers for its 128 tokens (14 x 8 units x 66 B = 7,392 B).
    expected = KV_SPACE * 65536 // (65536 + 14 * 8 * 66) // 65536
    assert abs(runs["infinigen"]["num_blocks"] - expected) <= 1
    blocks_per_request = (PROMPT_TOKENS + OUTPUT_TOKENS) // 128
    assert runs["infinigen"]["num_blocks"] // blocks_per_request >= 3 * STOCK_CAPACITY


def test_stock_holds_only_n(runs):
    assert runs["stock"]["max_running"] <= STOCK_CAPACITY + 1
    assert len(runs["stock"]["outputs"]) == NUM_REQUESTS


def test_infinigen_runs_3n_at_once_without_preemption(runs):
    ours = runs["infinigen"]
    assert ours["max_running"] >= 3 * STOCK_CAPACITY
    assert ours["preemptions"] == 0
    assert ours["outputs"] == {str(i): OUTPUT_TOKENS for i in range(NUM_REQUESTS)}
