# SPDX-License-Identifier: Apache-2.0
"""The soak benchmark's request mix and verdict (benchmarks/perf/soak.py)."""

from __future__ import annotations

from benchmarks.harness.request_mix import BAD_REQUESTS, random_mix
from benchmarks.perf import soak


def _burst(rss: int, errors: int = 0, idle: bool = True) -> dict:
    return {"rss_bytes": rss, "idle": idle,
            "results": {"errors": errors, "wrong_length": 0}}


def test_the_mix_has_seeds_cancellations_and_bad_requests():
    args = soak.parse_args(["--requests", "400"])
    args.seed = 0
    requests = random_mix(args)
    assert sum(r.seed is not None for r in requests) > 20
    assert all(r.sampled for r in requests if r.seed is not None)
    assert sum(r.cancel_after is not None for r in requests) > 20
    bad = {r.bad for r in requests if r.bad is not None}
    assert bad == set(BAD_REQUESTS)
    assert any(isinstance(r.prompt, str) for r in requests)
    assert any(isinstance(r.prompt, list) and len(r.prompt) > 128 for r in requests)


def test_verdict_fails_on_growth_errors_or_a_busy_server():
    base = {"bursts": [_burst(100), _burst(200), _burst(204)]}
    assert soak.verdict(base, 0.05) == (True, 0.02)
    assert not soak.verdict({"bursts": [_burst(100), _burst(200), _burst(220)]}, 0.05)[0]
    assert not soak.verdict({"bursts": [_burst(100), _burst(200, errors=1)]}, 0.05)[0]
    assert not soak.verdict({"bursts": [_burst(100), _burst(200, idle=False)]}, 0.05)[0]
