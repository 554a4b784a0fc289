# SPDX-License-Identifier: Apache-2.0
"""Many concurrent long requests in a fixed KV space: dense vLLM, InfiniGen, vLLM's CPU offloading.

python -m benchmarks.perf.memory_pressure [--model DIR] [--configs vllm infinigen
    vllm-offload vllm-offload-simple] [--requests 24] [--prompt-tokens 1024]
    [--output-tokens 512] [--kv-cache-mib 48] [--offload-gib 1] [--out PATH]

Every configuration gets the same device KV space (``kv_cache_memory_bytes``)
and the same requests, all submitted at once (random prompt ids, greedy,
``ignore_eos``). Reported per configuration: requests/s and output tokens/s
over the wall time, TTFT (from arrival, queueing included), TPOT and
end-to-end latency percentiles from vLLM's per-request ``RequestOutput.metrics``,
preemptions (``vllm:num_preemptions``), the KV capacity vLLM computed
(blocks x block size) and the peak of ``vllm:num_requests_running``.

Configurations:

- ``vllm``: stock vLLM (its defaults: prefix caching on, recompute on preemption).
- ``infinigen``: ``--kv-manager infinigen`` (budget 0.2): the device space holds
  the dense layers' blocks and the partial keys; the sparse layers' K/V live
  in the host pool.
- ``vllm-offload``: stock vLLM with ``--kv-offloading-size GIB``
  (``CacheConfig.kv_offloading_size``; backend ``native`` = vLLM's
  ``OffloadingConnector`` with ``cpu_bytes_to_use = GIB x 2^30``). It copies
  computed KV blocks to a CPU cache so that a later prefix hit (e.g. a
  preempted request coming back) loads them instead of recomputing; it does
  not raise how many requests run at once.
- ``vllm-offload-simple``: the same with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``
  (``SimpleCPUOffloadConnector``).

Each configuration runs in a child process (a failed start-up cannot leave
state behind); a configuration that fails to start is recorded with its error
(vLLM 0.32's CPU offloading workers need CUDA or XPU streams).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report
from benchmarks.harness.engines import engine, infinigen_kwargs
from benchmarks.perf import kv_math, latency_stats, machine

CONFIGS: dict[str, dict[str, Any]] = {
    "vllm": {"kv_manager": "vllm"},
    "infinigen": {"kv_manager": "infinigen", "infinigen": {"budget": 0.2}},
    "vllm-offload": {"kv_manager": "vllm", "offload": True},
    "vllm-offload-simple": {"kv_manager": "vllm", "offload": True,
                            "env": {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}},
}
# The last exception line of a traceback in a log, e.g. "Exception: CPU Offloading is ...".
ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
WRAPPER_ERRORS = ("Engine core initialization failed",)

# The notes under the results table.
NOTES = """\
## Notes

- KV capacity: vLLM's device blocks x block size (InfiniGen: blocks of the dense \
layers' group; the sparse layers' K/V are in the host pool, outside this space); \
≈ requests held = capacity / tokens per request.
- TTFT counts from the arrival (all requests arrive at once, so it includes \
queueing); TPOT = (last token - first token) / (tokens - 1) per request; \
preemptions: `vllm:num_preemptions` over the run (a preempted request is \
recomputed).
- Peak running: `vllm:num_requests_running`, sampled every 4 engine steps.
- others' cores: CPU that processes other than this run's used during it \
(of 2 cores): other jobs share the machine.\
"""


def root_cause(log: str) -> str | None:
    """The innermost exception line of a log: the last one not a wrapper's."""
    found = None
    for line in log.splitlines():
        match = ERROR_LINE.match(line.strip())
        if match and not any(w in match.group(2) for w in WRAPPER_ERRORS):
            found = f"{match.group(1)}: {match.group(2)}"
    return found


def workload(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, args.vocab_limit) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests)]


