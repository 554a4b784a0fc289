# SPDX-License-Identifier: Apache-2.0
"""vLLM's prefix caching with InfiniGen: a hit reuses the dense layers' blocks,
and by their slot ids the sparse layers' pool rows and speculation keys, with
the same tokens as a prefill of the whole prompt."""

from __future__ import annotations

import contextlib

import pytest

from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

# A prefix of two 128-token steps (the tests' --max-num-batched-tokens), so
# that a request alone is prefilled in the same chunks whether it hits it or not.
PREFIX = 256
SUFFIXES = [40, 17, 64]
MAX_TOKENS = 24
BUDGET = {"kv_manager": "infinigen", "infinigen_budget": 0.2}


def shared_prefix_prompts(seed: int = 0) -> list[dict]:
    """Prompts of ``PREFIX`` common tokens and suffixes of ``SUFFIXES`` tokens."""
    prefix = random_prompts([PREFIX], seed=seed)[0]["prompt_token_ids"]
    suffixes = random_prompts([n + 1 for n in SUFFIXES], seed=seed + 1)
    return [{"prompt_token_ids": prefix + s["prompt_token_ids"][1:]} for s in suffixes]


def prefix_cache_hits(llm) -> int:
    """Prompt tokens vLLM found in its prefix cache so far."""
    return int(sum(metric.value for metric in llm.get_metrics()
                   if metric.name == "vllm:prefix_cache_hits"))


def test_budget_with_hits_equals_without(tiny_models):
    """At budget 0.2, one request at a time: the requests that hit the first
    one's prefix generate what an engine without prefix caching does."""
    model = tiny_models["llama-gqa"]
    prompts = shared_prefix_prompts()
    with engine(model, enable_prefix_caching=True, **BUDGET) as llm:
        hot = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        hits = prefix_cache_hits(llm)
        with pytest.raises(Exception, match="--no-enable-prefix-caching") as refused:
            llm.collective_rpc("set_infinigen_selection", kwargs={"policy": "h2o"})
    with engine(model, enable_prefix_caching=False, **BUDGET) as llm:
        cold = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
    assert hits >= (len(prompts) - 1) * PREFIX
    assert hot == cold
    assert "--infinigen-policy h2o" in str(refused.value)


# gemma3: its sliding-window layers' groups take part in vLLM's hit lookup (beside
# the dense group; the sparse groups do not). opt: no RoPE, learned positions.
@pytest.mark.parametrize("name", ["llama-gqa", "gemma3", "opt"])
def test_select_all_with_hits_equals_stock(name, tiny_models, shared_engine):
    """Select-all, one batch whose requests hit each other's blocks (within a
    step, and across steps while the long ones are still prefilled), then the
    same prompts again (whole-prompt hits): stock vLLM's tokens, both times."""
    model = tiny_models[name]
    prompts = shared_prefix_prompts(seed=3)
    stock_llm = shared_engine(model)
    stock_llm.reset_prefix_cache()
    stock = greedy_tokens(stock_llm, prompts, MAX_TOKENS)
    stock_again = greedy_tokens(stock_llm, prompts, MAX_TOKENS)
    with engine(model, enable_prefix_caching=True, **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, prompts, MAX_TOKENS)
        before = prefix_cache_hits(llm)
        again = greedy_tokens(llm, prompts, MAX_TOKENS)
        hits = prefix_cache_hits(llm) - before
    assert hits >= len(prompts) * PREFIX
    assert ours == stock
    assert again == stock_again


