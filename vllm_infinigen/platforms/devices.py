# SPDX-License-Identifier: Apache-2.0
"""What differs by the torch device a tensor is on (not by vLLM's platform): the
tables the neutral modules reach device-specific code through
(``tests/unit/test_structure.py``: no ``torch.cuda`` and no device-type branch
outside ``platforms/``). Like ``platforms/__init__.py``'s, the tables name a
platform's module as a dotted string, imported on first use; this module
imports no platform (the neutral modules import it without a circle)."""

from __future__ import annotations

import functools
import importlib

import torch

# Device type -> how the speculation applies RoPE to a query [S, H_q * D]:
# ``rotate(rope, positions, query)``. A device without a line calls the model's
# module on the query as it is (CUDA: in place, vLLM's kernel takes the row
# stride of a qkv slice).
ROTATIONS = {
    "cpu": "vllm_infinigen.platforms.cpu.rope.rotate",
}

# Device type -> whether its current stream is being captured into a graph now.
CAPTURE_CHECKS = {
    "cuda": "torch.cuda.is_current_stream_capturing",
}

# Device type -> waits for all its work, every stream's: ``synchronize(device)``. A
# device without a line runs each op before the next (the CPU).
SYNCHRONIZERS = {
    "cuda": "torch.cuda.synchronize",
}

# Device type -> how vLLM's own FP8 KV-cache write rounds K / k_scale and V / v_scale
# there (``--kv-cache-dtype fp8``): its CPU build toward zero
# (``cpu_attn_reshape_and_cache``, measured: tests/unit/test_kernels_fp8.py); a device
# without a line to nearest (its CUDA build).
FP8_WRITE_ROUNDING = {
    "cpu": "toward-zero",
}


def fp8_write_rounding(device: torch.device) -> str:
    """``"toward-zero"`` or ``"nearest"``: how vLLM's FP8 pages on ``device`` round."""
    return FP8_WRITE_ROUNDING.get(device.type, "nearest")


def rotate(rope, positions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``query`` after the model's RoPE (``rope``: its ``rotary_emb``), by the
    query's device's line in ``ROTATIONS``; ``query`` may be overwritten."""
    path = ROTATIONS.get(query.device.type)
    if path is None:
        return rope(positions, query, None)[0]
    return _load(path)(rope, positions, query)


def is_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a graph."""
    path = CAPTURE_CHECKS.get(device.type)
    return path is not None and _load(path)()


def synchronize(device: torch.device) -> None:
    """Returns once every op queued on ``device`` so far has run."""
    path = SYNCHRONIZERS.get(device.type)
    if path is not None:
        _load(path)(device)


@functools.cache
def _load(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
