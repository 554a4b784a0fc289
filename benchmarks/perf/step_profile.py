# SPDX-License-Identifier: Apache-2.0
"""Where an InfiniGen decode step's time goes, by component, beside dense vLLM.

    python -m benchmarks.perf.step_profile [--context 16384] [--batch 1]
        [--dtypes float32 bfloat16] [--alphas default 5] [--decode-steps 16]
        [--out benchmarks/results/step_profile]

One engine per dtype and manager (dense vLLM, InfiniGen with the default
settings) on the random head_dim-128 GQA 4:1 model of the decode benchmark
(``--preset gqa128``), one request of ``--context`` random tokens, engine
core in this process, ``enforce_eager`` (so that the plugin's Python runs as
written and can be timed). InfiniGen runs one window per ``--alphas`` value in
the same engine: the default (alpha off: the budget binds, 20 %) and 5 (the
paper's count: a small fraction of a random model's context).

Components, ms per decode step summed over the layers (wall time of the
functions named, which run synchronously on the CPU):

    query projection   the next layer's query from this layer's attention input
                       (``policies.infinigen.partial_query``)
    score + select     the speculation keys scored and the selection made
                       (``kernels.select_bounds``, the default's bound keys;
                       ``select_tokens_int`` / ``select_tokens``)
    attend             attention over the selected rows (``kernels.attend_decode``)
    write              the step's K/V into the pool and its speculation keys
    capture            the qkv_proj pre-hook that keeps the attention input
    plugin Python      the rest of the plugin's per-layer calls (the runtime's
                       ``begin_layer``, ``attend``, ``write``, the hook) minus the above
    rest of the step   everything else (dense layers' attention, projections,
                       MLPs, sampling, scheduler): step time minus the plugin's

Bytes and GB/s: the selected rows the attention reads (``selected_kv_bytes``
counter) over the attend time; the speculation keys scored (every candidate
token's keys) over the score + select time; against the streaming limit
measured in the same run (``benchmarks/perf/bandwidth.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.harness import models, paths, report
from benchmarks.harness.engines import engine
from benchmarks.perf import decode_report, kv_math, machine
from benchmarks.perf.bandwidth import measure_bandwidth
from benchmarks.perf.decode_windows import counters
from benchmarks.perf.step_driver import Driver

COMPONENTS = ("query projection", "score + select", "attend", "write", "capture")
# Functions timed: (module path, attribute, component); the runtime's methods
# and the capture hook are the plugin's entry points (their time, less the
# components inside them, is the plugin's own Python).
TIMED = (("vllm_infinigen.policies.infinigen", "partial_query", "query projection"),
         ("vllm_infinigen.platforms.cpu.kernels", "select_tokens_int", "score + select"),
         ("vllm_infinigen.platforms.cpu.kernels", "select_tokens", "score + select"),
         ("vllm_infinigen.platforms.cpu.kernels", "select_bounds", "score + select"),
         ("vllm_infinigen.platforms.cpu.kernels", "attend_decode", "attend"),
         ("vllm_infinigen.platforms.cpu.kernels", "write_pool", "write"),
         ("vllm_infinigen.platforms.cpu.kernels", "write_int_keys", "write"),
         ("vllm_infinigen.platforms.cpu.kernels", "write_bounds", "write"),
         ("vllm_infinigen.platforms.cpu.kernels", "write_partial_keys", "write"),
         # The short path's one op (a step below min-context): its write counted as attend.
         ("vllm_infinigen.platforms.cpu.kernels", "decode_short", "attend"))
ENTRY_POINTS = ("begin_step", "begin_layer", "attend", "write", "decode_short")
TITLE = "Where a decode step's time goes: InfiniGen by component beside dense vLLM"


class Clock:
    """Wall seconds accumulated per component; nested entry points counted once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0

    def timed(self, component: str, fn, *, entry: bool = False):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if entry:
                self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if entry:
                    self._depth -= 1
                if not entry or self._depth == 0:
                    self.seconds[component] += time.perf_counter() - start
        return wrapper

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


