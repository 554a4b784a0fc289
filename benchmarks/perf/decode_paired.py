# SPDX-License-Identifier: Apache-2.0
"""Decode time per step, dense and InfiniGen measured in alternation (``decode_latency --paired``).

This machine's step times drift by 20-40 % over minutes (other tenants of the
host share its memory), and ``decode_latency`` measures dense and InfiniGen
minutes apart: one disturbed window moves a ratio by as much as the effect
measured. Here each engine runs in a process of its own, both hold the same
prompts at once, and the parent runs their windows in turn, ``--rounds``
times: dense, InfiniGen at each ``--alphas`` value, dense, ... A slow spell
then hits the windows of one round alike, and each round gives its own
ratio. The rows are those of ``decode_latency`` (``decode_windows.measure_row``: every
round's steps together), plus ``round_ms`` (each round's median) and, for
InfiniGen, ``paired_speedup`` (the median over rounds of dense's round median
over the config's) and its range.

An engine process waits on its pipe between windows (no CPU); each window
waits for a quiet second first (``--quiet-wait``) and records the cores
other processes kept busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.perf import decode_windows as dw
from benchmarks.perf import kv_math, machine
from benchmarks.perf.step_driver import Driver


def _engine_process(engine_name: str, model: str, args: argparse.Namespace, conn) -> None:
    """Serves one engine: prefill, timed windows and finish, as the parent asks."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    shape = dw.shape_of(Path(model), args)
    _, max_tokens, _, kv_bytes = dw.sizing(engine_name, shape, _sizing_args(args))
    infinigen = dw.ENGINES[engine_name]["infinigen"] is not None
    with dw.engine_of(engine_name, Path(model), args, max_tokens, kv_bytes) as llm:
        driver = Driver(llm, max_tokens)
        default_alpha = llm.collective_rpc(dw.engine_alpha)[0] if infinigen else None
        driver.submit_and_prefill([[1, 5, 6, 7]] * max(b for _, b in dw.grid(args)), "warmup")
        driver.warm(2)
        driver.finish()
        conn.send(("ready", kv_bytes))
        while True:
            command, *params = conn.recv()
            if command == "stop":
                break
            if command == "prefill":
                context, batch = params
                conn.send(driver.submit_and_prefill(prompts_of(context, batch),
                                                    f"c{context}b{batch}"))
            elif command == "window":
                policy, alpha = params
                dw.select_window(llm, policy, alpha, default_alpha, args)
                conn.send(dw.timed_window(llm, driver, policy, args))
            elif command == "finish":
                driver.finish()
                conn.send(True)


def _sizing_args(args: argparse.Namespace) -> argparse.Namespace:
    """``decode_windows.sizing`` counts (1 + retries) windows per policy: here, rounds."""
    return argparse.Namespace(**{**vars(args), "retries": args.rounds - 1})


def prompts_of(context: int, batch: int) -> list[list[int]]:
    """The batch's random prompt ids, the same in every engine process."""
    rng = random.Random(context * 1000 + batch)
    return [[rng.randrange(3, 500) for _ in range(context)] for _ in range(batch)]


