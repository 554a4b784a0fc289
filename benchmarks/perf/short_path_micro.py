# SPDX-License-Identifier: Apache-2.0
"""The short path's cost per sparse layer, without an engine: the fused op against the glue.

Drives ``--layers`` sparse layers as vLLM's attention layer does (per layer
the wrapped impl's ``do_kv_cache_update``, then its ``forward``, inside a
forward context) for decode steps of one request below
``--infinigen-min-context``, on the CPU data path with ``decode_short`` (fused)
and on one without it (the present path: ``write`` + ``attend_decode``), in
alternation, round by round (this machine's speed drifts over minutes, so
only interleaved medians compare). The shape is ``gqa128``'s (2 KV heads of
8 query heads, head 128). One thread. Reports microseconds per layer and
step: what vLLM's own per-layer work and the rest of the step add is not in it.

Example: ``python -m benchmarks.perf.short_path_micro --context 256``
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from vllm.forward_context import ForwardContext, override_forward_context

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.worker.attention import SPARSE_METADATA, InfiniGenImplMixin
from vllm_infinigen.worker.layer_state import LayerSource
from vllm_infinigen.worker.runtime import InfiniGenRuntime

BLOCK = 64


class Unfused(CpuDataPath):
    """The CPU data path without the fused op: the present short path."""

    decode_short = None


class _Stock:
    def do_kv_cache_update(self, *args):
        raise AssertionError("a sparse layer reached the stock impl")

    forward = do_kv_cache_update


def _runtime(args, fused: bool):
    heads, group, dim = args.kv_heads, args.group, args.head_size
    layers = args.layers + 1  # layer 0 dense: its metadata indexes the pool
    config = InfiniGenConfig(alpha=1.0, dense_layers=1, min_context=10**9)
    layout = ModelLayout("llama", num_layers=layers, num_heads=heads * group,
                         num_kv_heads=heads, head_dim=dim, dense_layers=1, partial_ratio=1.0)
    impl = SimpleNamespace(num_heads=heads * group, num_kv_heads=heads, head_size=dim,
                           scale=dim ** -0.5)
    sources = [LayerSource(i, f"model.layers.{i}.self_attn.attn", SimpleNamespace(impl=impl),
                           torch.nn.Module(), skew=None, query_proj=None)
               for i in range(layers)]
    data_path = (CpuDataPath if fused else Unfused)(config.transfer)
    runtime = InfiniGenRuntime(config, sources, torch.device("cpu"), data_path, layout=layout)
    num_blocks = (args.context + args.steps * args.rounds) // BLOCK + 2
    runtime.allocate_pool(PoolPlan(num_rows=num_blocks * BLOCK, num_slots=num_blocks * BLOCK,
                                   block_size=BLOCK, num_bytes=0, sized_by=""),
                          num_blocks=num_blocks, dtype=args.dtype)
    impls = [InfiniGenImplMixin.wrap(_Stock(), runtime, state) for state in runtime.sparse_layers]
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    return runtime, impls, block_table


def _steps(runtime, impls, block_table, first: int, steps: int, tensors) -> float:
    """Seconds of ``steps`` decode steps of every sparse layer."""
    query, key, value, output = tensors
    start = time.perf_counter()
    for position in range(first, first + steps):
        metadata = SimpleNamespace(query_start_loc=torch.tensor([0, 1]),
                                   seq_lens=torch.tensor([position + 1]),
                                   block_table=block_table)
        slots = torch.tensor([position])
        names = {impl.infinigen_layer.layer_name: SPARSE_METADATA for impl in impls}
        with override_forward_context(ForwardContext(
                no_compile_layers={}, attn_metadata={runtime.reference_layer: metadata, **names},
                slot_mapping={runtime.reference_layer: slots,
                              **{name: slots for name in names}})):
            for impl in impls:
                impl.do_kv_cache_update(None, key, value, None, slots)
                impl.forward(None, query, key, value, None, SPARSE_METADATA, output)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    heads, dim = args.kv_heads, args.head_size
    tensors = (torch.randn((1, heads * args.group, dim), generator=gen).to(args.dtype),
               torch.randn((1, heads, dim), generator=gen).to(args.dtype),
               torch.randn((1, heads, dim), generator=gen).to(args.dtype),
               torch.empty((1, heads * args.group, dim), dtype=args.dtype))
    runs = {name: _runtime(args, name == "fused") for name in ("present", "fused")}
    for name, (runtime, impls, table) in runs.items():  # warm up, context filled
        _steps(runtime, impls, table, 0, args.context, tensors)
    per_layer = {name: [] for name in runs}
    position = args.context
    for _ in range(args.rounds):
        for name, (runtime, impls, table) in runs.items():
            seconds = _steps(runtime, impls, table, position, args.steps, tensors)
            per_layer[name].append(1e6 * seconds / (args.steps * args.layers))
        position += args.steps
    medians = {name: statistics.median(values) for name, values in per_layer.items()}
    print(f"context {args.context}, {args.layers} sparse layers, {args.dtype}, one thread: "
          f"us per sparse layer and step (median of {args.rounds} rounds)")
    for name, value in medians.items():
        print(f"  {name:8s} {value:7.1f}")
    saved = medians["present"] - medians["fused"]
    print(f"  saved    {saved:7.1f} us per layer, {saved * args.layers / 1000:.2f} ms per step")


if __name__ == "__main__":
    main()
