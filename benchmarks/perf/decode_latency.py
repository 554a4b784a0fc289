# SPDX-License-Identifier: Apache-2.0
"""Decode time per step and KV bytes per step versus context: dense vLLM, InfiniGen, baselines.

python -m benchmarks.perf.decode_latency [--preset long|short|gqa128|gutenberg] [--model DIR]
    [--contexts 1024 ... 16384] [--batch-sizes 1 4] [--policies infinigen h2o streaming quest]
    [--engines dense in-place copy] [--budget 0.2] [--min-context N] [--decode-steps 16]
    [--dtype float32|bfloat16] [--alphas default 10000]
    [--max-batch-tokens 65536] [--retries 2] [--bandwidth-mib 256] [--out PATH]
    [--paired [--rounds 8]]
python -m benchmarks.perf.decode_latency --render RESULT.json   (rewrites RESULT.md and .png)

Presets (explicit flags override them):

- ``long`` (default): a random tiny Llama (6 layers, 8 x 32 MHA heads, 17K
  positions; ``models.LONG_MODEL``), contexts 1K..16K, batches 1 and 4, dense
  vLLM and an in-place InfiniGen engine running every policy
  -> ``benchmarks/results/decode_latency_long.{json,md,png}``; about 15
  minutes on 2 cores, most of it prefill (InfiniGen's prefill over the pool
  is 2-4x slower than vLLM's).
- ``short``: the same model at 128..512 tokens (InfiniGen's fixed costs)
  -> ``decode_latency_short``.
- ``gqa128``: a realistic attention shape with small weights (16 layers, 8
  query / 2 KV heads of 128, hidden 512, MLP 512, 17K positions;
  ``models.GQA128_MODEL``), contexts 256..16K, batches 1 and 4, dense vs
  in-place InfiniGen -> ``decode_latency_gqa128``.
- ``gqa64``: the ``gqa128`` model with head_dim 64, contexts 256..4K (where
  sparse starts to beat dense: ``--infinigen-min-context``)
  -> ``decode_latency_gqa64``.
- ``gutenberg``: ``../shared/models/gutenberg-llama-2k`` at 256..1920 tokens,
  dense vs InfiniGen with the in-place and the copy transfer
  -> ``decode_latency``.

Method. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and the script drives it step by step. For each (context, batch) it submits the
batch (random prompt ids, prefix caching off), steps until every request has
its first token (prefill, chunked), then for each policy: switches the running
engine (``set_infinigen_selection``), runs ``--warmup-steps`` steps, and times
``--decode-steps`` steps of the whole batch (every request gets one token per
step: the time per step is the batch's TPOT). Others' jobs share the machine:
a window during which other processes kept more than ``--contention-cores``
busy (``/proc/stat`` minus this process) is measured again, up to
``--retries`` times, and the least disturbed attempt is kept (its
``other_cores_busy`` is in the JSON); before each window the script waits up
to ``--quiet-wait`` seconds for a quiet second. The policies share one prefill:
they decode successive tokens of the same requests (the context grows by a few
tokens per policy; the rows report the mean context of their window). H2O's
scores then start at the switch instead of at the prefill, which changes what
it keeps, not what a step costs. A baseline's per-slot state (H2O scores,
Quest page bounds) once allocated is kept up to date on every later write, so
the policies run in the order infinigen, streaming, quest, h2o.

With ``--paired`` the engines run side by side instead, a process each, and
their windows alternate over ``--rounds`` rounds (``decode_paired.py``): the
machine's drift over minutes then hits both sides of each ratio alike.

InfiniGen runs one window per ``--alphas`` value (default: the engine's alpha,
then 10000): a random model's scores put ~1 % of the context within the
default alpha of the best, where trained models select 8-14 %; at 10000 every
token is in reach and the budget binds, the density a served model reads.

KV bytes per step: dense attention reads every context token's K/V in every
layer. A sparse engine reads the dense layers' K/V, the selection metadata of
every context token (InfiniGen's partial keys: r of the key channels; Quest's
page min/max; H2O's scores) and the selected K/V moved from the pool to the
attention (``vllm:infinigen_swap_bytes_total``). The ideal, as in the paper, is
r/2 + budget of the dense bytes in each sparse layer (InfiniGen; the
baselines: their metadata + budget), dense layers reading everything.
Every row also has ``achieved_gb_s`` (KV bytes per step / median step time),
and the run measures the machine's streaming read/copy bandwidth before the
engines start (``meta["bandwidth"]``, ``bandwidth.measure_bandwidth``), the
physical limit those are compared with. The Markdown (``decode_report``) adds
the context-dependent cost: ms/step at the longest context minus at the
shortest, and dense's over each config's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from benchmarks.harness import models, paths, report
from benchmarks.harness.engines import engine, infinigen_kwargs
from vllm_infinigen.config import SPECULATIONS
from benchmarks.perf import decode_report, kv_math, machine
from benchmarks.perf.step_driver import Driver
from benchmarks.perf.bandwidth import measure_bandwidth

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
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Order of the policies inside one window (see the module docstring).
POLICY_ORDER = ("infinigen", "streaming", "quest", "h2o")
# "model": a directory, or None for the random ``models.long_context_model(**model_spec)``.
PRESETS: dict[str, dict[str, Any]] = {
    "long": {"model": None, "contexts": [1024, 2048, 4096, 8192, 16384], "batch_sizes": [1, 4],
             "engines": ["dense", "in-place"], "policies": list(POLICY_ORDER),
             "out": "decode_latency_long"},
    "short": {"model": None, "contexts": [128, 256, 512], "batch_sizes": [1, 4],
              "engines": ["dense", "in-place"], "policies": list(POLICY_ORDER),
              "out": "decode_latency_short"},
    "gqa128": {"model": None, "model_spec": models.GQA128_MODEL,
               "contexts": [256, 1024, 4096, 16384], "batch_sizes": [1, 4],
               "engines": ["dense", "in-place"], "policies": ["infinigen"],
               "out": "decode_latency_gqa128"},
    "gqa64": {"model": None, "model_spec": models.GQA64_MODEL,
              "contexts": [256, 512, 1024, 2048, 4096], "batch_sizes": [1],
              "engines": ["dense", "in-place"], "policies": ["infinigen"],
              "out": "decode_latency_gqa64"},
    "gutenberg": {"model": paths.GUTENBERG, "contexts": [256, 512, 1024, 1920],
                  "batch_sizes": [1, 4], "engines": ["dense", "in-place", "copy"],
                  "policies": ["infinigen"], "out": "decode_latency"},
}


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
        swap_wait_ms_per_step=delta.get("swap_wait_us", 0.0) / 1000 / len(times),
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
    settings = {**setup, "budget": args.budget, "dense_layers": args.dense_layers,
                "partial_ratio": args.partial_ratio}
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
    tokens = max(batch * (context + max_tokens + 64) for context, batch in points)
    kv_bytes = kv_math.kv_space_bytes(
        shape, tokens, setup["kv_manager"], dense_layers=args.dense_layers,
        group_size=kv_cache_group_size(args.dense_layers, shape.layers - args.dense_layers),
        partial_ratio=args.partial_ratio, speculation_keys=speculation_keys(engine_name))
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
                  enforce_eager=args.enforce_eager, dtype=args.dtype)


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


def run_engine(engine_name: str, model: Path, args, progress: machine.Progress) -> list[dict]:
    """One engine: every (context, batch), every policy of the window."""
    shape = kv_math.model_shape(model, dtype_bytes=DTYPE_BYTES[args.dtype])
    policies, max_tokens, _, kv_bytes = sizing(engine_name, shape, args)
    points = grid(args)
    infinigen = infinigen_settings(engine_name, args)
    progress(f"{engine_name}: starting the engine ({kv_bytes / 2**20:.0f} MiB KV space)")
    rows: list[dict] = []
    rng = random.Random(0)
    with engine_of(engine_name, model, args, max_tokens, kv_bytes) as llm:
        driver = Driver(llm, max_tokens)
        default_alpha = llm.collective_rpc(engine_alpha)[0] if infinigen else None
        progress(f"{engine_name}: engine up; warm-up")
        driver.submit_and_prefill([[1, 5, 6, 7]] * max(b for _, b in points), "warmup")
        for policy in policies:
            if policy:
                llm.collective_rpc("set_infinigen_selection", kwargs={"policy": policy})
            driver.warm(2)
        driver.finish()
        for context, batch in points:
            prompts = [[rng.randrange(3, 500) for _ in range(context)] for _ in range(batch)]
            prefill_s = driver.submit_and_prefill(prompts, f"c{context}b{batch}")
            progress(f"{engine_name}: context {context} x {batch}: prefill {prefill_s:.1f} s")
            for policy, alpha in windows(policies, args.alphas):
                select_window(llm, policy, alpha, default_alpha, args)
                attempts = []
                for _ in range(1 + args.retries):
                    attempts.append(timed_window(llm, driver, policy, args))
                    if attempts[-1]["other_cores"] <= args.contention_cores:
                        break
                    progress(f"{config_label(engine_name, policy)}: other processes kept "
                             f"{attempts[-1]['other_cores']:.2f} cores busy; measuring again")
                # The least disturbed attempt.
                kept = min(attempts, key=lambda a: a["other_cores"])
                full = all(count == batch for count in kept["got"])
                row = measure_row(engine_name=engine_name, policy=policy, alpha=alpha,
                                  context=context, batch=batch,
                                  mean_context=window_context(context, kept),
                                  times=kept["times"], full=full, prefill_s=prefill_s,
                                  delta=kept["delta"], shape=shape, args=args)
                row["other_cores_busy"] = round(kept["other_cores"], 3)
                row["attempts"] = len(attempts)
                rows.append(row)
                progress(f"{row['config']:>16} context {context:>5} x {batch}: "
                         f"{row['decode_ms_per_step']:7.1f} ms/step, KV read "
                         f"{row['kv_read_vs_dense']:.3f} of dense "
                         f"(ideal {row['ideal_kv_read_vs_dense']:.3f})", advance=True)
            driver.finish()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="long")
    parser.add_argument("--model", type=Path, help="model directory (default: the preset's)")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batch-sizes", "--batch", type=int, nargs="+")
    parser.add_argument("--policies", nargs="+", choices=list(POLICY_ORDER))
    parser.add_argument("--engines", "--configs", nargs="+", choices=list(ENGINES))
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--partial-ratio", type=float, default=0.2)
    parser.add_argument("--min-context", type=int, help="InfiniGen's --infinigen-min-context: "
                        "sparse layers attend densely below this context (default: the "
                        "engine's)")
    parser.add_argument("--alpha", type=float, help="InfiniGen's --infinigen-alpha (default: the "
                        "engine's; a large value makes every step select the budget cap)")
    parser.add_argument("--cpu-pool-gib", type=float, help="pool cap of the 'capped' engine "
                        "(InfiniGen's --infinigen-cpu-pool-gib)")
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32",
                        help="the engines' dtype (--dtype of vllm); the KV bytes follow it")
    parser.add_argument("--alphas", nargs="+", default=["default", "10000"],
                        help="InfiniGen windows: 'default' (the engine's alpha: the rule keeps "
                        "what it counts, ~1 %% of a random model's context) and numbers "
                        "(10000: every score in reach, the budget binds, as with trained "
                        "models' density)")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--speculation", choices=SPECULATIONS,
                        help="InfiniGen's --infinigen-speculation (default: previous-layer)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--retries", type=int, default=3,
                        help="measure a window again (up to this many times) when other "
                        "processes kept more than --contention-cores busy meanwhile")
    parser.add_argument("--contention-cores", type=float, default=0.25)
    parser.add_argument("--quiet-wait", type=float, default=20,
                        help="seconds to wait, before each timed window, for a second in "
                        "which other processes use at most --contention-cores (0: no wait)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-batch-tokens", type=int, default=65536,
                        help="skip (context, batch) points with more prompt tokens than this "
                        "(prefill time grows with batch x context^2)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="tensor size of the streaming-bandwidth measurement (0: skip)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile (faster start, slower steps)")
    parser.add_argument("--paired", action="store_true",
                        help="run the engines side by side, one process each, and alternate "
                        "their windows over --rounds rounds (decode_paired.py): ratios "
                        "robust to the machine's drift")
    parser.add_argument("--rounds", type=int, default=8,
                        help="--paired: windows per config, taken in turn")
    parser.add_argument("--render", type=Path, help="only rewrite the Markdown and PNG of "
                        "an existing result JSON (no engine)")
    parser.add_argument("--out", type=Path, help="output path without suffix "
                        "(default: benchmarks/results/<preset's name>)")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    for key in ("contexts", "batch_sizes", "policies", "engines"):
        if getattr(args, key) is None:
            setattr(args, key, list(preset[key]))
    if args.out is None:
        args.out = paths.RESULTS / preset["out"]
    args.model_default = args.model is None
    if args.model is None:
        args.model = preset["model"]
    args.model_spec = preset.get("model_spec") if args.model is None else None
    return args


def render(path: Path) -> int:
    """Rewrites ``path``'s Markdown and PNG from its JSON (settings, rows, provenance)."""
    meta, settings, rows = report.read_results(path)
    args = argparse.Namespace(**{k: v for k, v in settings.items() if k != "model_shape"})
    shape = kv_math.ModelShape(**settings["model_shape"])
    out = Path(path).with_suffix("")
    title = f"Decode latency and KV bytes per step: {Path(args.model).name} ({args.preset})"
    report.write_results(out, meta, title, settings, rows, decode_report.sections(
        rows, args, shape, meta.get("bandwidth"), meta.get("model_weight_bytes")))
    decode_report.plot(rows, out.with_suffix(".png"), Path(args.model).name)
    print(out.with_suffix(".md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    # Drive the engine core step by step in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    progress = machine.Progress(total=len(grid(args)) * sum(
        len(windows(ordered_policies(args.policies), args.alphas)) if ENGINES[name]["infinigen"]
        else 1 for name in args.engines))
    if args.model is None:
        args.model = models.long_context_model(**(args.model_spec or {}))
        progress(f"model: {args.model}")
    if not Path(args.model).is_dir():
        print(f"skipped: model directory {args.model} is absent (pass --model)")
        return 0
    meta = report.run_metadata(model=str(args.model), load_average_start=machine.load_average())
    weights = Path(args.model) / "model.safetensors"
    meta["model_weight_bytes"] = weights.stat().st_size if weights.is_file() else None
    if args.bandwidth_mib > 0:
        if args.quiet_wait > 0:
            machine.wait_for_quiet(args.contention_cores, args.quiet_wait)
        meta["bandwidth"] = measure_bandwidth(args.bandwidth_mib)
        progress(f"streaming bandwidth: {decode_report.bandwidth_text(meta['bandwidth'])}")
    if args.paired:
        from benchmarks.perf import decode_paired

        rows = decode_paired.run(args, Path(args.model), progress)
    else:
        rows = [row for name in args.engines
                for row in run_engine(name, Path(args.model), args, progress)]
    meta["load_average_end"] = machine.load_average()
    meta["wall_s"] = round(time.monotonic() - progress.start, 1)
    shape = kv_math.model_shape(Path(args.model), dtype_bytes=DTYPE_BYTES[args.dtype])
    settings = {key: (str(value) if isinstance(value, Path) else value)
                for key, value in vars(args).items()}
    settings["model_shape"] = {"layers": shape.layers, "kv_heads": shape.kv_heads,
                               "head_dim": shape.head_dim, "dtype_bytes": shape.dtype_bytes}
    title = f"Decode latency and KV bytes per step: {Path(args.model).name} ({args.preset})"
    report.write_results(args.out, meta, title, settings, rows, decode_report.sections(
        rows, args, shape, meta.get("bandwidth"), meta["model_weight_bytes"]))
    decode_report.plot(rows, args.out.with_suffix(".png"), Path(args.model).name)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
