# SPDX-License-Identifier: Apache-2.0
"""Cost of skewing: `vllm-infinigen prepare` and the engine's load-time skewing.

python -m benchmarks.perf.prepare_cost [--models bundled gutenberg long] [--repeats 2]
    [--engine-starts] [--out benchmarks/results/prepare_cost]

Per model:

- ``prepare`` CLI: ``vllm-infinigen prepare MODEL --out F`` in a child process:
  wall time (imports included), CPU time (user + sys of the child) and peak
  RSS, and the compute time the tool prints (model load, forward over the
  calibration text, SVDs, write).
- load time: what an engine started without ``--infinigen-skew-file`` adds in
  its front-end process (``skew_setup.prepare_skew_file``), in a child
  with an empty ``VLLM_INFINIGEN_CACHE``: cold (computes and caches the
  skew) and warm (finds the cached file and validates it against the model),
  wall and CPU time, after the imports vLLM needs anyway.
- with ``--engine-starts``: seconds to construct an ``LLM`` (stock vLLM,
  InfiniGen with a cold cache, InfiniGen with the cached skew); each start in
  a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import models, paths, report
from benchmarks.harness.engines import engine
from benchmarks.perf import kv_math, machine

PREPARE = Path(sys.executable).parent / "vllm-infinigen"
PRINTED_SECONDS = re.compile(r"; ([0-9.]+) s, peak RSS")

# The notes under the results table.
NOTES = """\
## Notes

- prepare wall/CPU: the whole `vllm-infinigen prepare` process (Python, torch \
and transformers imports included); CPU = user + sys of that child, so with \
2 cores it can exceed wall. The printed compute time is the tool's own \
(model load in the checkpoint's dtype, bfloat16 for 16-bit checkpoints, forward \
over up to 2,048 calibration tokens, one SVD per layer and KV head, writing the file).
- llama3.1-8b-shape: a random-weight bfloat16 checkpoint with Llama 3.1 8B's \
shapes and RoPE scaling (`benchmarks/harness/models.py::full_size_llama`, \
built once and cached), the largest that fits this machine's memory; its \
outputs mean nothing, its time and memory are a real 8B model's.
- load-time: `prepare_skew_file` as the engine's front end runs it without \
`--infinigen-skew-file`: cold = compute + cache, warm = the cached file found \
and validated (fingerprint of the checkpoint, shapes).\
"""


def model_dirs(names: list[str]) -> dict[str, Path]:
    known = {"bundled": lambda: paths.BUNDLED_MODEL, "gutenberg": lambda: paths.GUTENBERG,
             "long": models.long_context_model, "llama3.1-8b-shape": models.full_size_llama}
    out = {}
    for name in names:
        out[name] = Path(known[name]()) if name in known else Path(name)
    return out


def with_rusage(command: list[str], env: dict[str, str] | None = None,
                timeout: float = 900) -> dict[str, Any]:
    """Runs ``command``: wall time, and CPU seconds (user + sys) and peak RSS of that child."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, text=True, cwd=paths.REPO)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        output = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - start,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
            "output": output}


def prepare_cli(model: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{model.name}.skew.safetensors"
    result = with_rusage([str(PREPARE), "prepare", str(model), "--out", str(out)])
    match = PRINTED_SECONDS.search(result["output"])
    result["printed_compute_s"] = float(match.group(1)) if match else None
    result["file_bytes"] = out.stat().st_size if out.is_file() else None
    result["output"] = result["output"][-800:]
    return result


def load_time_child(model: str) -> dict[str, Any]:
    """(In the child.) Cold and warm ``prepare_skew_file`` after vLLM's imports."""
    start = time.perf_counter()
    import vllm  # noqa: F401
    import vllm_infinigen
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.layout import ModelLayout
    from vllm_infinigen.frontend.skew_setup import prepare_skew_file

    vllm_infinigen.register()  # the patches an engine's front end runs with
    imports = time.perf_counter() - start
    out: dict[str, Any] = {"imports_s": imports}
    for phase in ("cold", "warm"):
        wall, cpu = time.perf_counter(), time.process_time()
        config = InfiniGenConfig(speculation_keys="partial")  # the keys a skew is for
        prepare_skew_file(model, config, ModelLayout.of_model_dir(
            model, config.dense_layers, config.partial_ratio))
        out[f"{phase}_wall_s"] = time.perf_counter() - wall
        out[f"{phase}_cpu_s"] = time.process_time() - cpu
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def engine_start_child(model: str, kv_manager: str) -> dict[str, Any]:
    """(In the child.) Seconds to construct an ``LLM`` for ``model``."""
    start = time.perf_counter()
    with engine(model, kv_manager=kv_manager, max_model_len=512,
                kv_cache_memory_bytes=64 << 20):
        return {"start_s": time.perf_counter() - start}


