# SPDX-License-Identifier: Apache-2.0
"""Soak: repeated bursts of mixed OpenAI traffic against a server short of memory.

python -m benchmarks.perf.soak [--bursts 3] [--requests 200] [--concurrency 24]
    [--out benchmarks/results]

Starts ``vllm serve`` on the bundled stories260K with ``--kv-manager
infinigen``, a KV space of a few requests (``--kv-cache-memory-bytes``: vLLM
preempts), a capped pool (``--infinigen-cpu-pool-gib``: every sparse layer
evicts) and small steps (``--max-num-batched-tokens``: prefills are split,
seeded ones included). Each burst is the mix of ``load`` (streaming and
not, token-id and text prompts, greedy and sampled with n = 1..3, half of the
sampled ones seeded, client cancellations) with requests the server must
refuse (malformed and out of range). After each burst, once the server is
idle, it records the resident memory of the server's process tree (API
server, engine core, worker), preemptions and evictions so far.

Writes ``soak.json`` and ``soak.md`` to ``--out``. Exit code 1 when a request
failed unexpectedly, a completed request had the wrong length, the server was
not idle after a burst, or the resident memory grew by more than
``--rss-growth`` between the second and the last burst (the first burst
warms caches up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import BUNDLED_MODEL, RESULTS
from benchmarks.harness.report import metadata_markdown, run_metadata
from benchmarks.harness.request_mix import BAD_REQUESTS, IDLE_GAUGES, random_mix, send_all
from benchmarks.harness.servers import (
    metric_total,
    metrics,
    process_tree,
    start_server,
    stop_server,
)
from benchmarks.perf.load import idle_metrics, summarize
from vllm_infinigen.layout import ModelLayout


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants."""
    import psutil

    total = 0
    for proc in process_tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def counters(base_url: str) -> dict[str, float]:
    text = metrics(base_url)
    return {name: metric_total(text, name) or 0.0 for name in (
        "vllm:num_preemptions_total", "vllm:infinigen_evictions_total",
        "vllm:request_success_total")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per burst")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 20)
    parser.add_argument("--pool-tokens", type=int, default=1024,
                        help="pool cap in tokens per sparse layer and KV head")
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--rss-growth", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # The mix of the load benchmark.
    args.cancel_fraction, args.sampled_fraction, args.bad_fraction = 0.1, 0.3, 0.05
    args.min_prompt, args.max_prompt, args.min_tokens, args.max_tokens = 4, 300, 8, 64
    return args


def run(args) -> dict:
    # stories260K: 3 sparse layers x 4 KV heads x K+V of 32 float32 per token.
    token_bytes = ModelLayout.of_model_dir(BUNDLED_MODEL).pool_bytes_per_token(dtype_bytes=4)
    pool_gib = args.pool_tokens * token_bytes / 2**30
    flags = ["--kv-manager", "infinigen", "--infinigen-budget", "0.2",
             "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
             "--infinigen-cpu-pool-gib", f"{pool_gib:.9f}",
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "soak_serve.log"
    print(f"vllm serve {' '.join(flags)} (log: {log})", flush=True)
    server = start_server(log, *flags)
    bursts = []
    try:
        rss_start = tree_rss(server.proc.pid)
        for burst in range(args.bursts):
            args.seed = burst
            requests = random_mix(args)
            start = time.monotonic()
            results = asyncio.run(send_all(server.base_url, requests, args.concurrency,
                                           report_every=max(1, len(requests) // 10)))
            wall = time.monotonic() - start
            idle = idle_metrics(server.base_url)
            summary = summarize(requests, results, wall)
            done = sorted(r.seconds for r in results if r.ended == "completed")
            summary["latency_p99_s"] = done[min(len(done) - 1, int(0.99 * len(done)))]
            entry = {"burst": burst, "results": summary, "idle_after": idle,
                     "idle": all(not idle.get(name) for name in IDLE_GAUGES),
                     "counters": counters(server.base_url),
                     "rss_bytes": tree_rss(server.proc.pid),
                     "seeded": sum(r.seed is not None for r in requests),
                     "bad": sum(r.bad is not None for r in requests)}
            bursts.append(entry)
            print(f"burst {burst}: {summary['completed']} completed, {summary['cancelled']} "
                  f"cancelled, {summary['rejected']} rejected, {summary['errors']} errors; "
                  f"RSS {entry['rss_bytes'] / 2**20:.0f} MiB; idle {entry['idle']}", flush=True)
    finally:
        code = stop_server(server)
    return {"meta": run_metadata(serve_flags=flags, bad_requests=sorted(BAD_REQUESTS),
                                 **{k: v for k, v in vars(args).items()
                                    if k not in ("out", "seed")}),
            "rss_start_bytes": rss_start, "bursts": bursts, "server_exit_code": code}


def verdict(report: dict, growth_limit: float) -> tuple[bool, float]:
    bursts = report["bursts"]
    rss = [b["rss_bytes"] for b in bursts]
    growth = (rss[-1] - rss[1]) / rss[1] if len(rss) > 1 else 0.0
    ok = all(b["results"]["errors"] == 0 and b["results"]["wrong_length"] == 0 and b["idle"]
             for b in bursts) and growth <= growth_limit
    return ok, growth


def write_markdown(report: dict, path: Path, growth_limit: float) -> None:
    ok, growth = verdict(report, growth_limit)
    meta = report["meta"]
    lines = ["# Soak: repeated bursts under preemption, eviction and split prefills", "",
             metadata_markdown(meta),
             f"- server: `vllm serve stories260k {' '.join(meta['serve_flags'])}` "
             "(plus the tests' flags: float32, --max-model-len 512, --enforce-eager)",
             f"- per burst: {meta['requests']} requests, {meta['concurrency']} in flight; "
             "streaming and not, token-id and text prompts, greedy and sampled (n 1-3, half "
             f"seeded), ~10% cancelled by the client, ~5% refused on purpose "
             f"({', '.join(meta['bad_requests'])})",
             f"- resident memory of the server's processes at start: "
             f"{report['rss_start_bytes'] / 2**20:.0f} MiB", "",
             "| burst | completed | cancelled | refused | errors | wrong length "
             "| seeded | p50 s | p99 s | preemptions (total) | evictions (total) "
             "| idle after | RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report["bursts"]:
        r, c = b["results"], b["counters"]
        lines.append(
            f"| {b['burst']} | {r['completed']} | {r['cancelled']} | {r['rejected']} "
            f"| {r['errors']} | {r['wrong_length']} | {b['seeded']} | {r['latency_p50_s']:.2f} "
            f"| {r['latency_p99_s']:.2f} | {c['vllm:num_preemptions_total']:.0f} "
            f"| {c['vllm:infinigen_evictions_total']:.0f} | {'yes' if b['idle'] else 'NO'} "
            f"| {b['rss_bytes'] / 2**20:.0f} |")
    lines += ["", "refused: the bad requests, answered with HTTP 400 or (checks that run "
              "once a stream has started) an error event in the stream; errors: anything "
              "else that failed, bad requests accepted included. Preemptions and "
              "evictions are the server's totals so far; RSS is the resident memory of "
              "the server's processes once idle after the burst.",
              "", f"RSS growth from burst 1 to burst {len(report['bursts']) - 1}: "
              f"{100 * growth:+.1f}% (limit {100 * growth_limit:.0f}%); server exit code on "
              f"SIGINT: {report['server_exit_code']}. Verdict: {'pass' if ok else 'FAIL'}."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_markdown(report, args.out / "soak.md", args.rss_growth)
    print((args.out / "soak.md").read_text())
    return 0 if verdict(report, args.rss_growth)[0] else 1


if __name__ == "__main__":
    sys.exit(main())
