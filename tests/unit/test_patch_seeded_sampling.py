# SPDX-License-Identifier: Apache-2.0
"""The seeded-sampling patch on a stand-in of vLLM's model runner.

The stand-in's ``_bookkeeping_sync`` rewinds generators exactly as vLLM
0.32's does (``gen.set_offset(gen.get_offset() - 4)`` for every discarded
row), which raises on CPU generators.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_infinigen.patch import patch_seeded_sampling


class Runner:
    """The attributes and methods of ``GPUModelRunner`` that the patch touches."""

    def __init__(self, discard: list[bool], seeds: dict[int, int]) -> None:
        self.discard_request_mask = SimpleNamespace(np=np.array(discard + [True] * 3))
        generators = {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}
        self.input_batch = SimpleNamespace(num_reqs=len(discard), generators=generators)
        self.rewound: list[int] = []

    def _sample(self, logits: torch.Tensor) -> dict[int, torch.Tensor]:
        return {row: torch.rand(logits.shape[-1], generator=gen)
                for row, gen in self.input_batch.generators.items()}

    def _bookkeeping_sync(self, tag: str) -> str:
        rows = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        for row in rows:
            gen = self.input_batch.generators.get(int(row))
            if gen is not None:
                self.rewound.append(int(row))
                gen.set_offset(gen.get_offset() - 4)
        return tag


def test_unpatched_rewind_fails_on_cpu_generators():
    """The stand-in reproduces vLLM's failure (else the tests below prove nothing)."""
    runner = Runner([True, False], {0: 1, 1: 2})
    runner._sample(torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="offset"):
        runner._bookkeeping_sync("step")


def test_discarded_rows_sample_again_as_if_never_sampled():
    runner = Runner([True, False, True], {0: 1, 1: 2, 2: 3})
    assert patch_seeded_sampling.apply(runner)
    fresh = {row: torch.rand(8, generator=torch.Generator().manual_seed(seed))
             for row, seed in {0: 1, 1: 2, 2: 3}.items()}

    first = runner._sample(torch.zeros(1, 8))
    assert runner._bookkeeping_sync("step") == "step"
    second = runner._sample(torch.zeros(1, 8))

    for row in (0, 1, 2):
        assert torch.equal(first[row], fresh[row])
    assert torch.equal(second[0], fresh[0]) and torch.equal(second[2], fresh[2])
    assert not torch.equal(second[1], fresh[1])  # kept rows advance
    assert runner.rewound == []  # the offset rewind never saw a discarded row
    assert sorted(runner.input_batch.generators) == [0, 1, 2]


def test_unseeded_and_kept_rows_are_untouched():
    runner = Runner([False, True], {0: 5})  # row 1 is discarded but unseeded
    patch_seeded_sampling.apply(runner)
    assert patch_seeded_sampling.discarded_generators(runner) == {}
    before = runner.input_batch.generators[0].get_state()
    runner._sample(torch.zeros(1, 4))
    runner._bookkeeping_sync("step")
    assert not torch.equal(runner.input_batch.generators[0].get_state(), before)


def test_generators_come_back_when_bookkeeping_raises():
    runner = Runner([True], {0: 1})

    def failing(tag):
        assert runner.input_batch.generators == {}
        raise ValueError(tag)

    runner._bookkeeping_sync = failing
    patch_seeded_sampling.apply(runner)
    with pytest.raises(ValueError, match="boom"):
        runner._bookkeeping_sync("boom")
    assert list(runner.input_batch.generators) == [0]


def test_applied_once_and_only_on_the_cpu_platform(monkeypatch):
    from vllm.platforms import current_platform

    runner = Runner([True], {0: 1})
    assert patch_seeded_sampling.apply(runner)
    wrapped = runner._sample
    assert not patch_seeded_sampling.apply(runner)
    assert runner._sample == wrapped

    other = Runner([True], {0: 1})
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not patch_seeded_sampling.apply(other)
    assert "_sample" not in vars(other) and "_bookkeeping_sync" not in vars(other)