def run_in_child(function: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Runs ``--child FUNCTION ARGS`` of this script; its JSON line, or the error."""
    result = with_rusage([sys.executable, "-m", "benchmarks.perf.prepare_cost", "--child",
                          function, *args], env=env)
    for line in reversed(result["output"].splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "child_wall_s": result["wall_s"],
                    "child_cpu_s": result["cpu_s"]}
    return {"failed": True, "returncode": result["returncode"],
            "output": result["output"][-1500:]}


def measure(models: dict[str, Path], args, progress: machine.Progress) -> list[dict]:
    rows = []
    for name, model in models.items():
        if not model.is_dir():
            progress(f"{name}: {model} is absent, skipped", advance=True)
            continue
        shape = kv_math.model_shape(model)
        row: dict[str, Any] = {"model": name, "path": str(model), "layers": shape.layers,
                               "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                               "params_bytes": sum(f.stat().st_size
                                                   for f in model.glob("*.safetensors")),
                               "cli": [], "load_time": [], "engine_start": {}}
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="prepare_cost_") as tmp:
                progress(f"{name}: prepare CLI (run {repeat + 1})")
                row["cli"].append(prepare_cli(model, Path(tmp)))
                progress(f"{name}: load-time skewing (run {repeat + 1})")
                row["load_time"].append(run_in_child(
                    "load_time", str(model), env={"VLLM_INFINIGEN_CACHE": tmp}))
        if args.engine_starts:
            with tempfile.TemporaryDirectory(prefix="prepare_cost_engine_") as tmp:
                env = {"VLLM_INFINIGEN_CACHE": tmp}
                for label, kv_manager in (("vllm", "vllm"), ("infinigen_cold", "infinigen"),
                                          ("infinigen_warm", "infinigen")):
                    progress(f"{name}: engine start, {label}")
                    row["engine_start"][label] = run_in_child(
                        "engine_start", str(model), kv_manager, env=env)
        rows.append(row)
        progress(f"{name}: done", advance=True)
    return rows


def best(values: list[dict], key: str) -> float | None:
    found = [v[key] for v in values if v.get(key) is not None]
    return min(found) if found else None


def sections(rows: list[dict], args) -> list[str]:
    table = []
    for row in rows:
        cli, load = row["cli"], row["load_time"]
        table.append([
            row["model"], f"{row['layers']} x {row['kv_heads']} x {row['head_dim']}",
            report.cell(best(cli, "wall_s"), ".1f"), report.cell(best(cli, "cpu_s"), ".1f"),
            report.cell(best(cli, "printed_compute_s"), ".1f"),
            report.cell(max((c["max_rss_mib"] for c in cli), default=None), ".0f"),
            report.cell(best(load, "cold_wall_s"), ".2f"),
            report.cell(best(load, "cold_cpu_s"), ".2f"),
            report.cell(best(load, "warm_wall_s"), ".3f"),
            report.cell(best(load, "imports_s"), ".1f"),
        ])
    out = [
        "## Skewing cost (best of "
        f"{args.repeats})\n\n" + report.markdown_table(
            ["model", "layers x KV heads x head dim", "prepare wall s", "prepare CPU s",
             "prepare compute s (printed)", "prepare peak RSS MiB",
             "load-time cold wall s", "load-time cold CPU s", "load-time warm wall s",
             "imports s (paid by vLLM anyway)"], table),
    ]
    starts = [row for row in rows if row["engine_start"]]
    if starts:
        lines = []
        for row in starts:
            cells = [row["model"]]
            for label in ("vllm", "infinigen_cold", "infinigen_warm"):
                cells.append(report.cell(row["engine_start"].get(label, {}).get("start_s"), ".1f"))
            lines.append(cells)
        out.append("## Engine start (LLM construction, s)\n\n" + report.markdown_table(
            ["model", "stock vLLM", "InfiniGen, cold skew cache", "InfiniGen, cached skew"],
            lines))
    out.append(NOTES)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bundled", "gutenberg"],
                        help="bundled, gutenberg, long, llama3.1-8b-shape (16 GB, built once), "
                             "or model directories")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-starts", action="store_true",
                        help="also time LLM construction (starts engines: run under the lock)")
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "prepare_cost")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        function, *rest = args.child
        result = {"load_time": load_time_child, "engine_start": engine_start_child}[function](*rest)
        print(json.dumps(result), flush=True)
        return 0
    models = model_dirs(args.models)
    progress = machine.Progress(total=len(models))
    meta = report.run_metadata(load_average_start=machine.load_average())
    rows = measure(models, args, progress)
    meta["load_average_end"] = machine.load_average()
    settings = {"models": {k: str(v) for k, v in models.items()}, "repeats": args.repeats,
                "engine_starts": args.engine_starts}
    report.write_results(args.out, meta, "Skewing cost: `vllm-infinigen prepare` and load time",
                         settings, rows, sections(rows, args))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
