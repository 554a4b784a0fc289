# SPDX-License-Identifier: Apache-2.0
"""InfiniGen in the GPU benchmark: the product's runtime and CUDA data path, driven as vLLM drives them.

The decoder (``decoder.py``) stands in for vLLM's model; per layer this variant
makes the calls InfiniGen's attention impl makes (``worker/attention.py``): the
speculating layer's attention input into its capture buffer, then for a
sparse layer ``begin_step`` and ``write`` (vLLM's KV-cache update), then
``begin_layer`` (the speculation for the next layer) and ``attend``, on an
``InfiniGenRuntime`` over a ``CudaDataPath``, with a step planned on the device
(``step_plan.build_device_plan``) from metadata shaped as vLLM's. Nothing here
reimplements the product's step: only the model, its dense layers' attention
(the Triton kernel over resident units) and the K/V's placement in the pool
(layers share pool regions where host memory is short: ``KVSetup``) are the
benchmark's.

With a replayed trace, each sparse layer's selection is computed by the product
(its cost is in the time) and then replaced by the trace's blocks for this step,
picked on the device (so that a captured graph replays them step by step).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from benchmarks.gpu.decoder import LayerWeights
from benchmarks.gpu.variants import KVSetup, Streams, Variant, dense_attention
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.platforms.cuda.kernels import selection_of_blocks
from vllm_infinigen.worker.layer_state import LayerSource
from vllm_infinigen.worker.runtime import InfiniGenRuntime


class _QKV(torch.nn.Module):
    """A layer's fused qkv projection, as vLLM's ``QKVParallelLinear`` returns it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight  # [hidden, (H_q + 2 H_kv) * D]

    def forward(self, hidden: torch.Tensor):
        return hidden @ self.weight, None


