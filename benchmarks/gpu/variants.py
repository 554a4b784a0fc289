# SPDX-License-Identifier: Apache-2.0
"""The attention of each benchmarked way to decode, as the decoder's plug-in (``decoder.Decoder``).

    dense        K/V of every layer in GPU memory, torch SDPA
    dense_units  the same K/V as pool units in GPU memory, the Triton kernel
                 InfiniGen attends with (shows that kernel's cost against SDPA)
    full         every layer's K/V copied from the pinned pool (one copy_ per
                 layer, layer i+1's during layer i, on the transfer stream)
    infinigen    dense_layers dense (resident units), then per sparse layer the
                 block rule's selection, made in the layer before (speculation),
                 gathered from the pinned pool into device units by one kernel
                 on the transfer stream: either all selected blocks into a
                 staging buffer (``cache=False``), or only the blocks missing
                 from the device block cache (``cache=True``)

The transfer stream has a lower priority than the compute stream; layer i+1's
transfer waits for an event recorded in layer i and layer i+1's attention for
the transfer's event. On the CPU (the self-test) both streams are the one
stream and every kernel is its torch reference.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from benchmarks.gpu.decoder import DecoderShape, LayerWeights, next_query, partial_query
from vllm_infinigen.platforms.cuda import block_selection as rule
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.block_cache import (
    DeviceBlockCache,
    substitute_block_table,
)

_BIG = 1 << 62


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
        kernels.write_own_tokens(units, table, seq_lens, key.reshape(heads, -1),
                                 value.reshape(heads, -1))
        out = kernels.attend_units(query.reshape(heads, shape.group, shape.head_dim), units,
                                   table, seq_lens, scale=shape.scale)
        return out.reshape(batch, -1)


class Dense(Variant):
    name = "dense"

    def __init__(self, setup: KVSetup, streams: Streams):
        super().__init__(setup, streams)
        self.kv = [setup.dense_kv(layer) for layer in range(self.shape.num_layers)]

    def attend(self, layer, query, key, value):
        keys, values = self.kv[layer]
        keys[:, :, -1] = key
        values[:, :, -1] = value
        out = F.scaled_dot_product_attention(query[:, :, None], keys, values, enable_gqa=True,
                                             scale=self.shape.scale)
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


class InfiniGen(Variant):
    """Speculation one layer ahead, block gather, with or without the device block cache.

    Args:
        weights: The decoder's layers (the next layer's query projection and skew).
        speculation: Per sparse layer its speculation keys, a row's blocks
            consecutive: ``{"codes", "scales"}`` (the int keys, the product's
            default: [B * blocks_per_row, H_kv, block_size / 16, D, 2 * bits]
            uint8 and [..., D] float16, scored in place on CUDA) or
            ``{"partial"}`` ([B, blocks_per_row, H_kv, R, block_size]).
        budget: The budget as a fraction of the context.
        replay: [steps, sparse layers, B, H_kv, W] int32 logical blocks to use
            instead of the computed selection (a recorded trace), or None.
        slots_per_head: Cache slots per (layer, KV head); None: no cache.
    """

    def __init__(self, setup: KVSetup, streams: Streams, weights: list[LayerWeights],
                 speculation: list[dict[str, torch.Tensor]], *, budget: float,
                 replay: torch.Tensor | None, slots_per_head: int | None,
                 compute_dtype: torch.dtype):
        super().__init__(setup, streams)
        shape = self.shape
        self.name = "infinigen_cache" if slots_per_head else "infinigen_nocache"
        self.weights, self.speculation, self.replay = weights, speculation, replay
        self.compute_dtype = compute_dtype
        self.dense = [setup.region(layer).to(setup.device) for layer in range(shape.dense_layers)]
        caps = [max(1, int(budget * setup.context))] * setup.batch
        self.token_caps = torch.tensor(caps, dtype=torch.int64, device=setup.device)
        self.width = self.selection_width(setup, budget)
        fetch_width = replay.shape[-1] if replay is not None else self.width
        num_sparse = shape.num_layers - shape.dense_layers
        self.cache = None
        if slots_per_head:
            self.cache = DeviceBlockCache(num_sparse, shape.num_kv_heads, slots_per_head,
                                          setup.batch * setup.blocks_per_row, setup.device)
            self.units = [self.cache.allocate_units(shape.block_size, shape.head_dim,
                                                    setup.pool.dtype) for _ in range(num_sparse)]
        else:
            staging = setup.batch * shape.num_kv_heads * fetch_width + 1
            self.units = [torch.empty((staging, shape.block_size, 2 * shape.head_dim),
                                      dtype=setup.pool.dtype, device=setup.device)
                          for _ in range(2)]
        self.fetched_units = torch.zeros((), dtype=torch.int64, device=setup.device)
        self.step_index = -1
        self.pending: dict[int, tuple[object, torch.Tensor]] = {}

    @staticmethod
    def selection_width(setup: KVSetup, budget: float) -> int:
        """Blocks per KV head of the computed selection (1 sink + the own block)."""
        caps = [max(1, int(budget * setup.context))] * setup.batch
        return rule.selection_width([setup.context] * setup.batch, caps,
                                    setup.shape.block_size, sink_blocks=1, recent_blocks=1)

    def begin_step(self):
        self.step_index += 1

    def _selection(self, target: int, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, W] block ids of ``target``'s selection (computed; replaced by
        the trace when replaying, after paying for the computation)."""
        shape, setup = self.shape, self.setup
        keys = self.speculation[target - shape.dense_layers]
        if "codes" in keys:
            tokens = rule.int_token_scores(next_query(shape, self.weights[target], hidden),
                                           keys["codes"], keys["scales"], setup.block_table,
                                           setup.context_lens, scale=shape.scale)
        else:
            tokens = rule.row_token_scores(partial_query(shape, self.weights[target], hidden),
                                           keys["partial"], scale=shape.scale,
                                           compute_dtype=self.compute_dtype)
        scores = rule.block_scores(tokens, setup.context_lens, shape.block_size)
        logical = rule.select_blocks(scores, setup.context_lens, self.token_caps,
                                     block_size=shape.block_size, width=self.width).logical
        if self.replay is not None:
            step = self.step_index % self.replay.shape[0]
            logical = self.replay[step, target - shape.dense_layers].to(torch.int64)
        return torch.where(logical >= 0, setup.row_base + logical, -1)

    def after_norm(self, layer, hidden):
        target = layer + 1
        if target >= self.shape.num_layers or target < self.shape.dense_layers:
            return
        block_ids = self._selection(target, hidden)
        sparse = target - self.shape.dense_layers
        if self.cache is not None:
            found = self.cache.lookup(sparse, block_ids)
            slots, units = found.slots, self.units[sparse]
            fetch = (found.fetch_units, found.fetch_slots, found.num_fetch)
        else:
            slots, fetch = self._staging_list(block_ids)
            units = self.units[target % 2]
            self.fetched_units += fetch[2][0]
        ready = self.streams.record()
        self.streams.keep(*fetch)
        with self.streams.on_transfer():
            self.streams.wait(ready)
            kernels.gather_units(self.setup.region(target), units, *fetch)
            self.pending[target] = (self.streams.record(), slots)

    def _staging_list(self, block_ids: torch.Tensor):
        """(staging slots [B, H_kv, W], fetch list) of every selected block."""
        rows, heads, width = block_ids.shape
        valid = block_ids >= 0
        head = torch.arange(heads, device=block_ids.device)[None, :, None]
        units = torch.where(valid, block_ids * heads + head, _BIG).flatten()
        slots = torch.arange(rows * heads * width, device=block_ids.device)
        units, order = units.sort()
        fetching = units < _BIG
        fetch = (torch.where(fetching, units, -1), torch.where(fetching, slots[order], -1),
                 valid.sum().view(1))
        return torch.where(valid, slots.view(rows, heads, width), -1), fetch

    def attend(self, layer, query, key, value):
        shape, setup = self.shape, self.setup
        if layer < shape.dense_layers:
            return self._attend_units(self.dense[layer], setup.full_table, setup.full_lens,
                                      query, key, value)
        event, slots = self.pending.pop(layer)
        self.streams.wait(event)
        units = self.units[layer - shape.dense_layers] if self.cache else self.units[layer % 2]
        table, seq_lens = substitute_block_table(slots, setup.context_lens, shape.block_size)
        return self._attend_units(units, table, seq_lens, query, key, value)

    def take_fetched_units(self) -> tuple[int, int | None]:
        """(units fetched over PCIe, units found in the cache or None) since the last call."""
        if self.cache is not None:
            hits, misses = self.cache.take_counters()
            return sum(misses), sum(hits)
        fetched = int(self.fetched_units)
        self.fetched_units.zero_()
        return fetched, None
