# SPDX-License-Identifier: Apache-2.0
"""The CUDA worker imports on the CPU build, and splits vLLM's GPU grant exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.platforms import WORKERS
from vllm_infinigen.platforms.cuda import memory


def test_the_worker_imports_on_the_cpu_build_and_mixes_infinigen_in_first():
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_infinigen.platforms.cuda.worker import InfiniGenCUDAWorker
    from vllm_infinigen.worker.base import InfiniGenWorkerMixin

    assert InfiniGenCUDAWorker.__mro__[1:3] == (InfiniGenWorkerMixin, Worker)
    assert not torch.cuda.is_available()
    assert WORKERS["cuda"] == f"{InfiniGenCUDAWorker.__module__}.{InfiniGenCUDAWorker.__name__}"


def test_cache_slots_cover_the_block_rules_widest_step_times_the_reuse_factor():
    # 1000 tokens at budget 0.1: 100 tokens = 7 blocks, + 1 sink block (4 tokens)
    # + the own block and 1 recent block (4 tokens) = 10, twice: 20 of the row's 64
    assert memory.cache_slots_per_head(max_num_seqs=3, max_model_len=1000, block_size=16,
                                       budget=0.1, min_context=0, sink_tokens=4,
                                       recent_tokens=4,
                                       reuse=2) == 3 * 20
    # 100 tokens at budget 0.5: 50 tokens = 4 blocks + the first and the own block
    # = 6, twice: 12, but a row has 8
    assert memory.cache_slots_per_head(max_num_seqs=2, max_model_len=100, block_size=16,
                                       budget=0.5, min_context=0, sink_tokens=0,
                                       recent_tokens=0,
                                       reuse=2) == 2 * 8
    # 4000 tokens at budget 0.02: 80 tokens = 5 blocks + 2 = 7, 1.5 times: 11
    assert memory.cache_slots_per_head(max_num_seqs=1, max_model_len=4000, block_size=16,
                                       budget=0.02, min_context=0, sink_tokens=0,
                                       recent_tokens=0, reuse=1.5) == 11
    # below --infinigen-min-context every block is selected: the whole row (251 blocks)
    assert memory.cache_slots_per_head(max_num_seqs=1, max_model_len=4000, block_size=16,
                                       budget=0.02, min_context=4096, sink_tokens=0,
                                       recent_tokens=0, reuse=1.5) == 251


def test_the_grant_keeps_the_cache_and_splits_the_rest_by_block_costs():
    split = memory.split_device_grant(10_000, pages=60, speculation=20, cache=2_000)
    assert split == memory.DeviceSplit(kv_space=6_000, speculation=2_000, cache=2_000)
    # The cache holds every block below --infinigen-min-context (the default 4096 rules
    # the cache's size at contexts up to ~20K): the message names it with the others.
    with pytest.raises(ValueError, match="lower --max-num-seqs, --max-model-len, "
                       "--infinigen-min-context or --infinigen-budget, set "
                       "--infinigen-budget-tokens, or raise --gpu-memory-utilization"):
        memory.split_device_grant(2_050, pages=60, speculation=20, cache=2_000)
    # Sized for 10 rows (200 bytes each) of 2 blocks (80 bytes each): 5 fit with theirs.
    with pytest.raises(ValueError, match=r"where given\); 5 rows of --max-model-len would "
                       r"fit beside their blocks \(--max-num-seqs 5\)"):
        memory.split_device_grant(2_050, pages=60, speculation=20, cache=2_000, rows=10,
                                  row_blocks=2)


def test_the_worker_split_counts_speculation_keys_cache_and_vllm_pages():
    from vllm_infinigen.platforms.cuda.worker import InfiniGenCUDAWorker

    layout = ModelLayout("llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                         dense_layers=2, partial_ratio=0.25)
    worker = SimpleNamespace(
        infinigen=SimpleNamespace(layout=layout, dtype_bytes=2, kv_dtype_bytes=2),
        cache_config=SimpleNamespace(block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=1),
        model_config=SimpleNamespace(max_model_len=64),
        infinigen_runtime=SimpleNamespace(sparse_layers=[SimpleNamespace(num_kv_heads=2)],
                                          data_path=SimpleNamespace(slots_per_head=5)))
    kv_space, budget, sized_by = InfiniGenCUDAWorker.split_memory(worker, 1 << 20)
    cache = 2 * ((2 * 5 + 1) * 16 * 2 * 8 * 2 + 2 * 6 * 24)  # 2 sparse layers
    pages = layout.group_size * 16 * layout.kv_bytes_per_token_layer(2, 2)
    speculation = 16 * layout.partial_bytes_per_token(2, 2) + 2 * 2 * 4
    assert kv_space == ((1 << 20) - cache) * pages // (pages + speculation)
    assert budget is None and "host memory" in sized_by


def test_the_device_block_cache_at_vllms_defaults_and_with_a_cap():
    """The arithmetic the README's CUDA limit quotes: a Llama-3.1-8B shape (30 sparse
    layers, 8 KV heads of 128, bfloat16). The cache holds, for each of --max-num-seqs
    rows, the widest selection of a --max-model-len context: at vLLM's 256 rows and
    128K it cannot fit any GPU (the start-up refuses it, naming the flags); 32 rows
    under a 4,096-token cap fit beside the model on an 80 GB one."""
    def gib(max_num_seqs: int, max_model_len: int, budget_tokens: int | None) -> float:
        slots = memory.cache_slots_per_head(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=16,
            budget=0.2, min_context=4096, sink_tokens=0, recent_tokens=16,
            budget_tokens=budget_tokens)
        return memory.cache_bytes(num_sparse=30, kv_heads=8, slots_per_head=slots,
                                  block_size=16, head_size=128, dtype_bytes=2) / 2**30

    assert round(gib(256, 131072, None)) == 1544
    assert round(gib(256, 8192, None)) == 241  # every block below the min context
    assert round(gib(256, 131072, 4096)) == 244
    assert round(gib(32, 131072, 4096), 1) == 30.4


class _Dispatcher:
    """vLLM's CUDA graph dispatcher as the runner asks it: a full graph for a
    uniform decode batch, piecewise for a mixed one."""

    def dispatch(self, num_tokens, uniform_decode, **_):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        mode = CUDAGraphMode.FULL if uniform_decode else CUDAGraphMode.PIECEWISE
        return mode, BatchDescriptor(num_tokens=num_tokens, uniform=uniform_decode)


def _runner(computed, prompts):
    """vLLM's own batch decision (GPUModelRunner's methods) over an input batch
    of these computed and prompt token counts."""
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class Runner:
        _is_uniform_decode = staticmethod(GPUModelRunner._is_uniform_decode)
        _determine_batch_execution_and_padding = (
            GPUModelRunner._determine_batch_execution_and_padding)

    runner = Runner()
    runner.uniform_decode_query_len = 1
    runner.cudagraph_dispatcher = _Dispatcher()
    runner.model_config = SimpleNamespace(is_encoder_decoder=False)
    runner.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=1),
        observability_config=SimpleNamespace(cudagraph_metrics=False))
    runner.input_batch = SimpleNamespace(
        lora_id_to_lora_request={},
        num_computed_tokens_cpu=np.array(computed + [7, 7], dtype=np.int32),  # stale rows
        num_prompt_tokens=np.array(prompts + [9, 9], dtype=np.int32))
    return runner


def _decide(runner, num_reqs, **kwargs):
    import numpy as np

    mode, batch, *_ = runner._determine_batch_execution_and_padding(
        num_tokens=num_reqs, num_reqs=num_reqs, max_num_scheduled_tokens=1,
        num_scheduled_tokens_np=np.ones(num_reqs, dtype=np.int32), **kwargs)
    return mode.name, batch.uniform


def test_a_one_token_prompt_chunk_among_decodes_is_dispatched_and_planned_as_a_prompt():
    """A prompt's one-token last chunk (here: 99 of its 100 tokens computed, a
    prefix-cache hit or a chunked prefill's remainder) beside a decode row: vLLM
    calls the step a uniform decode by its query lengths and would replay the
    full decode graph, whose device plan attends every row over a selection.
    The CUDA worker makes vLLM dispatch it as a mixed batch, planned on the host."""
    from vllm_infinigen.platforms.cuda.worker import dispatch_prompt_rows_as_prompts

    # row 0 decodes (its 120 tokens past a 100-token prompt), row 1 a prompt's last token
    stock = _runner([120, 99], [100, 100])
    assert _decide(stock, 2) == ("FULL", True)  # vLLM's own decision

    runtime = SimpleNamespace(plan_on_host=None)
    runner = _runner([120, 99], [100, 100])
    dispatch_prompt_rows_as_prompts(runner, runtime)
    assert _decide(runner, 2) == ("PIECEWISE", False)
    assert runtime.plan_on_host is True
    # every row past its prompt: the full decode graph and the device plan, as stock
    # (the batch's stale rows beyond num_reqs are not read)
    decoding = _runner([120, 100], [100, 100])
    dispatch_prompt_rows_as_prompts(decoding, runtime)
    assert _decide(decoding, 2) == ("FULL", True)
    assert runtime.plan_on_host is False
    # vLLM's captures force their decision: left as they are
    assert _decide(runner, 2, force_uniform_decode=True) == ("FULL", True)
    assert runtime.plan_on_host is False


def test_the_runtime_plans_a_step_on_the_host_when_the_worker_says_so():
    """The same uniform step's plan: on the device (every row selects), or on
    the host, where the prompt's last token is a prompt row."""
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.runtime import InfiniGenRuntime

    runtime = SimpleNamespace(
        _plan_source=None, plan_on_host=False, config=InfiniGenConfig(alpha=1.0, min_context=0),
        data_path=SimpleNamespace(plans_on_device=True),
        prompt_lens_of=lambda num_reqs: torch.tensor([100, 100])[:num_reqs])
    metadata = SimpleNamespace(seq_lens=torch.tensor([121, 100], dtype=torch.int32),
                               query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                               block_table=torch.zeros((2, 8), dtype=torch.int32),
                               max_query_len=1)
    plan = InfiniGenRuntime.plan_for(runtime, metadata, 16)
    assert plan.on_device and plan.num_decodes == 2
    runtime._plan_source, runtime.plan_on_host = None, True
    plan = InfiniGenRuntime.plan_for(runtime, metadata, 16)
    assert not plan.on_device and plan.num_decodes == 1
    assert plan.prompt_requests.tolist() == [1] and plan.tokens.tolist() == [0]
