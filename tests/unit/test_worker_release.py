# SPDX-License-Identifier: Apache-2.0
"""The worker frees the pool rows of requests that finished or were preempted, once:
a preempted request keeps its old block ids in vLLM's runner state until it resumes,
and if it is aborted before that (a client gone, a stop string the front end saw
late), its blocks may be another request's by then."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_infinigen.platforms.cpu.pool_index import CappedPoolIndex
from vllm_infinigen.worker.base import InfiniGenWorkerMixin
from vllm_infinigen.worker.runtime import InfiniGenRuntime

BLOCK = 4


class _Stock:
    def execute_model(self, scheduler_output):
        """vLLM's runner forgets finished requests in the step (a preempted one keeps
        its state, its old block ids included, until it resumes)."""
        for req_id in scheduler_output.finished_req_ids:
            self.model_runner.requests.pop(req_id, None)


class _Worker(InfiniGenWorkerMixin, _Stock):
    pass


def _worker(prefix_caching: bool):
    pool = CappedPoolIndex(1, 1, num_slots=8 * BLOCK, num_rows=16, policy="fifo",
                           block_size=BLOCK)
    released = []  # the data path's releases (CUDA: its device block cache's copies)
    runtime = SimpleNamespace(pool_index=pool, data_path=SimpleNamespace(
        release_blocks=released.extend, released=released))
    runtime.release_blocks = lambda block_ids: InfiniGenRuntime.release_blocks(runtime, block_ids)
    worker = object.__new__(_Worker)
    worker.infinigen_runtime, worker._dense_group = runtime, 0
    worker._released_at_preemption = set()  # (load_model's)
    worker.cache_config = SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=BLOCK)
    worker.model_runner = SimpleNamespace(requests={})
    return worker, pool


def _step(finished=(), preempted=(), resumed=()):
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                             resumed_req_ids=set(resumed))
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                           scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           kv_connector_metadata=None)


def _holds(pool: CappedPoolIndex, block: int) -> bool:
    return bool((pool.row_map[0, block] >= 0).all())


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_aborted_after_its_preemption_frees_nothing_again(prefix_caching):
    worker, pool = _worker(prefix_caching)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[2]])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))  # x's tokens in block 2
    worker.execute_model(_step(preempted={"x"}))
    assert _holds(pool, 2) == prefix_caching  # (retired: kept for a hit, first to go)
    released = worker.infinigen_runtime.data_path.released
    assert released == [2]
    worker.model_runner.requests["y"] = SimpleNamespace(block_ids=[[2]])  # vLLM reuses it
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    worker.execute_model(_step(finished={"x"}))  # x aborted while waiting
    assert _holds(pool, 2) and released == [2]  # y's block: not released again
    assert pool.num_retired.sum() == 0  # nor retired (y holds it)
    worker.execute_model(_step(finished={"y"}))
    assert released == [2, 2]
    if prefix_caching:
        assert pool.num_retired.sum() == BLOCK  # kept for a hit, first to go
    else:
        assert not _holds(pool, 2)


def test_a_finished_requests_block_a_live_request_shares_is_not_retired():
    """With prefix caching a running request may hold a finished one's block (a
    hit on its prompt): only the finished request's own blocks are retired."""
    worker, pool = _worker(True)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[2, 3]])
    worker.model_runner.requests["y"] = SimpleNamespace(block_ids=[[2, 4]])  # y hit block 2
    pool.admit(torch.arange(2 * BLOCK, 5 * BLOCK))
    worker.execute_model(_step(finished={"x"}))
    assert pool.num_retired.sum() == BLOCK  # block 3's rows; block 2 is y's too
    assert _holds(pool, 2) and _holds(pool, 4)


def test_a_resumed_request_frees_its_new_blocks_when_it_finishes():
    worker, pool = _worker(False)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[2]])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    worker.execute_model(_step(preempted={"x"}))
    worker.execute_model(_step(resumed={"x"}))
    worker.model_runner.requests["x"].block_ids = [[5]]  # (the runner's, at the resume)
    pool.admit(torch.arange(5 * BLOCK, 6 * BLOCK))
    worker.execute_model(_step(finished={"x"}))
    assert not _holds(pool, 5)
    assert worker._released_at_preemption == set()


def test_with_prefix_caching_a_preempted_requests_stale_ids_keep_nothing_live():
    """A finished request's entries no live request holds are retired (kept for a
    hit, first to go), though a preempted request's stale ids still name its block."""
    worker, pool = _worker(True)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[5]])
    pool.admit(torch.arange(5 * BLOCK, 6 * BLOCK))
    worker.execute_model(_step(preempted={"x"}))
    worker.model_runner.requests["y"] = SimpleNamespace(block_ids=[[5]])  # vLLM reuses it
    pool.admit(torch.arange(5 * BLOCK, 6 * BLOCK))
    worker.execute_model(_step(finished={"y"}))
    assert pool.num_retired.sum() == BLOCK and pool.occupancy()[0] == 0


def test_preempted_and_resumed_in_one_step_frees_the_old_blocks_and_later_the_new():
    """vLLM's ``reset_prefix_cache`` of running requests preempts and resumes them in
    one step: the old blocks go then, the new ones when the request finishes."""
    worker, pool = _worker(False)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[2]])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    worker.execute_model(_step(preempted={"x"}, resumed={"x"}))
    assert not _holds(pool, 2)
    worker.model_runner.requests["x"].block_ids = [[5]]
    pool.admit(torch.arange(5 * BLOCK, 6 * BLOCK))
    worker.execute_model(_step(finished={"x"}))
    assert not _holds(pool, 5)


def test_a_resumed_requests_old_ids_keep_nothing_live_in_its_resume_step():
    """x preempted; a takes x's old block and finishes in the step x resumes (the
    runner still holds x's old ids then): a's entries are retired."""
    worker, pool = _worker(True)
    worker.model_runner.requests["x"] = SimpleNamespace(block_ids=[[2]])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    worker.execute_model(_step(preempted={"x"}))
    worker.model_runner.requests["a"] = SimpleNamespace(block_ids=[[2]])
    pool.admit(torch.arange(2 * BLOCK, 3 * BLOCK))
    worker.execute_model(_step(finished={"a"}, resumed={"x"}))
    assert pool.num_retired.sum() == BLOCK
