# SPDX-License-Identifier: Apache-2.0
"""Pure-torch bound speculation keys: what ``write_bounds`` stores and which tokens
``select_bounds`` keeps (``vllm_infinigen/platforms/cpu/kernels/csrc/bounds.cpp``)."""

from __future__ import annotations

import math

import torch

from tests.reference.layouts import present_of
from vllm_infinigen.block_layout import entries_of


def scale_at_least(value: torch.Tensor) -> torch.Tensor:
    """The float16 values at or above ``value`` (> 0), nearest to it."""
    rounded = value.to(torch.float16)
    below = rounded.float() < value
    return torch.where(below, torch.nextafter(rounded, torch.tensor(math.inf, dtype=torch.float16)),
                       rounded)


def encode_unit(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One unit of one KV head: keys [n, D] (its present entries; n may be 0) ->
    (codes [2, D] int64, rows max then min, offset by 2^(bits-1); scale float16)."""
    offset = 1 << (bits - 1)
    head_size = keys.shape[-1]
    if keys.shape[0] == 0:
        return torch.full((2, head_size), offset, dtype=torch.int64), torch.tensor(0.0).half()
    keys = keys.float()
    high, low = keys.amax(dim=0), keys.amin(dim=0)
    magnitude = torch.maximum(high.abs(), low.abs()).max()
    if magnitude == 0:
        return torch.full((2, head_size), offset, dtype=torch.int64), torch.tensor(0.0).half()
    scale = scale_at_least(magnitude / (offset - 1))
    step = scale.float()
    up = (torch.ceil(high / step) + offset).clamp(0, 2 * offset - 1)
    down = (torch.floor(low / step) + offset).clamp(0, 2 * offset - 1)
    return torch.stack([up, down]).to(torch.int64), scale


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] int64 -> [..., D * bits / 8] uint8 (4 bits: byte j = channel j
    low, channel j + D/2 high)."""
    if bits == 8:
        return codes.to(torch.uint8)
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)


def unpack(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """rows [..., D * bits / 8] uint8 -> codes [..., D] int64."""
    rows = rows.to(torch.int64)
    if bits == 8:
        return rows
    return torch.cat([rows & 15, rows >> 4], dim=-1)


def unit_codes(kv_pool: torch.Tensor, block_table: torch.Tensor, num_tokens: int, unit: int,
               bits: int, row_map: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [B, num_tokens // unit, H_kv, 2, D] int64, scales [B, U, H_kv] float16):
    ``encode_unit`` of each complete unit, over the entries the pool holds."""
    num_rows, num_heads = block_table.shape[0], kv_pool.shape[1]
    head_size = kv_pool.shape[-1] // 2
    num_units = num_tokens // unit
    everything = torch.arange(num_units * unit).expand(num_rows, num_heads, -1).contiguous()
    keys = entries_of(kv_pool, block_table, everything, row_map)[..., :head_size].float()
    keys = keys.permute(0, 2, 1, 3)  # [B, N, H, D]
    present = torch.ones(keys.shape[:3], dtype=torch.bool)
    if row_map is not None:
        present = present_of(row_map, block_table, num_units * unit)
    codes = torch.zeros((num_rows, num_units, num_heads, 2, head_size), dtype=torch.int64)
    scales = torch.zeros((num_rows, num_units, num_heads), dtype=torch.float16)
    for b in range(num_rows):
        for u in range(num_units):
            for h in range(num_heads):
                span = slice(u * unit, (u + 1) * unit)
                codes[b, u, h], scales[b, u, h] = encode_unit(
                    keys[b, span, h][present[b, span, h]], bits)
    return codes, scales


def unit_scores(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
                scale: float) -> torch.Tensor:
    """[H, U] each unit's score for one row, as the kernel rounds it: the max over the
    query group of q+ . max codes + q- . min codes - 2^(bits-1) x sum q (float32),
    times the unit's scale, times ``scale``.

    Args:
        query: [H, G, D]; codes [U, H, 2, D]; scales [U, H].
    """
    q = query.double()
    offset = float(1 << (bits - 1))
    dots = (torch.einsum("hgd,uhd->hgu", q.clamp(min=0), codes[:, :, 0].double())
            + torch.einsum("hgd,uhd->hgu", q.clamp(max=0), codes[:, :, 1].double())
            - offset * q.sum(dim=-1)[..., None])
    best = dots.amax(dim=1).float()  # [H, U]
    return best * scales.t().float() * torch.tensor(scale, dtype=torch.float32)


def select(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           context_lens: torch.Tensor, caps: torch.Tensor, *, unit: int, bits: int,
           scale: float, alpha: float, sink_tokens: int = 0, recent_tokens: int = 0,
           present: torch.Tensor | None = None) -> list[list[list[int]]]:
    """Per row and KV head the positions kept, ascending (the kernel's rule, its
    docstring in ``kernels.select_bounds``): the own unit, the best whole units and
    the first tokens of the next (k tokens in all), the sink and recent windows.

    Args:
        query: [B, H_kv, G, D] float32; codes, scales: ``unit_codes``'s.
        present: [B, N, H_kv] whether a capped pool holds each entry, or None.
    """
    num_rows, num_heads = query.shape[:2]
    out = []
    for b in range(num_rows):
        n = int(context_lens[b])
        complete, own = n // unit, n % unit
        scores = unit_scores(query[b], codes[b, :complete], scales[b, :complete], bits, scale)
        held = torch.ones((n, num_heads), dtype=torch.bool) if present is None else present[b, :n]
        if complete:
            whole_unit_gone = ~held[: complete * unit].view(complete, unit, num_heads).any(dim=1)
            scores = scores.masked_fill(whole_unit_gone.t(), -math.inf)
        total = 0
        for h in range(num_heads):
            best = float(scores[h].max()) if complete else -math.inf
            total += int((scores[h] > best - alpha).sum()) * unit + own
        k = min(total // num_heads, int(caps[b]))
        kept_own = min(own, k)  # the own unit's most recent tokens
        rest = k - kept_own
        row = []
        for h in range(num_heads):
            candidates = [u for u in range(complete) if scores[h, u] != -math.inf]
            # Best first, ties in position order: whole units, then the first
            # tokens of the next (the token rule over tokens scored by their unit).
            ranked = sorted(candidates, key=lambda u: (-float(scores[h, u]), u))
            take = {u: unit for u in ranked[: rest // unit]}
            if rest % unit and rest // unit < len(ranked):
                take[ranked[rest // unit]] = rest % unit
            kept = []
            for t in range(n):
                if not bool(held[t, h]):
                    continue
                own_unit = t >= complete * unit
                if own_unit and t < n - kept_own and not (t < sink_tokens
                                                          or t >= n - recent_tokens):
                    continue
                taking = not own_unit and take.get(t // unit, 0) > 0
                if taking:  # a unit's first present tokens
                    take[t // unit] -= 1
                if own_unit or taking or t < sink_tokens or t >= n - recent_tokens:
                    kept.append(t)
            row.append(kept)
        out.append(row)
    return out
