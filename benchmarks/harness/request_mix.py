# SPDX-License-Identifier: Apache-2.0
"""Seeded mixes of OpenAI completion requests, and the client that sends them to a server.

Two mixes of the same ``Request``: ``fixed_mix`` (28 requests, the tests'
burst: outputs compared across runs) and ``random_mix`` (the load and soak
benchmarks: sizes, fractions and seed from the command line). ``send_all``
sends a mix with at most ``concurrency`` requests in flight and returns one
``Result`` per request, in the mix's order.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from benchmarks.harness.servers import SERVED_NAME, metric_total, metrics

SENTENCE = "Once upon a time, there was a little girl named Lily. She liked to play. "
# /metrics gauges that are back to 0 once a server has nothing to do.
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:infinigen_pool_used_bytes", "vllm:infinigen_device_blocks")
FIXED_MIX_SIZE = 28
# Requests the server must refuse: overrides of the request's fields.
BAD_REQUESTS = {
    "negative max_tokens": {"max_tokens": -1},
    "negative temperature": {"temperature": -1.0},
    "empty prompt": {"prompt": []},
    "prompt beyond the context": {"prompt": [1] + [7] * 4096},
    "token id beyond the vocabulary": {"prompt": [1, 10**7, 5]},
}


@dataclass(frozen=True)
class Request:
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    n: int = 1
    sampled: bool = False  # temperature 0.8, else greedy
    seed: int | None = None
    cancel_after: int | None = None  # chunks read before the client hangs up
    bad: str | None = None  # what makes the server refuse it (HTTP 400)


@dataclass
class Result:
    ended: str  # completed | cancelled | rejected (HTTP 400 to a bad request) | error
    seconds: float = 0.0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index -> ids
    completion_tokens: int | None = None  # from usage
    first_token_s: float | None = None
    error: str = ""

    @property
    def cancelled(self) -> bool:
        return self.ended == "cancelled"

    @property
    def num_tokens(self) -> int:
        """Tokens delivered to the client, all choices."""
        return sum(len(ids) for ids in self.tokens.values())

    def wrong_length(self, request: Request) -> bool:
        """A completed request whose choices are not ``max_tokens`` long each."""
        lengths = [len(self.tokens.get(index, [])) for index in range(request.n)]
        return self.ended == "completed" and lengths != [request.max_tokens] * request.n


# Options of ``random_mix``: name -> (type, load benchmark's default, help).
MIX_OPTIONS = {
    "requests": (int, 100, "requests in the mix"),
    "cancel_fraction": (float, 0.1, "streams the client hangs up on after a few chunks"),
    "sampled_fraction": (float, 0.25, "sampled requests (n 1..3, half of them seeded)"),
    "bad_fraction": (float, 0.0, "requests the server must refuse with HTTP 400"),
    "min_prompt": (int, 4, "shortest token-id prompt"),
    "max_prompt": (int, 300, "longest token-id prompt"),
    "min_tokens": (int, 8, "smallest max_tokens"),
    "max_tokens": (int, 64, "largest max_tokens"),
    "seed": (int, 0, "seed of the mix"),
}


def add_mix_options(parser, **defaults) -> None:
    """``random_mix``'s command-line options (``defaults`` override ``MIX_OPTIONS``')."""
    for name, (kind, default, text) in MIX_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind,
                            default=defaults.get(name, default), help=text)


def fixed_mix(seed: int = 7) -> list[Request]:
    """28 requests: 16 greedy, 8 sampled with a seed and n = 2 or 3, 4 cancelled streams."""
    rng = random.Random(seed)
    requests = []
    for index in range(FIXED_MIX_SIZE):
        if index % 2:
            prompt: str | list[int] = SENTENCE * rng.randint(1, 8)
        else:
            prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(3, 300))]
        kind = index % 7
        max_tokens = rng.randint(8, 48)
        if kind <= 3:
            requests.append(Request(prompt, max_tokens, stream=kind >= 2))
        elif kind <= 5:
            requests.append(Request(prompt, max_tokens, stream=kind == 5, n=kind - 2,
                                    sampled=True, seed=1000 + index))
        else:
            requests.append(Request(prompt, 150, stream=True, cancel_after=rng.randint(1, 4)))
    return requests


def random_mix(args) -> list[Request]:
    """``args.requests`` requests drawn from ``args.seed``: text and token-id prompts,
    streams and not, greedy and sampled (n 1..3, half seeded), cancelled and bad ones
    in the given fractions."""
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
    """Sends one request; how it ended (errors are counted, never raised)."""
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
            return Result("completed", time.monotonic() - start,
                          {choice.index: list(choice.token_ids) for choice in out.choices},
                          out.usage.completion_tokens)
        result = Result("completed")
        stream = await client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)
        chunks = 0
        async for chunk in stream:
            for choice in chunk.choices:
                result.tokens.setdefault(choice.index, []).extend(choice.token_ids or [])
            if result.first_token_s is None and result.num_tokens:
                result.first_token_s = time.monotonic() - start
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
            chunks += 1
            if request.cancel_after is not None and chunks >= request.cancel_after:
                await stream.close()  # closes the connection: the server aborts
                result.ended = "cancelled"
                break
        result.seconds = time.monotonic() - start
        return result
    except Exception as exc:  # counted, the run goes on
        return Result("error", time.monotonic() - start, error=f"{type(exc).__name__}: {exc}")


async def send_all(base_url: str, requests: list[Request], concurrency: int,
                   timeout: float = 600, report_every: int | None = None) -> list[Result]:
    """Sends ``requests`` with at most ``concurrency`` in flight (1: one after another).

    Args:
        timeout: The client's timeout per request, seconds.
        report_every: Print a progress line after every this many results.

    Returns:
        One result per request, in the order of ``requests``.
    """
    from openai import AsyncOpenAI

    results: list[Result | None] = [None] * len(requests)
    gate = asyncio.Semaphore(concurrency)
    start = time.monotonic()

    async def one(client, index: int) -> None:
        async with gate:
            results[index] = await send(client, requests[index])
        done = [r for r in results if r is not None]
        if report_every and len(done) % report_every == 0:
            print(progress_line(done, len(requests), time.monotonic() - start), flush=True)

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=timeout,
                           max_retries=0) as client:
        await asyncio.gather(*(one(client, index) for index in range(len(requests))))
    return results


def burst(base_url: str, requests: list[Request], concurrency: int | None = None,
          timeout: float = 300) -> list[Result]:
    """``send_all`` (all at once unless ``concurrency``), finished within ``timeout`` s."""
    return asyncio.run(asyncio.wait_for(
        send_all(base_url, requests, concurrency or len(requests), timeout=120), timeout))


def progress_line(done: list[Result], total: int, elapsed: float) -> str:
    count = {kind: sum(r.ended == kind for r in done)
             for kind in ("completed", "cancelled", "rejected", "error")}
    return (f"[{len(done):5d}/{total}] {elapsed:7.1f} s  "
            f"{count['completed'] / elapsed:6.2f} req/s  cancelled {count['cancelled']}  "
            f"rejected {count['rejected']}  errors {count['error']}")


def wait_until_idle(base_url: str, timeout: float) -> str:
    """/metrics once every ``IDLE_GAUGES`` gauge is 0 or absent (or after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(base_url)
        if (all(not metric_total(text, name) for name in IDLE_GAUGES)
                or time.monotonic() > deadline):
            return text
        time.sleep(0.5)