def run_one(name: str, args) -> dict[str, Any]:
    """Runs one configuration in this process (the child); returns its summary."""
    from vllm import SamplingParams

    setup = CONFIGS[name]
    extra: dict[str, Any] = {}
    if setup.get("offload"):
        extra["kv_offloading_size"] = args.offload_gib
    prompts = workload(args)
    with engine(args.model, kv_manager=setup["kv_manager"],
                **infinigen_kwargs(setup.get("infinigen")),
                max_model_len=args.prompt_tokens + args.output_tokens + 16,
                kv_cache_memory_bytes=args.kv_cache_mib << 20,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.requests, **extra) as llm:
        llm_engine = llm.llm_engine
        cache = llm_engine.vllm_config.cache_config
        block_size = cache.block_size
        num_blocks = cache.num_gpu_blocks
        params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True,
                                detokenize=False)
        # Warm-up (compilation, first-step costs), not measured.
        llm.generate([{"prompt_token_ids": [1, 5, 6, 7] * 16}], SamplingParams(
            max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
        preemptions_before = latency_stats.metric_value(llm.get_metrics(), "vllm:num_preemptions")
        meter = machine.CpuMeter(tree=True).__enter__()
        start = time.monotonic()
        for index, prompt in enumerate(prompts):
            llm_engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        finished: dict[str, Any] = {}
        running_peak, steps, last_report = 0, 0, start
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps % 4 == 0:
                running = latency_stats.metric_value(llm.get_metrics(), "vllm:num_requests_running")
                running_peak = max(running_peak, int(running))
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                print(f"[{name}] {last_report - start:6.1f} s: {len(finished)}/{len(prompts)} "
                      f"finished, {running_peak} running at most", file=sys.stderr, flush=True)
        wall = time.monotonic() - start
        meter.__exit__(None, None, None)
        metrics = llm.get_metrics()
        latencies = [latency_stats.request_latency(out.metrics) for out in finished.values()]
        summary = latency_stats.latency_summary(latencies, wall)
        summary.update(
            config=name, preemptions=latency_stats.metric_value(metrics, "vllm:num_preemptions")
            - preemptions_before,
            running_peak=running_peak, kv_blocks=num_blocks, block_size=block_size,
            other_cores_busy=meter.other_cores,
            kv_capacity_tokens=(num_blocks or 0) * block_size,
            request_tokens=args.prompt_tokens + args.output_tokens,
            kv_capacity_requests=(num_blocks or 0) * block_size
            / (args.prompt_tokens + args.output_tokens),
        )
        if setup["kv_manager"] == "infinigen":
            from vllm_infinigen.scheduler.metrics import summarize

            totals = kv_math.counter_totals(summarize(metrics))
            if totals.get("candidate_tokens"):
                summary["selected_fraction"] = (totals["selected_tokens"]
                                                / totals["candidate_tokens"])
    return summary


def run_child(name: str, args, log_dir: Path) -> dict[str, Any]:
    """Runs ``name`` in a child process; its summary, or the error that stopped it."""
    log = log_dir / f"{name}.log"
    result = log_dir / f"{name}.json"
    env = {**os.environ, **CONFIGS[name].get("env", {})}
    command = [sys.executable, "-m", "benchmarks.perf.memory_pressure", "--run-config", name,
               "--result-file", str(result), *args.child_argv]
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=paths.REPO)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    for line in text.splitlines():  # forward the child's progress lines
        if line.startswith(f"[{name}]"):
            print(line, file=sys.stderr)
    if proc.returncode == 0 and result.is_file():
        return json.loads(result.read_text())
    return {"config": name, "failed": True, "returncode": proc.returncode,
            "error": root_cause(text), "seconds": round(time.monotonic() - start, 1),
            "log_tail": text[-3000:]}


def sections(results: list[dict], args) -> list[str]:
    ok = [r for r in results if not r.get("failed")]
    headers = ["config", "KV capacity (tokens)", "≈ requests held", "peak running", "preemptions",
               "requests/s", "output tokens/s", "TTFT p50 s", "TTFT p90 s", "TPOT p50 ms",
               "TPOT p90 ms", "e2e p50 s", "wall s", "others' cores"]
    rows = [[r["config"], str(r["kv_capacity_tokens"]), f"{r['kv_capacity_requests']:.1f}",
             str(r["running_peak"]), f"{r['preemptions']:.0f}", f"{r['requests_per_s']:.3f}",
             f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_s_p50']:.2f}",
             f"{r['ttft_s_p90']:.2f}", f"{1000 * r['tpot_s_p50']:.1f}",
             f"{1000 * r['tpot_s_p90']:.1f}", f"{r['e2e_s_p50']:.2f}", f"{r['wall_s']:.1f}",
             report.cell(r.get("other_cores_busy"), ".2f")]
            for r in ok]
    out = [
        f"{args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} "
        f"output tokens, all submitted at once; device KV space {args.kv_cache_mib} MiB for "
        "every configuration.",
        "## Results\n\n" + report.markdown_table(headers, rows),
    ]
    failed = [r for r in results if r.get("failed")]
    if failed:
        lines = ["## Configurations that did not run", ""]
        for r in failed:
            lines.append(f"- `{r['config']}`: {r.get('error') or 'see log_tail in the JSON'} "
                         f"(exit code {r.get('returncode')})")
        out.append("\n".join(lines))
    out.append(NOTES)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=paths.GUTENBERG)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-mib", type=int, default=48)
    parser.add_argument("--offload-gib", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vocab-limit", type=int, default=8000,
                        help="prompt ids are drawn from [3, this)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "memory_pressure")
    parser.add_argument("--run-config", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # The children get the same options (plus --run-config); they ignore --configs.
    args.child_argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_config:
        summary = run_one(args.run_config, args)
        args.result_file.write_text(json.dumps(summary, indent=1, default=str))
        return 0
    if not args.model.is_dir():
        print(f"skipped: model directory {args.model} is absent (pass --model)")
        return 0
    progress = machine.Progress(total=len(args.configs))
    meta = report.run_metadata(model=str(args.model), load_average_start=machine.load_average())
    results = []
    with tempfile.TemporaryDirectory(prefix="memory_pressure_") as tmp:
        for name in args.configs:
            progress(f"{name}: running")
            result = run_child(name, args, Path(tmp))
            results.append(result)
            if result.get("failed"):
                progress(f"{name}: did not run: {result.get('error')}", advance=True)
            else:
                progress(f"{name}: {result['requests_per_s']:.3f} req/s, "
                         f"{result['output_tokens_per_s']:.1f} tok/s, "
                         f"{result['preemptions']:.0f} preemptions", advance=True)
    meta["load_average_end"] = machine.load_average()
    settings = {key: (str(value) if isinstance(value, Path) else value)
                for key, value in vars(args).items()
                if key not in ("run_config", "result_file", "child_argv")}
    title = f"Memory pressure: {args.model.name}, fixed {args.kv_cache_mib} MiB KV space"
    report.write_results(args.out, meta, title, settings, results, sections(results, args))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
