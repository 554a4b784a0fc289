# SPDX-License-Identifier: Apache-2.0
"""A decoder shaped like Llama-3.1-8B with random weights: one decode step, attention pluggable.

Per layer: RMSNorm, the fused qkv GEMM, attention (the variant's: dense,
offloaded, InfiniGen), the output GEMM, RMSNorm, gate|up GEMM, SiLU, down
GEMM; the LM head after the last layer. RoPE is left out (speed, and the
same K/V feed every variant). Every row decodes one token per step at the
same context T, so that repeated steps read the same K/V::

    per layer, one row   K/V of T context tokens + 1 own token
    pool units           [B * (T / block_size + 1) * H_kv, block_size, 2 * D]
                         unit (b * blocks_per_row + j) * H_kv + h: row b's block j, head h
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_infinigen.layout import ModelLayout


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int = 32
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    block_size: int = 16
    dense_layers: int = 2  # InfiniGen's first layers, dense (the last speculates)
    partial_channels: int = 25  # the paper's r * d at r = 0.2 (layout.partial_rank)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def blocks_per_row(self, context: int) -> int:
        """Blocks of one row: its context and its own token."""
        return context // self.block_size + 1

    def unit_bytes(self, dtype: torch.dtype) -> int:
        return self.block_size * 2 * self.head_dim * dtype.itemsize

    def layer_kv_bytes(self, batch: int, context: int, dtype: torch.dtype) -> int:
        """One layer's pool region: every unit of every row."""
        return batch * self.blocks_per_row(context) * self.num_kv_heads * self.unit_bytes(dtype)

    def layout(self, speculation_keys: str = "int") -> ModelLayout:
        """The product's view of this shape (its dense/sparse split, speculation keys)."""
        return ModelLayout("llama", num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           dense_layers=self.dense_layers,
                           partial_ratio=self.partial_channels / self.head_dim,
                           speculation_keys=speculation_keys)

    def weight_bytes(self, dtype: torch.dtype) -> int:
        per_layer = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer += self.num_heads * self.head_dim * self.hidden
        per_layer += 3 * self.hidden * self.intermediate
        return (self.num_layers * per_layer + self.hidden * self.vocab) * dtype.itemsize


LLAMA_31_8B = DecoderShape()
TINY = DecoderShape(num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate=96, vocab=64, block_size=16, partial_channels=4)


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [hidden, (H_q + 2 H_kv) * D]
    out: torch.Tensor  # [H_q * D, hidden]
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    down: torch.Tensor  # [intermediate, hidden]
    skew: torch.Tensor  # [H_kv, D, R] the partial query's columns


def random_weights(shape: DecoderShape, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> tuple[list[LayerWeights], torch.Tensor]:
    """(layers, LM head [hidden, vocab]), scaled 1 / sqrt(fan in)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, columns: int) -> torch.Tensor:
        weight = torch.randn(rows, columns, device=device, dtype=dtype, generator=generator)
        return weight.mul_(1.0 / math.sqrt(rows))

    qkv_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    layers = []
    for _ in range(shape.num_layers):
        skew = torch.linalg.qr(torch.randn(shape.num_kv_heads, shape.head_dim, shape.head_dim,
                                           device=device, generator=generator))[0]
        layers.append(LayerWeights(
            matrix(shape.hidden, qkv_width), matrix(shape.num_heads * shape.head_dim, shape.hidden),
            matrix(shape.hidden, 2 * shape.intermediate), matrix(shape.intermediate, shape.hidden),
            skew[..., : shape.partial_channels].contiguous()))
    return layers, matrix(shape.hidden, shape.vocab)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


class Decoder:
    """One decode step of every row; ``variant`` supplies the attention (``variants.py``)."""

    def __init__(self, shape: DecoderShape, layers: list[LayerWeights], lm_head: torch.Tensor):
        self.shape, self.layers, self.lm_head = shape, layers, lm_head

    def step(self, x: torch.Tensor, variant, *, last_only: bool = False) -> torch.Tensor:
        """[B, vocab] logits of the step whose inputs are x [B, hidden] (``last_only``:
        [1, vocab], the last row's, as a prefill chunk samples)."""
        shape = self.shape
        num_q = shape.num_heads * shape.head_dim
        num_kv = shape.num_kv_heads * shape.head_dim
        variant.begin_step()
        for index, weights in enumerate(self.layers):
            hidden = rms_norm(x)
            variant.after_norm(index, hidden)
            qkv = hidden @ weights.qkv
            query = qkv[:, :num_q].view(-1, shape.num_heads, shape.head_dim)
            key = qkv[:, num_q : num_q + num_kv].view(-1, shape.num_kv_heads, shape.head_dim)
            value = qkv[:, num_q + num_kv :].view(-1, shape.num_kv_heads, shape.head_dim)
            attended = variant.attend(index, query, key, value)  # [B, H_q * D]
            x = x + attended @ weights.out
            gate, up = (rms_norm(x) @ weights.gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ weights.down
        variant.end_step()
        return rms_norm(x[-1:] if last_only else x) @ self.lm_head
