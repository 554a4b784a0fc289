# SPDX-License-Identifier: Apache-2.0
"""How benchmarks/perf/prefix_reuse times requests: each one's first token from when
the requests were added, and the last token of all."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.perf import prefix_reuse


class FakeEngine:
    """Each added request gives its first token at the step its ``firsts`` entry names
    (in order of adding), then one a step for ``tokens``; a step takes 0.5 s."""

    def __init__(self, firsts: list[int], tokens: int) -> None:
        self.firsts, self.tokens = firsts, tokens
        self.added: list[str] = []
        self.step_index, self.now = 0, 10.0

    def add_request(self, request_id: str, prompt: dict, params: object) -> None:
        self.added.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(self.step_index < first + self.tokens for first in self.firsts)

    def step(self) -> list[SimpleNamespace]:
        self.now += 0.5
        outputs = [SimpleNamespace(request_id=request_id,
                                   outputs=[SimpleNamespace(token_ids=[7])])
                   for request_id, first in zip(self.added, self.firsts)
                   if first <= self.step_index < first + self.tokens]
        self.step_index += 1
        return outputs

    def clock(self) -> float:
        return self.now


def test_each_requests_first_token_and_the_last():
    engine = FakeEngine([2, 0, 5], tokens=3)
    result = prefix_reuse.timed(engine, [{}] * 3, None, "batch", clock=engine.clock)
    assert engine.added == ["batch-0", "batch-1", "batch-2"]
    assert result["ttft_s"] == pytest.approx([1.5, 0.5, 3.0])
    assert result["total_s"] == pytest.approx(4.0)


def test_a_request_without_a_token_is_an_error():
    engine = FakeEngine([0, 1], tokens=1)
    with pytest.raises(RuntimeError, match="2 of 3 requests"):
        prefix_reuse.timed(engine, [{}] * 3, None, "batch", clock=engine.clock)
