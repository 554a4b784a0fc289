# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's prompt rows over an uncapped pool, attended by vLLM's own CPU
attention kernel (``cpu_attention_with_kv_cache``, the dense layers' kernel).

``kernels.attend_prefill`` runs ATen's flash attention once per KV head with the
query group expanded; on the decode benchmarks' head_dim-128 model a 4K prompt's
sparse layer took 2.7x vLLM's kernel's time over the same tokens in a dense layer
(a 4K prompt 1.93x stock's, ``benchmarks/results/archive/prefix_reuse_before_prefill_kernel.md``).

Uncapped, the pool's units are the dense group's blocks (``[blocks, H_kv,
block_size, 2D]``, each token's K | V in one row), while vLLM's kernel reads, per
block and KV head, the block's keys and then its values. Each prompt request's
blocks are gathered into that layout once per layer (an FP8 pool widened to the
query's dtype, its scales folded into the softmax scale and the output) and attended
causally, the last ``query_len`` of its ``seq_len`` tokens being this step's rows,
as vLLM attends a chunked prefill. A capped pool keeps ``kernels.attend_prefill``:
its heads evict different entries, and vLLM's kernel takes one length per request; so
does a head size vLLM's kernel lacks (``supports``: none in an engine, whose dense
layers run on that kernel; the data paths' tests use tiny heads).
"""

from __future__ import annotations

import functools

import torch


CHUNK_BLOCKS = 256  # blocks gathered from the pool at a time


@functools.cache
def _isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The instruction set vLLM's CPU backend picks for these shapes."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size)


@functools.cache
def supports(head_size: int) -> bool:
    """Whether vLLM's CPU attention kernel takes this head size."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return head_size in CPUAttentionBackend.get_supported_head_sizes()


def attend(query: torch.Tensor, output: torch.Tensor, kv_pool: torch.Tensor,
           block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
           requests: torch.Tensor, *, scale: float, key_scale: float = 1.0,
           value_scale: float = 1.0) -> None:
    """``kernels.attend_prefill`` without a row map, by vLLM's kernel.

    Args:
        query, output: [T, H_q, D] the step's rows; ``output`` written in place.
        kv_pool: [blocks, H_kv, block_size, 2D] the layer's uncapped pool.
        block_table: [num_reqs, max_blocks] int32 of every request of the step.
        query_start: [num_reqs + 1] int64 first row of each request.
        seq_lens: [num_reqs] int64 tokens of each request after this step.
        requests: [R] int64 the requests whose rows to compute.
    """
    import vllm.envs as envs
    from vllm import _custom_ops as ops

    _, num_kv_heads, block_size, row = kv_pool.shape
    head_size = row // 2
    isa = _isa(query.dtype, block_size, head_size)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for req in requests.tolist():
        begin, end, seq_len = starts[req], starts[req + 1], lens[req]
        if end <= begin:
            continue
        num_blocks = -(-seq_len // block_size)
        # (zeros: vLLM's kernel reads the last block whole, and stale bits may be NaN)
        cache = torch.zeros((num_blocks, num_kv_heads, 2 * block_size, head_size),
                            dtype=query.dtype)
        keys, values = cache.chunk(2, dim=2)  # vLLM's [n, H_kv, block_size, D] views
        blocks = block_table[req, :num_blocks].to(torch.int64)
        for first in range(0, num_blocks, CHUNK_BLOCKS):  # (bounds the temporaries)
            units = kv_pool.index_select(0, blocks[first:first + CHUNK_BLOCKS])
            count = min(seq_len - first * block_size, units.shape[0] * block_size)
            tokens = units.transpose(1, 2).reshape(-1, num_kv_heads, row)[:count]
            tokens = tokens.to(query.dtype)  # [count, H_kv, 2D] in order
            # (written by vLLM's own op: the layout inside a block is its ISA's)
            slots = torch.arange(first * block_size, first * block_size + count)
            ops.cpu_attn_reshape_and_cache(tokens[..., :head_size], tokens[..., head_size:],
                                           keys, values, slots, isa)
        rows = torch.tensor([0, end - begin], dtype=torch.int32)
        length = torch.tensor([seq_len], dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=query.shape[1], num_kv_heads=num_kv_heads,
            head_dim=head_size, seq_lens=length, dtype=query.dtype, query_start_loc=rows,
            causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        out = output[begin:end]
        ops.cpu_attention_with_kv_cache(
            query=query[begin:end], key_cache=keys, value_cache=values, output=out,
            query_start_loc=rows, seq_lens=length, scale=scale * key_scale, causal=True,
            alibi_slopes=None, sliding_window=-1,
            block_table=torch.arange(num_blocks, dtype=torch.int32)[None], softcap=0.0,
            scheduler_metadata=metadata, s_aux=None)
        if value_scale != 1.0:
            out.mul_(value_scale)
