# SPDX-License-Identifier: Apache-2.0
"""Worker side: the persistent buffers the capture op copies attention inputs into.

Apart from the op (``capture.py``, which needs vLLM) so that a layer's state
imports without vLLM: the GPU tests and the GPU benchmark drive the runtime on
machines with torch and Triton only, where no forward context exists.
"""

from __future__ import annotations

import torch

import vllm_infinigen.platforms.devices as devices

try:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available
except ImportError:  # no vLLM: no forward context either (``graph_tokens``)
    CUDAGraphMode = get_forward_context = is_forward_context_available = None


class CaptureBuffers:
    """Persistent [rows, hidden] buffers for the speculating layers' attention
    inputs: two, shared by a chain of speculating layers (layer i, the layer it
    speculates for, that layer's next...) and taken in turn along it
    (``LayerState.capture_slot``). Layer i's input is read by layer i's
    attention (in evaluation mode with prompt rows, by the next layer's),
    before the layer two links on copies its own over it.

    Sized by the first copy into each: in vLLM's worker that is the profile run
    (``max_num_batched_tokens`` tokens, ``gpu_model_runner.profile_run``), which
    comes before any CUDA graph is captured and counts in the memory profile.
    A larger copy later grows a buffer in an eager step; during a capture it
    raises (a buffer moved after a capture would leave the graph writing
    freed memory).
    """

    def __init__(self):
        self.tensors: list[torch.Tensor | None] = [None, None]

    def buffer_for(self, slot: int, hidden: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s buffer, with at least ``hidden``'s rows, its row
        shape, dtype and device.

        Raises:
            RuntimeError: When the buffer must grow while a CUDA graph is
                being captured.
        """
        buffer = self.tensors[slot]
        fits = (buffer is not None and buffer.shape[1:] == hidden.shape[1:]
                and buffer.dtype == hidden.dtype and buffer.device == hidden.device)
        if fits and buffer.shape[0] >= hidden.shape[0]:
            return buffer
        if devices.is_capturing(hidden.device):
            raise RuntimeError(
                f"InfiniGen: a CUDA graph capture needs a capture buffer of "
                f"{hidden.shape[0]} rows; the buffer is sized by the first forward "
                f"(vLLM's profile run, max_num_batched_tokens tokens) and cannot "
                f"move during a capture")
        rows = max(hidden.shape[0], buffer.shape[0] if fits else 0)
        buffer = hidden.new_empty((rows, *hidden.shape[1:]))
        self.tensors[slot] = buffer
        return buffer


def graph_tokens() -> int | None:
    """The running forward's tokens (padded) when it runs under CUDA graphs,
    where a captured copy replays without the op's Python; None otherwise
    (without vLLM: always)."""
    if is_forward_context_available is None or not is_forward_context_available():
        return None
    context = get_forward_context()
    if (context.cudagraph_runtime_mode == CUDAGraphMode.NONE
            or context.batch_descriptor is None):
        return None
    return context.batch_descriptor.num_tokens
