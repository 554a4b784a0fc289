# SPDX-License-Identifier: Apache-2.0
"""Serving under load: a long run of concurrent OpenAI completions against `vllm serve`.

python benchmarks/perf/load.py [--url URL | --model DIR] [--kv-manager vllm|infinigen]
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
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests` importable
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tests.e2e.servers import (  # noqa: E402
    SERVED_NAME,
    metric_total,
    metrics,
    start_server,
    stop_server,
)
from tests.models import BUNDLED_MODEL  # noqa: E402

SENTENCE = "Once upon a time, there was a little girl named Lily. She liked to play. "
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:infinigen_pool_used_bytes", "vllm:infinigen_device_blocks")


@dataclass(frozen=True)
class Request:
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    n: int
    sampled: bool
    cancel_after: int | None  # chunks read before the client hangs up
    seed: int | None = None
    bad: str | None = None  # what makes the server refuse it (HTTP 400)


# Requests the server must refuse: overrides of the request's fields.
BAD_REQUESTS = {
    "negative max_tokens": {"max_tokens": -1},
    "negative temperature": {"temperature": -1.0},
    "empty prompt": {"prompt": []},
    "prompt beyond the context": {"prompt": [1] + [7] * 4096},
    "token id beyond the vocabulary": {"prompt": [1, 10**7, 5]},
}


@dataclass
class Result:
    ended: str  # completed | cancelled | rejected (HTTP 400 to a bad request) | error
    seconds: float
    tokens: int = 0  # delivered to the client, all choices
    wrong_length: bool = False
    first_token_s: float | None = None
    error: str = ""


@dataclass
class Tally:
    results: list[Result] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def line(self, total: int) -> str:
        elapsed = time.monotonic() - self.start
        count = {kind: sum(r.ended == kind for r in self.results)
                 for kind in ("completed", "cancelled", "rejected", "error")}
        return (f"[{len(self.results):5d}/{total}] {elapsed:7.1f} s  "
                f"{count['completed'] / elapsed:6.2f} req/s  cancelled {count['cancelled']}  "
                f"rejected {count['rejected']}  errors {count['error']}")


def make_requests(args) -> list[Request]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        if rng.random() < 0.5:
            prompt: str | list[int] = SENTENCE * rng.randint(1, 8)
        else:
            length = rng.randint(args.min_prompt, args.max_prompt)
            prompt = [1] + [rng.randrange(3, 500) for _ in range(length - 1)]
        cancel = rng.random() < args.cancel_fraction
        sampled = not cancel and rng.random() < args.sampled_fraction
        bad = None
        if not cancel and rng.random() < getattr(args, "bad_fraction", 0.0):
            bad = rng.choice(sorted(BAD_REQUESTS))
        out.append(Request(
            prompt=prompt,
            max_tokens=rng.randint(args.min_tokens, args.max_tokens),
            stream=cancel or rng.random() < 0.5,
            n=rng.randint(1, 3) if sampled else 1,
            sampled=sampled,
            cancel_after=rng.randint(1, 4) if cancel else None,
            seed=rng.randrange(1 << 30) if sampled and rng.random() < 0.5 else None,
            bad=bad,
        ))
    return out


async def send(client, request: Request) -> Result:
    from openai import APIError, BadRequestError

    start = time.monotonic()
    kwargs = dict(model=SERVED_NAME, prompt=request.prompt, max_tokens=request.max_tokens,
                  n=request.n, temperature=0.8 if request.sampled else 0.0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    if request.seed is not None:
        kwargs["seed"] = request.seed
    if request.bad is not None:
        kwargs.update(BAD_REQUESTS[request.bad])
        try:
            out = await client.completions.create(stream=request.stream, **kwargs)
            if request.stream:  # some checks run once the stream has started
                async for _ in out:
                    pass
        except BadRequestError as exc:
            return Result("rejected", time.monotonic() - start, error=str(exc))
        except APIError as exc:  # an error event in the stream
            return Result("rejected", time.monotonic() - start, error=f"in stream: {exc}")
        except Exception as exc:
            return Result("error", time.monotonic() - start,
                          error=f"{type(exc).__name__} to a bad request ({request.bad}): {exc}")
        return Result("error", time.monotonic() - start,
                      error=f"accepted a bad request ({request.bad})")
    try:
        if not request.stream:
            out = await client.completions.create(**kwargs)
            lengths = [len(choice.token_ids) for choice in out.choices]
            return Result("completed", time.monotonic() - start, sum(lengths),
                          wrong_length=lengths != [request.max_tokens] * request.n)
        lengths = [0] * request.n
        result = Result("completed", 0.0)
        stream = await client.completions.create(stream=True, **kwargs)
        chunks = 0
        async for chunk in stream:
            for choice in chunk.choices:
                lengths[choice.index] += len(choice.token_ids or [])
            if result.first_token_s is None and any(lengths):
                result.first_token_s = time.monotonic() - start
            chunks += 1
            if request.cancel_after is not None and chunks >= request.cancel_after:
                await stream.close()
                result.ended = "cancelled"
                break
        result.seconds = time.monotonic() - start
        result.tokens = sum(lengths)
        result.wrong_length = (result.ended == "completed"
                               and lengths != [request.max_tokens] * request.n)
        return result
    except Exception as exc:  # counted, the run goes on
        return Result("error", time.monotonic() - start, error=f"{type(exc).__name__}: {exc}")


async def run_load(base_url: str, requests: list[Request], concurrency: int) -> Tally:
    from openai import AsyncOpenAI

    tally = Tally()
    gate = asyncio.Semaphore(concurrency)
    every = max(1, len(requests) // 10)

    async def one(client, request: Request) -> None:
        async with gate:
            tally.results.append(await send(client, request))
        if len(tally.results) % every == 0:
            print(tally.line(len(requests)), flush=True)

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600,
                           max_retries=0) as client:
        await asyncio.gather(*(one(client, request) for request in requests))
    return tally


def idle_metrics(base_url: str, timeout: float = 30) -> dict[str, float | None]:
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(base_url)
        values = {name: metric_total(text, name) for name in IDLE_GAUGES}
        if all(not value for value in values.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    values["vllm:generation_tokens_total"] = metric_total(text, "vllm:generation_tokens_total")
    selected = metric_total(text, "vllm:infinigen_selected_tokens_total")
    candidates = metric_total(text, "vllm:infinigen_candidate_tokens_total")
    values["infinigen_selected_fraction"] = selected / candidates if candidates else None
    return values


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def summarize(tally: Tally, wall: float) -> dict:
    results = tally.results
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
        "wrong_length": sum(r.wrong_length for r in done),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(done) / wall, 3),
        "output_tokens": sum(r.tokens for r in results),
        "output_tokens_per_s": round(sum(r.tokens for r in results) / wall, 1),
        "latency_p50_s": percentile([r.seconds for r in done], 50),
        "latency_p95_s": percentile([r.seconds for r in done], 95),
        "first_token_p50_s": percentile(first, 50),
    }


def write_table(out_dir: Path) -> None:
    rows = [json.loads(path.read_text()) for path in sorted(out_dir.glob("load_*.json"))]
    lines = ["# Serving under load", "",
             "Concurrent OpenAI completions against `vllm serve` "
             "(`benchmarks/perf/load.py`); 2-core CPU, so absolute numbers are small.", "",
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
    lines += ["", "Commands:", ""]
    lines += [f"    {row['meta']['command']}" for row in rows]
    lines += ["", f"Machine: {rows[0]['meta']['machine']}, {rows[0]['meta']['cpus']} CPUs, "
              f"vLLM {rows[0]['meta']['vllm']}. \"idle after\": running/waiting requests, "
              "InfiniGen pool bytes and device blocks back to 0 on /metrics."] if rows else []
    (out_dir / "load.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--kv-manager", choices=["vllm", "infinigen"], default="infinigen")
    parser.add_argument("--serve-args", default="", help="extra `vllm serve` flags, one string")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--sampled-fraction", type=float, default=0.25)
    parser.add_argument("--bad-fraction", type=float, default=0.0,
                        help="requests the server must refuse with HTTP 400")
    parser.add_argument("--min-prompt", type=int, default=4)
    parser.add_argument("--max-prompt", type=int, default=300)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="directory for load_<kv_manager>.json")
    args = parser.parse_args()
    import vllm

    server = None
    base_url = args.url
    if base_url is None:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"load_{args.kv_manager}_serve.log"
        print(f"starting vllm serve --kv-manager {args.kv_manager} (log: {log})", flush=True)
        server = start_server(log, "--kv-manager", args.kv_manager, *args.serve_args.split(),
                              model=args.model)
        base_url = server.base_url
    try:
        requests = make_requests(args)
        start = time.monotonic()
        tally = asyncio.run(run_load(base_url, requests, args.concurrency))
        wall = time.monotonic() - start
        report = {
            "meta": {"command": " ".join(["python", *sys.argv]), "machine": platform.platform(),
                     "cpus": os.cpu_count(), "vllm": vllm.__version__,
                     "model": str(args.model), "url": args.url,
                     **{key: value for key, value in vars(args).items()
                        if key not in ("out", "url", "model")}},
            "results": summarize(tally, wall),
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
