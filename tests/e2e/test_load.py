# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --kv-manager infinigen` under a burst of concurrent OpenAI requests.

One server (its worker on the CPU platform's data path, then on the CUDA
platform's on CPU tensors: ``cuda_path_worker.py``) takes the same burst twice (streaming and non-streaming
completions, token-id and text prompts, greedy and seeded n > 1 sampling,
streams cut off by the client mid-way), then every completed request once more
alone. Every finished request must get exactly ``max_tokens`` tokens per
choice, outputs must not depend on what else was in the batch, and once the
burst is over the server must be healthy with nothing held: no running
request, no pool bytes, no device blocks.
"""

from __future__ import annotations

import pytest
import requests

from benchmarks.harness.request_mix import IDLE_GAUGES, SENTENCE, burst, fixed_mix, wait_until_idle
from benchmarks.harness.servers import SERVED_NAME, metric_total, start_server, stop_server
from tests.e2e.cuda_path_worker import server_env

pytestmark = pytest.mark.slow
MAX_STEP_TOKENS = 16384  # > the burst's prompt tokens (<= 40 sequences x 301)


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def server(tmp_path_factory, request):
    """The server, its worker on the CPU platform's data path or on the CUDA
    platform's (``cuda_path_worker.py``: block cache, block rule, on CPU tensors)."""
    folder = tmp_path_factory.mktemp(f"load-{request.param}")
    env = server_env(folder) if request.param == "cuda" else None
    # A step holds every prompt of the burst: no prefill is split and nothing
    # is preempted, so outputs can be compared across runs (test_pressure.py
    # has the server short of everything).
    server = start_server(folder / "serve.log", "--kv-manager", "infinigen",
                          "--infinigen-budget", "0.2",
                          "--max-num-batched-tokens", str(MAX_STEP_TOKENS), env=env)
    server.data_path = request.param
    yield server
    assert stop_server(server) is not None, "vllm serve did not stop on SIGINT"


@pytest.fixture(scope="module")
def runs(server) -> dict:
    """Two concurrent bursts, then the uncancelled jobs one at a time; then
    /metrics once the server is idle (or after 15 s)."""
    jobs = fixed_mix()
    out: dict = {}
    for name in ("burst", "burst_again"):
        out[name] = burst(server.base_url, jobs)
    kept = [job for job in jobs if job.cancel_after is None]
    alone = iter(burst(server.base_url, kept, concurrency=1))
    out["alone"] = [None if job.cancel_after is not None else next(alone) for job in jobs]
    out["metrics"] = wait_until_idle(server.base_url, 15)
    return out


def completed(runs: dict, name: str):
    return [(job, outcome) for job, outcome in zip(fixed_mix(), runs[name])
            if job.cancel_after is None]


def test_the_mix_has_every_kind():
    jobs = fixed_mix()
    assert sum(job.cancel_after is not None for job in jobs) == 4
    assert {job.n for job in jobs} == {1, 2, 3}
    assert any(job.stream and job.seed is not None for job in jobs)
    assert any(isinstance(job.prompt, str) for job in jobs)
    assert max(len(job.prompt) for job in jobs if isinstance(job.prompt, list)) > 200


@pytest.mark.parametrize("name", ["burst", "burst_again", "alone"])
def test_every_completed_request_gets_max_tokens_per_choice(runs, name):
    for job, outcome in completed(runs, name):
        assert not outcome.cancelled
        assert sorted(outcome.tokens) == list(range(job.n))
        assert [len(ids) for ids in outcome.tokens.values()] == [job.max_tokens] * job.n
        assert outcome.completion_tokens == job.max_tokens * job.n


def test_cancelled_streams_stopped_early(runs):
    for name in ("burst", "burst_again"):
        for job, outcome in zip(fixed_mix(), runs[name]):
            if job.cancel_after is not None:
                assert outcome.cancelled
                assert len(outcome.tokens[0]) < job.max_tokens


def test_greedy_outputs_do_not_depend_on_the_batch(runs):
    for (job, batched), (_, alone) in zip(completed(runs, "burst"), completed(runs, "alone")):
        if job.seed is None:
            assert batched.tokens == alone.tokens


def test_same_seed_and_inputs_give_same_outputs(runs):
    pairs = zip(completed(runs, "burst"), completed(runs, "burst_again"),
                completed(runs, "alone"))
    sampled = 0
    for (job, first), (_, again), (_, alone) in pairs:
        assert first.tokens == again.tokens
        if job.seed is not None:
            sampled += 1
            assert first.tokens == alone.tokens
    assert sampled == 8


def test_seeded_choices_are_sampled(runs):
    """Sanity check on the seeded jobs: their n choices are not all the same."""
    distinct = [len({tuple(ids) for ids in outcome.tokens.values()}) > 1
                for job, outcome in completed(runs, "burst") if job.seed is not None]
    assert any(distinct)


def test_server_is_healthy_and_holds_nothing_after_the_burst(runs, server):
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
    text = runs["metrics"]
    assert {name: metric_total(text, name) for name in IDLE_GAUGES} == dict.fromkeys(
        IDLE_GAUGES, 0.0)
    assert metric_total(text, "vllm:infinigen_pool_capacity_bytes") > 0
    # The CUDA data path looked its selections up in its block cache (found
    # there when their prompt placed them, else fetched); the CPU's reads the
    # pool in place.
    looked_up = sum(metric_total(text, f"vllm:infinigen_cache_{name}_total") or 0
                    for name in ("hits", "misses"))
    assert looked_up > 0 if server.data_path == "cuda" else looked_up == 0


def test_cancelled_streams_were_aborted_in_the_engine(runs):
    """Had the server run them to their length, the cancelled jobs would have
    generated 150 tokens each."""
    delivered = sum(len(ids) for name in ("burst", "burst_again", "alone")
                    for _, outcome in completed(runs, name) for ids in outcome.tokens.values())
    generated = metric_total(runs["metrics"], "vllm:generation_tokens_total")
    num_cancelled = 2 * sum(job.cancel_after is not None for job in fixed_mix())
    assert num_cancelled <= generated - delivered < num_cancelled * 150


def test_server_still_serves_after_the_burst(runs, server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=SERVED_NAME, prompt=SENTENCE, max_tokens=8,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
