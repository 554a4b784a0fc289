# SPDX-License-Identifier: Apache-2.0
"""The neutral runtime over the CUDA platform's data path (device="cpu"): one decode
step of test_runtime.py's hand-built layers, InfiniGen's block rule selecting
(``LayerState.selector``), the selection's blocks attended, the cache's
counters exported with the runtime's, release through the runtime."""

from __future__ import annotations

import pytest
import torch

from tests.reference.runtime_step import BLOCK, CONTEXT, DIM, build_step
from tests.reference.runtime_step import attend_layer2 as _attend_layer2
from tests.reference.runtime_step import attention_over as _attention_over
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath


@pytest.fixture(params=["partial", "int"])
def step(request):
    """The runtime step of tests/reference/runtime_step.py (IMPORTANT match the query), on the CUDA platform's
    data path with device="cpu" and 8 cache slots per head."""
    return build_step(request.param, lambda config: CudaDataPath("cpu", 8))


def _decode(runtime, metadata, new_slot) -> tuple[torch.Tensor, torch.Tensor]:
    speculating = runtime.layers[1]
    hidden = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    speculating.capture(hidden)
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    query = hidden.view(1, 1, DIM)
    return query, _attend_layer2(runtime, metadata, new_slot, query)


def test_the_policy_keeps_whole_blocks_on_a_block_granular_data_path(step):
    runtime, metadata, new_slot = step
    assert runtime.layers[2].selector is not None  # the data path's own, in blocks
    speculating = runtime.layers[1]
    hidden = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    speculating.capture(hidden)
    runtime.begin_layer(speculating, metadata, new_slot, block_size=BLOCK)
    # alpha 1 counts the 3 IMPORTANT tokens (the token rule keeps just them,
    # test_runtime.py): k = 3 rounds up to one block beside the always-kept
    # first block and own block 2; block 1 is the one left, and every context
    # token of blocks 0 and 1 is selected (block 2 holds none: the context is 32)
    selection = runtime.layers[2].selection
    assert selection.logical[0, 0].tolist() == [0, 1, 2]
    assert selection.seq_lens.tolist() == [CONTEXT + 1]
    kept = list(range(CONTEXT))
    query = hidden.view(1, 1, DIM)
    output = _attend_layer2(runtime, metadata, new_slot, query)
    torch.testing.assert_close(output, _attention_over(kept, query))
    counters = runtime.take_counters()
    assert counters["selected_tokens.2"] == CONTEXT
    assert counters["cache_misses.2"] == 3


def test_the_selected_tokens_blocks_are_attended_and_counted(step):
    runtime, metadata, new_slot = step
    runtime.update_selection(alpha=1000.0)  # the budget (every token) binds: all blocks
    query, output = _decode(runtime, metadata, new_slot)
    # IMPORTANT lie in blocks 0 and 1; block 2 is the row's own: every context token
    torch.testing.assert_close(output, _attention_over(list(range(CONTEXT)), query))
    counters = runtime.take_counters()
    assert counters["selected_tokens.2"] == CONTEXT
    assert counters["cache_misses.2"] == 3 and counters["cache_hits.2"] == 0
    assert counters["pcie_bytes.2"] == 3 * BLOCK * 2 * DIM * 4


def test_release_through_the_runtime_empties_the_cache(step):
    runtime, metadata, new_slot = step
    runtime.update_selection(alpha=1000.0)
    _decode(runtime, metadata, new_slot)
    runtime.take_counters()
    runtime.release_blocks([0, 1, 2])
    cache = runtime.data_path._cache
    assert (cache.block_of == -1).all()
    _decode(runtime, metadata, new_slot)
    assert runtime.take_counters()["cache_misses.2"] == 3
