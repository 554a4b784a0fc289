# SPDX-License-Identifier: Apache-2.0
"""Block selections recorded on a trained model: the file, the reuse measure, the replay.

A trace holds, for every decode step, sparse layer and KV head, which of the
request's blocks InfiniGen's block rule selected (one request, block size
16): a bool mask [steps, layers, kv_heads, max_blocks], stored packed
(numpy ``packbits``, zlib, base64) in JSON beside its provenance.

Replay at a longer context (``replay_blocks``), exactly:

- scale: recorded block b becomes the ``group`` consecutive blocks
  b * group .. b * group + group - 1, with group = context_blocks // max_blocks,
  so the kept fraction and every step-to-step overlap are the recorded ones
  (a cache of the same size relative to the selection sees the same hits);
  to replay a smaller fraction (a token cap: ``kept_fraction``), each kept
  block becomes only the first ``per_block`` blocks of its group: the
  fraction scales by per_block / group and the overlaps stay the recorded ones;
  the replaying row's own block (index ``context_blocks``) is added to every
  selection, as the rule always keeps the own block;
- streams: (sparse layer i, KV head h, row b) replays recorded stream
  (i * kv_heads + h + b) mod (recorded layers x recorded heads);
- steps: row b starts at recorded step 8 * b and runs back and forth over
  the recorded steps (0, 1, ..., n-1, n-2, ..., 1, 0, 1, ...), so that a
  replay never jumps between distant steps.
"""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRACES = Path(__file__).resolve().parent / "traces"
# The longest recall model's selections at 4K, one trace per budget and cap
# (``record_selections``); a replay takes the one recorded at its fraction.
TRACE_MODEL = "recall-llama-12l-4k"
ROW_STEP_OFFSET = 8


def pack_masks(masks: np.ndarray) -> str:
    """Bool array -> base64 of zlib of packbits (shape kept by the caller)."""
    return base64.b64encode(zlib.compress(np.packbits(masks.astype(bool)).tobytes(), 9)).decode()


def unpack_masks(data: str, shape: list[int]) -> np.ndarray:
    bits = np.frombuffer(zlib.decompress(base64.b64decode(data)), dtype=np.uint8)
    return np.unpackbits(bits)[: int(np.prod(shape))].reshape(shape).astype(bool)


def save_trace(path: Path, masks: np.ndarray, provenance: dict[str, Any]) -> Path:
    """Writes ``masks`` [steps, layers, kv_heads, max_blocks] and ``provenance``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance, "shape": list(masks.shape),
              "masks": pack_masks(masks)}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_trace(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """(masks [steps, layers, kv_heads, max_blocks] bool, provenance)."""
    record = json.loads(Path(path).read_text())
    return unpack_masks(record["masks"], record["shape"]), record["provenance"]


def save_recorded(directory: Path, masks: np.ndarray, provenance: dict[str, Any], *,
                  budget: float, cap: int | None, **about: Any) -> Path:
    """Writes one recorded setting's trace as ``<model>_budget<B>[_cap<N>].json``,
    its provenance with the setting and the fraction of the recorded context it
    selects (``selection_fraction``: the budget, or the cap over the context)."""
    context = provenance["context_tokens"]
    fraction = budget if cap is None else min(budget, cap / context)
    name = f"{provenance['model']}_budget{budget:g}" + ("" if cap is None else f"_cap{cap}")
    return save_trace(Path(directory) / f"{name}.json", masks, {
        **provenance, "budget": budget, "token_cap": cap, "selection_fraction": fraction,
        **about})


def recorded_traces(directory: Path = TRACES, model: str = TRACE_MODEL) -> list[Path]:
    """``model``'s traces in ``directory``."""
    return sorted(Path(directory).glob(f"{model}_budget*.json"))


def recorded_blocks(traces: list[Path]) -> int:
    """Blocks per row the budget-0.2 trace of ``traces`` records (the self-tests'
    context: a block per recorded block)."""
    return load_trace(trace_for(0.2, traces))[0].shape[-1]


def selection_fraction(path: Path) -> float:
    """The fraction of its context a trace's setting selects."""
    return float(json.loads(Path(path).read_text())["provenance"]["selection_fraction"])


