# SPDX-License-Identifier: Apache-2.0
"""How benchmarks/perf/served_step times decode steps: only steps that give every request
of the batch a token, after the prompts and the warm-up, in windows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.perf import served_step


class FakeEngine:
    """Requests whose first tokens come in the given steps, then a token a step each;
    each step takes ``step_ms`` on the fake clock (the prompts' steps ``prompt_ms``)."""

    def __init__(self, first_steps: list[int], tokens: int, step_ms: float,
                 prompt_ms: float = 500.0) -> None:
        self.first_steps, self.tokens = first_steps, tokens
        self.step_ms, self.prompt_ms = step_ms, prompt_ms
        self.step_index, self.now = 0, 0.0

    def has_unfinished_requests(self) -> bool:
        return any(self.step_index < first + self.tokens for first in self.first_steps)

    def step(self) -> list[SimpleNamespace]:
        prompts_left = any(self.step_index < first for first in self.first_steps)
        self.now += (self.prompt_ms if prompts_left else self.step_ms) / 1000
        outputs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7])])
                   for first in self.first_steps
                   if first <= self.step_index < first + self.tokens]
        self.step_index += 1
        return outputs

    def clock(self) -> float:
        return self.now


def test_prompt_steps_and_a_staggered_batch_are_not_timed():
    engine = FakeEngine([0, 3], tokens=1 + served_step.WARMUP_STEPS + 3 * 64 + 8, step_ms=2.5)
    assert served_step.decode_step_ms(engine, 2, clock=engine.clock) == pytest.approx([2.5] * 3)


def test_too_few_steps_of_the_whole_batch_is_an_error():
    engine = FakeEngine([0, 40], tokens=3 * 64, step_ms=1.0)
    with pytest.raises(RuntimeError, match="decode steps of the whole batch"):
        served_step.decode_step_ms(engine, 2, clock=engine.clock)
