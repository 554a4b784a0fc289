# SPDX-License-Identifier: Apache-2.0
"""The decode benchmarks' engines and timed windows, shared by the sequential mode
(``decode_latency``) and the paired one (``decode_paired``), which both import it.

An engine configuration (``ENGINES``) is sized for a grid of (context, batch)
points (``sizing``, ``engine_of``); a window switches the running engine to a
policy and alpha (``select_window``), then times ``--decode-steps`` steps
(``timed_window``); ``measure_row`` turns a window's steps and counters into a
result row (time per step, KV bytes per step against dense and the ideal).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.engines import engine, infinigen_kwargs
from benchmarks.perf import kv_math, machine
from benchmarks.perf.step_driver import Driver

# Engine configurations: stock vLLM, or InfiniGen with a transfer mode.
ENGINES = {
    "dense": {"kv_manager": "vllm", "infinigen": None},
    "in-place": {"kv_manager": "infinigen", "infinigen": {"transfer": "in-place"}},
    "copy": {"kv_manager": "infinigen", "infinigen": {"transfer": "copy"}},
    # In place with a capped pool (--cpu-pool-gib): the cap's bookkeeping cost.
    "capped": {"kv_manager": "infinigen", "infinigen": {"transfer": "in-place"}},
    # In place with the speculation keys named (the engine default is int).
    "int-keys": {"kv_manager": "infinigen",
                 "infinigen": {"transfer": "in-place", "speculation_keys": "int"}},
    "partial-keys": {"kv_manager": "infinigen",
                     "infinigen": {"transfer": "in-place", "speculation_keys": "partial"}},
    # --infinigen-residency device-first, sized to stay resident: the sparse
    # layers attend with vLLM's kernel over its blocks (what a step costs
    # while memory allows).
    "device-first": {"kv_manager": "infinigen",
                     "infinigen": {"transfer": "in-place", "residency": "device-first"}},
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# vLLM's --kv-cache-dtype values the benchmarks take (K/V element bytes; auto: the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "fp8_e5m2": 1}
# Order of the policies inside one window (see decode_latency's docstring).
POLICY_ORDER = ("infinigen", "streaming", "quest", "h2o")


def shape_of(model: Path, args) -> kv_math.ModelShape:
    """The model's shape for the run's dtype and ``--kv-cache-dtype``."""
    return kv_math.model_shape(
        Path(model), dtype_bytes=DTYPE_BYTES[args.dtype],
        kv_element_bytes=KV_CACHE_DTYPES[getattr(args, "kv_cache_dtype", "auto")])


def config_label(engine_name: str, policy: str | None, alpha: str = "default") -> str:
    """Column label: "dense", the policy (in-place engine), or "policy (copy)";
    an InfiniGen window at another alpha than the engine's adds "alpha A"."""
    if policy is None:
        return "dense"
    label = policy if engine_name == "in-place" else f"{policy} ({engine_name})"
    return label if alpha == "default" or policy != "infinigen" else f"{label}, alpha {alpha}"


def engine_alpha(worker) -> float:
    """The running engine's alpha (``collective_rpc``: the default resolved for the model)."""
    return worker.infinigen_runtime.config.alpha


def ordered_policies(policies: list[str]) -> list[str]:
    return [p for p in POLICY_ORDER if p in policies]


def counters(llm) -> dict[str, float]:
    from vllm_infinigen.scheduler.metrics import summarize

    return kv_math.counter_totals(summarize(llm.get_metrics()))


def grid(args) -> list[tuple[int, int]]:
    """(context, batch) points, context-major, within ``--max-batch-tokens``."""
    return [(context, batch) for context in args.contexts for batch in args.batch_sizes
            if batch * context <= args.max_batch_tokens]