class Product(Variant):
    """The product's InfiniGen step (the device block cache; bounds, int or partial keys).

    Args:
        weights: The decoder's layers (their qkv projections speculate).
        budget, alpha: ``--infinigen-budget``, ``--infinigen-alpha``.
        budget_tokens: ``--infinigen-budget-tokens`` (the token cap), or None.
        keys: ``--infinigen-speculation-keys``.
        replay: [steps, sparse layers, B, H_kv, W] int64 logical blocks to
            attend instead of the computed selection, or None.
        slots_per_head: The device block cache's slots per (layer, KV head).
    """

    name = "infinigen"

    def __init__(self, setup: KVSetup, streams: Streams, weights: list[LayerWeights], *,
                 budget: float, alpha: float, keys: str, replay: torch.Tensor | None,
                 slots_per_head: int, budget_tokens: int | None = None,
                 residency: str = "pool"):
        super().__init__(setup, streams)
        shape, device = self.shape, setup.device
        config = InfiniGenConfig(alpha=alpha, budget=budget, dense_layers=shape.dense_layers,
                                 min_context=0, speculation_keys=keys,
                                 budget_tokens=budget_tokens, residency=residency)
        impl = SimpleNamespace(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                               head_size=shape.head_dim, scale=shape.scale)
        sources = []
        for index, layer in enumerate(weights):
            self_attn = torch.nn.Module()
            self_attn.qkv_proj = _QKV(layer.qkv)
            skew = layer.skew.float() if keys == "partial" else None
            sources.append(LayerSource(index, f"model.layers.{index}.self_attn.attn",
                                       SimpleNamespace(impl=impl), self_attn, skew, None))
        layout = shape.layout()
        self.data_path = CudaDataPath(device, slots_per_head, host_pool=self._region)
        self.runtime = InfiniGenRuntime(config, sources, device, self.data_path, layout=layout)
        num_blocks = setup.batch * setup.blocks_per_row
        slots = num_blocks * shape.block_size
        self.runtime.allocate_pool(PoolPlan(num_rows=slots, num_slots=slots,
                                            block_size=shape.block_size, num_bytes=0,
                                            sized_by="the benchmark"), num_blocks,
                                   weights[0].qkv.dtype, kv_dtype=setup.pool.dtype)
        self._random_keys()
        self.dense = [setup.region(layer).to(device) for layer in range(shape.dense_layers)]
        self.metadata = SimpleNamespace(
            seq_lens=torch.full((setup.batch,), setup.context + 1, dtype=torch.int32,
                                device=device),
            block_table=setup.block_table, max_query_len=1,
            query_start_loc=torch.arange(setup.batch + 1, dtype=torch.int32, device=device))
        own = setup.row_base[:, 0, 0] + setup.context // shape.block_size
        self.slot_mapping = own * shape.block_size + setup.context % shape.block_size
        self.replay = replay
        self.step_index = torch.zeros(1, dtype=torch.int64, device=device)
        if replay is not None:
            for state in self.runtime.sparse_layers:
                state.selector = self._replaying(state, state.selector)

    def _region(self, layer, num_blocks: int) -> torch.Tensor:
        """A sparse layer's pool: its region of the shared pinned pool, as the
        data path addresses it ([num_blocks, H_kv, block_size, 2 * D])."""
        shape = self.shape
        return self.setup.region(layer.layer_idx).view(num_blocks, shape.num_kv_heads,
                                                       shape.block_size, 2 * shape.head_dim)

    def _random_keys(self) -> None:
        """Speculation keys of random content (speed only), in the product's layout."""
        generator = torch.Generator(device=self.setup.device).manual_seed(1)
        for state in self.runtime.sparse_layers:
            if state.bound_keys:
                state.bounds.copy_(torch.randint(0, 256, state.bounds.shape, dtype=torch.uint8,
                                                 device=self.setup.device, generator=generator))
                state.bound_scales.copy_(torch.rand(state.bound_scales.shape,
                                                    device=self.setup.device,
                                                    generator=generator) / 16)
            elif state.int_keys:
                state.key_codes.copy_(torch.randint(0, 256, state.key_codes.shape,
                                                    dtype=torch.uint8, device=self.setup.device,
                                                    generator=generator))
                state.key_scales.copy_(torch.rand(state.key_scales.shape,
                                                  device=self.setup.device,
                                                  generator=generator) / 16)
            else:
                state.partial_keys.normal_(generator=generator)

    def _replaying(self, state, selector):
        sparse = state.pool_layer
        block_size = self.shape.block_size

        def replayed(rows, query, row_map):
            selector(rows, query, row_map)  # the product's selection, paid for
            steps = self.replay.shape[0]
            logical = self.replay[:, sparse].index_select(0, self.step_index % steps)[0]
            return selection_of_blocks(logical, rows, block_size)

        return replayed

    # -- the decoder's hooks

    def begin_step(self) -> None:
        self.step_index += 1

    def after_norm(self, layer: int, hidden: torch.Tensor) -> None:
        state = self.runtime.layers[layer]
        if state.next is not None:
            state.capture(hidden)

    def attend(self, layer, query, key, value) -> torch.Tensor:
        runtime, state = self.runtime, self.runtime.layers[layer]
        query = query.view(-1, self.shape.num_heads, self.shape.head_dim)
        if state.sparse:
            runtime.begin_step(self.metadata, self.slot_mapping)
            runtime.write(state, key, value, self.slot_mapping)
        plan = runtime.begin_layer(state, self.metadata, self.slot_mapping,
                                   block_size=self.shape.block_size)
        if not state.sparse:
            return self._attend_units(self.dense[layer], self.setup.full_table,
                                      self.setup.full_lens, query, key, value)
        output = torch.empty_like(query)
        runtime.attend(state, plan, query, output)
        return output.reshape(query.shape[0], -1)

    def take_fetched_units(self) -> tuple[int, int]:
        """(units fetched over PCIe, units found in the cache) since the last call."""
        stats = self.runtime.take_counters(wait=True)  # every count, now
        misses = sum(v for k, v in stats.items() if k.startswith("cache_misses."))
        hits = sum(v for k, v in stats.items() if k.startswith("cache_hits."))
        return int(misses), int(hits)


class Resident(Product):
    """The product's step with ``--infinigen-residency device-first`` before the
    move: every layer attends densely over its device K/V (the benchmark's
    dense attention standing in for vLLM's kernel, as in ``Dense``), and each
    sparse layer's new K/V and speculation keys are written through to the
    host pool by the product's runtime, as a resident engine's KV-cache update
    does (``worker/attention.py``). Its time against ``Dense`` is what
    InfiniGen costs while memory allows."""

    name = "infinigen_resident"

    def __init__(self, setup: KVSetup, streams: Streams, weights: list[LayerWeights], **kwargs):
        super().__init__(setup, streams, weights, residency="device-first", **kwargs)
        if not self.runtime.resident:
            raise AssertionError("a device-first runtime starts resident")
        self.kv = [setup.dense_kv(layer) for layer in range(self.shape.num_layers)]

    def attend(self, layer, query, key, value) -> torch.Tensor:
        runtime, state = self.runtime, self.runtime.layers[layer]
        if state.sparse:
            runtime.begin_step(self.metadata, self.slot_mapping)
            runtime.write(state, key, value, self.slot_mapping)
        return dense_attention(self.kv[layer], query, key, value, self.shape.scale)


def cache_slots(setup: KVSetup, width: int, factor: float) -> int:
    """Slots per head for ``factor`` times a step's widest selection (at most the rows' blocks)."""
    return setup.batch * min(setup.blocks_per_row, math.ceil(factor * width))
