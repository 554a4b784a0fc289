# SPDX-License-Identifier: Apache-2.0
"""Serving under load: a long run of concurrent OpenAI completions against `vllm serve`.

python -m benchmarks.perf.load [--url URL | --model DIR] [--kv-manager vllm|infinigen]
    [--requests 100] [--concurrency 16] [--cancel-fraction 0.1] [--out benchmarks/results]

Without ``--url`` it starts ``vllm serve MODEL --kv-manager K`` itself (the
bundled stories260K by default, the tests' flags) and stops it with SIGINT at
the end. At most ``--concurrency`` requests are in flight; the mix is seeded:
token-id and text prompts, streaming and non-streaming, greedy and sampled
(n = 1..3, half of them with a ``seed``), ``ignore_eos``, a fraction of
streams the client hangs up on after a few chunks, and (``--bad-fraction``)
requests the server must refuse with HTTP 400: malformed (negative
``max_tokens``, negative temperature, empty prompt) or out of range (a prompt
longer than the model's context, a token id beyond the vocabulary).

Reports completed requests/s and output tokens/s (tokens delivered, cancelled
streams included) over the wall time, latency percentiles, errors,
cancellations, completed choices whose length is not ``max_tokens``, and
/metrics once the server is idle again. With ``--out DIR``: writes
``DIR/load_<kv_manager>.json`` and rebuilds ``DIR/load.md`` from every
``load_*.json`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import BUNDLED_MODEL
from benchmarks.harness.report import metadata_markdown, run_metadata
from benchmarks.harness.request_mix import (
    IDLE_GAUGES,
    Request,
    Result,
    add_mix_options,
    random_mix,
    send_all,
    wait_until_idle,
)
from benchmarks.harness.servers import metric_total, start_server, stop_server
from benchmarks.perf.latency_stats import percentile


def idle_metrics(base_url: str, timeout: float = 30) -> dict[str, float | None]:
    """The idle gauges (0 once idle), tokens generated and InfiniGen's selected fraction."""
    text = wait_until_idle(base_url, timeout)
    values = {name: metric_total(text, name)
              for name in (*IDLE_GAUGES, "vllm:generation_tokens_total")}
    selected = metric_total(text, "vllm:infinigen_selected_tokens_total")
    candidates = metric_total(text, "vllm:infinigen_candidate_tokens_total")
    values["infinigen_selected_fraction"] = selected / candidates if candidates else None
    return values


def optional_percentile(values: list[float], q: float) -> float | None:
    """``percentile``, or None (JSON null) for no values."""
    return percentile(values, q) if values else None


def summarize(requests: list[Request], results: list[Result], wall: float) -> dict:
    """Counts by how requests ended, throughput and latency percentiles of one run."""
    done = [r for r in results if r.ended == "completed"]
    errors: dict[str, int] = {}
    for r in results:
        if r.ended == "error":
            key = r.error.split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    first = [r.first_token_s for r in results if r.first_token_s is not None]
    return {
        "requests": len(results),
        "completed": len(done),
        "cancelled": sum(r.ended == "cancelled" for r in results),
        "rejected": sum(r.ended == "rejected" for r in results),
        "errors": sum(r.ended == "error" for r in results),
        "error_types": errors,
        "first_errors": [r.error for r in results if r.ended == "error"][:5],
        "wrong_length": sum(r.wrong_length(q) for q, r in zip(requests, results)),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(done) / wall, 3),
        "output_tokens": sum(r.num_tokens for r in results),
        "output_tokens_per_s": round(sum(r.num_tokens for r in results) / wall, 1),
        "latency_p50_s": optional_percentile([r.seconds for r in done], 50),
        "latency_p95_s": optional_percentile([r.seconds for r in done], 95),
        "first_token_p50_s": optional_percentile(first, 50),
    }


def write_table(out_dir: Path) -> None:
    rows = [json.loads(path.read_text()) for path in sorted(out_dir.glob("load_*.json"))]
    lines = ["# Serving under load", "",
             "Concurrent OpenAI completions against `vllm serve` "
             "(`python -m benchmarks.perf.load`); 2-core CPU, so absolute numbers are small.", "",
             "| kv-manager | requests | concurrency | completed | cancelled | errors "
             "| wrong length | req/s | output tok/s | p50 s | p95 s | idle after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        meta, res = row["meta"], row["results"]
        idle = all(not row["idle_after"].get(name) for name in IDLE_GAUGES)
        lines.append(
            f"| {meta['kv_manager']} | {res['requests']} | {meta['concurrency']} "
            f"| {res['completed']} | {res['cancelled']} | {res['errors']} "
            f"| {res['wrong_length']} | {res['requests_per_s']:.2f} "
            f"| {res['output_tokens_per_s']:.0f} | {res['latency_p50_s']:.2f} "
            f"| {res['latency_p95_s']:.2f} | {'yes' if idle else 'NO'} |")
    lines += ["", "\"idle after\": running/waiting requests, InfiniGen pool bytes and device "
              "blocks back to 0 on /metrics."]
    for row in rows:
        lines += ["", f"`load_{row['meta']['kv_manager']}.json`:", "",
                  metadata_markdown(row["meta"])]
    (out_dir / "load.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--kv-manager", choices=["vllm", "infinigen"], default="infinigen")
    parser.add_argument("--serve-args", default="", help="extra `vllm serve` flags, one string")
    parser.add_argument("--concurrency", type=int, default=16)
    add_mix_options(parser)
    parser.add_argument("--out", type=Path, help="directory for load_<kv_manager>.json")
    args = parser.parse_args()
    server = None
    base_url = args.url
    if base_url is None:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"load_{args.kv_manager}_serve.log"
        print(f"starting vllm serve --kv-manager {args.kv_manager} (log: {log})", flush=True)
        server = start_server(log, "--kv-manager", args.kv_manager, *args.serve_args.split(),
                              model=args.model)
        base_url = server.base_url
    try:
        requests = random_mix(args)
        start = time.monotonic()
        results = asyncio.run(send_all(base_url, requests, args.concurrency,
                                       report_every=max(1, len(requests) // 10)))
        wall = time.monotonic() - start
        report = {
            "meta": run_metadata(model=str(args.model), url=args.url,
                                 **{key: value for key, value in vars(args).items()
                                    if key not in ("out", "url", "model")}),
            "results": summarize(requests, results, wall),
            "idle_after": idle_metrics(base_url),
        }
    finally:
        if server is not None:
            stop_server(server)
    print(json.dumps(report, indent=1, default=str))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"load_{args.kv_manager}.json"
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        write_table(args.out)
        print(f"wrote {path} and {args.out / 'load.md'}")
    return 1 if report["results"]["errors"] or report["results"]["wrong_length"] else 0


if __name__ == "__main__":
    sys.exit(main())
