# SPDX-License-Identifier: Apache-2.0
"""KV bytes per decode step: what dense attention reads, what InfiniGen and the baselines read.

A sparse engine reads its dense layers' K/V, the selection metadata of every
context token and the selected K/V (``vllm:infinigen_*`` counters); the ideal
fractions are the speculation keys + budget (InfiniGen: the paper's nominal
r/2 for the partial keys, the int codes and scales for the int keys) or
metadata + budget (baselines). Plain arithmetic, unit-tested in ``tests/unit/test_perf_harness.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_infinigen.policies.quest import QUEST_PAGE_SIZE
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import KEY_GROUP, ModelLayout

DEFAULT_KEYS = InfiniGenConfig.speculation_keys  # --infinigen-speculation-keys

# H2O keeps one float32 accumulated score per token and KV head.
H2O_SCORE_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """What the KV arithmetic needs from a model's config."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4  # the benchmarks run float32 on CPU
    # K/V element bytes where they differ from the model's (FP8 K/V: 1)
    kv_element_bytes: int | None = None

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K + V of one token in one layer, all KV heads."""
        return 2 * self.kv_heads * self.head_dim * (self.kv_element_bytes or self.dtype_bytes)


def model_shape(model_dir: Path, dtype_bytes: int = 4,
                kv_element_bytes: int | None = None) -> ModelShape:
    """The shape of the Hugging Face model in ``model_dir``, as the runtime reads it."""
    layout = ModelLayout.of_model_dir(model_dir)
    return ModelShape(layers=layout.num_layers, kv_heads=layout.num_kv_heads,
                      head_dim=layout.head_dim, dtype_bytes=dtype_bytes,
                      kv_element_bytes=kv_element_bytes)


def weight_bytes(model_dir: Path, dtype_bytes: int) -> int | None:
    """Bytes of ``model_dir``'s ``model.safetensors`` weights as an engine of
    ``dtype_bytes`` per value holds them (floating tensors cast, the rest as
    stored): what a decode step reads of the weights. None without the file.
    Read from the file's header (8-byte length, then JSON), not its data."""
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        return None
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    stored = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = math.prod(entry["shape"])
        floating = entry["dtype"] in ("F64", "F32", "F16", "BF16")
        total += count * (dtype_bytes if floating else stored[entry["dtype"]])
    return total


def speculation_key_bytes(shape: ModelShape, partial_ratio: float = 0.2,
                          speculation_keys: str = DEFAULT_KEYS) -> float:
    """Bytes of one token's speculation keys per KV head: int codes plus their
    scales amortized over a 16-token group, or ``rank`` partial channels."""
    layout = ModelLayout("", num_layers=1, num_heads=shape.kv_heads, num_kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, dense_layers=0, partial_ratio=partial_ratio,
                         speculation_keys=speculation_keys)
    return layout.key_bytes_per_group(shape.dtype_bytes) / KEY_GROUP


def metadata_bytes_per_token(policy: str, shape: ModelShape, partial_ratio: float = 0.2,
                             speculation_keys: str = DEFAULT_KEYS) -> float:
    """Bytes a policy reads per context token in one sparse layer to choose (all KV heads).

    - infinigen: the speculation keys (``speculation_key_bytes``).
    - quest: each 16-token page's key min and max (1/16 of K+V).
    - h2o: one float32 accumulated score per token and KV head.
    - streaming: nothing (positions only).
    """
    per_head = {
        "infinigen": speculation_key_bytes(shape, partial_ratio, speculation_keys),
        "quest": 2 * shape.head_dim * shape.dtype_bytes / QUEST_PAGE_SIZE,
        "h2o": H2O_SCORE_BYTES,
        "streaming": 0,
    }
    if policy not in per_head:
        raise ValueError(f"unknown policy {policy!r}; known: {sorted(per_head)}")
    return per_head[policy] * shape.kv_heads


def ideal_kv_fraction(num_layers: int, dense_layers: int, sparse_fraction: float) -> float:
    """KV bytes read per step relative to dense attention in every layer.

    Dense layers read everything; each sparse layer reads ``sparse_fraction``
    of its dense bytes (for InfiniGen the paper's r/2 + budget: partial keys
    are r of K, i.e. r/2 of K+V, plus the selected K/V).
    """
    if not 0 <= dense_layers <= num_layers or num_layers < 1:
        raise ValueError(f"need 0 <= dense_layers ({dense_layers}) <= layers ({num_layers})")
    sparse = num_layers - dense_layers
    return (dense_layers + sparse * sparse_fraction) / num_layers