@contextlib.contextmanager
def instrumented(clock: Clock):
    """Wraps the timed functions and the plugin's entry points (before the engine
    starts: the capture hooks are made at install time)."""
    import importlib

    from vllm_infinigen.worker import attention
    from vllm_infinigen.worker.runtime import InfiniGenRuntime

    saved = []
    for module_name, name, component in TIMED:
        module = importlib.import_module(module_name)
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, clock.timed(component, getattr(module, name)))
    for name in ENTRY_POINTS:
        saved.append((InfiniGenRuntime, name, getattr(InfiniGenRuntime, name)))
        setattr(InfiniGenRuntime, name,
                clock.timed("plugin", getattr(InfiniGenRuntime, name), entry=True))
    make_hook = attention.capture_pre_hook
    saved.append((attention, "capture_pre_hook", make_hook))

    def timed_hook(layer_name: str):
        return clock.timed("capture", make_hook(layer_name))

    attention.capture_pre_hook = timed_hook
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def breakdown(seconds: dict[str, float], step_s: float, steps: int) -> dict[str, float]:
    """ms per step by component (``COMPONENTS``, plugin Python, rest of the step)."""
    per_step = {name: 1000 * seconds.get(name, 0.0) / steps for name in COMPONENTS}
    # The capture hook is an entry point of its own; the others nest in "plugin".
    inner = sum(per_step[name] for name in COMPONENTS if name != "capture")
    plugin = 1000 * seconds.get("plugin", 0.0) / steps
    per_step["plugin Python"] = max(plugin - inner, 0.0)
    per_step["rest of the step"] = 1000 * step_s - plugin - per_step["capture"]
    return per_step


def measure(driver: Driver, clock: Clock | None, steps: int, warmup: int,
            llm=None) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """A timed window: (step seconds, component seconds, counter increments)."""
    driver.warm(warmup)
    if clock is not None:
        clock.take()
    before = counters(llm) if llm is not None else {}
    times, _ = driver.window(steps)
    seconds = clock.take() if clock is not None else {}
    delta = kv_math.counter_delta(before, counters(llm)) if llm is not None else {}
    return times, seconds, delta


def run(args, model: Path, dtype: str, manager: str, progress) -> list[dict[str, Any]]:
    """One engine: dense (one window) or InfiniGen (a window per alpha)."""
    shape = kv_math.model_shape(model, dtype_bytes=2 if dtype == "bfloat16" else 4)
    max_model_len = args.context + 4 * args.decode_steps + 64
    # vLLM refuses a KV space that cannot hold one request of max_model_len
    # (with its own rounding: twice that at a short context, a few MiB).
    tokens = args.batch * max(args.context + args.warmup_steps + 3 * args.decode_steps + 64,
                              2 * max_model_len)
    kv_bytes = kv_math.kv_space_bytes(shape, tokens, manager, dense_layers=2)
    clock = Clock() if manager == "infinigen" else None
    extra = {"infinigen_budget": args.budget} if manager == "infinigen" else {}
    rows = []
    progress(f"{manager} {dtype}: starting the engine")
    with contextlib.ExitStack() as stack:
        if clock is not None:
            stack.enter_context(instrumented(clock))
        llm = stack.enter_context(engine(
            model, kv_manager=manager, dtype=dtype, kv_cache_memory_bytes=kv_bytes,
            max_model_len=max_model_len, enable_prefix_caching=False, max_num_seqs=args.batch,
            enforce_eager=True, **extra))
        driver = Driver(llm, max_tokens=len(args.alphas) * (args.warmup_steps + args.decode_steps)
                        + 8)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 500) for _ in range(args.context)]
                   for _ in range(args.batch)]
        prefill = driver.submit_and_prefill(prompts, "profile")
        progress(f"{manager} {dtype}: prefill {prefill:.1f} s")
        for alpha in (args.alphas if clock is not None else [None]):
            if alpha not in (None, "default"):
                llm.collective_rpc("set_infinigen_selection", kwargs={"alpha": float(alpha)})
            machine.wait_for_quiet(args.contention_cores, args.quiet_wait)
            with machine.CpuMeter() as meter:
                times, seconds, delta = measure(driver, clock, args.decode_steps,
                                                args.warmup_steps, llm if clock else None)
            step_s = statistics.median(times)
            row = {"manager": manager, "dtype": dtype, "alpha": alpha, "context": args.context,
                   "batch": args.batch, "ms_per_step": 1000 * step_s,
                   "ms_per_step_min": 1000 * min(times), "steps": len(times),
                   "others_cores": round(meter.other_cores or 0.0, 3)}
            if clock is not None:
                row["components_ms"] = breakdown(seconds, statistics.fmean(times), len(times))
                candidates = delta.get("candidate_tokens", 0.0)
                row["selected_fraction"] = (delta.get("selected_tokens", 0.0) / candidates
                                            if candidates else None)
                row["selected_bytes_per_step"] = delta.get("selected_kv_bytes", 0.0) / len(times)
                # Every candidate token's speculation keys, per KV head.
                row["key_bytes_per_step"] = (candidates * shape.kv_heads / len(times)
                                             * kv_math.speculation_key_bytes(shape))
            rows.append(row)
            progress(f"{manager} {dtype} alpha {alpha}: {row['ms_per_step']:.1f} ms/step")
        driver.finish()
    return rows


