# SPDX-License-Identifier: Apache-2.0
"""Per-request latencies (TTFT, TPOT, end to end) from vLLM's ``RequestOutput`` metrics.

Unit-tested in ``tests/unit/test_perf_harness.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class RequestLatency:
    """One finished request, from ``RequestOutput.metrics`` (vLLM's RequestStateStats)."""

    ttft_s: float  # arrival (frontend, wall clock) to first token
    tpot_s: float | None  # mean time per output token after the first (None: 1 token)
    e2e_s: float  # arrival to last token
    output_tokens: int
    preemptions: int


def request_latency(metrics: Any) -> RequestLatency:
    """TTFT, TPOT and end-to-end latency of one request.

    ``first_token_latency`` is measured by the frontend from the arrival time;
    ``first_token_ts`` and ``last_token_ts`` are engine-core monotonic stamps,
    so TPOT uses their difference only: (last - first) / (tokens - 1).
    """
    tokens = int(metrics.num_generation_tokens)
    ttft = float(metrics.first_token_latency)
    decode = float(metrics.last_token_ts) - float(metrics.first_token_ts)
    return RequestLatency(
        ttft_s=ttft,
        tpot_s=decode / (tokens - 1) if tokens > 1 else None,
        e2e_s=ttft + decode,
        output_tokens=tokens,
        preemptions=int(getattr(metrics, "num_preemptions", 0)),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(latencies: Iterable[RequestLatency], wall_s: float) -> dict[str, float]:
    """Throughput and TTFT/TPOT/e2e mean, p50, p90, p99 over finished requests."""
    latencies = list(latencies)
    out: dict[str, float] = {
        "requests": len(latencies),
        "wall_s": wall_s,
        "requests_per_s": len(latencies) / wall_s if wall_s > 0 else math.nan,
        "output_tokens": sum(lat.output_tokens for lat in latencies),
        "request_preemptions": sum(lat.preemptions for lat in latencies),
    }
    out["output_tokens_per_s"] = out["output_tokens"] / wall_s if wall_s > 0 else math.nan
    series = {
        "ttft_s": [lat.ttft_s for lat in latencies],
        "tpot_s": [lat.tpot_s for lat in latencies if lat.tpot_s is not None],
        "e2e_s": [lat.e2e_s for lat in latencies],
    }
    for name, values in series.items():
        out[f"{name}_mean"] = sum(values) / len(values) if values else math.nan
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
    return out


def metric_value(metrics: Iterable[Any], name: str) -> float:
    """A counter or gauge of ``LLM.get_metrics()`` summed over its label sets (0 if absent)."""
    total = 0.0
    for metric in metrics:
        if getattr(metric, "name", None) == name and hasattr(metric, "value"):
            total += float(metric.value)
    return total