def trace_for(fraction: float, traces: list[Path]) -> Path:
    """The trace recorded at the smallest fraction at least ``fraction`` (a
    replay thins a recorded selection, it cannot widen one: ``per_block_for``),
    or the widest where none reaches it.

    Raises:
        ValueError: If ``traces`` is empty.
    """
    if not traces:
        raise ValueError("no recorded trace: run python -m benchmarks.gpu.record_selections "
                         f"(the traces of {TRACE_MODEL} are in {TRACES})")
    recorded = sorted((selection_fraction(path), path.name, path) for path in traces)
    return next((path for value, _, path in recorded if value >= fraction * (1 - 1e-9)),
                recorded[-1][2])


def step_reuse(masks: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """[steps - 1, layers, heads] fraction of each step's selected blocks that
    the previous step selected too (``skip`` [steps, blocks]: blocks left out
    of both counts, e.g. the always-kept sink and own blocks)."""
    current, previous = masks[1:], masks[:-1]
    if skip is not None:
        keep = ~skip[1:, None, None, :]
        current, previous = current & keep, previous & keep
    selected = current.sum(axis=-1)
    both = (current & previous).sum(axis=-1)
    return both / np.maximum(selected, 1)


def replay_order(num_steps: int, length: int, start: int) -> list[int]:
    """Recorded steps to replay, back and forth from ``start``."""
    period = max(1, 2 * (num_steps - 1))
    order = []
    for index in range(start, start + length):
        phase = index % period
        order.append(phase if phase < num_steps else period - phase)
    return order


def kept_fraction(masks: np.ndarray) -> float:
    """The mean fraction of the recorded blocks a selection kept."""
    return float(masks.mean())


def per_block_for(masks: np.ndarray, context_blocks: int, fraction: float,
                  recorded: float | None = None) -> int:
    """Blocks each kept recorded block becomes so that a replay keeps about
    ``fraction`` of ``context_blocks`` where the trace kept ``recorded`` (default:
    the fraction of its blocks it kept; a trace's ``selection_fraction`` compares
    a budget with a budget): at most the whole group, at least 1."""
    group = context_blocks // masks.shape[-1]
    recorded = kept_fraction(masks) if recorded is None else recorded
    return max(1, min(group, round(group * fraction / recorded)))


def replay_blocks(masks: np.ndarray, *, num_layers: int, num_kv_heads: int, num_rows: int,
                  context_blocks: int, num_steps: int, first_step: int = 0,
                  per_block: int | None = None) -> torch.Tensor:
    """[num_steps, num_layers, num_rows, num_kv_heads, W] int32 logical blocks (-1 padded).

    Args:
        masks: A trace's masks [steps, layers, heads, max_blocks].
        num_layers, num_kv_heads, num_rows: The replaying model's sparse layers,
            KV heads per layer and batch rows.
        context_blocks: Blocks of context per row (own block excluded); the
            own block is ``context_blocks`` (module docstring).
        num_steps: Steps to replay; ``first_step`` of the replay order first.
        per_block: Blocks each kept recorded block becomes, the first of its
            group (``per_block_for``); None: the whole group.

    Raises:
        ValueError: If the context has fewer blocks than the trace, or
            ``per_block`` is not in 1..group.
    """
    recorded_steps, recorded_layers, recorded_heads, max_blocks = masks.shape
    group = context_blocks // max_blocks
    if group < 1:
        raise ValueError(f"a context of {context_blocks} blocks is shorter than the "
                         f"trace's {max_blocks}")
    per_block = group if per_block is None else per_block
    if not 1 <= per_block <= group:
        raise ValueError(f"per_block {per_block} is not in 1..{group}")
    streams = masks.reshape(recorded_steps, recorded_layers * recorded_heads, max_blocks)
    width = int(streams.sum(axis=-1).max()) * per_block + 1
    out = np.full((num_steps, num_layers, num_rows, num_kv_heads, width), -1, dtype=np.int32)
    offsets = np.arange(per_block, dtype=np.int64)
    for row in range(num_rows):
        order = replay_order(recorded_steps, num_steps, first_step + ROW_STEP_OFFSET * row)
        for layer in range(num_layers):
            for head in range(num_kv_heads):
                stream = (layer * num_kv_heads + head + row) % streams.shape[1]
                for step, recorded in enumerate(order):
                    chosen = np.flatnonzero(streams[recorded, stream])
                    blocks = (chosen[:, None] * group + offsets[None, :]).reshape(-1)
                    blocks = np.append(blocks, context_blocks)
                    out[step, layer, row, head, : blocks.size] = blocks
    return torch.from_numpy(out)