def sections(rows: list[dict], bandwidth: dict | None, args) -> list[str]:
    dense = {r["dtype"]: r["ms_per_step"] for r in rows if r["manager"] == "vllm"}
    out = [f"Context {args.context} x {args.batch}, budget {args.budget}, eager mode "
           "(`enforce_eager`), 16 layers (2 dense, 14 sparse). Streaming limit: "
           + (decode_report.bandwidth_text(bandwidth) if bandwidth else "not measured") + "."]
    table = []
    for r in rows:
        if r["manager"] != "infinigen":
            continue
        ms = r["components_ms"]
        base = dense.get(r["dtype"])
        table.append([r["dtype"], str(r["alpha"]), report.cell(r["selected_fraction"], ".4f"),
                      f"{r['ms_per_step']:.1f}",
                      report.cell(base, ".1f"),
                      report.cell(r["ms_per_step"] / base if base else None, ".2f"),
                      *(f"{ms[name]:.2f}" for name in (*COMPONENTS, "plugin Python",
                                                       "rest of the step"))])
    out.append("## ms per decode step by component (all layers)")
    out.append(report.markdown_table(
        ["dtype", "alpha", "kept", "InfiniGen ms", "dense ms", "÷ dense", *COMPONENTS,
         "plugin Python", "rest of the step"], table))
    limit = (bandwidth or {}).get("read_gb_s_1_thread")
    rates = []
    for r in rows:
        if r["manager"] != "infinigen":
            continue
        ms = r["components_ms"]
        attend = r["selected_bytes_per_step"] / (ms["attend"] / 1000) / 1e9 if ms["attend"] else None
        score = r["key_bytes_per_step"] / (ms["score + select"] / 1000) / 1e9 \
            if ms["score + select"] else None
        rates.append([r["dtype"], str(r["alpha"]),
                      f"{r['selected_bytes_per_step'] / 2**20:.2f}", report.cell(attend, ".1f"),
                      report.cell(attend / limit if attend and limit else None, ".2f"),
                      f"{r['key_bytes_per_step'] / 2**20:.2f}", report.cell(score, ".1f"),
                      report.cell(score / limit if score and limit else None, ".2f")])
    out.append("## Bytes and GB/s of the sparse layers' reads (one thread)")
    out.append(report.markdown_table(
        ["dtype", "alpha", "selected rows MiB/step", "attend GB/s", "of limit",
         "speculation keys MiB/step", "score + select GB/s", "of limit"], rates))
    out.append("Per sparse layer: divide by 14. Eager mode makes the rest of the step "
               "larger than the compiled engine's (`decode_latency_gqa128_keys.md`); the "
               "plugin's components run the same code either way.")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--alphas", nargs="+", default=["default", "5"],
                        help="InfiniGen windows, in order: 'default' (the engine's alpha; "
                        "first, since a set alpha stays) or a number")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--contention-cores", type=float, default=0.25)
    parser.add_argument("--quiet-wait", type=float, default=20)
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "step_profile")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the Markdown from the JSON at --out (no engine)")
    args = parser.parse_args(argv)
    if "default" in args.alphas[1:]:
        parser.error("--alphas: 'default' goes first (a set alpha stays for later windows)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        meta, settings, rows = report.read_results(args.out)
        report.write_results(args.out, meta, TITLE, settings, rows,
                             sections(rows, meta.get("bandwidth"), argparse.Namespace(**settings)))
        print(args.out.with_suffix(".md").read_text())
        return 0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    progress = machine.Progress(total=len(args.dtypes) * (1 + len(args.alphas)))
    model = models.long_context_model(**{**models.GQA128_MODEL,
                                         "max_positions": args.context + 1024})
    meta = report.run_metadata(model=str(model), load_average_start=machine.load_average())
    machine.wait_for_quiet(args.contention_cores, args.quiet_wait)
    bandwidth = measure_bandwidth(256)
    progress(f"streaming bandwidth: {decode_report.bandwidth_text(bandwidth)}")
    rows = [row for dtype in args.dtypes for manager in ("vllm", "infinigen")
            for row in run(args, model, dtype, manager, progress)]
    meta["bandwidth"] = bandwidth
    meta["load_average_end"] = machine.load_average()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report.write_results(args.out, meta, TITLE, settings, rows, sections(rows, bandwidth, args))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
