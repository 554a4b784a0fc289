# SPDX-License-Identifier: Apache-2.0
"""Seeded sampling across a split prefill on the CPU platform.

A request whose prefill is split over steps (chunked prefill, a busy batch)
is sampled in every step, and the token of each non-final chunk is discarded.
vLLM 0.32's model runner then rewinds the request's generator by the Philox
offset one sampling consumed (``GPUModelRunner._bookkeeping_sync``:
``gen.set_offset(gen.get_offset() - 4)``), so that the final chunk samples
as an unsplit prefill would. A CPU generator is a Mersenne Twister without
an offset: the call raises ``RuntimeError: CPU Generator does not use
offset`` and the engine dies with every request in flight.

On the CPU platform the InfiniGen worker's model runner instead saves the
generator state of each request whose token will be discarded before it
samples, restores it afterwards, and keeps those generators out of the
offset rewind. The sampled tokens of a seeded request are then the same
whether or not its prefill was split. On any other platform the runner's
own methods are called unchanged. See the patch index in ``__init__.py``.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import torch


def discarded_generators(runner) -> dict[int, torch.Generator]:
    """{batch row: generator} of the seeded requests whose sampled token this
    step discards (non-final prefill chunks)."""
    generators = runner.input_batch.generators
    if not generators:  # no seeded request: every step but those with one
        return {}
    num_reqs = runner.input_batch.num_reqs
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return {int(row): generators[int(row)] for row in rows if int(row) in generators}


def apply(runner) -> bool:
    """Wraps ``runner``'s ``_sample`` and ``_bookkeeping_sync`` (this instance
    only) on the CPU platform. Returns whether it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(runner, "_infinigen_seeded_sampling", False):
        return False
    original_sample = runner._sample
    original_bookkeeping = runner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        states = {row: gen.get_state() for row, gen in discarded_generators(self).items()}
        try:
            return original_sample(*args, **kwargs)
        finally:
            generators = self.input_batch.generators
            for row, state in states.items():
                generators[row].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        with _without(self.input_batch.generators, discarded_generators(self)):
            return original_bookkeeping(*args, **kwargs)

    runner._sample = types.MethodType(_sample, runner)
    runner._bookkeeping_sync = types.MethodType(_bookkeeping_sync, runner)
    runner._infinigen_seeded_sampling = True
    return True


@contextlib.contextmanager
def _without(generators: dict[int, torch.Generator], held: dict[int, torch.Generator]):
    """``generators`` without the rows of ``held`` (already rewound) while inside."""
    for row in held:
        del generators[row]
    try:
        yield
    finally:
        generators.update(held)
