# SPDX-License-Identifier: Apache-2.0
"""Decode time per step and KV bytes per step versus context: dense vLLM, InfiniGen, baselines.

python -m benchmarks.perf.decode_latency [--preset long|short|gqa128|gutenberg] [--model DIR]
    [--contexts 1024 ... 16384] [--batch-sizes 1 4] [--policies infinigen h2o streaming quest]
    [--engines dense in-place copy] [--budget 0.2] [--min-context N] [--decode-steps 16]
    [--dtype float32|bfloat16] [--kv-cache-dtype auto|fp8|fp8_e5m2] [--alphas default 5]
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
- ``gqa128-32k``: the same weights with 33K positions, 32K x 1
  -> ``decode_latency_gqa128_32k``.
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

InfiniGen runs one window per ``--alphas`` value (default: the engine's, then
5): the product's default lets the budget bind (every row keeps budget x
context, the density a served model reads, whatever its weights); the paper's
alpha 5 keeps what it counts within 5 of the best, a small fraction of a
random model's context (trained models: 8-14 %).

KV bytes per step: dense attention reads every context token's K/V in every
layer. A sparse engine reads the dense layers' K/V, the selection metadata of
every context token (InfiniGen's partial keys: r of the key channels; Quest's
page min/max; H2O's scores) and the selected K/V the attention reads from the
pool (``vllm:infinigen_selected_kv_bytes_total``: bytes read, in place on the CPU
build). The ideal, as in the paper, is r/2 + budget of the dense bytes in
each sparse layer (InfiniGen; the baselines: their metadata + budget), dense
layers reading everything.
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
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import models, paths, report
from vllm_infinigen.config import SPECULATIONS
from benchmarks.perf import decode_paired, decode_report, kv_math, machine
from benchmarks.perf.step_driver import Driver
from benchmarks.perf.bandwidth import measure_bandwidth
# The engines and windows, both modes' (``speculation_keys``: importable from here too).
from benchmarks.perf.decode_windows import (  # noqa: F401
    DTYPE_BYTES,
    ENGINES,
    KV_CACHE_DTYPES,
    POLICY_ORDER,
    config_label,
    engine_alpha,
    engine_of,
    grid,
    infinigen_settings,
    measure_row,
    ordered_policies,
    select_window,
    shape_of,
    sizing,
    speculation_keys,
    timed_window,
    window_context,
    windows,
)

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
    "gqa128-32k": {"model": None, "model_spec": models.GQA128_32K_MODEL,
                   "contexts": [32768], "batch_sizes": [1], "engines": ["dense", "in-place"],
                   "policies": ["infinigen"], "out": "decode_latency_gqa128_32k"},
    "gqa64": {"model": None, "model_spec": models.GQA64_MODEL,
              "contexts": [256, 512, 1024, 2048, 4096], "batch_sizes": [1],
              "engines": ["dense", "in-place"], "policies": ["infinigen"],
              "out": "decode_latency_gqa64"},
    "gutenberg": {"model": paths.GUTENBERG, "contexts": [256, 512, 1024, 1920],
                  "batch_sizes": [1, 4], "engines": ["dense", "in-place", "copy"],
                  "policies": ["infinigen"], "out": "decode_latency"},
}




def run_engine(engine_name: str, model: Path, args, progress: machine.Progress) -> list[dict]:
    """One engine: every (context, batch), every policy of the window."""
    shape = shape_of(model, args)
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
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="vLLM's --kv-cache-dtype for every engine (fp8: e4m3; vLLM's CPU "
                        "FP8 attention needs AVX-512 or AMX); the KV bytes follow it")
    parser.add_argument("--alphas", nargs="+", default=["default", "5"],
                        help="InfiniGen windows: 'default' (the engine's alpha: off unless "
                        "--alpha, so the budget binds, the density a served model reads) and "
                        "numbers (5: the paper's count, which keeps a small fraction of a "
                        "random model's context)")
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
    # Files before 2026-11-27 hold the checkpoint's size: recomputed in the run's
    # dtype where the model is at hand.
    weights = kv_math.weight_bytes(Path(args.model), shape.dtype_bytes)
    if weights is not None:
        meta["model_weight_bytes"] = weights
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
    # The weights a step reads, in the run's dtype (before 2026-11-27: the
    # checkpoint file's size, a float32 model's also in bfloat16 runs).
    meta["model_weight_bytes"] = kv_math.weight_bytes(Path(args.model), DTYPE_BYTES[args.dtype])
    if args.bandwidth_mib > 0:
        if args.quiet_wait > 0:
            machine.wait_for_quiet(args.contention_cores, args.quiet_wait)
        meta["bandwidth"] = measure_bandwidth(args.bandwidth_mib)
        progress(f"streaming bandwidth: {decode_report.bandwidth_text(meta['bandwidth'])}")
    if args.paired:
        rows = decode_paired.run(args, Path(args.model), progress)
    else:
        rows = [row for name in args.engines
                for row in run_engine(name, Path(args.model), args, progress)]
    meta["load_average_end"] = machine.load_average()
    meta["wall_s"] = round(time.monotonic() - progress.start, 1)
    shape = shape_of(Path(args.model), args)
    settings = {key: (str(value) if isinstance(value, Path) else value)
                for key, value in vars(args).items()}
    settings["model_shape"] = {"layers": shape.layers, "kv_heads": shape.kv_heads,
                               "head_dim": shape.head_dim, "dtype_bytes": shape.dtype_bytes,
                               "kv_element_bytes": shape.kv_element_bytes}
    title = f"Decode latency and KV bytes per step: {Path(args.model).name} ({args.preset})"
    report.write_results(args.out, meta, title, settings, rows, decode_report.sections(
        rows, args, shape, meta.get("bandwidth"), meta["model_weight_bytes"]))
    decode_report.plot(rows, args.out.with_suffix(".png"), Path(args.model).name)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
