# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --kv-manager infinigen` short of everything at once.

The burst of ``test_load.py`` (``request_mix.fixed_mix``: greedy and seeded
n > 1 sampling, streams and not, token-id and text prompts, client
cancellations) against a server whose
KV space holds 768 tokens, two or three of its requests (vLLM preempts), whose capped pool
holds 256 tokens per sparse layer and KV head, fewer than the longest request
alone (308 tokens), so every sparse layer evicts whatever the interleaving,
and whose steps take 64 tokens (most prefills, seeded ones included, are
split). Every request must complete or be cancelled, and the server must be
idle and hold nothing afterwards.
"""

from __future__ import annotations

import re

import pytest
import requests

from benchmarks.harness.request_mix import IDLE_GAUGES, SENTENCE, burst, fixed_mix, wait_until_idle
from benchmarks.harness.servers import SERVED_NAME, metric_total, start_server, stop_server

pytestmark = pytest.mark.slow
# stories260K: 3 sparse layers x 4 KV heads x K+V of 32 float32 = 3,072 B a token.
POOL_TOKENS = 256
POOL_GIB = POOL_TOKENS * 3 * 4 * 2 * 32 * 4 / 2**30
KV_SPACE = 7 << 18  # 1.75 MiB: 6 blocks of 128 tokens (dense layers + partial keys)
STEP_TOKENS = 64


def per_layer(text: str, name: str) -> dict[str, float]:
    """{layer: value} of a per-layer counter in /metrics (summed over other labels)."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        layer = re.search(r'layer="([^"]*)"', labels).group(1)
        out[layer] = out.get(layer, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("pressure") / "serve.log"
    server = start_server(log, "--kv-manager", "infinigen", "--infinigen-budget", "0.2",
                          "--infinigen-cpu-pool-gib", f"{POOL_GIB:.9f}",
                          "--kv-cache-memory-bytes", str(KV_SPACE),
                          "--max-num-batched-tokens", str(STEP_TOKENS))
    yield server
    assert stop_server(server) is not None, "vllm serve did not stop on SIGINT"


@pytest.fixture(scope="module")
def run(server) -> dict:
    jobs = fixed_mix()
    outcomes = burst(server.base_url, jobs, timeout=600)
    return {"jobs": jobs, "outcomes": outcomes, "metrics": wait_until_idle(server.base_url, 15)}


def test_the_burst_preempts_evicts_and_splits_seeded_prefills(run):
    # A request that completes holds more tokens than the pool: it must evict.
    assert max(len(job.prompt) + job.max_tokens for job in run["jobs"]
               if isinstance(job.prompt, list) and job.cancel_after is None) > POOL_TOKENS
    text = run["metrics"]
    assert metric_total(text, "vllm:num_preemptions_total") > 0
    evictions = per_layer(text, "vllm:infinigen_evictions_total")
    assert sorted(evictions) == ["2", "3", "4"]
    assert all(count > 0 for count in evictions.values()), evictions
    assert any(job.seed is not None and isinstance(job.prompt, list)
               and len(job.prompt) > STEP_TOKENS for job in run["jobs"])


def test_every_request_completes_or_is_cancelled(run):
    for job, outcome in zip(run["jobs"], run["outcomes"]):
        if job.cancel_after is not None:
            assert outcome.cancelled and len(outcome.tokens[0]) < job.max_tokens
            continue
        assert sorted(outcome.tokens) == list(range(job.n))
        assert [len(ids) for ids in outcome.tokens.values()] == [job.max_tokens] * job.n
        assert outcome.completion_tokens == job.max_tokens * job.n


def test_server_is_idle_holds_nothing_and_still_serves(run, server):
    text = run["metrics"]
    assert {name: metric_total(text, name) for name in IDLE_GAUGES} == dict.fromkeys(
        IDLE_GAUGES, 0.0)
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=SERVED_NAME, prompt=SENTENCE, max_tokens=8,
                                    temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
