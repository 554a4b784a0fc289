# SPDX-License-Identifier: Apache-2.0
"""Candidate forms of InfiniGen's speculation keys, and what each costs per token.

A form is a projection and a codec. The projection maps a post-RoPE key of a
KV head to C channels (``key_proj``) and the speculation query to the same C
channels (``query_proj``), so that the score is their dot product::

    score(q, k) = (q @ query_proj[h]) . codec(k @ key_proj[h])     per KV head h

Projections (per layer and KV head, from calibration activations):

- ``skew``: columns of the skewing basis V (SVD of the group's stacked
  queries), query_proj = key_proj = V[:, columns]; columns by today's rule
  (``vllm_infinigen.skewing.skew_from_activations``: top |qV| + |kV|), by
  |qV| alone, by the artifact's union of the top |qV| and top |kV| columns,
  or all D columns ordered by |qV|;
- ``identity``: the raw key channels; ``hadamard``: all D channels rotated by
  the normalised Hadamard matrix (spreads outlier channels before a per-token scale);
- ``lowrank``: the best rank-C bilinear approximation of q.k under the
  calibration second moments (whitened SVD, ``bilinear_lowrank``).

Codecs: ``fp32``, ``bf16``, ``fp8`` (e4m3) per value; ``block-int`` b-bit
integers with an fp16 scale (``sym``) or scale and minimum (``asym``) per
channel per 16-token block, channel-major, the open (not yet full) block of
a request scored with its full keys; ``token-int`` b-bit integers with one
fp16 scale (and minimum) per token. Bits per token per KV head: ``bits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per block of the block-quantized codecs (vLLM's CPU block size)
PER_VALUE_BITS = {"fp32": 32, "bf16": 16, "fp8": 8}


@dataclass(frozen=True)
class FormSpec:
    """A candidate: projection x channels x codec (what the tables name).

    ``channels``: C as a fraction of head_dim (``None``: the projection's
    own count, e.g. today's r x D or the artifact's union).
    """

    name: str
    projection: str  # skew-today|-q|-union|-union-matched|-all, identity, hadamard, lowrank
    codec: str  # fp32 | bf16 | fp8 | block-int | token-int
    channels: float | None = None
    bits: int = 0  # block-int / token-int
    asym: bool = False
    rerank: int = 0  # two-pass: keep rerank x k candidates, re-score with full keys

    def num_channels(self, head_dim: int, partial: int) -> int:
        if self.channels is None:
            return partial
        return max(1, round(self.channels * head_dim))

    def bits_per_token(self, num_channels: float) -> float:
        """Stored bits per token per KV head (scales amortized over a block)."""
        if self.codec in PER_VALUE_BITS:
            return num_channels * PER_VALUE_BITS[self.codec]
        scales = 2 if self.asym else 1
        if self.codec == "block-int":
            return num_channels * self.bits + num_channels * 16 * scales / BLOCK
        return num_channels * self.bits + 16 * scales  # token-int


# -- projections -------------------------------------------------------------------


def skew_basis(queries: torch.Tensor, keys: torch.Tensor):
    """Per KV head: V [D, D] (columns by decreasing singular value of the group's
    stacked queries), |qV| and |kV| column energies [D]. queries [H_q, N, D], keys [H_kv, N, D]."""
    num_kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    group = queries.shape[0] // num_kv_heads
    out = []
    for head in range(num_kv_heads):
        stacked = queries[head * group:(head + 1) * group].reshape(-1, head_dim).double()
        basis = torch.linalg.svd(stacked, full_matrices=False)[2].T
        out.append((basis, (stacked @ basis).abs().sum(0), (keys[head].double() @ basis).abs().sum(0)))
    return out


def bilinear_lowrank(queries: torch.Tensor, keys: torch.Tensor, rank: int, eps: float = 1e-4):
    """(query_proj, key_proj) [D, rank] of one KV head minimising E[(q.k - (qA).(kB))^2]
    for q, k drawn independently with the calibration second moments.

    With S_q = L_q^2 and S_k = L_k^2 (symmetric square roots), q.k = a^T (L_q L_k) b
    for whitened a, b; the truncated SVD U S W^T of L_q L_k is the optimum:
    A = L_q^-1 U_R, B = L_k^-1 W_R S_R.
    """
    def sqrt_and_inverse(x: torch.Tensor):
        moment = x.T @ x / x.shape[0]
        moment = moment + eps * moment.trace() / moment.shape[0] * torch.eye(moment.shape[0],
                                                                                dtype=x.dtype)
        values, vectors = torch.linalg.eigh(moment)
        return (vectors * values.sqrt()) @ vectors.T, (vectors / values.sqrt()) @ vectors.T

    root_q, inv_q = sqrt_and_inverse(queries.double())
    root_k, inv_k = sqrt_and_inverse(keys.double())
    u, s, wh = torch.linalg.svd(root_q @ root_k)
    return inv_q @ u[:, :rank], inv_k @ wh[:rank].T * s[:rank]


def hadamard(size: int) -> torch.Tensor:
    """[size, size] orthonormal Sylvester-Hadamard matrix (size a power of 2)."""
    if size & (size - 1):
        raise ValueError(f"hadamard needs a power of 2, got {size}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / size ** 0.5


def union_columns(q_energy: torch.Tensor, k_energy: torch.Tensor, count: int,
                  matched: bool) -> torch.Tensor:
    """The artifact's rule: top ``count`` by |qV| union top ``count`` by |kV| (up to
    2 x count columns); ``matched``: alternate the two rankings until ``count`` distinct."""
    q_rank, k_rank = q_energy.argsort(descending=True), k_energy.argsort(descending=True)
    if not matched:
        return torch.unique(torch.cat([q_rank[:count], k_rank[:count]]))
    chosen: list[int] = []
    for q_col, k_col in zip(q_rank.tolist(), k_rank.tolist()):
        for col in (q_col, k_col):
            if col not in chosen and len(chosen) < count:
                chosen.append(col)
    return torch.tensor(sorted(chosen))


def layer_projections(spec: FormSpec, queries: torch.Tensor, keys: torch.Tensor,
                      partial: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per KV head (query_proj, key_proj), float32 [D, C_h], for one layer."""
    from vllm_infinigen.skewing.calibration import skew_from_activations

    head_dim = keys.shape[-1]
    count = spec.num_channels(head_dim, partial)
    if spec.projection == "identity":
        eye = torch.eye(head_dim)[:, :count]
        return [(eye, eye)] * keys.shape[0]
    if spec.projection == "hadamard":
        rotation = hadamard(head_dim)[:, :count]
        return [(rotation, rotation)] * keys.shape[0]
    if spec.projection == "skew-today":
        slices = skew_from_activations(queries, keys, count)  # the product's own function
        return [(s, s) for s in slices]
    if spec.projection == "lowrank":
        group = queries.shape[0] // keys.shape[0]
        out = []
        for head in range(keys.shape[0]):
            stacked = queries[head * group:(head + 1) * group].reshape(-1, head_dim)
            query_proj, key_proj = bilinear_lowrank(stacked, keys[head], count)
            out.append((query_proj.float(), key_proj.float()))
        return out
    out = []
    for basis, q_energy, k_energy in skew_basis(queries, keys):
        if spec.projection == "skew-q":
            columns = q_energy.topk(count).indices.sort().values
        elif spec.projection == "skew-all":
            columns = q_energy.argsort(descending=True)[:count]
        elif spec.projection in ("skew-union", "skew-union-matched"):
            columns = union_columns(q_energy, k_energy, count,
                                    spec.projection == "skew-union-matched")
        else:
            raise ValueError(f"unknown projection {spec.projection!r}")
        piece = basis[:, columns].float()
        out.append((piece, piece))
    return out


