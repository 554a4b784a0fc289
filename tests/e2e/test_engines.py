# SPDX-License-Identifier: Apache-2.0
"""The tests' in-process engines (``tests/e2e/engines.py``) leave the process as they found it,
and refuse to overlap."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from benchmarks.harness.paths import BUNDLED_MODEL
from tests.e2e.engines import engine, greedy_tokens, random_prompts

pytestmark = pytest.mark.slow
PROMPTS = random_prompts([5, 60], seed=4)


def test_an_engine_in_this_process_leaves_the_process_as_it_found_it():
    import vllm.envs as envs

    environ, threads = dict(os.environ), torch.get_num_threads()
    with engine(str(BUNDLED_MODEL)) as llm:
        assert llm.llm_engine.engine_core.__class__.__name__ == "InprocClient"
        assert len(greedy_tokens(llm, PROMPTS, 4)[1]) == 4
        # Started: vLLM's own variables are gone again, its reads uncached.
        assert dict(os.environ) == environ
        assert not envs._is_envs_cache_enabled()
    assert torch.set_num_threads.__module__ == "torch"
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    assert gc.get_freeze_count() == 0


def test_a_second_engine_in_this_process_is_refused_and_the_shared_one_restarts(shared_engine):
    stock = greedy_tokens(shared_engine(BUNDLED_MODEL), PROMPTS, 4)
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen") as llm:  # closes the shared one
        with pytest.raises(RuntimeError, match="processes=True"):
            with engine(str(BUNDLED_MODEL)):
                pass
        assert len(greedy_tokens(llm, PROMPTS, 4)[0]) == 4
    assert greedy_tokens(shared_engine(BUNDLED_MODEL), PROMPTS, 4) == stock
