# SPDX-License-Identifier: Apache-2.0
"""The neutral runtime over the CUDA platform's data path (device="cpu"): one decode
step of test_runtime.py's hand-built layers, the selection's blocks attended, the
cache's counters exported with the runtime's, release through the runtime."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_runtime import (
    BLOCK,
    CONTEXT,
    DIM,
    _attend_layer2,
    _attention_over,
    build_step,
)
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath


@pytest.fixture(params=["partial", "int"])
def step(request):
    """test_runtime.py's step (IMPORTANT match the query), on the CUDA platform's
    data path with device="cpu" and 8 cache slots per head."""
    return build_step(request.param, lambda config: CudaDataPath("cpu", 8))


def _decode(runtime, metadata, new_slot) -> tuple[torch.Tensor, torch.Tensor]:
    speculating = runtime.layers[1]
    hidden = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    speculating.capture(hidden)
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    query = hidden.view(1, 1, DIM)
    return query, _attend_layer2(runtime, metadata, new_slot, query)


def test_the_selected_tokens_blocks_are_attended_and_counted(step):
    runtime, metadata, new_slot = step
    query, output = _decode(runtime, metadata, new_slot)
    # IMPORTANT lie in blocks 0 and 1; block 2 is the row's own: every context token
    torch.testing.assert_close(output, _attention_over(list(range(CONTEXT)), query))
    counters = runtime.take_counters()
    assert counters["selected_tokens.2"] == CONTEXT
    assert counters["cache_misses.2"] == 3 and counters["cache_hits.2"] == 0
    assert counters["pcie_bytes.2"] == 3 * BLOCK * 2 * DIM * 4


def test_release_through_the_runtime_empties_the_cache(step):
    runtime, metadata, new_slot = step
    _decode(runtime, metadata, new_slot)
    runtime.take_counters()
    runtime.release_blocks([0, 1, 2])
    cache = runtime.data_path._layers[2].cache
    assert (cache.block_of == -1).all()
    _decode(runtime, metadata, new_slot)
    assert runtime.take_counters()["cache_misses.2"] == 3