# -- codecs ------------------------------------------------------------------------


def quantize_blocks(x: torch.Tensor, bits: int, asym: bool) -> torch.Tensor:
    """Dequantized x [T, C]: b-bit codes, fp16 scale (and minimum) per channel per block."""
    num_tokens = x.shape[0]
    pad = (-num_tokens) % BLOCK
    blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(-1, BLOCK, x.shape[-1])
    return _quantize(blocks, bits, asym, dim=1).reshape(-1, x.shape[-1])[:num_tokens]


def quantize_tokens(x: torch.Tensor, bits: int, asym: bool) -> torch.Tensor:
    """Dequantized x [T, C]: b-bit codes, one fp16 scale (and minimum) per token."""
    return _quantize(x, bits, asym, dim=-1)


def _quantize(x: torch.Tensor, bits: int, asym: bool, dim: int) -> torch.Tensor:
    levels = 2 ** bits - 1
    if asym:  # x ~ minimum + code * scale, code in 0..levels
        low = x.amin(dim, keepdim=True).half().float()
        scale = ((x.amax(dim, keepdim=True) - low) / levels).half().float().clamp(min=1e-8)
        return low + torch.round((x - low) / scale).clamp(0, levels) * scale
    # midrise: x ~ (code - levels / 2) * scale, every code a non-zero level
    scale = (x.abs().amax(dim, keepdim=True) / (levels / 2)).half().float().clamp(min=1e-8)
    return (torch.round(x / scale + levels / 2).clamp(0, levels) - levels / 2) * scale


