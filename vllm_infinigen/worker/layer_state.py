# SPDX-License-Identifier: Apache-2.0
"""Worker side: one attention layer's InfiniGen state.

A sparse layer keeps, addressed by the dense KV-cache group's block ids
(block-granular, so a request's context is read in runs), two buffers that
the platform's data path allocates and writes (``data_path.py``)::

    kv_pool       [units, H_kv, block_size, 2 * D]   host pool; a token's K | V
                                                     side by side in one row
    speculation keys, on the device, scored by the layer before (or the layer):
      bounds (the default; no skew)
        bounds        [num_blocks, H_kv, block_size / U, 2, D * bits / 8] uint8
        bound_scales  [num_blocks, H_kv, block_size / U] float16
                      U = BOUND_UNIT, bits = BOUND_BITS
      int (no skew)
        key_codes   [num_blocks, H_kv, G, D, 2 * bits] uint8   G = block_size / 16
        key_scales  [num_blocks, H_kv, G, D] float16
      partial (``skew`` set)
        partial_keys  [num_blocks, H_kv, R, block_size]  skewed, channel-major

Uncapped, a unit is a block id; with ``--infinigen-cpu-pool-gib`` each
(layer, KV head) maps its entries to rows of fewer units (``platforms/cpu/pool_index.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.layout import BOUND_BITS, BOUND_UNIT, KEY_GROUP, int_key_bits
from vllm_infinigen.worker.capture_buffers import CaptureBuffers, graph_tokens

if TYPE_CHECKING:
    from vllm_infinigen.worker.step_plan import RowSet


UNSCALED = MappingProxyType({"key_scale": 1.0, "value_scale": 1.0})  # K/V as they are


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class LayerSource:
    """What the loaded model gives one attention layer (found by ``install``)."""

    index: int  # decoder layer
    name: str  # vLLM's name of its attention layer
    attention: torch.nn.Module  # vLLM's ``Attention``
    self_attn: torch.nn.Module | None  # holds ``qkv_proj``, ``rotary_emb``, ``q_norm``
    skew: torch.Tensor | None  # [H_kv of this rank, D, R] float32; None: int keys
    query_proj: torch.nn.Module | None  # a platform's (CPU: ``query_weights.py``); None: qkv_proj


class LayerState:
    """InfiniGen state of one attention layer on this worker.

    Args:
        layer_idx: Index of the decoder layer.
        layer_name: vLLM's name of its attention layer.
        attn: vLLM's ``Attention`` module (shapes and scale from its impl).
        self_attn: The module holding ``qkv_proj``, ``rotary_emb`` and, in
            models that normalise each head's query before RoPE (Qwen3),
            ``q_norm``, if any.
        sparse: Whether the layer attends over a selection.
        skew: [H_kv, D, R] float32 skew slice of this rank's KV heads, for
            partial keys; None: every channel (bounds or int keys).
        speculation_keys: ``--infinigen-speculation-keys`` of a layer without
            skew: bounds or int.
        query_proj: The query rows of ``qkv_proj`` (a platform's; CPU:
            ``query_weights.py``): called with the attention input, and its
            ``rotated(hidden, positions, rope)`` the query after RoPE, or None
            where it cannot apply ``rope``; None: through ``qkv_proj``.
        next: The sparse layer this layer speculates for, if any.
        windowed: A sliding-window layer, left to vLLM (neither dense nor sparse).
        pool_layer: Index among the sparse layers (the pool index's layer).
        stats: [2] float64 view of the runtime's counters for this layer.
    """

    def __init__(self, layer_idx: int, layer_name: str, attn: torch.nn.Module,
                 self_attn: torch.nn.Module | None, sparse: bool, *,
                 skew: torch.Tensor, query_proj: torch.nn.Module | None = None,
                 next: LayerState | None = None, windowed: bool = False,
                 pool_layer: int = -1, stats: torch.Tensor | None = None,
                 speculation_keys: str = "int"):
        self.layer_idx = layer_idx
        self.layer_name = layer_name
        self.sparse = sparse
        self.windowed = windowed
        self.pool_layer = pool_layer
        impl = attn.impl
        self.num_heads = impl.num_heads
        self.num_kv_heads = impl.num_kv_heads
        self.head_size = impl.head_size
        self.scale = impl.scale
        self._attn = attn  # its k_scale and v_scale (``kv_scales``)
        self.qkv_proj = getattr(self_attn, "qkv_proj", None)
        self.rotary_emb = getattr(self_attn, "rotary_emb", None)
        # Per-head RMSNorm of the query before RoPE (Qwen3); the keys reach
        # ``write`` already normalised and rotated by the model.
        self.q_norm = getattr(self_attn, "q_norm", None)
        self.skew = skew
        self.speculation_keys = "partial" if skew is not None else speculation_keys
        self.query_proj = query_proj
        self.next = next
        # Entries attended besides the rows' own (over KV heads), context tokens.
        self.stats = torch.zeros(2, dtype=torch.float64) if stats is None else stats
        # Where the qkv_proj pre-hook's op copies this layer's attention input
        # (``worker/capture.py``): persistent, shared along the speculation chain.
        self.capture_buffers: CaptureBuffers | None = None
        self._captured_rows: int | None = None  # by the op's Python, this step
        # [S, H_kv, W] int32 positions selected for this layer's sparse rows (-1: none).
        self.selection: torch.Tensor | None = None
        # Set by the data path's ``allocate``.
        self.num_blocks = 0
        self.kv_pool: torch.Tensor | None = None
        self.partial_keys: torch.Tensor | None = None  # partial keys
        self.key_codes: torch.Tensor | None = None  # int keys
        self.key_scales: torch.Tensor | None = None
        self.bounds: torch.Tensor | None = None  # bounds
        self.bound_scales: torch.Tensor | None = None
        # InfiniGen's rule where the data path keeps the speculation keys, at
        # its granularity: (rows, query [S, H_kv, G, R], row_map) -> selection
        # (CPU: token positions; CUDA: whole blocks on the device).
        self.selector: Callable[[RowSet, torch.Tensor, torch.Tensor | None],
                                object] | None = None

    @property
    def attention(self) -> torch.nn.Module:
        """vLLM's attention layer: its impl, its KV cache and scales."""
        return self._attn

    def kv_scales(self) -> Mapping[str, float]:
        """vLLM's ``k_scale`` and ``v_scale`` of this layer as the kernels'
        ``key_scale`` and ``value_scale``: an FP8 pool (``--kv-cache-dtype
        fp8``) holds K / k_scale and V / v_scale, as vLLM's FP8 pages do; any
        other pool holds K and V themselves (1.0). Read at each call: vLLM
        may set them at the first forward (``--calculate-kv-scales``)."""
        if self.kv_pool is None or self.kv_pool.element_size() != 1:
            return UNSCALED
        return {"key_scale": float(getattr(self._attn, "_k_scale_float", 1.0)),
                "value_scale": float(getattr(self._attn, "_v_scale_float", 1.0))}

    def capture(self, hidden: torch.Tensor | None) -> None:
        """Copies this step's attention input [T, hidden] into the layer's
        capture buffer (None: forgets it, so that an eager step reads None)."""
        if hidden is None:
            self._captured_rows = None
            return
        if self.capture_buffers is None:
            self.capture_buffers = CaptureBuffers()
        if self.next is not None and self.next.capture_buffers is None:
            self.next.capture_buffers = self.capture_buffers  # one pair per chain
        buffer = self.capture_buffers.buffer_for(self.capture_slot, hidden)
        buffer[: hidden.shape[0]].copy_(hidden)
        self._captured_rows = hidden.shape[0]

    @property
    def capture_slot(self) -> int:
        """This layer's buffer of the chain's two: consecutive speculating
        layers alternate (the sparse layers' ``pool_layer`` runs along the chain)."""
        return 0 if self.next is None else self.next.pool_layer % 2

    @property
    def capture_buffer(self) -> torch.Tensor | None:
        """The persistent [rows, hidden] buffer the op copies into (None: none yet)."""
        buffers = self.capture_buffers
        return None if buffers is None else buffers.tensors[self.capture_slot]

    @property
    def captured_input(self) -> torch.Tensor | None:
        """This step's attention input [T, hidden]: the first T rows of the
        capture buffer, T the forward's tokens under CUDA graphs (a replayed
        copy runs without the op's Python), else the rows the op copied; None
        when nothing was captured in an eager step."""
        rows = graph_tokens()
        if rows is None:
            rows = self._captured_rows
        buffer = self.capture_buffer
        if rows is None or buffer is None:
            return None
        return buffer[:rows]

    def offer_selection(self, positions: torch.Tensor) -> None:
        """The selection this layer attends over in this step."""
        self.selection = positions

    def take_selection(self) -> torch.Tensor:
        """This step's selection, once.

        Raises:
            RuntimeError: When no layer selected for this one.
        """
        positions, self.selection = self.selection, None
        if positions is None:
            raise RuntimeError(
                f"InfiniGen: sparse layer {self.layer_idx} has no selection; "
                "the layer before it did not speculate for it"
            )
        return positions

    def allocate_speculation_keys(
            self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
            partial: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
            = _zeros) -> None:
        """Allocates this layer's speculation keys (the module docstring's
        shapes) on ``device``: the bounds' or the int keys' codes and
        scales, zeroed, or the partial keys of ``dtype`` made by
        ``partial(shape, dtype, device)`` (a platform's: CUDA adds a scratch block)."""
        heads, head_size = self.num_kv_heads, self.head_size
        if self.bound_keys:
            if block_size % BOUND_UNIT:
                raise ValueError(f"bounds over {BOUND_UNIT} tokens need blocks of a "
                                 f"multiple of {BOUND_UNIT} tokens, got {block_size}")
            units = block_size // BOUND_UNIT
            self.bounds = torch.zeros((num_blocks, heads, units, 2, head_size * BOUND_BITS // 8),
                                      dtype=torch.uint8, device=device)
            self.bound_scales = torch.zeros((num_blocks, heads, units), dtype=torch.float16,
                                            device=device)
        elif self.int_keys:
            bits, groups = int_key_bits(dtype.itemsize), block_size // KEY_GROUP
            self.key_codes = torch.zeros((num_blocks, heads, groups, head_size, 2 * bits),
                                         dtype=torch.uint8, device=device)
            self.key_scales = torch.zeros((num_blocks, heads, groups, head_size),
                                          dtype=torch.float16, device=device)
        else:
            self.partial_keys = partial((num_blocks, heads, self.rank, block_size), dtype,
                                        device)

    @property
    def int_keys(self) -> bool:
        """Speculation scores every key channel in a few bits (no skew)."""
        return self.speculation_keys == "int"

    @property
    def bound_keys(self) -> bool:
        """Speculation scores each unit's bound of q . k (no skew)."""
        return self.speculation_keys == "bounds"

    @property
    def every_channel(self) -> bool:
        """The speculation's query keeps every channel, unskewed (bounds, int keys)."""
        return self.skew is None

    @property
    def rank(self) -> int:
        """Channels the speculation scores: the paper's r x d, or every channel."""
        return self.head_size if self.skew is None else self.skew.shape[-1]

    @property
    def block_size(self) -> int:
        return self.kv_pool.shape[2]

    @property
    def num_slots(self) -> int:
        """Slots of the dense group this layer's state covers."""
        return self.num_blocks * self.block_size

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """[..., H_kv, D] keys of ``slots`` (uncapped pool: unit = block id), read
        from the pool, on the pool's device."""
        block_size = self.block_size
        slots = slots.to(self.kv_pool.device)
        return self.kv_pool[slots // block_size, :, slots % block_size, : self.head_size]