def test_capped_pool_keeps_a_finished_requests_rows_for_a_hit(shared_engine):
    """A capped pool (--infinigen-cpu-pool-gib) retires a finished request's
    rows instead of freeing them: the requests after it hit its prefix and,
    select-all, generate stock vLLM's tokens, with nothing evicted; a flush
    leaves only the flushing request's entries counted as held."""
    from benchmarks.harness.paths import BUNDLED_MODEL
    from tests.e2e.test_pool_cap import POOL_GIB, POOL_TOKENS, TOKEN_BYTES

    model = str(BUNDLED_MODEL)
    prompts = shared_prefix_prompts(seed=5)
    stock_llm = shared_engine(model)
    stock = [greedy_tokens(stock_llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
    with engine(model, enable_prefix_caching=True, infinigen_cpu_pool_gib=POOL_GIB,
                **SELECT_ALL) as llm:
        ours = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        hits = prefix_cache_hits(llm)
        greedy_tokens(llm, random_prompts([3], seed=1), 1)  # frees what the others held
        counters = summarize(llm.get_metrics())
    assert hits >= (len(prompts) - 1) * PREFIX
    assert ours == stock
    assert sum(counters.get("evictions", {}).values()) == 0
    assert sum(counters["pool_used_bytes"].values()) == 3 * TOKEN_BYTES
    assert sum(counters["pool_capacity_bytes"].values()) == POOL_TOKENS * TOKEN_BYTES


def test_the_cuda_data_path_serves_hits_from_the_pool(tiny_models, shared_engine):
    """The CUDA platform's data path (``cuda_path_worker.py``, on CPU tensors): a
    finished request's blocks leave the device block cache, and the requests that
    hit its prefix fetch them from the pool again; select-all, one at a time and
    then in one batch, stock vLLM's tokens."""
    from tests.e2e.cuda_path_worker import with_cuda_data_path

    model = tiny_models["llama-gqa"]
    prompts = shared_prefix_prompts(seed=7)
    stock_llm = shared_engine(model)
    stock_llm.reset_prefix_cache()
    stock = [greedy_tokens(stock_llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
    stock_batch = greedy_tokens(stock_llm, prompts, MAX_TOKENS)
    with with_cuda_data_path(), engine(model, enable_prefix_caching=True, **SELECT_ALL) as llm:
        ours = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        batch = greedy_tokens(llm, prompts, MAX_TOKENS)
        hits = prefix_cache_hits(llm)
        counters = summarize(llm.get_metrics())
    assert hits >= (2 * len(prompts) - 1) * PREFIX
    assert sum(counters["cache_misses"].values()) > 0
    assert ours == stock
    assert batch == stock_batch


# gemma3: its window groups take part in the hit lookup beside the dense group.
@pytest.mark.parametrize("name, data_path", [("stories260K", "cpu"), ("stories260K", "cuda"),
                                             ("gemma3", "cpu")])
def test_device_first_shares_a_resident_hits_sparse_blocks(name, data_path, tiny_models,
                                                            shared_engine, monkeypatch):
    """``device-first`` keeps prefix caching on: a resident request's hit shares the
    sparse groups' cached blocks as it shares the dense group's, one request at a time
    (nothing copied). With those uncached (as a move leaves them), the same prompts in
    one batch get fresh sparse blocks for the dense group's whole hit, which the workers
    fill from the pool before the forward; without the fill they would hold whatever
    they held before. The engine stays resident (vLLM's kernel over those blocks, no
    InfiniGen step), and its tokens are stock vLLM's both times."""
    import contextlib

    from benchmarks.harness.paths import BUNDLED_MODEL
    from tests.e2e.cuda_path_worker import with_cuda_data_path
    from vllm_infinigen.worker import restore

    copied = []
    copy = restore.copy_from_pool
    monkeypatch.setattr(restore, "copy_from_pool",
                        lambda *args, **kwargs: copied.append(copy(*args, **kwargs)))
    model = str(BUNDLED_MODEL) if name == "stories260K" else tiny_models[name]
    prompts = shared_prefix_prompts(seed=9)
    stock_llm = shared_engine(model)
    stock_llm.reset_prefix_cache()
    stock = [greedy_tokens(stock_llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
    stock_batch = greedy_tokens(stock_llm, prompts, MAX_TOKENS)
    worker = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with worker, engine(model, infinigen_residency="device-first", **SELECT_ALL) as llm:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        ours = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        shared_copies = list(copied)
        assert uncache_sparse_blocks(llm) > 0
        batch = greedy_tokens(llm, prompts, MAX_TOKENS)
        hits = prefix_cache_hits(llm)
        counters = summarize(llm.get_metrics())
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
    assert hits >= (2 * len(prompts) - 1) * PREFIX
    # the prefix's blocks once, per layer: the batch's others share what the first filled
    assert shared_copies == [] and sum(copied) == PREFIX // block_size
    assert counters["resident"] == {"": 1.0}
    assert counters.get("residency_moves", {}) in ({}, {"pool": 0, "device": 0})
    assert sum(counters.get("selected_tokens", {}).values()) == 0  # vLLM's kernel only
    assert ours == stock
    assert batch == stock_batch


def uncache_sparse_blocks(llm) -> int:
    """Takes the sparse groups' blocks out of an in-process engine's prefix cache (the
    dense group's stay); returns how many were cached."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    from vllm_infinigen.scheduler.spec import InfiniGenSparseManager

    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    sparse = {index for index, group in enumerate(manager.coordinator.single_type_managers)
              if isinstance(group, InfiniGenSparseManager)}
    cached = {block.block_id for block in manager.block_pool.blocks
              if block.block_hash is not None and get_group_id(block.block_hash) in sparse}
    manager.block_pool.evict_blocks(cached)
    return len(cached)


def test_device_first_hits_on_blocks_computed_in_the_same_step(tiny_models):
    """Prompts sharing a prefix, new to the cache, in one step (a step of 1,024
    tokens): the later ones hit the blocks the first computes in that step, which the
    pool does not hold before the forward, so the sparse groups share them as the dense
    group does. Stock vLLM's tokens (a fill from the pool gave others)."""
    from benchmarks.harness.paths import BUNDLED_MODEL

    model, prompts = str(BUNDLED_MODEL), shared_prefix_prompts(seed=21)
    with engine(model, max_num_batched_tokens=1024) as llm:
        stock = greedy_tokens(llm, prompts, MAX_TOKENS)
    with engine(model, max_num_batched_tokens=1024, infinigen_residency="device-first",
                **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, prompts, MAX_TOKENS)
        hits = prefix_cache_hits(llm)
    assert hits == (len(prompts) - 1) * PREFIX
    assert ours == stock


def test_device_first_over_a_capped_pool_moves_at_a_hit_it_would_fill(shared_engine):
    """A capped pool may have evicted a hit's entries: a resident hit that shares the
    sparse groups' cached blocks needs none of them and stays resident; one that would
    be filled from the pool (its sparse blocks uncached) moves the engine to the pool,
    which serves it: select-all over a pool that holds everything, stock vLLM's
    tokens both times."""
    from benchmarks.harness.paths import BUNDLED_MODEL
    from tests.e2e.test_pool_cap import POOL_GIB

    model = str(BUNDLED_MODEL)
    prompts = shared_prefix_prompts(seed=11)
    stock_llm = shared_engine(model)
    stock_llm.reset_prefix_cache()
    stock = [greedy_tokens(stock_llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
    with engine(model, infinigen_residency="device-first", infinigen_cpu_pool_gib=POOL_GIB,
                **SELECT_ALL) as llm:
        shared = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        resident = summarize(llm.get_metrics())
        uncache_sparse_blocks(llm)
        filled = [greedy_tokens(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]
        hits = prefix_cache_hits(llm)
        counters = summarize(llm.get_metrics())
    assert hits >= (2 * len(prompts) - 1) * PREFIX
    assert resident.get("residency_moves", {}) in ({}, {"pool": 0, "device": 0})
    assert sum(resident.get("selected_tokens", {}).values()) == 0
    assert counters["residency_moves"]["pool"] >= 1
    assert sum(counters["selected_tokens"].values()) > 0  # over the pool
    assert shared == stock and filled == stock


@pytest.mark.parametrize("data_path, residency", [("cpu", "pool"), ("cuda", "pool"),
                                                  ("cpu", "device-first")])
def test_beam_search_equals_stock(data_path, residency, shared_engine):
    """``LLM.beam_search``: each of its steps is a batch of one-token requests, one
    per beam, each a prefix-cache hit on a parent's blocks (pool rows shared by
    their slot ids, or under ``device-first`` the sparse blocks themselves).
    Select-all, the beams, their texts and scores are stock vLLM's."""
    from vllm.sampling_params import BeamSearchParams

    from benchmarks.harness.paths import BUNDLED_MODEL
    from tests.e2e.cuda_path_worker import with_cuda_data_path

    model = str(BUNDLED_MODEL)
    prompts = random_prompts([150, 40], seed=11)
    params = BeamSearchParams(beam_width=3, max_tokens=12)

    def beams(llm) -> list[list[tuple[list[int], float]]]:
        return [[(list(seq.tokens), round(seq.cum_logprob, 4)) for seq in out.sequences]
                for out in llm.beam_search(prompts, params)]

    stock = beams(shared_engine(model))
    paths = with_cuda_data_path() if data_path == "cuda" else contextlib.nullcontext()
    with paths, engine(model, enable_prefix_caching=True, infinigen_residency=residency,
                       **SELECT_ALL) as llm:
        ours = beams(llm)
        hits = prefix_cache_hits(llm)
    assert [len(out) for out in ours] == [3, 3]
    assert hits > 0
    assert ours == stock