class _Engine:
    """The parent's handle on one engine process."""

    def __init__(self, engine_name: str, model: Path, args: argparse.Namespace):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_engine_process, name=f"engine-{engine_name}",
                                       args=(engine_name, str(model), args, child))
        self.process.start()
        child.close()

    def ask(self, *message: Any) -> Any:
        self.conn.send(message)
        return self.answer(message[0])

    def answer(self, what: str) -> Any:
        """The process's next message; fails if it exits or is silent for an hour."""
        for _ in range(3600):
            if self.conn.poll(1):
                try:
                    return self.conn.recv()
                except EOFError:  # it exited: its traceback is on stderr
                    self.process.join(30)
            if not self.process.is_alive():
                raise RuntimeError(f"{self.process.name} exited (code "
                                   f"{self.process.exitcode}) before answering {what!r}")
        raise TimeoutError(f"{self.process.name} did not answer {what!r} in an hour")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(120)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def paired_speedups(round_ms: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per config: dense's round median over the config's, round by round
    (rounds where both ran); the median, lowest and highest of those ratios."""
    dense = round_ms.get("dense")
    out = {}
    for label, rounds in round_ms.items():
        if label == "dense" or not dense:
            continue
        ratios = [d / c for d, c in zip(dense, rounds) if c > 0]
        if ratios:
            out[label] = {"median": statistics.median(ratios), "low": min(ratios),
                          "high": max(ratios)}
    return out


def run(args: argparse.Namespace, model: Path, progress: machine.Progress) -> list[dict]:
    """Every (context, batch): both engines prefill it, then ``args.rounds`` rounds
    of one window per config in turn; one row per config and point."""
    shape = dw.shape_of(model, args)
    windows = [(name, policy, alpha) for name in args.engines
               for policy, alpha in dw.windows(
                   dw.ordered_policies(args.policies) if dw.ENGINES[name]["infinigen"]
                   else [None], args.alphas)]
    engines: dict[str, _Engine] = {}
    rows: list[dict] = []
    try:
        for name in args.engines:
            progress(f"{name}: starting its engine process")
            engines[name] = _Engine(name, model, args)
        for name, handle in engines.items():
            _, kv_bytes = handle.answer("ready")
            progress(f"{name}: engine up ({kv_bytes / 2**20:.0f} MiB KV space)")
        for context, batch in dw.grid(args):
            prefill = {}
            for name, handle in engines.items():
                prefill[name] = handle.ask("prefill", context, batch)
                progress(f"{name}: context {context} x {batch}: prefill {prefill[name]:.1f} s")
            results: dict[tuple, list[dict]] = {window: [] for window in windows}
            for round_index in range(args.rounds):
                for window in windows:
                    name, policy, alpha = window
                    results[window].append(engines[name].ask("window", policy, alpha))
                progress(f"context {context} x {batch}: round {round_index + 1} of "
                         f"{args.rounds}: " + ", ".join(
                             f"{dw.config_label(n, p, a)} "
                             f"{1000 * statistics.median(results[(n, p, a)][-1]['times']):.1f}"
                             for n, p, a in windows) + " ms")
            for handle in engines.values():
                handle.ask("finish")
            point_rows = [_row(window, results[window], context, batch, prefill[window[0]],
                               shape, args) for window in windows]
            speedups = paired_speedups({row["config"]: row["round_ms"] for row in point_rows})
            for row in point_rows:
                entry = speedups.get(row["config"])
                row["paired_speedup"] = entry and entry["median"]
                row["paired_speedup_range"] = entry and [entry["low"], entry["high"]]
                rows.append(row)
                progress(f"{row['config']:>24} context {context:>5} x {batch}: "
                         f"{row['decode_ms_per_step']:7.1f} ms/step"
                         + (f", paired speed-up {entry['median']:.2f} "
                            f"({entry['low']:.2f}-{entry['high']:.2f})" if entry else ""),
                         advance=True)
    finally:
        for handle in engines.values():
            handle.close()
    return rows


def _row(window: tuple, windows: list[dict], context: int, batch: int, prefill_s: float,
         shape: kv_math.ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    """``measure_row`` over every round's steps of one config, plus its round medians."""
    name, policy, alpha = window
    times = [t for w in windows for t in w["times"]]
    delta: dict[str, float] = {}
    for w in windows:
        for key, value in w["delta"].items():
            delta[key] = delta.get(key, 0.0) + value
    mean_context = statistics.fmean(dw.window_context(context, w) for w in windows)
    row = dw.measure_row(engine_name=name, policy=policy, alpha=alpha, context=context,
                         batch=batch, mean_context=mean_context, times=times,
                         full=all(count == batch for w in windows for count in w["got"]),
                         prefill_s=prefill_s, delta=delta, shape=shape, args=args)
    row["round_ms"] = [1000 * statistics.median(w["times"]) for w in windows]
    row["other_cores_busy"] = round(max(w["other_cores"] for w in windows), 3)
    row["attempts"] = 1
    return row
