# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the performance harnesses (benchmarks/perf/).

- KV bytes per decode step: what dense attention reads, what InfiniGen and the
  baselines read (selection metadata + the selected K/V, from the
  ``vllm:infinigen_*`` counters), and the ideal fractions they aim at.
- Per-request latencies (TTFT, TPOT, end to end) from vLLM's ``RequestOutput``
  metrics, and percentiles.
- The long-context benchmark models (random tiny Llamas built with
  ``tests/models.build_tiny_llama``, cached beside the skew files in
  ``~/.cache/vllm_infinigen/bench-models``, ``VLLM_INFINIGEN_CACHE``),
  engine start/stop and progress lines.

Everything above the engine helpers is plain arithmetic and is unit-tested in
``tests/unit/test_perf_harness.py``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # imported from a script: make `benchmarks`/`tests` importable
    sys.path.append(str(Path(__file__).resolve().parents[2]))

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
MODEL_CACHE = Path(os.environ.get(
    "VLLM_INFINIGEN_CACHE", Path.home() / ".cache" / "vllm_infinigen")) / "bench-models"
SHARED = Path(os.environ.get("VLLM_INFINIGEN_SHARED", REPO.parent / "shared"))
BUNDLED_MODEL = REPO / "vllm_infinigen" / "assets" / "stories260k"
GUTENBERG = SHARED / "models" / "gutenberg-llama-2k"

POLICIES = ("infinigen", "h2o", "streaming", "quest")
# Quest's page size and H2O's per-token state, as in vllm_infinigen/baselines.py
# and runtime.py (page min/max of the keys; one float32 score per token and KV head).
QUEST_PAGE_SIZE = 16
H2O_SCORE_BYTES = 4

# The long-context model of the decode sweep: few layers, wide enough that
# attention (context x 8 KV heads x 32) dominates the weights (~2.6 MB per
# layer) from a few thousand tokens on; positions for 16K + decode steps.
LONG_MODEL = {"num_layers": 6, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 8,
              "max_positions": 16384 + 1024, "seed": 0}
# A realistic attention shape (head_dim 128, GQA 4:1, 16 layers) with small
# weights (~8 MB per layer): attention-bound from a few thousand tokens on.
GQA128_MODEL = {"num_layers": 16, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
                "head_dim": 128, "intermediate_size": 512, "max_positions": 16384 + 1024,
                "seed": 0}


