# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's kernels: one wrapper per compiled op.

Each op's schema is declared in ``csrc/ops.cpp`` and its CPU implementation
registered under the CPU dispatch key (``csrc/*.cpp``, built by ``build.py``).
The wrappers document shapes; the unit tests hold each op to a pure-torch
reference (``tests/reference/``). The CUDA platform's kernels are Triton's
(``platforms/cuda/kernels/``).
"""

from __future__ import annotations

import torch

from vllm_infinigen.platforms.cpu.kernels.build import cache_dir, load

__all__ = ["attend_decode", "attend_prefill", "cache_dir", "decode_short", "load", "record_uses",
           "select_bounds", "select_tokens", "select_tokens_int", "speculation_query",
           "write_int_keys",
           "write_bounds", "write_partial_keys", "write_pool"]


def _ops():
    load()
    return torch.ops.vllm_infinigen_C


def write_pool(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor, row_map: torch.Tensor | None = None, *,
               key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """The host write-through: new K|V rows into one layer's pool, in place.

    The pool may be FP8 beside K/V of the model's dtype: it takes K / ``key_scale``
    and V / ``value_scale`` (vLLM's ``k_scale``, ``v_scale``), rounded toward
    zero and saturating at the format's largest finite value, as vLLM's CPU
    build writes its FP8 pages.

    Args:
        kv_pool: [units, H_kv, block_size, 2 * D] one layer's pool.
        key, value: [T, H_kv, D] new entries (last dim contiguous).
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        row_map: [num_blocks, H_kv, block_size] int32 rows of a capped pool
            (evicted entries are not written).
    """
    _ops().write_pool(kv_pool, key, value, slot_mapping, row_map, float(key_scale),
                      float(value_scale))


def write_partial_keys(partial_keys: torch.Tensor, key: torch.Tensor, skew: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """The device write: the new keys' skewed partial keys, in place.

    Args:
        partial_keys: [num_blocks, H_kv, R, block_size] channel-major per block.
        key: [T, H_kv, D] new keys (last dim contiguous).
        skew: [H_kv, D, R] float32 skew columns of the layer.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
    """
    _ops().write_partial_keys(partial_keys, key, skew, slot_mapping)


def select_tokens(partial_query: torch.Tensor, partial_keys: torch.Tensor,
                  block_table: torch.Tensor, context_lens: torch.Tensor,
                  token_caps: torch.Tensor, *, scale: float, alpha: float,
                  sink_tokens: int = 0, recent_tokens: int = 0,
                  row_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's rule over the partial keys.

    Per row, k = min(floor(mean over KV heads of the count of tokens scoring
    within ``alpha`` of the head's best), ``token_caps``), plus the sink and
    recent windows; each KV head keeps its own top k.

    Args:
        partial_query: [B, H_kv, G, R] float32 skewed partial queries.
        partial_keys: [num_blocks, H_kv, R, block_size] the target layer's.
        block_table: [B, max_blocks] int32 dense-group block ids of each row.
        context_lens: [B] int64 context tokens before each row's own.
        token_caps: [B] int64 the budget in tokens of each row
            (``worker.step_plan.token_budget``).
        row_map: Capped pool rows; evicted entries are never selected.

    Returns:
        positions [B, H_kv, K] int32, ascending, -1 padded (K: the largest
        count selected), and num_selected [B] int64.
    """
    return _ops().select_tokens(partial_query, partial_keys, block_table, context_lens,
                                token_caps, float(scale), float(alpha), int(sink_tokens),
                                int(recent_tokens), row_map)


def write_int_keys(codes: torch.Tensor, scales: torch.Tensor, kv_pool: torch.Tensor,
                   slot_mapping: torch.Tensor, row_map: torch.Tensor | None = None) -> None:
    """Encodes each 16-token group whose last token ``slot_mapping`` writes, in place.

    Runs after the pool write of the same tokens (it reads the group's keys
    from the pool).

    Args:
        codes: [num_blocks, H_kv, G, D, 2 * bits] uint8, G = block_size / 16:
            row c of a group holds channel c of its 16 tokens, ``bits`` bits each.
        scales: [num_blocks, H_kv, G, D] float16, max |k| / ((2^bits - 1) / 2)
            per channel and group.
        kv_pool: [units, H_kv, block_size, 2 * D] the layer's pool.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        row_map: A capped pool's rows (evicted keys encode as zeros).
    """
    _ops().write_int_keys(codes, scales, kv_pool, slot_mapping, row_map)


def select_tokens_int(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      kv_pool: torch.Tensor, block_table: torch.Tensor,
                      context_lens: torch.Tensor, token_caps: torch.Tensor, *, scale: float,
                      alpha: float, sink_tokens: int = 0, recent_tokens: int = 0,
                      row_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's rule over integer speculation keys (``select_tokens``'s rule).

    Complete 16-token groups are scored from ``codes``/``scales``; the group a
    row's context ends in, from the full keys in ``kv_pool``.

    Args:
        query: [B, H_kv, G_q, D] float32 queries (post-RoPE, not skewed).
        codes, scales: The layer's integer keys (``write_int_keys``).

    Returns:
        positions [B, H_kv, K] int32, ascending, -1 padded, and num_selected [B] int64.
    """
    return _ops().select_tokens_int(query, codes, scales, kv_pool, block_table, context_lens,
                                    token_caps, float(scale), float(alpha), int(sink_tokens),
                                    int(recent_tokens), row_map)


def write_bounds(bounds: torch.Tensor, bound_scales: torch.Tensor, kv_pool: torch.Tensor,
                 slot_mapping: torch.Tensor, row_map: torch.Tensor | None = None) -> None:
    """Summarises each unit whose last token ``slot_mapping`` writes, in place.

    Runs after the pool write of the same tokens (it reads the unit's keys
    from the pool). Per channel the unit's largest and smallest key, as codes
    c = v / s + 2^(bits-1) rounded outwards (the maximum up, the minimum
    down), s = max |key| / (2^(bits-1) - 1) rounded up to float16: the codes
    bound every key of the unit.

    Args:
        bounds: [num_blocks, H_kv, block_size / U, 2, D * bits / 8] uint8: per
            unit of U tokens and KV head, row 0 the maxima, row 1 the minima;
            8 bits one channel per byte, 4 bits byte j holding channel j (low
            nibble) and channel j + D/2 (high).
        bound_scales: [num_blocks, H_kv, block_size / U] float16 s per unit.
        kv_pool: [units, H_kv, block_size, 2 * D] the layer's pool.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        row_map: A capped pool's rows (the bounds of the entries it holds).
    """
    _ops().write_bounds(bounds, bound_scales, kv_pool, slot_mapping, row_map)


def select_bounds(query: torch.Tensor, bounds: torch.Tensor, bound_scales: torch.Tensor,
                  kv_pool: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                  token_caps: torch.Tensor, *, scale: float, alpha: float, sink_tokens: int = 0,
                  recent_tokens: int = 0,
                  row_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's rule over bounds, in whole units of U tokens.

    A complete unit scores scale x the max over the KV head's query group of
    sum_c max(q_c max_c, q_c min_c), its upper bound of q . k (Quest's). A
    row's k is the token rule's (``select_tokens``), counted in tokens:
    min(floor(mean over KV heads of the tokens of the units within ``alpha``
    of the head's best, plus the own unit's), ``token_caps``). The row's own
    unit (its context ends inside it, no bounds yet) is kept and counts in k
    (its most recent k tokens where k is smaller); each KV head keeps its best complete units (ties in position
    order) up to the rest: whole units, then the first tokens of the next,
    which is the token rule over tokens scored by their unit's bound; plus
    the sink and recent windows.

    Args:
        query: [B, H_kv, G_q, D] float32 queries (post-RoPE).
        bounds, bound_scales: The layer's bounds (``write_bounds``).

    Returns:
        positions [B, H_kv, K] int32, ascending, -1 padded, and num_selected [B]
        int64 (the most any KV head of the row keeps).
    """
    return _ops().select_bounds(query, bounds, bound_scales, kv_pool, block_table, context_lens,
                                token_caps, float(scale), float(alpha), int(sink_tokens),
                                int(recent_tokens), row_map)


def attend_decode(query: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
                  context_lens: torch.Tensor, positions: torch.Tensor | None, *, scale: float,
                  row_map: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                  stats: torch.Tensor | None = None, key_scale: float = 1.0,
                  value_scale: float = 1.0) -> torch.Tensor:
    """One query row per entry of ``context_lens`` over the pool, in place.

    Each row attends over ``positions`` (or, when None, every position before
    it) plus its own position ``context_lens[b]``, whose entry must be written.

    Args:
        query: [B, H_q, D].
        positions: [B, H_kv, K] int32, -1 padded; None: dense.
        probs: [B, H_kv, K] float32, filled with the attention each selected
            position received, summed over the KV head's query group.
        stats: [2] float64, incremented by (entries attended besides the
            rows' own, summed over KV heads; context tokens of the rows).
        key_scale, value_scale: The pool holds K / key_scale and V /
            value_scale (``write_pool``); the attention multiplies them back.

    Returns:
        [B, H_q, D] in the query's dtype (the pool's, or any beside an FP8 pool).
    """
    return _ops().attend_decode(query, kv_pool, block_table, context_lens, positions, row_map,
                                float(scale), probs, stats, float(key_scale), float(value_scale))


def decode_short(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_pool: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, *, scale: float,
                 row_map: torch.Tensor | None = None, key_codes: torch.Tensor | None = None,
                 key_scales: torch.Tensor | None = None,
                 partial_keys: torch.Tensor | None = None, skew: torch.Tensor | None = None,
                 stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 bounds: torch.Tensor | None = None,
                 bound_scales: torch.Tensor | None = None, key_scale: float = 1.0,
                 value_scale: float = 1.0) -> torch.Tensor:
    """A sparse layer's short decode step in one call (every row below
    ``--infinigen-min-context``): ``write_pool``, then ``write_int_keys`` (int
    keys; only when a slot closes a 16-token group), ``write_bounds`` (only
    when a slot closes a unit) or ``write_partial_keys``,
    then ``attend_decode`` with ``positions`` None over the first
    ``len(context_lens)`` rows of ``query``. The same kernels, called from C++:
    the same pool, keys, output and ``stats``.

    Args:
        query: [T, H_q, D] the step's queries; row b attends for ``context_lens[b]``.
        key, value: [T, H_kv, D] the step's new entries (``write_pool``).
        slot_mapping: [T] slot ids of the dense group (< 0: padding).
        key_codes, key_scales: The layer's int keys (``write_int_keys``), or
        partial_keys, skew: its partial keys (``write_partial_keys``), or
        bounds, bound_scales: its bounds (``write_bounds``); none: the pool alone.
        stats: [2] float64 counters (``attend_decode``).
        out: [T, H_q, D] whose first rows receive the output, or None.
        key_scale, value_scale: ``write_pool``'s and ``attend_decode``'s.

    Returns:
        [len(context_lens), H_q, D] in the query's dtype.
    """
    return _ops().decode_short(query, key, value, kv_pool, slot_mapping, block_table,
                               context_lens, row_map, float(scale), key_codes, key_scales,
                               partial_keys, skew, stats, out, bounds,
                               bound_scales, float(key_scale), float(value_scale))


def attend_prefill(query: torch.Tensor, output: torch.Tensor, kv_pool: torch.Tensor,
                   block_table: torch.Tensor, query_start: torch.Tensor,
                   seq_lens: torch.Tensor, requests: torch.Tensor, *, scale: float,
                   row_map: torch.Tensor | None = None, key_scale: float = 1.0,
                   value_scale: float = 1.0) -> None:
    """Causal attention of the prompt rows of ``requests``, written into ``output``.

    Args:
        query, output: [T, H_q, D] the step's rows.
        block_table: [num_reqs, max_blocks] int32 of every request of the step.
        query_start: [num_reqs + 1] int64 first row of each request.
        seq_lens: [num_reqs] int64 tokens of each request after this step.
        requests: [R] int64 the requests whose rows to compute.
        key_scale, value_scale: ``attend_decode``'s.
    """
    _ops().attend_prefill(query, output, kv_pool, block_table, query_start, seq_lens,
                          requests, row_map, float(scale), float(key_scale), float(value_scale))


def record_uses(positions: torch.Tensor, block_table: torch.Tensor, row_map: torch.Tensor,
                count: torch.Tensor, last_used: torch.Tensor, tick: int) -> None:
    """A capped pool's bookkeeping of one selection, in place.

    Args:
        positions: [B, H_kv, K] int32 selected positions (-1: none).
        row_map: [num_blocks, H_kv, block_size] int32 the layer's rows.
        count, last_used: [H_kv, rows] int64 the layer's use counts and last
            uses; each selected entry the pool holds gets +1 and ``tick``.
    """
    _ops().record_uses(positions, block_table, row_map, count, last_used, int(tick))


def speculation_query(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      cos_sin_cache: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, *, head_size: int = 0,
                      is_neox_style: bool = True) -> torch.Tensor:
    """The speculation's query: ``hidden`` W^T + ``bias``, then, given the
    rotary cache, RoPE as vLLM's ``RotaryEmbedding`` (its base rule) applies
    it to each head; sums and result in float32.

    Args:
        hidden: [T, K] attention inputs (any float dtype).
        weight: [N, K] contiguous query rows of ``qkv_proj`` (float32,
            bfloat16 or float16).
        cos_sin_cache: [positions, rotary_dim] contiguous float32, cos then
            sin (the module's ``cos_sin_cache``, converted once by the caller).
        positions: [T] int64 position of each row (with the cache).
        head_size: Channels per head (with the cache: the first
            ``rotary_dim`` of each are rotated).

    Returns:
        [T, N] float32.
    """
    return _ops().speculation_query(hidden, weight, bias, cos_sin_cache, positions,
                                    int(head_size), bool(is_neox_style))
