# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's prompt rows over an uncapped pool, attended by vLLM's own CPU
attention kernel (``cpu_attention_with_kv_cache``, the dense layers' kernel).

``kernels.attend_prefill`` runs ATen's flash attention once per KV head with the
query group expanded; on the decode benchmarks' head_dim-128 model a 4K prompt's
sparse layer took 2.7x vLLM's kernel's time over the same tokens in a dense layer
(a 4K prompt 1.93x stock's, ``benchmarks/results/archive/prefix_reuse_before_prefill_kernel.md``).

Uncapped, the pool's units are the dense group's blocks (``[blocks, H_kv,
block_size, 2D]``, each token's K | V in one row), while vLLM's kernel reads, per
block and KV head, the block's keys and then its values. The step's prompt requests'
blocks are gathered into that layout once per layer, into one scratch cache up to
``SCRATCH_BYTES`` (a block several requests read, a prefix-cache hit's, once; an FP8
pool widened to the query's dtype, its scales folded into the softmax scale and the
output), and attended causally in one call, the last ``query_len`` of each request's
``seq_len`` tokens being this step's rows, as vLLM attends a chunked prefill.

A capped pool (``attend_capped``) evicts different entries in each KV head, and vLLM's
kernel takes one length per request: each (request, KV head) is one of its requests,
with one KV head and the head's query group, over the entries the head holds in
position order. The step's own tokens are always held (the write admitted them), so
they are the last ``query_len`` of those: causal as above, every earlier held entry
visible to every row, as ``kernels.attend_prefill`` attends them (ATen's flash
attention, 2.1-2.3x the time over a capped pool, ``benchmarks/results/prefill_micro.md``;
it stays for head sizes vLLM's kernel lacks, ``supports``:
none in an engine, whose dense layers run on that kernel; the data paths' tests use
tiny heads).
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
    """``kernels.attend_prefill`` without a row map, by vLLM's kernel: the requests'
    blocks gathered into one scratch cache (a block they share, a prefix-cache hit's,
    once), up to ``SCRATCH_BYTES`` at a time, and attended in one call.

    Args:
        query, output: [T, H_q, D] the step's rows; ``output`` written in place.
        kv_pool: [blocks, H_kv, block_size, 2D] the layer's uncapped pool.
        block_table: [num_reqs, max_blocks] int32 of every request of the step.
        query_start: [num_reqs + 1] int64 first row of each request.
        seq_lens: [num_reqs] int64 tokens of each request after this step.
        requests: [R] int64 the requests whose rows to compute.
    """
    _, num_kv_heads, block_size, row = kv_pool.shape
    block_bytes = num_kv_heads * block_size * row * query.element_size()
    starts, lens = query_start.tolist(), seq_lens.tolist()
    batch: list[tuple[int, int, int, list[int]]] = []  # (begin, end, seq_len, blocks)
    held: set[int] = set()
    for req in requests.tolist():
        begin, end, seq_len = starts[req], starts[req + 1], lens[req]
        if end <= begin:
            continue
        blocks = block_table[req, :-(-seq_len // block_size)].tolist()
        new = held.union(blocks)
        if batch and len(new) * block_bytes > SCRATCH_BYTES:
            _attend_gathered(query, output, kv_pool, batch, scale * key_scale, value_scale)
            batch, new = [], set(blocks)
        batch.append((begin, end, seq_len, blocks))
        held = new
    if batch:
        _attend_gathered(query, output, kv_pool, batch, scale * key_scale, value_scale)


SCRATCH_BYTES = 256 << 20  # one scratch cache's size at most (a larger request: its own)


def _attend_gathered(query: torch.Tensor, output: torch.Tensor, kv_pool: torch.Tensor,
                     batch: list[tuple[int, int, int, list[int]]], scale: float,
                     value_scale: float) -> None:
    """``attend`` of ``batch`` (row range, length and pool blocks of each request)."""
    _, num_kv_heads, block_size, row = kv_pool.shape
    index: dict[int, int] = {}  # pool block -> scratch block
    filled: dict[int, int] = {}  # scratch block -> tokens any request reads of it
    tables = []
    for _, _, seq_len, blocks in batch:
        table = [index.setdefault(block, len(index)) for block in blocks]
        for position, scratch in enumerate(table):
            count = min(seq_len - position * block_size, block_size)
            filled[scratch] = max(filled.get(scratch, 0), count)
        tables.append(table)
    cache = _Scratch(len(index), num_kv_heads, block_size, row // 2, query.dtype,
                     zeroed=[scratch for scratch, count in filled.items() if count < block_size])
    limits = torch.tensor([filled[scratch] for scratch in range(len(index))])
    sources = torch.tensor(list(index), dtype=torch.int64)
    by_token = kv_pool.transpose(1, 2)  # [blocks, block_size, H_kv, 2D]: a gather copies once
    offsets = torch.arange(block_size)
    for first in range(0, len(index), CHUNK_BLOCKS):  # (bounds the temporaries)
        chunk = slice(first, first + CHUNK_BLOCKS)
        tokens = by_token[sources[chunk]].reshape(-1, num_kv_heads, row)
        slots = torch.arange(first, first + tokens.shape[0] // block_size)[:, None] * block_size
        slots = torch.where(offsets < limits[chunk, None], slots + offsets, -1)  # -1: skipped
        cache.write(tokens, slots.flatten())
    widest = max(len(table) for table in tables)
    table = torch.tensor([table + table[-1:] * (widest - len(table)) for table in tables])
    rows = [(begin, end) for begin, end, _, _ in batch]
    lengths = torch.tensor([0] + [end - begin for begin, end in rows])
    seq_lens = torch.tensor([seq_len for _, _, seq_len, _ in batch])
    if all(end == begin for (_, end), (begin, _) in zip(rows, rows[1:])):  # one run of rows
        span = slice(rows[0][0], rows[-1][1])
        cache.attend(query[span], output[span], lengths.cumsum(0), seq_lens, table,
                     scale=scale, value_scale=value_scale)
        return
    picked = torch.cat([torch.arange(begin, end) for begin, end in rows])
    out = torch.empty((picked.numel(), *output.shape[1:]), dtype=output.dtype)
    cache.attend(query.index_select(0, picked), out, lengths.cumsum(0), seq_lens, table,
                 scale=scale, value_scale=value_scale)
    output.index_copy_(0, picked, out)


def attend_capped(query: torch.Tensor, output: torch.Tensor, kv_pool: torch.Tensor,
                  row_map: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
                  seq_lens: torch.Tensor, requests: torch.Tensor, *, scale: float,
                  key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """``kernels.attend_prefill`` over a capped pool (``row_map``), by vLLM's kernel:
    each KV head one of its requests, over the entries the head holds.

    Args:
        row_map: [num_blocks, H_kv, block_size] int32 each entry's row (-1: evicted).
        The others: ``attend``'s.

    Raises:
        RuntimeError: If a token of this step is not in the pool.
    """
    _, num_kv_heads, block_size, row = kv_pool.shape
    head_size = row // 2
    group = query.shape[1] // num_kv_heads
    pool_rows = kv_pool.view(-1, row)  # row r of head h: ((r // B) x H_kv + h) x B + r % B
    chunk = CHUNK_BLOCKS * block_size
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for req in requests.tolist():
        begin, end, seq_len = starts[req], starts[req + 1], lens[req]
        if end <= begin:
            continue
        blocks = block_table[req, :-(-seq_len // block_size)].to(torch.int64)
        rows = row_map.index_select(0, blocks).transpose(0, 1).reshape(num_kv_heads, -1)
        rows = rows[:, :seq_len]  # [H_kv, seq_len] each position's row, in order
        if bool((rows[:, seq_len - (end - begin):] < 0).any()):
            raise RuntimeError("InfiniGen: a token of this step is not in the pool")
        held = [rows[head][rows[head] >= 0].to(torch.int64) for head in range(num_kv_heads)]
        counts = [entries.numel() for entries in held]
        firsts = [0]  # each head's first block in the scratch cache
        for count in counts:
            firsts.append(firsts[-1] - (-count // block_size))
        cache = _Scratch(firsts[-1], 1, block_size, head_size, query.dtype)
        for head, entries in enumerate(held):
            for first in range(0, entries.numel(), chunk):  # (bounds the temporaries)
                piece = entries[first:first + chunk]
                taken = pool_rows.index_select(0, (piece // block_size * num_kv_heads + head)
                                               * block_size + piece % block_size)
                cache.write(taken[:, None], firsts[head] * block_size + first
                            + torch.arange(taken.shape[0]))
        widest = max(b - a for a, b in zip(firsts, firsts[1:]))
        table = torch.tensor([[min(a + i, b - 1) for i in range(widest)]
                              for a, b in zip(firsts, firsts[1:])])
        length = end - begin
        # [H_kv x length, G, D]: the KV heads' query groups one after another
        grouped = (query[begin:end].view(length, num_kv_heads, group, head_size)
                   .transpose(0, 1).reshape(num_kv_heads * length, group, head_size))
        out = torch.empty_like(grouped)
        cache.attend(grouped, out, torch.arange(num_kv_heads + 1) * length,
                     torch.tensor(counts), table, scale=scale * key_scale,
                     value_scale=value_scale)
        output[begin:end] = (out.view(num_kv_heads, length, group, head_size).transpose(0, 1)
                             .reshape(length, num_kv_heads * group, head_size))


class _Scratch:
    """A cache in vLLM's CPU layout (``[blocks, H_kv, 2 x block_size, D]``: each
    block's keys, then its values), written by vLLM's own op (the layout inside a
    block is its ISA's) and attended by its kernel. Zeroed, or only the blocks
    ``zeroed`` (those not written whole): the kernel reads a last block whole, and
    stale bits may be NaN."""

    def __init__(self, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                 dtype: torch.dtype, zeroed: list[int] | None = None):
        shape = (num_blocks, num_kv_heads, 2 * block_size, head_size)
        if zeroed is None:
            self.cache = torch.zeros(shape, dtype=dtype)
        else:
            self.cache = torch.empty(shape, dtype=dtype)
            self.cache[zeroed] = 0
        self.keys, self.values = self.cache.chunk(2, dim=2)
        self.isa = _isa(dtype, block_size, head_size)

    def write(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """``tokens`` [n, H_kv, 2D] (K | V rows of the pool; an FP8 pool's widened
        to the cache's dtype) at ``slots`` [n] (-1: not written)."""
        from vllm import _custom_ops as ops

        tokens = tokens.to(self.cache.dtype)
        head_size = self.cache.shape[-1]
        ops.cpu_attn_reshape_and_cache(tokens[..., :head_size], tokens[..., head_size:],
                                       self.keys, self.values, slots.to(torch.int64), self.isa)

    def attend(self, query: torch.Tensor, output: torch.Tensor, query_start: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, *, scale: float,
               value_scale: float) -> None:
        """vLLM's causal attention of ``query`` [N, H, D] (its requests' rows one after
        another, ``query_start`` [R + 1]) over ``seq_lens`` [R] tokens of the cache's
        blocks ``block_table`` [R, W], into ``output``; times ``value_scale``."""
        import vllm.envs as envs
        from vllm import _custom_ops as ops

        query_start = query_start.to(torch.int32)
        seq_lens = seq_lens.to(torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=query.shape[1],
            num_kv_heads=self.cache.shape[1], head_dim=self.cache.shape[-1],
            seq_lens=seq_lens, dtype=query.dtype, query_start_loc=query_start, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.keys, value_cache=self.values, output=output,
            query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table.to(torch.int32),
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        if value_scale != 1.0:
            output.mul_(value_scale)
