# SPDX-License-Identifier: Apache-2.0
"""Decode attention over the selected KV entries (worker side, pure torch)."""

from __future__ import annotations

import math

import torch


def slots_of_positions(
    positions: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Maps token positions of each request to vLLM slot ids.

    Args:
        positions: [B, ...] token positions of request b.
        block_table: [B, max_blocks] vLLM block ids of each request.

    Returns:
        [B, ...] slot ids (block_id * block_size + offset).
    """
    num_reqs = positions.shape[0]
    flat = positions.reshape(num_reqs, math.prod(positions.shape[1:]))
    block_ids = torch.gather(block_table.to(torch.int64), 1, flat // block_size)
    return (block_ids * block_size + flat % block_size).view_as(positions)


def gather_selected(key_store: torch.Tensor, value_store: torch.Tensor,
                    slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected entries of one layer: [B, H_kv, K, D] keys and values.

    Args:
        key_store: [S, H_kv, D] pool keys; value_store likewise.
        slots: [B, H_kv, K] pool slot of each selected entry, per KV head.
    """
    heads = torch.arange(key_store.shape[1], device=slots.device)[None, :, None]
    return key_store[slots, heads], value_store[slots, heads]


def attend_selected(
    query: torch.Tensor,
    key_store: torch.Tensor,
    value_store: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    current_key: torch.Tensor,
    current_value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per request over selected pool entries.

    Args:
        query: [B, H_q, D] decode queries.
        key_store: [S, H_kv, D] keys of the layer, by slot id.
        value_store: [S, H_kv, D] values of the layer, by slot id.
        slots: [B, H_kv, K] slot ids of the selected entries, per KV head.
        valid: [B, H_kv, K] which of them are real.
        current_key: [B, H_kv, D] key of the token being decoded (always attended).
        current_value: [B, H_kv, D] its value.
        scale: Softmax scale.

    Returns:
        [B, H_q, D] attention output, in the query's dtype.
    """
    return attend_gathered(query, *gather_selected(key_store, value_store, slots),
                           valid, current_key, current_value, scale)


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    current_key: torch.Tensor,
    current_value: torch.Tensor,
    scale: float,
    return_probs: bool = False,
):
    """Like ``attend_selected``, over entries already gathered: [B, H_kv, K, D].

    With ``return_probs``, also returns the attention each selected entry
    received, summed over the KV head's query group: [B, H_kv, K].
    """
    num_reqs, num_heads, head_size = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    keys = torch.cat([keys, current_key[:, :, None]], dim=2)
    values = torch.cat([values, current_value[:, :, None]], dim=2)
    mask = torch.cat([valid, valid.new_ones(num_reqs, num_kv_heads, 1)], dim=2)
    # keys, values: [B, H_kv, K + 1, D]; logits: [B, H_kv, G, K + 1]
    grouped = query.float().view(num_reqs, num_kv_heads, group, head_size)
    logits = torch.einsum("bhgd,bhkd->bhgk", grouped, keys.float()) * scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgk,bhkd->bhgd", probs, values.float())
    out = out.reshape(num_reqs, num_heads, head_size).to(query.dtype)
    if return_probs:
        return out, probs[..., :-1].sum(dim=2)
    return out
