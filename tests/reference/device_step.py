# SPDX-License-Identifier: Apache-2.0
"""A decode step of the CUDA data path planned on the device, driven as vLLM's attention
impl drives it (``worker/attention.py``), on any device: per layer the capture of its
attention input, ``do_kv_cache_update`` (begin_step, write), then ``forward`` (plan,
begin_layer, attend). Four layers (layer 0 dense), GQA 4:2, two requests and a padding
row (a captured graph's batch has them). Shared by ``tests/unit/test_cuda_device_step.py``
(CPU tensors) and ``tests/gpu/test_cuda_device.py`` (CUDA, graphs)."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch

from tests.reference.step_watch import StepWatch
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.worker.layer_state import LayerSource
from vllm_infinigen.worker.runtime import InfiniGenRuntime

LAYERS, HEADS, KV_HEADS, DIM, HIDDEN, BLOCK = 4, 4, 2, 16, 32, 16
TABLE_BLOCKS, NUM_BLOCKS = 8, 24


class QKV(torch.nn.Module):
    """The layer's fused qkv projection (random weights)."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("weight",
                             torch.randn((HEADS + 2 * KV_HEADS) * DIM, HIDDEN, generator=gen) / 6)

    def forward(self, hidden: torch.Tensor):
        return hidden @ self.weight.t(), None


def build_runtime(config: InfiniGenConfig, device: str = "cpu") -> InfiniGenRuntime:
    impl = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM,
                           scale=1 / math.sqrt(DIM))
    sources = []
    for index in range(LAYERS):
        self_attn = torch.nn.Module()
        self_attn.qkv_proj = QKV(index).to(device)
        sources.append(LayerSource(index, f"model.layers.{index}.self_attn.attn",
                                   SimpleNamespace(impl=impl), self_attn, skew=None,
                                   query_proj=None))
    layout = ModelLayout("llama", num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         head_dim=DIM, dense_layers=1, partial_ratio=1.0)
    runtime = InfiniGenRuntime(config, sources, torch.device(device),
                               CudaDataPath(device, 3 * TABLE_BLOCKS), layout=layout)
    slots = NUM_BLOCKS * BLOCK
    runtime.allocate_pool(PoolPlan(num_rows=slots, num_slots=slots, block_size=BLOCK,
                                   num_bytes=0, sized_by=""), NUM_BLOCKS, torch.float32)
    return runtime


class DecodeStep:
    """Two requests (and a padding row, as a captured graph's batch has) decoding."""

    def __init__(self, config: InfiniGenConfig, context_lens=(70, 45), device: str = "cpu"):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.runtime = build_runtime(config, device)
        self.table = torch.tensor([[3, 9, 0, 14, 7, 20, 11, 2], [5, 1, 17, 8, 12, 23, 4, 6],
                                   [0] * TABLE_BLOCKS], dtype=torch.int32, device=self.device)
        self.context = list(context_lens)
        for row, context in enumerate(self.context):
            slots = self._slots(row, range(context))
            for state in self.runtime.sparse_layers:
                self.runtime.write(state, torch.randn(context, KV_HEADS, DIM).to(device),
                                   torch.randn(context, KV_HEADS, DIM).to(device), slots)

    def _slots(self, row: int, positions) -> torch.Tensor:
        positions = torch.tensor(list(positions), device=self.device)
        return self.table[row, positions // BLOCK].long() * BLOCK + positions % BLOCK

    def inputs(self, seed: int):
        """(metadata, slot mapping, per layer its attention input) of the next step."""
        seq_lens = torch.tensor([c + 1 for c in self.context] + [0], dtype=torch.int32,
                                device=self.device)
        metadata = SimpleNamespace(seq_lens=seq_lens, block_table=self.table, max_query_len=1,
                                   query_start_loc=torch.arange(4, dtype=torch.int32,
                                                                device=self.device))
        slots = torch.cat([torch.cat([self._slots(r, [c]) for r, c in enumerate(self.context)]),
                           torch.tensor([-1], device=self.device)])
        gen = torch.Generator().manual_seed(seed)
        hidden = [torch.randn(3, HIDDEN, generator=gen).to(self.device) for _ in range(LAYERS)]
        return metadata, slots, hidden

    def run(self, watch: StepWatch | None = None, seed: int = 1) -> torch.Tensor:
        """One decode step over every layer, the contexts one token longer after it;
        [3, H_q, D] the last layer's output."""
        output = self.step(*self.inputs(seed), watch)
        for row in range(len(self.context)):
            self.context[row] += 1
        return output

    def step(self, metadata, slots: torch.Tensor, hiddens: list[torch.Tensor],
             watch: StepWatch | None = None) -> torch.Tensor:
        """One decode step of the given inputs (``inputs``): what a CUDA graph captures."""
        runtime = self.runtime
        output = None
        for state, hidden in zip(runtime.layers, hiddens):  # the model's own work unwatched
            qkv, _ = state.qkv_proj(hidden)
            query = qkv[:, :HEADS * DIM].view(3, HEADS, DIM)
            key = qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(3, KV_HEADS, DIM)
            value = qkv[:, (HEADS + KV_HEADS) * DIM:].view(3, KV_HEADS, DIM)
            output = torch.zeros(3, HEADS, DIM, device=self.device)
            with _watched(watch, f"layer{state.layer_idx}"):
                if state.next is not None:
                    state.capture(hidden)
                if state.sparse:
                    runtime.begin_step(metadata, slots)
                    runtime.write(state, key, value, slots)
                plan = runtime.begin_layer(state, metadata, slots, block_size=BLOCK)
                if state.sparse:
                    runtime.attend(state, plan, query, output)
        return output


def _watched(watch: StepWatch | None, name: str):
    return watch.layer(name) if watch is not None else contextlib.nullcontext()


def config(**changes) -> InfiniGenConfig:
    """The step's settings: alpha 5, budget 0.2, one dense layer, selecting from the first token."""
    return InfiniGenConfig(**{"alpha": 5.0, "budget": 0.2, "dense_layers": 1, "min_context": 0,
                              **changes})
