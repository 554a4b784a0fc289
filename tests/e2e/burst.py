# SPDX-License-Identifier: Apache-2.0
"""A fixed mix of OpenAI completion requests, sent to a server as one burst.

Used by ``test_load.py`` (a roomy server: outputs compared across runs) and
``test_pressure.py`` (a server short of KV space and pool: preemption,
eviction, split prefills).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from tests.e2e.servers import SERVED_NAME

NUM_JOBS = 28
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:infinigen_pool_used_bytes", "vllm:infinigen_device_blocks")
SENTENCE = "Once upon a time, there was a little girl named Lily. She liked to play. "


@dataclass(frozen=True)
class Job:
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    n: int = 1
    seed: int | None = None  # sampled (temperature 0.8) when set, else greedy
    cancel_after: int | None = None  # chunks read before the client hangs up


@dataclass
class Outcome:
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index -> ids
    completion_tokens: int | None = None  # from usage
    cancelled: bool = False


def make_jobs(seed: int = 7) -> list[Job]:
    """A fixed mix: 16 greedy, 8 sampled with n = 2 or 3, 4 cancelled streams."""
    rng = random.Random(seed)
    jobs = []
    for idx in range(NUM_JOBS):
        if idx % 2:
            prompt: str | list[int] = SENTENCE * rng.randint(1, 8)
        else:
            prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(3, 300))]
        kind = idx % 7
        max_tokens = rng.randint(8, 48)
        if kind <= 3:
            jobs.append(Job(prompt, max_tokens, stream=kind >= 2))
        elif kind <= 5:
            jobs.append(Job(prompt, max_tokens, stream=kind == 5, n=kind - 2,
                            seed=1000 + idx))
        else:
            jobs.append(Job(prompt, 150, stream=True, cancel_after=rng.randint(1, 4)))
    return jobs


async def run_job(client, job: Job) -> Outcome:
    kwargs = dict(model=SERVED_NAME, prompt=job.prompt, max_tokens=job.max_tokens, n=job.n,
                  temperature=0.0 if job.seed is None else 0.8,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    if job.seed is not None:
        kwargs["seed"] = job.seed
    if not job.stream:
        out = await client.completions.create(**kwargs)
        return Outcome({c.index: list(c.token_ids) for c in out.choices},
                       out.usage.completion_tokens)
    outcome = Outcome()
    stream = await client.completions.create(stream=True,
                                             stream_options={"include_usage": True},
                                             **kwargs)
    chunks = 0
    async for chunk in stream:
        for choice in chunk.choices:
            outcome.tokens.setdefault(choice.index, []).extend(choice.token_ids or [])
        if chunk.usage is not None:
            outcome.completion_tokens = chunk.usage.completion_tokens
        chunks += 1
        if job.cancel_after is not None and chunks >= job.cancel_after:
            await stream.close()  # closes the connection: the server aborts
            outcome.cancelled = True
            break
    return outcome


async def run_burst(base_url: str, jobs: list[Job], concurrent: bool) -> list[Outcome]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120,
                           max_retries=0) as client:
        if concurrent:
            return list(await asyncio.gather(*(run_job(client, job) for job in jobs)))
        return [await run_job(client, job) for job in jobs]
