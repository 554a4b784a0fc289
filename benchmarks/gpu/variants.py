# SPDX-License-Identifier: Apache-2.0
"""The attention of each benchmarked way to decode that is not the product, as the decoder's plug-in.

    dense        K/V of every layer in GPU memory, torch SDPA
    dense_units  the same K/V as pool units in GPU memory, the Triton kernel
                 InfiniGen attends with (shows that kernel's cost against SDPA;
                 with FP8 K/V, dense's stand-in: torch has no FP8 attention)
    full         every layer's K/V copied from the pinned pool (one copy_ per
                 layer, layer i+1's during layer i, on the transfer stream)

InfiniGen itself is the product's runtime and CUDA data path (``product.py``).

The transfer stream has a lower priority than the compute stream; layer i+1's
transfer waits for an event recorded in layer i and layer i+1's attention for
the transfer's event. On the CPU (the self-test) both streams are the one
stream and every kernel is its torch reference.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from benchmarks.gpu.decoder import DecoderShape
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import reference


class Streams:
    """The compute stream and a lower-priority transfer stream (nothing on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.Stream(device, priority=-1)
            self.transfer = torch.cuda.Stream(device, priority=0)

    def record(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def on_transfer(self):
        return torch.cuda.stream(self.transfer) if self.cuda else contextlib.nullcontext()

    def keep(self, *tensors: torch.Tensor) -> None:
        """Tensors made on the compute stream and read on the transfer stream."""
        if self.cuda:
            for tensor in tensors:
                tensor.record_stream(self.transfer)


class KVSetup:
    """The K/V every variant reads: per layer, a region of the pool (pool units).

    Args:
        pool: [regions * units_per_layer, block_size, 2 * D] host units (pinned on CUDA).
    """

    def __init__(self, shape: DecoderShape, batch: int, context: int, pool: torch.Tensor,
                 device: torch.device):
        self.shape, self.batch, self.context, self.device = shape, batch, context, device
        self.blocks_per_row = shape.blocks_per_row(context)
        self.units_per_layer = batch * self.blocks_per_row * shape.num_kv_heads
        self.num_regions = pool.shape[0] // self.units_per_layer
        if self.num_regions < 1:
            raise ValueError("the host pool cannot hold one layer's K/V")
        self.pool = pool[: self.num_regions * self.units_per_layer]
        self.context_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        heads = shape.num_kv_heads
        rows = torch.arange(batch, device=device)[:, None, None] * self.blocks_per_row
        blocks = torch.arange(self.blocks_per_row, device=device)[None, None, :]
        head = torch.arange(heads, device=device)[None, :, None]
        # every unit of a row, per KV head, in position order: [B * H_kv, blocks]
        self.full_table = ((rows + blocks) * heads + head).reshape(batch * heads, -1).int()
        self.full_lens = torch.full((batch * heads,), context + 1, dtype=torch.int32,
                                    device=device)
        self.row_base = rows  # [B, 1, 1] first block id of each row
        self.block_table = (rows[:, 0] + blocks[0]).int()  # [B, blocks] each row's block ids

    def region(self, layer: int) -> torch.Tensor:
        """[units_per_layer, block_size, 2 * D] layer ``layer``'s K/V (layers share
        regions modulo ``num_regions`` when the pool is smaller than the model)."""
        start = (layer % self.num_regions) * self.units_per_layer
        return self.pool[start : start + self.units_per_layer]

    def dense_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, H_kv, T + 1, D] K, V) on the device, the region's tokens in order."""
        shape = self.shape
        units = self.region(layer).to(self.device)
        tokens = units.view(self.batch, self.blocks_per_row, shape.num_kv_heads,
                            shape.block_size, -1).permute(0, 2, 1, 3, 4)
        tokens = tokens.reshape(self.batch, shape.num_kv_heads, -1, 2 * shape.head_dim)
        tokens = tokens[:, :, : self.context + 1]
        return (tokens[..., : shape.head_dim].contiguous(),
                tokens[..., shape.head_dim :].contiguous())


class Variant:
    name = ""

    def __init__(self, setup: KVSetup, streams: Streams):
        self.setup, self.streams, self.shape = setup, streams, setup.shape
        self.pcie_units = 0  # units copied per step, when known on the host

    def begin_step(self) -> None:
        pass

    def after_norm(self, layer: int, hidden: torch.Tensor) -> None:
        pass

    def end_step(self) -> None:
        pass

    def attend(self, layer, query, key, value) -> torch.Tensor:
        raise NotImplementedError

    def _attend_units(self, units, table, seq_lens, query, key, value) -> torch.Tensor:
        """The own token into its block, then attention; [B, H_q * D]."""
        shape, batch = self.shape, self.setup.batch
        heads = batch * shape.num_kv_heads
        reference.write_own_tokens(units, table, seq_lens, key.reshape(heads, -1),
                                   value.reshape(heads, -1))
        out = kernels.attend_units(query.reshape(batch, shape.num_heads, shape.head_dim), units,
                                   table, seq_lens, num_kv_heads=shape.num_kv_heads,
                                   scale=shape.scale)
        return out.reshape(batch, -1)


class Dense(Variant):
    name = "dense"

    def __init__(self, setup: KVSetup, streams: Streams):
        super().__init__(setup, streams)
        if setup.pool.element_size() == 1:
            raise ValueError("torch's SDPA has no FP8 K/V: dense_units attends FP8 units")
        self.kv = [setup.dense_kv(layer) for layer in range(self.shape.num_layers)]

    def attend(self, layer, query, key, value):
        return dense_attention(self.kv[layer], query, key, value, self.shape.scale)


def dense_attention(kv: tuple[torch.Tensor, torch.Tensor], query, key, value,
                    scale: float) -> torch.Tensor:
    """The own token into its layer's device K/V, then SDPA over all of it; [B, H_q * D]."""
    keys, values = kv
    keys[:, :, -1] = key
    values[:, :, -1] = value
    out = F.scaled_dot_product_attention(query[:, :, None], keys, values, enable_gqa=True,
                                         scale=scale)
    return out.reshape(query.shape[0], -1)


class DenseUnits(Variant):
    name = "dense_units"

    def __init__(self, setup: KVSetup, streams: Streams):
        super().__init__(setup, streams)
        self.units = [setup.region(layer).to(setup.device)
                      for layer in range(self.shape.num_layers)]

    def attend(self, layer, query, key, value):
        return self._attend_units(self.units[layer], self.setup.full_table,
                                  self.setup.full_lens, query, key, value)


class FullOffload(Variant):
    name = "full"

    def __init__(self, setup: KVSetup, streams: Streams):
        super().__init__(setup, streams)
        self.buffers = [torch.empty(setup.region(0).shape, dtype=setup.pool.dtype,
                                    device=setup.device) for _ in range(2)]
        self.fetched: dict[int, object] = {}
        self.pcie_units = setup.units_per_layer * self.shape.num_layers

    def _copy(self, layer: int) -> None:
        ready = self.streams.record()
        with self.streams.on_transfer():
            self.streams.wait(ready)
            self.buffers[layer % 2].copy_(self.setup.region(layer), non_blocking=True)
            self.fetched[layer] = self.streams.record()

    def begin_step(self):
        self._copy(0)

    def after_norm(self, layer, hidden):
        if layer + 1 < self.shape.num_layers:
            self._copy(layer + 1)

    def attend(self, layer, query, key, value):
        self.streams.wait(self.fetched.pop(layer))
        return self._attend_units(self.buffers[layer % 2], self.setup.full_table,
                                  self.setup.full_lens, query, key, value)