def encode(spec: FormSpec, x: torch.Tensor) -> torch.Tensor:
    """What a scoring kernel would read back, dequantized: x [T, C] float32."""
    if spec.codec == "fp32":
        return x
    if spec.codec == "bf16":
        return x.bfloat16().float()
    if spec.codec == "fp8":
        return x.to(torch.float8_e4m3fn).float()
    if spec.codec == "block-int":
        return quantize_blocks(x, spec.bits, spec.asym)
    if spec.codec == "token-int":
        return quantize_tokens(x, spec.bits, spec.asym)
    raise ValueError(f"unknown codec {spec.codec!r}")


class KeyForm:
    """One form with its projections for every layer of one model.

    Args:
        spec: The candidate.
        calibration: Per layer (queries [H_q, N, D], keys [H_kv, N, D]).
        partial: Today's channel count int(r x D).
        layers: The layers scored (the sparse ones).
    """

    def __init__(self, spec: FormSpec, calibration, partial: int, layers):
        self.spec = spec
        self.projections = {idx: layer_projections(spec, *calibration[idx], partial)
                            for idx in layers}
        counts = [key_proj.shape[1] for heads in self.projections.values()
                  for _, key_proj in heads]
        self.mean_channels = sum(counts) / len(counts)
        self.bits = spec.bits_per_token(self.mean_channels)

    def scores(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Raw dot products [H_kv, G, n, T] of query [H_q, n, D] with keys [H_kv, T, D]."""
        query, keys = query.float(), keys.float()
        num_kv_heads = keys.shape[0]
        grouped = query.view(num_kv_heads, -1, query.shape[1], query.shape[2])
        out = []
        for head, (query_proj, key_proj) in enumerate(self.projections[layer_idx]):
            stored = encode(self.spec, keys[head] @ key_proj)  # [T, C]
            out.append(torch.einsum("gnc,tc->gnt", grouped[head] @ query_proj, stored))
        scores = torch.stack(out)
        if self.spec.codec == "block-int":  # the open block: full keys
            exact = torch.einsum("hgnd,htd->hgnt", grouped, keys)
            open_from = positions // BLOCK * BLOCK  # [n]
            is_open = torch.arange(keys.shape[1])[None, :] >= open_from[:, None]  # [n, T]
            scores = torch.where(is_open, exact, scores)
        return scores


def describe_bits(bits: float, head_dim: int) -> str:
    return f"{bits / 8:g} B ({bits / head_dim:.3g} bit/ch)"


def matched(bits: float, budget_bits: float) -> bool:
    return math.isclose(bits, budget_bits) or bits <= budget_bits