def ideal_sparse_fraction(policy: str, budget: float, partial_ratio: float = 0.2,
                          shape: ModelShape | None = None,
                          speculation_keys: str = DEFAULT_KEYS) -> float:
    """A sparse layer's ideal read as a fraction of its dense bytes: metadata + budget.

    InfiniGen's partial keys use the paper's nominal r/2 (``partial_ratio / 2``);
    its int keys and the other policies their metadata per token (needs
    ``shape``) relative to K+V.
    """
    if policy == "infinigen" and speculation_keys == "partial":
        return partial_ratio / 2 + budget
    if shape is None:
        raise ValueError(f"the ideal of {policy!r} needs the model shape")
    metadata = metadata_bytes_per_token(policy, shape, partial_ratio, speculation_keys)
    return metadata / shape.kv_bytes_per_token_layer + budget


@dataclass
class StepBytes:
    """KV bytes of one decode step (all requests of the batch), by where they come from."""

    dense_equivalent: float  # dense attention in every layer over the same contexts
    dense_layers: float  # the layers InfiniGen keeps dense (full KV)
    metadata: float  # partial keys / page bounds / scores the sparse layers score
    pool_to_attention: float  # selected K/V the attention reads from the pool (selected_kv_bytes)

    @property
    def total(self) -> float:
        return self.dense_layers + self.metadata + self.pool_to_attention

    @property
    def fraction(self) -> float:
        return self.total / self.dense_equivalent if self.dense_equivalent else math.nan


def dense_step_bytes(shape: ModelShape, context_tokens: float) -> float:
    """Bytes dense attention reads in one step over ``context_tokens`` (summed over the batch)."""
    return shape.layers * shape.kv_bytes_per_token_layer * context_tokens


def sparse_step_bytes(shape: ModelShape, dense_layers: int, policy: str,
                      counters: Mapping[str, float], steps: int,
                      partial_ratio: float = 0.2,
                      speculation_keys: str = DEFAULT_KEYS) -> StepBytes:
    """Per-step KV bytes of a sparse engine from counter differences over ``steps`` steps.

    Args:
        counters: Totals over the sparse layers of ``candidate_tokens`` (context
            tokens each sparse layer would have read, summed over decode rows
            and steps) and ``selected_kv_bytes`` (selected K/V the attention read).
        steps: Decode steps the counters cover.
    """
    sparse_layers = shape.layers - dense_layers
    if steps < 1 or sparse_layers < 1:
        raise ValueError(f"need steps >= 1 and a sparse layer (steps {steps}, "
                         f"sparse layers {sparse_layers})")
    # Context tokens per step summed over the batch (the same in every layer).
    context = counters.get("candidate_tokens", 0) / sparse_layers / steps
    per_layer = shape.kv_bytes_per_token_layer * context
    return StepBytes(
        dense_equivalent=shape.layers * per_layer,
        dense_layers=dense_layers * per_layer,
        metadata=sparse_layers * context * metadata_bytes_per_token(
            policy, shape, partial_ratio, speculation_keys),
        pool_to_attention=counters.get("selected_kv_bytes", 0) / steps,
    )


def kv_space_bytes(shape: ModelShape, tokens: int, kv_manager: str, *, dense_layers: int = 2,
                   group_size: int | None = None, partial_ratio: float = 0.2,
                   speculation_keys: str = DEFAULT_KEYS, margin: float = 1.15,
                   resident: bool = False) -> int:
    """``kv_cache_memory_bytes`` that holds ``tokens`` tokens (with ``margin`` for blocks).

    Stock vLLM keeps K/V of every layer; InfiniGen keeps ``group_size`` pages
    per block id (``vllm_infinigen.layout.kv_cache_group_size``; the dense
    layers' count by default) plus every sparse layer's speculation keys, while
    the sparse layers' K/V live in the host pool outside this space. A
    ``resident`` engine (``--infinigen-residency device-first`` that never
    moves) holds a block id in every group: every layer's K/V, as stock does,
    plus the speculation keys.
    """
    if kv_manager == "vllm":
        per_token = shape.layers * shape.kv_bytes_per_token_layer
    elif kv_manager == "infinigen":
        pages = dense_layers if group_size is None else group_size
        if resident:
            pages = shape.layers if group_size is None else group_size * -(
                -shape.layers // group_size)
        sparse = shape.layers - dense_layers
        per_token = (pages * shape.kv_bytes_per_token_layer + sparse * shape.kv_heads
                     * speculation_key_bytes(shape, partial_ratio, speculation_keys))
    else:
        raise ValueError(f"unknown kv_manager {kv_manager!r}")
    return int(math.ceil(tokens * per_token * margin))


def counter_totals(summary: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``vllm_infinigen.metrics.summarize`` output summed over layers."""
    return {name: float(sum(values.values())) for name, values in summary.items()}


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Counter increments between two ``counter_totals``."""
    return {name: after.get(name, 0.0) - before.get(name, 0.0)
            for name in set(before) | set(after)}
