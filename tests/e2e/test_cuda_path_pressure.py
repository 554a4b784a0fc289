# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's data path under load, short of device blocks (issue 47).

``vllm serve`` whose worker runs ``CudaDataPath`` on CPU tensors
(``cuda_path_worker.py``: device block cache, block rule, decode steps
planned on the device; vLLM's CUDA build cannot run here) with
``--infinigen-residency device-first`` and a KV space of 6 blocks of 128
tokens. Three phases, each to idle: a burst of the soak's mix
(``request_mix.random_mix``: token-id and text prompts, streams and not,
greedy and sampled with n = 1..3, seeded ones, client cancellations, and
requests the server must refuse) moves the engine to the pool and preempts
(the dense group holds 768 tokens; steps of 64 tokens split the prefills);
a lone request finds the blocks free and runs resident again; the burst
again moves it again. A capped pool is refused on CUDA, so none here
(``test_pressure.py`` has the CPU path's).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import requests

from benchmarks.harness.request_mix import (
    IDLE_GAUGES,
    SENTENCE,
    burst,
    random_mix,
    wait_until_idle,
)
from benchmarks.harness.servers import SERVED_NAME, metric_total, start_server, stop_server
from tests.e2e.cuda_path_worker import server_env

pytestmark = pytest.mark.slow
KV_SPACE = 7 << 18  # 6 blocks of 128 tokens in every group (268,480 B a block id)
STEP_TOKENS = 64
MIX = SimpleNamespace(requests=32, seed=47, min_prompt=8, max_prompt=300, min_tokens=8,
                      max_tokens=40, cancel_fraction=0.1, sampled_fraction=0.3,
                      bad_fraction=0.1)


def moves(text: str) -> dict[str, float]:
    """``vllm:infinigen_residency_moves_total`` by destination."""
    found = re.findall(r'^vllm:infinigen_residency_moves_total\{[^}]*to="(\w+)"[^}]*\} (\S+)$',
                       text, re.M)
    return {to: float(value) for to, value in found}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-path-pressure")
    server = start_server(folder / "serve.log", "--kv-manager", "infinigen",
                          "--infinigen-budget", "0.2", "--infinigen-residency", "device-first",
                          "--kv-cache-memory-bytes", str(KV_SPACE),
                          "--max-num-batched-tokens", str(STEP_TOKENS),
                          env=server_env(folder))
    yield server
    assert stop_server(server) is not None, "vllm serve did not stop on SIGINT"


@pytest.fixture(scope="module")
def phases(server) -> dict:
    jobs = random_mix(MIX)
    out: dict = {"jobs": jobs}
    out["burst"] = burst(server.base_url, jobs, timeout=900)
    out["after_burst"] = wait_until_idle(server.base_url, 30)
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    lone = client.completions.create(model=SERVED_NAME, prompt=SENTENCE, max_tokens=16,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    out["lone_tokens"] = lone.usage.completion_tokens
    out["after_lone"] = wait_until_idle(server.base_url, 30)
    out["burst_again"] = burst(server.base_url, jobs, timeout=900)
    out["after_again"] = wait_until_idle(server.base_url, 30)
    return out


def test_the_mix_has_every_kind():
    jobs = random_mix(MIX)
    assert any(job.bad for job in jobs) and any(job.cancel_after for job in jobs)
    assert any(job.seed is not None for job in jobs) and {1, 2} <= {job.n for job in jobs}
    assert max(len(job.prompt) for job in jobs if isinstance(job.prompt, list)) > STEP_TOKENS


@pytest.mark.parametrize("name", ["burst", "burst_again"])
def test_every_request_completes_is_cancelled_or_refused(phases, name):
    for job, outcome in zip(phases["jobs"], phases[name]):
        if job.bad is not None:
            assert outcome.ended == "rejected", (job, outcome.error)
        elif job.cancel_after is not None:
            assert outcome.cancelled and len(outcome.tokens[0]) < job.max_tokens
        else:
            assert outcome.ended == "completed", (job, outcome.error)
            assert sorted(outcome.tokens) == list(range(job.n))
            assert [len(ids) for ids in outcome.tokens.values()] == [job.max_tokens] * job.n


def test_each_phase_ends_idle_holding_nothing(phases):
    for name in ("after_burst", "after_lone", "after_again"):
        text = phases[name]
        assert {gauge: metric_total(text, gauge) for gauge in IDLE_GAUGES} == dict.fromkeys(
            IDLE_GAUGES, 0.0), name


def test_the_burst_moves_preempts_and_the_lone_request_runs_resident_again(phases):
    """Counts at least: where every request over the pool has finished or been
    preempted in the middle of a burst, the next one admitted returns too."""
    burst_, lone, again = (moves(phases[name])
                           for name in ("after_burst", "after_lone", "after_again"))
    assert burst_["pool"] >= 1
    assert metric_total(phases["after_burst"], "vllm:num_preemptions_total") > 0
    assert metric_total(phases["after_burst"], "vllm:infinigen_cache_hits_total") > 0
    assert phases["lone_tokens"] == 16
    assert metric_total(phases["after_lone"], "vllm:infinigen_resident") == 1.0
    assert lone["device"] >= 1 and lone["pool"] == burst_["pool"]
    assert again["pool"] > lone["pool"] and again["device"] >= lone["device"]


def test_the_server_still_serves(phases, server):
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
    response = requests.post(f"{server.base_url}/v1/completions",
                             json={"model": SERVED_NAME, "prompt": SENTENCE, "max_tokens": 4,
                                   "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