def measure_row(*, engine_name: str, policy: str | None, context: int, batch: int,
                mean_context: float, times: list[float], full: bool, prefill_s: float,
                delta: dict[str, float], shape: kv_math.ModelShape, args,
                alpha: str = "default") -> dict[str, Any]:
    """One result row: timing, and KV bytes per step against dense and the ideal."""
    step_s = statistics.median(times)
    dense_bytes = kv_math.dense_step_bytes(shape, batch * mean_context)
    row: dict[str, Any] = {
        "config": config_label(engine_name, policy, alpha), "engine": engine_name,
        "policy": policy, "alpha": alpha, "dtype": args.dtype,
        "context": context, "batch": batch, "mean_context": round(mean_context, 1),
        "decode_ms_per_step": 1000 * step_s,
        "decode_ms_per_step_mean": 1000 * statistics.fmean(times),
        "decode_ms_per_step_min": 1000 * min(times),
        "decode_ms_per_token": 1000 * step_s / batch,
        "tokens_per_s": batch / step_s, "steps": len(times), "all_steps_full_batch": full,
        "step_ms": [round(1000 * t, 3) for t in times],
        "prefill_s": prefill_s, "dense_kv_bytes_per_step": dense_bytes,
    }
    if policy is None:
        row.update(kv_bytes_per_step=dense_bytes, kv_read_vs_dense=1.0,
                   ideal_kv_read_vs_dense=1.0, pool_bytes_per_step=0.0,
                   achieved_gb_s=dense_bytes / step_s / 1e9)
        return row
    keys = speculation_keys(engine_name)
    step = kv_math.sparse_step_bytes(shape, args.dense_layers, policy, delta, len(times),
                                    args.partial_ratio, keys)
    sparse_layers = shape.layers - args.dense_layers
    ideal_pool = sparse_layers * args.budget * shape.kv_bytes_per_token_layer * batch * mean_context
    candidates = delta.get("candidate_tokens", 0.0)
    row.update(
        kv_bytes_per_step=step.total, kv_read_vs_dense=step.fraction,
        achieved_gb_s=step.total / step_s / 1e9,
        counter_dense_kv_bytes_per_step=step.dense_equivalent,
        dense_layer_bytes_per_step=step.dense_layers, metadata_bytes_per_step=step.metadata,
        pool_bytes_per_step=step.pool_to_attention, ideal_pool_bytes_per_step=ideal_pool,
        ideal_kv_read_vs_dense=kv_math.ideal_kv_fraction(
            shape.layers, args.dense_layers,
            kv_math.ideal_sparse_fraction(policy, args.budget, args.partial_ratio, shape, keys)),
        selected_fraction=delta.get("selected_tokens", 0.0) / candidates if candidates else None,
        swap_wait_ms_per_step=delta.get("fetch_wait_us", 0.0) / 1000 / len(times),
    )
    return row


def speculation_keys(engine_name: str) -> str:
    """The speculation-key form of an engine (the product's default unless it names one)."""
    setup = ENGINES[engine_name]["infinigen"] or {}
    return setup.get("speculation_keys", kv_math.DEFAULT_KEYS)


def infinigen_settings(engine_name: str, args) -> dict[str, Any] | None:
    """``infinigen_*`` engine settings (without the prefix) of a configuration; None: dense.

    ``min_context`` only when given (``--min-context``; else the engine's default).
    """
    setup = ENGINES[engine_name]["infinigen"]
    if not setup:
        return None
    settings = {**setup, "budget": args.budget, "dense_layers": args.dense_layers}
    if speculation_keys(engine_name) == "partial":  # others refuse a partial ratio
        settings["partial_ratio"] = args.partial_ratio
    if getattr(args, "min_context", None) is not None:
        settings["min_context"] = args.min_context
    if getattr(args, "alpha", None) is not None:
        settings["alpha"] = args.alpha
    if getattr(args, "speculation", None) is not None:
        settings["speculation"] = args.speculation
    if engine_name == "capped":
        if getattr(args, "cpu_pool_gib", None) is None:
            raise SystemExit("--engines capped needs --cpu-pool-gib")
        settings["cpu_pool_gib"] = args.cpu_pool_gib
    return settings


# The largest KV-cache block vLLM's CPU backend uses (its default there: 128 tokens).
VLLM_BLOCK_TOKENS = 128


