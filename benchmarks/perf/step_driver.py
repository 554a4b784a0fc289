# SPDX-License-Identifier: Apache-2.0
"""Drives an in-process engine step by step: submit a batch, prefill, timed decode windows.

The engine core must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that each ``LLMEngine.step`` is one scheduler step whose time is measured.
"""

from __future__ import annotations

import statistics
import time


class Driver:
    """Steps an in-process engine through submit / prefill / timed decode windows."""

    def __init__(self, llm, max_tokens: int):
        from vllm import SamplingParams

        self.llm = llm
        self.engine = llm.llm_engine
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     detokenize=False)
        self.generated: dict[str, int] = {}

    def _step(self) -> int:
        """One engine step; returns how many requests got a token."""
        got = 0
        for out in self.engine.step():
            tokens = len(out.outputs[0].token_ids) if out.outputs else 0
            if tokens > self.generated.get(out.request_id, 0):
                got += 1
            self.generated[out.request_id] = tokens
        return got

    def submit_and_prefill(self, prompts: list[list[int]], tag: str) -> float:
        """Adds the requests and steps until each has its first token; returns seconds."""
        self.generated = {}
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            request_id = f"{tag}-{index}"
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, self.params)
            self.generated[request_id] = 0
        while min(self.generated.values()) < 1:
            self._step()
        return time.perf_counter() - start

    def warm(self, steps: int) -> None:
        for _ in range(steps):
            self._step()

    def window(self, steps: int) -> tuple[list[float], list[int]]:
        """``steps`` timed steps: (seconds per step, requests that got a token in each)."""
        times, got = [], []
        for _ in range(steps):
            start = time.perf_counter()
            got.append(self._step())
            times.append(time.perf_counter() - start)
        return times, got

    def mean_generated(self) -> float:
        return statistics.fmean(self.generated.values())

    def finish(self) -> None:
        """Aborts the batch and steps until the engine is idle."""
        self.engine.abort_request(list(self.generated))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.generated = {}
