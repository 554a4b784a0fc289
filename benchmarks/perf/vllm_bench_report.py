# SPDX-License-Identifier: Apache-2.0
"""Summary of ``benchmarks/perf/vllm_bench.sh``: vLLM's result files side by side.

python -m benchmarks.perf.vllm_bench_report [--model DIR] [--wide-model DIR]

Reads ``benchmarks/results/vllm_bench_{throughput,latency,serve}_{vllm,infinigen}.json``
(written by ``vllm bench``) and the ``.txt`` next to them, adds to each of vLLM's
files a ``meta`` entry (the date, commit, machine and command its ``.txt`` header
records), and writes ``benchmarks/results/vllm_bench.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report
from benchmarks.perf import machine

MANAGERS = ("vllm", "infinigen")
# (label, key in vLLM's JSON, format) per benchmark.
FIELDS = {
    "throughput": [("requests/s", "requests_per_second", ".2f"),
                   ("tokens/s (prompt + output)", "tokens_per_second", ".1f"),
                   ("elapsed s", "elapsed_time", ".2f"), ("requests", "num_requests", "")],
    "latency": [("avg latency s (one batch)", "avg_latency", ".3f"),
                ("p50 s", ("percentiles", "50"), ".3f"), ("p90 s", ("percentiles", "90"), ".3f")],
    "serve": [("requests/s", "request_throughput", ".2f"),
              ("output tokens/s", "output_throughput", ".1f"),
              ("mean TTFT ms", "mean_ttft_ms", ".1f"), ("p99 TTFT ms", "p99_ttft_ms", ".1f"),
              ("mean TPOT ms", "mean_tpot_ms", ".1f"), ("p99 TPOT ms", "p99_tpot_ms", ".1f"),
              ("completed", "completed", ""), ("duration s", "duration", ".1f")],
}


def lookup(data: dict[str, Any], key: str | tuple[str, ...]) -> Any:
    if isinstance(key, str):
        return data.get(key)
    value: Any = data
    for part in key:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def load(results: Path, bench: str, manager: str) -> dict[str, Any] | None:
    path = results / f"vllm_bench_{bench}_{manager}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def txt_provenance(text: str) -> dict[str, str]:
    """The header ``vllm_bench.sh`` writes atop a ``.txt``: date, commit, machine, command."""
    keys = {"# date (UTC): ": "date_utc", "# repository commit: ": "repo_commit",
            "# machine: ": "machine", "$ ": "command"}
    out: dict[str, str] = {}
    for line in text.splitlines():
        for prefix, key in keys.items():
            if line.startswith(prefix) and key not in out:
                out[key] = line[len(prefix):]
    return out


def stamp(results: Path, bench: str, manager: str) -> dict[str, str] | None:
    """Adds the ``.txt`` header to vLLM's JSON as ``meta``; returns it (None: no files)."""
    path = results / f"vllm_bench_{bench}_{manager}.json"
    txt = path.with_suffix(".txt")
    if not (path.is_file() and txt.is_file()):
        return None
    meta = txt_provenance(txt.read_text(errors="replace"))
    data = json.loads(path.read_text())
    data["meta"] = {**meta, "written_by": f"vllm bench {bench}; meta from {txt.name}"}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return meta


def exit_line(results: Path, name: str) -> str | None:
    path = results / f"{name}.txt"
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    return next((line for line in lines if line.startswith("exit code")), None)


def summary(results: Path) -> dict[str, dict[str, dict[str, Any] | None]]:
    out: dict[str, dict[str, dict[str, Any] | None]] = {}
    for bench, fields in FIELDS.items():
        out[bench] = {}
        for manager in MANAGERS:
            data = load(results, bench, manager)
            out[bench][manager] = None if data is None else {
                label: lookup(data, key) for label, key, _ in fields}
    return out


def sections(data: dict, results: Path, args) -> list[str]:
    out = []
    for bench, fields in FIELDS.items():
        rows = []
        for label, _, spec in fields:
            cells = [label]
            for manager in MANAGERS:
                values = data[bench][manager]
                cells.append(report.cell(None if values is None else values[label], spec))
            rows.append(cells)
        model = args.wide_model if bench == "latency" else args.model
        text = [f"## vllm bench {bench} ({Path(model).name})", "",
                report.markdown_table(["", *MANAGERS], rows)]
        for manager in MANAGERS:
            line = exit_line(results, f"vllm_bench_{bench}_{manager}")
            if line and line != "exit code: 0":
                text.append(f"\n`{manager}`: {line} (see vllm_bench_{bench}_{manager}.txt)")
        out.append("\n".join(text))
    bundled = results / "vllm_bench_latency_bundled_vllm.txt"
    if bundled.is_file():
        lines = bundled.read_text(errors="replace").splitlines()
        errors = [line for line in lines if "Error" in line or "error" in line]
        out.append("## vllm bench latency on the bundled model\n\n"
                   f"{exit_line(results, 'vllm_bench_latency_bundled_vllm')}; "
                   "`vllm bench latency` draws prompt ids below 10,000 and the bundled "
                   "model has 512 tokens"
                   + (f": `{errors[-1].strip()[:300]}`" if errors else "") + ". Latency ran "
                   "on a random Llama with a 10,240-token vocabulary instead "
                   "(`benchmarks/harness/models.build_wide_vocab_llama`).")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(paths.BUNDLED_MODEL))
    parser.add_argument("--wide-model", default="wide-vocab-llama")
    parser.add_argument("--results", type=Path, default=paths.RESULTS)
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "vllm_bench")
    parser.add_argument("--command", default="bash benchmarks/perf/vllm_bench.sh",
                        help="how vllm_bench.sh was started (it passes its own)")
    args = parser.parse_args(argv)
    data = summary(args.results)
    runs = {f"vllm_bench_{bench}_{manager}": stamp(args.results, bench, manager)
            for bench in FIELDS for manager in MANAGERS}
    meta = report.run_metadata(model=args.model, wide_model=args.wide_model,
                               load_average=machine.load_average(), runs=runs)
    meta["command"] = args.command
    report.write_results(args.out, meta, "vLLM's own benchmarks, with and without InfiniGen",
                         {"model": args.model, "wide_model": args.wide_model}, data,
                         sections(data, args.results, args))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