def sizing(engine_name: str, shape: kv_math.ModelShape, args) -> tuple[list, int, int, int]:
    """(policies, max_tokens per request, tokens to hold, ``kv_cache_memory_bytes``)."""
    from vllm_infinigen.layout import kv_cache_group_size

    setup = ENGINES[engine_name]
    policies: list[str | None] = ordered_policies(args.policies) if setup["infinigen"] else [None]
    per_policy = (args.warmup_steps + args.decode_steps) * len(args.alphas)
    points = grid(args)
    # Requests that finish prefill early decode while the others prefill (chunked
    # prefill): room for those tokens, so that no request ends inside a window.
    ahead = max(batch * context for context, batch in points) // args.max_num_batched_tokens
    max_tokens = 2 + len(policies) * per_policy * (1 + args.retries) + ahead + 8
    # Each request's last block rounded up, and the null block vLLM keeps apart
    # (blocks of up to VLLM_BLOCK_TOKENS): at 256 tokens x 1 the margin alone
    # left vLLM 3 usable blocks of 128 for a 490-token max_model_len.
    tokens = max(batch * (context + max_tokens + 64 + VLLM_BLOCK_TOKENS)
                 for context, batch in points) + VLLM_BLOCK_TOKENS
    kv_bytes = kv_math.kv_space_bytes(
        shape, tokens, setup["kv_manager"], dense_layers=args.dense_layers,
        group_size=kv_cache_group_size(args.dense_layers, shape.layers - args.dense_layers),
        partial_ratio=args.partial_ratio, speculation_keys=speculation_keys(engine_name),
        resident=(setup["infinigen"] or {}).get("residency") == "device-first")
    return policies, max_tokens, tokens, kv_bytes


def windows(policies: list[str | None], alphas: list[str]) -> list[tuple[str | None, str]]:
    """(policy, alpha) of each timed window: InfiniGen once per ``--alphas``
    value, the others at the engine's alpha (which they do not read)."""
    return [(policy, alpha) for policy in policies
            for alpha in (alphas if policy == "infinigen" else ["default"])]


def engine_of(engine_name: str, model: Path, args, max_tokens: int, kv_bytes: int):
    """The offline engine of a configuration (``sizing``'s tokens and KV space),
    for every point of ``args``: a context manager."""
    infinigen = infinigen_settings(engine_name, args)
    return engine(model, kv_manager=ENGINES[engine_name]["kv_manager"],
                  **infinigen_kwargs(infinigen),
                  max_model_len=max(args.contexts) + max_tokens + 8,
                  kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=max(batch for _, batch in grid(args)),
                  enforce_eager=args.enforce_eager, dtype=args.dtype,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def select_window(llm, policy: str | None, alpha: str, default_alpha: float | None,
                  args) -> None:
    """Switches a running engine to ``policy`` at ``alpha`` ("default": the engine's);
    nothing for dense (``policy`` None)."""
    if policy:
        llm.collective_rpc("set_infinigen_selection", kwargs={
            "policy": policy, "budget": args.budget,
            "alpha": default_alpha if alpha == "default" else float(alpha)})


def timed_window(llm, driver: Driver, policy: str | None, args) -> dict[str, Any]:
    """One window: a quiet second (``--quiet-wait``), ``--warmup-steps``, then
    ``--decode-steps`` timed steps; the counters' increments (sparse engines),
    the mean tokens generated before it and the cores others kept busy."""
    if args.quiet_wait > 0:
        machine.wait_for_quiet(args.contention_cores, args.quiet_wait)
    driver.warm(args.warmup_steps)
    before = counters(llm) if policy else {}
    start_generated = driver.mean_generated()
    with machine.CpuMeter() as meter:
        times, got = driver.window(args.decode_steps)
    delta = kv_math.counter_delta(before, counters(llm)) if policy else {}
    return {"times": times, "got": got, "delta": delta, "start_generated": start_generated,
            "other_cores": meter.other_cores or 0.0}


def window_context(context: int, window: Mapping[str, Any]) -> float:
    """Mean context of a window's timed steps: prompt + tokens so far (the first
    step attends over prompt + generated - 1 earlier tokens)."""
    return context + window["start_generated"] - 1 + (len(window["times"]) - 1) / 2