# -- model shape and KV bytes ---------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the KV arithmetic needs from a model's config."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4  # the benchmarks run float32 on CPU

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K + V of one token in one layer, all KV heads."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def model_shape(model_dir: Path, dtype_bytes: int = 4) -> ModelShape:
    """The shape of the Hugging Face model in ``model_dir`` (config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return ModelShape(
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        dtype_bytes=dtype_bytes,
    )


def partial_rank(head_dim: int, partial_ratio: float) -> int:
    """Channels of the partial keys (the paper's r * d, at least one; as the runtime)."""
    return max(1, int(head_dim * partial_ratio))


def metadata_bytes_per_token(policy: str, shape: ModelShape, partial_ratio: float = 0.2) -> float:
    """Bytes a policy reads per context token in one sparse layer to choose (all KV heads).

    - infinigen: the partial keys, ``rank`` channels of every key (rank/2d of K+V).
    - quest: each 16-token page's key min and max (1/16 of K+V).
    - h2o: one float32 accumulated score per token and KV head.
    - streaming: nothing (positions only).
    """
    per_head = {
        "infinigen": partial_rank(shape.head_dim, partial_ratio) * shape.dtype_bytes,
        "quest": 2 * shape.head_dim * shape.dtype_bytes / QUEST_PAGE_SIZE,
        "h2o": H2O_SCORE_BYTES,
        "streaming": 0,
    }
    if policy not in per_head:
        raise ValueError(f"unknown policy {policy!r}; known: {sorted(per_head)}")
    return per_head[policy] * shape.kv_heads


def ideal_kv_fraction(num_layers: int, dense_layers: int, sparse_fraction: float) -> float:
    """KV bytes read per step relative to dense attention in every layer.

    Dense layers read everything; each sparse layer reads ``sparse_fraction``
    of its dense bytes (for InfiniGen the paper's r/2 + budget: partial keys
    are r of K, i.e. r/2 of K+V, plus the selected K/V).
    """
    if not 0 <= dense_layers <= num_layers or num_layers < 1:
        raise ValueError(f"need 0 <= dense_layers ({dense_layers}) <= layers ({num_layers})")
    sparse = num_layers - dense_layers
    return (dense_layers + sparse * sparse_fraction) / num_layers


def ideal_sparse_fraction(policy: str, budget: float, partial_ratio: float = 0.2,
                          shape: ModelShape | None = None) -> float:
    """A sparse layer's ideal read as a fraction of its dense bytes: metadata + budget.

    InfiniGen uses the paper's nominal r/2 (``partial_ratio / 2``); the other
    policies their metadata per token (needs ``shape``) relative to K+V.
    """
    if policy == "infinigen":
        return partial_ratio / 2 + budget
    if shape is None:
        raise ValueError(f"the ideal of {policy!r} needs the model shape")
    return metadata_bytes_per_token(policy, shape) / shape.kv_bytes_per_token_layer + budget


@dataclass
class StepBytes:
    """KV bytes of one decode step (all requests of the batch), by where they come from."""

    dense_equivalent: float  # dense attention in every layer over the same contexts
    dense_layers: float  # the layers InfiniGen keeps dense (full KV)
    metadata: float  # partial keys / page bounds / scores the sparse layers score
    pool_to_attention: float  # selected K/V gathered from the pool (swap_bytes)

    @property
    def total(self) -> float:
        return self.dense_layers + self.metadata + self.pool_to_attention

    @property
    def fraction(self) -> float:
        return self.total / self.dense_equivalent if self.dense_equivalent else math.nan


def dense_step_bytes(shape: ModelShape, context_tokens: float) -> float:
    """Bytes dense attention reads in one step over ``context_tokens`` (summed over the batch)."""
    return shape.layers * shape.kv_bytes_per_token_layer * context_tokens


def sparse_step_bytes(shape: ModelShape, dense_layers: int, policy: str,
                      counters: Mapping[str, float], steps: int,
                      partial_ratio: float = 0.2) -> StepBytes:
    """Per-step KV bytes of a sparse engine from counter differences over ``steps`` steps.

    Args:
        counters: Totals over the sparse layers of ``candidate_tokens`` (context
            tokens each sparse layer would have read, summed over decode rows
            and steps) and ``swap_bytes`` (selected K/V moved to the attention).
        steps: Decode steps the counters cover.
    """
    sparse_layers = shape.layers - dense_layers
    if steps < 1 or sparse_layers < 1:
        raise ValueError(f"need steps >= 1 and a sparse layer (steps {steps}, "
                         f"sparse layers {sparse_layers})")
    # Context tokens per step summed over the batch (the same in every layer).
    context = counters.get("candidate_tokens", 0) / sparse_layers / steps
    per_layer = shape.kv_bytes_per_token_layer * context
    return StepBytes(
        dense_equivalent=shape.layers * per_layer,
        dense_layers=dense_layers * per_layer,
        metadata=sparse_layers * context * metadata_bytes_per_token(policy, shape, partial_ratio),
        pool_to_attention=counters.get("swap_bytes", 0) / steps,
    )


def kv_space_bytes(shape: ModelShape, tokens: int, kv_manager: str, *, dense_layers: int = 2,
                   group_size: int | None = None, partial_ratio: float = 0.2,
                   margin: float = 1.15) -> int:
    """``kv_cache_memory_bytes`` that holds ``tokens`` tokens (with ``margin`` for blocks).

    Stock vLLM keeps K/V of every layer; InfiniGen keeps ``group_size`` pages
    per block id (``vllm_infinigen.layout.kv_cache_group_size``; the dense
    layers' count by default) plus every sparse layer's partial keys, while
    the sparse layers' K/V live in the host pool outside this space.
    """
    if kv_manager == "vllm":
        per_token = shape.layers * shape.kv_bytes_per_token_layer
    elif kv_manager == "infinigen":
        pages = dense_layers if group_size is None else group_size
        sparse = shape.layers - dense_layers
        per_token = (pages * shape.kv_bytes_per_token_layer + sparse * shape.kv_heads
                     * partial_rank(shape.head_dim, partial_ratio) * shape.dtype_bytes)
    else:
        raise ValueError(f"unknown kv_manager {kv_manager!r}")
    return int(math.ceil(tokens * per_token * margin))


def counter_totals(summary: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``vllm_infinigen.metrics.summarize`` output summed over layers."""
    return {name: float(sum(values.values())) for name, values in summary.items()}


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Counter increments between two ``counter_totals``."""
    return {name: after.get(name, 0.0) - before.get(name, 0.0)
            for name in set(before) | set(after)}


# -- per-request latencies -------------------------------------------------------

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


# -- models, engines, progress ---------------------------------------------------

def long_context_model(root: Path = MODEL_CACHE, **overrides: Any) -> Path:
    """The random tiny Llama of the decode sweep, built once (seeded) and cached."""
    spec = {**LONG_MODEL, **overrides}
    out = Path(root) / model_cache_name(spec)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from tests.models import build_tiny_llama

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_tiny_llama(tmp, **spec)
    tmp.rename(out)
    return out


def model_cache_name(spec: Mapping[str, Any]) -> str:
    """Directory name of a ``build_tiny_llama`` spec: head_dim (default 32) when it is
    not hidden / heads, the MLP width when it is not 2 x hidden."""
    name = "llama-l{num_layers}-h{hidden_size}-q{num_heads}-kv{num_kv_heads}".format(**spec)
    if spec.get("head_dim", 32) != spec["hidden_size"] // spec["num_heads"]:
        name += f"-d{spec.get('head_dim', 32)}"
    if spec.get("intermediate_size") not in (None, 2 * spec["hidden_size"]):
        name += f"-i{spec['intermediate_size']}"
    return name + "-p{max_positions}-s{seed}".format(**spec)


class Progress:
    """Progress lines on stderr with the time since start: ``[  12.3 s] message``."""

    def __init__(self, total: int | None = None):
        self.start = time.monotonic()
        self.total = total
        self.done = 0

    def __call__(self, message: str, advance: bool = False) -> None:
        if advance:
            self.done += 1
        count = f" ({self.done}/{self.total})" if self.total and advance else ""
        print(f"[{time.monotonic() - self.start:7.1f} s]{count} {message}",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def engine(model: Path, kv_manager: str, *, infinigen: Mapping[str, Any] | None = None,
           **llm_kwargs: Any) -> Iterator[Any]:
    """An offline ``LLM`` (float32, stats on, seed 0), shut down on exit.

    ``infinigen`` holds ``infinigen_*`` settings without the prefix.
    """
    import vllm_infinigen  # noqa: F401  (adds the kv_manager keyword)
    from vllm import LLM

    extra = {f"infinigen_{key}": value for key, value in (infinigen or {}).items()
             if value is not None}
    if extra and kv_manager != "infinigen":
        raise ValueError("infinigen settings need kv_manager='infinigen'")
    llm = LLM(model=str(model), kv_manager=kv_manager, dtype="float32", seed=0,
              disable_log_stats=False, **extra, **llm_kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def engine_failure(exc: BaseException, log_tail: str = "") -> dict[str, str]:
    """A recordable description of an engine that failed to start."""
    return {"error_type": type(exc).__name__, "error": str(exc)[:2000],
            "log_tail": log_tail[-4000:]}


class CpuMeter:
    """CPU time of this process and of the whole machine over a ``with`` block.

    ``other_cores`` is how many cores other processes kept busy on average
    (machine busy time minus ours, over the wall time): others' engines on a
    shared 2-core machine distort step times, so a window with ``other_cores``
    well above 0 is worth measuring again. With ``tree=True`` "ours" includes
    the live child processes (an engine core and its workers).
    """

    def __init__(self, tree: bool = False):
        self.tree = tree

    def __enter__(self) -> CpuMeter:
        self._wall, self._busy = time.monotonic(), _machine_busy()
        self._own = _own_cpu(self.tree)
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.monotonic() - self._wall
        self.own = _own_cpu(self.tree) - self._own
        busy = _machine_busy()
        self.busy = None if busy is None or self._busy is None else busy - self._busy

    @property
    def other_cores(self) -> float | None:
        if self.busy is None or self.wall <= 0:
            return None
        return max(0.0, (self.busy - self.own) / self.wall)


def wait_for_quiet(max_cores: float, timeout_s: float, interval_s: float = 1.0) -> float | None:
    """Waits (up to ``timeout_s``) for a ``interval_s`` during which other processes
    used at most ``max_cores``; returns the last measured value (None: no /proc/stat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with CpuMeter() as meter:
            time.sleep(interval_s)
        if meter.other_cores is None or meter.other_cores <= max_cores \
                or time.monotonic() >= deadline:
            return meter.other_cores


def _own_cpu(tree: bool = False) -> float:
    times = os.times()
    total = times.user + times.system
    if tree:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                cpu = child.cpu_times()
                total += cpu.user + cpu.system
            except psutil.Error:
                pass
    return total


def _machine_busy() -> float | None:
    """Seconds of busy CPU time since boot, all cores (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    # guest time is already in user/nice
    busy = sum(values[:8]) - idle if len(values) >= 8 else sum(values) - idle
    return busy / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (others' engines share this machine)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def as_dicts(items: Iterable[Any]) -> list[dict[str, Any]]:
    return [asdict(item) for item in items]
