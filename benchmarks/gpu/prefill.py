# SPDX-License-Identifier: Apache-2.0
"""Time to first token on CUDA: one prompt prefilled through every layer, InfiniGen's path against dense.

python -m benchmarks.gpu.prefill [--contexts 32768 131072] [--chunk 8192]
python -m benchmarks.gpu.prefill --self-test      # CPU, tiny shapes, torch references

One request's prompt of T tokens runs through the 32-layer Llama-3.1-8B-shaped
decoder (``decoder.py``, random bf16 weights) in chunks of ``--chunk`` tokens,
as vLLM's chunked prefill schedules it, up to its last token's logits (the
first token's). Variants:

    dense             every layer's K/V in device memory as contiguous K and
                      V; each chunk attends over its request's tokens so far
                      with torch's SDPA (FlashAttention on CUDA; each KV head
                      repeated for its query heads), as a dense engine attends
    dense_units       the same K/V as units, attended with the op InfiniGen's
                      prompts attend with (``kernels.attend_prompt_units``:
                      SDPA over the units gathered in order, for a 16-bit
                      model): that op's cost against ``dense``'s
    infinigen         the product's runtime and ``CudaDataPath``, driven as
                      vLLM's attention impl drives them: a sparse layer's
                      write (its prompt blocks placed in the device block
                      cache, ``platforms/cuda/prompts.py``, the tokens written
                      through to the pinned pool and into the cached copies,
                      the bound keys encoded), then its attention over the
                      cached blocks; dense layers as ``dense``
    infinigen_staged  the same with a block cache too small for the prompt:
                      each chunk's context staged back from the pool (the
                      path before ``prompts.py``)

Each variant runs a short prefill first (the kernels' compilation), then the
timed ones: the time to first token is the median over ``--repeats`` of the
whole prefill (CUDA events, chunks back to back, as the engine runs them).
Checked first at every context: every variant's logits equal dense's (a
prefill attends every token; the product stores the same K/V). Writes
benchmarks/results/gpu_prefill.{json,md} (command, commit, device, date);
``--self-test`` writes ..._selftest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from benchmarks.gpu.decoder import TINY, Decoder, DecoderShape, random_weights
from benchmarks.gpu.measure import make_pool
from benchmarks.gpu.product import Product
from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.gpu.variants import KVSetup, Streams, Variant
from benchmarks.harness import report
from vllm_infinigen.platforms.cuda import kernels

VARIANTS = ("dense", "dense_units", "infinigen", "infinigen_staged")
RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_OUT, SELF_TEST_OUT = RESULTS / "gpu_prefill", RESULTS / "gpu_prefill_selftest"


class DensePrefill(Variant):
    """Every layer's K/V in device memory: as units ([blocks * H_kv + 1,
    block_size, 2 * D], unit block * H_kv + head) attended with
    ``kernels.attend_prompt_units``; or, ``sdpa``, as [H_kv, T, D] K and V
    attended with torch's SDPA (each KV head repeated for its query heads,
    the causal mask aligned to the chunk's last row)."""

    name = "dense_units"

    def __init__(self, setup: KVSetup, streams: Streams, *, layers: int | None = None,
                 sdpa: bool = False):
        super().__init__(setup, streams)
        shape, blocks = self.shape, setup.blocks_per_row
        heads, count = shape.num_kv_heads, shape.num_layers if layers is None else layers
        self.sdpa = sdpa
        if sdpa:
            self.kv = [torch.zeros((2, heads, blocks * shape.block_size, shape.head_dim),
                                   dtype=setup.pool.dtype, device=setup.device)
                       for _ in range(count)]
        else:
            self.units = [torch.zeros((blocks * heads + 1, shape.block_size, 2 * shape.head_dim),
                                      dtype=setup.pool.dtype, device=setup.device)
                          for _ in range(count)]
        self.table = (torch.arange(blocks, device=setup.device)[None, :] * heads
                      + torch.arange(heads, device=setup.device)[:, None])
        self.first = self.length = 0

    def begin_chunk(self, first: int, length: int) -> None:
        self.first, self.length = first, length

    def attend(self, layer, query, key, value) -> torch.Tensor:
        shape, first, length = self.shape, self.first, self.length
        seq_len = first + length
        if self.sdpa:
            kv = self.kv[layer]
            kv[0, :, first:seq_len] = key.transpose(0, 1)
            kv[1, :, first:seq_len] = value.transpose(0, 1)
            keys, values = kv[:, :, :seq_len].repeat_interleave(shape.group, dim=1).unbind(0)
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1)[None], keys[None], values[None],
                attn_mask=causal_lower_right(length, seq_len), scale=shape.scale)
            return out[0].transpose(0, 1).reshape(length, -1)
        positions = torch.arange(first, seq_len, device=query.device)
        tokens = self.units[layer][:-1].view(-1, shape.num_kv_heads, shape.block_size,
                                             2 * shape.head_dim)  # the scratch unit left out
        tokens[positions // shape.block_size, :, positions % shape.block_size] = torch.cat(
            [key, value], dim=-1).to(tokens.dtype)
        out = kernels.attend_prompt_units(query, self.units[layer], self.table, first=first,
                                          seq_len=seq_len, scale=shape.scale)
        return out.reshape(length, -1)


class ProductPrefill(Product):
    """The product's prefill: per chunk, metadata shaped as vLLM's (one request,
    ``length`` rows from position ``first``), the sparse layers through the
    runtime, the dense layers as ``DensePrefill``."""

    name = "infinigen"

    def __init__(self, setup: KVSetup, streams: Streams, weights, *, slots_per_head: int):
        super().__init__(setup, streams, weights, budget=0.2, alpha=4.0, keys="bounds",
                         replay=None, slots_per_head=slots_per_head)
        self.dense_layers = DensePrefill(setup, streams, layers=self.shape.dense_layers,
                                         sdpa=True)
        self.dense = []  # the decode step's copies of the dense layers: not used here

    def begin_chunk(self, first: int, length: int) -> None:
        setup, block_size = self.setup, self.shape.block_size
        device = setup.device
        self.dense_layers.begin_chunk(first, length)
        self.metadata = SimpleNamespace(
            query_start_loc=torch.tensor([0, length], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([first + length], dtype=torch.int32, device=device),
            block_table=setup.block_table[:1], max_query_len=length)
        positions = torch.arange(first, first + length, device=device)
        self.slot_mapping = ((setup.block_table[0].to(torch.int64)[positions // block_size])
                             * block_size + positions % block_size)

    def attend(self, layer, query, key, value) -> torch.Tensor:
        runtime, state = self.runtime, self.runtime.layers[layer]
        if not state.sparse:
            return self.dense_layers.attend(layer, query, key, value)
        runtime.begin_step(self.metadata, self.slot_mapping)
        runtime.write(state, key, value, self.slot_mapping, self.metadata)
        plan = runtime.begin_layer(state, self.metadata, self.slot_mapping,
                                   block_size=self.shape.block_size)
        output = torch.empty_like(query)
        runtime.attend(state, plan, query, output)
        return output.reshape(query.shape[0], -1)

    def reset(self) -> None:
        """Between prefills: the request's blocks leave the cache (a new request),
        the counters start again."""
        self.data_path.release_blocks(self.setup.block_table[0].tolist())
        self.runtime.take_counters(wait=True)

    def pcie_bytes(self) -> int:
        """Bytes copied from the pool to the device since ``reset`` (fetched
        into the cache or staged: ``pcie_bytes``)."""
        stats = self.runtime.take_counters(wait=True)
        return int(sum(v for k, v in stats.items() if k.startswith("pcie_bytes.")))


def build(name: str, setup: KVSetup, streams: Streams, weights) -> Variant:
    if name.startswith("infinigen"):
        slots = 1 if name == "infinigen_staged" else setup.blocks_per_row
        variant = ProductPrefill(setup, streams, weights, slots_per_head=slots)
        variant.name = name
        return variant
    return DensePrefill(setup, streams, sdpa=name == "dense")


def prefill(decoder: Decoder, variant: Variant, prompt: torch.Tensor, chunk: int) -> torch.Tensor:
    """The prompt's [T, hidden] inputs through every layer, ``chunk`` rows at a
    time; the last token's logits [1, vocab]."""
    if hasattr(variant, "reset"):
        variant.reset()
    logits = None
    for first in range(0, prompt.shape[0], chunk):
        rows = prompt[first:first + chunk]
        variant.begin_chunk(first, rows.shape[0])
        logits = decoder.step(rows, variant, last_only=True)
    return logits


def measure_context(decoder: Decoder, shape: DecoderShape, pool: torch.Tensor, *,
                    context: int, chunk: int, variants: list[str], repeats: int,
                    streams: Streams, device: torch.device, dtype: torch.dtype,
                    warmup_tokens: int) -> dict[str, Any]:
    """Every variant's time to first token at ``context`` (and its logits against dense's)."""
    setup = KVSetup(shape, 1, context, pool, device)
    generator = torch.Generator(device=device).manual_seed(context)
    prompt = torch.randn(context, shape.hidden, device=device, generator=generator).to(dtype)
    result: dict[str, Any] = {"context": context, "chunk": chunk, "variants": {}}
    reference = None
    for name in variants:
        variant = build(name, setup, streams, decoder.layers)
        prefill(decoder, variant, prompt[:warmup_tokens], min(chunk, warmup_tokens // 2))
        times, logits = [], None
        for _ in range(repeats):
            began, ended = _events(device)
            logits = prefill(decoder, variant, prompt, chunk)
            times.append(_elapsed_ms(began, ended, device))
        if reference is None:
            reference = logits
        entry = {"ttft_ms": sorted(times)[len(times) // 2], "runs_ms": times,
                 "max_abs_diff_vs_first": float((logits.float() - reference.float()).abs().max())}
        if hasattr(variant, "pcie_bytes"):
            entry["pcie_GB"] = variant.pcie_bytes() / 1e9
        result["variants"][name] = entry
        print(name, context, entry, flush=True)
        del variant
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = result["variants"].get(variants[0], {}).get("ttft_ms")
    for entry in result["variants"].values():
        if base and "ttft_ms" in entry:
            entry["x_dense"] = round(entry["ttft_ms"] / base, 3)
    return result


def _events(device: torch.device):
    if device.type != "cuda":
        import time

        return time.perf_counter(), None
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    return began, ended


def _elapsed_ms(began, ended, device: torch.device) -> float:
    if device.type != "cuda":
        import time

        return (time.perf_counter() - began) * 1e3
    ended.record()
    ended.synchronize()
    return began.elapsed_time(ended)


def checks(results: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Every measured variant's logits within ``tolerance`` of the first's (dense);
    InfiniGen's prefill copies nothing from the pool (its cache holds the prompt)
    where the staged one does."""
    worst = max((entry["max_abs_diff_vs_first"] for result in results
                 for entry in result["variants"].values() if "ttft_ms" in entry), default=0.0)
    pcie = [(result["variants"].get("infinigen", {}).get("pcie_GB"),
             result["variants"].get("infinigen_staged", {}).get("pcie_GB"))
            for result in results]
    from_pool = all(cached in (None, 0.0) and (staged is None or staged > 0)
                    for cached, staged in pcie)
    return {"max_abs_diff_vs_dense": worst, "tolerance": tolerance,
            "prompt_read_from_pool": not from_pool,
            "passed": worst <= tolerance and from_pool}


def markdown(results: list[dict[str, Any]], check: dict[str, Any], self_test: bool) -> str:
    lines = (["CPU self-test: tiny shapes, every kernel its torch reference; it checks the "
              "code, and its times measure nothing.", ""] if self_test else [])
    lines += ["| context | chunk | variant | TTFT ms | x dense | GB from the pool |",
              "|---|---|---|---|---|---|"]
    for result in results:
        for name, entry in result["variants"].items():
            if "ttft_ms" not in entry:
                lines.append(f"| {result['context']} | {result['chunk']} | {name} | "
                             f"{entry['skipped']} | | |")
                continue
            lines.append(f"| {result['context']} | {result['chunk']} | {name} | "
                         f"{entry['ttft_ms']:.1f} | {entry.get('x_dense', '')} | "
                         f"{entry.get('pcie_GB', '')} |")
    lines += ["", f"Logits against dense's: largest difference {check['max_abs_diff_vs_dense']:.3g} "
              f"(tolerance {check['tolerance']}); InfiniGen's prefill read from the pool: "
              f"{check['prompt_read_from_pool']}. {'Passed' if check['passed'] else 'FAILED'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true",
                        help="tiny shapes on the CPU with the references (no GPU needed)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunk", type=int, default=8192,
                        help="prompt tokens per step (vLLM's --max-num-batched-tokens)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--host-pool-gib", type=float, default=32.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.self_test:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        contexts, chunk, warmup, tolerance = [256], 96, 64, 1e-4
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (the CPU self-test: --self-test)")
        from benchmarks.gpu.decoder import LLAMA_31_8B

        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_31_8B
        contexts, chunk, warmup, tolerance = args.contexts, args.chunk, 1024, 0.25
    torch.manual_seed(0)
    streams = Streams(device)
    if streams.cuda:
        torch.cuda.set_stream(streams.main)
    layers, lm_head = random_weights(shape, device, dtype)
    largest = max(shape.layer_kv_bytes(1, context, dtype) for context in contexts)
    pool_bytes = max(largest, min(int(args.host_pool_gib * 2**30), shape.num_layers * largest))
    pool, owner = make_pool(shape, pool_bytes, device, dtype)
    decoder = Decoder(shape, layers, lm_head)
    results = [measure_context(decoder, shape, pool, context=context, chunk=chunk,
                               variants=args.variants, repeats=args.repeats, streams=streams,
                               device=device, dtype=dtype, warmup_tokens=warmup)
               for context in contexts]
    if args.self_test:  # and one chunk holding the whole prompt
        results.append(measure_context(decoder, shape, pool, context=contexts[0],
                                       chunk=contexts[0], variants=args.variants, repeats=1,
                                       streams=streams, device=device, dtype=dtype,
                                       warmup_tokens=warmup))
    check = checks(results, tolerance)
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "shape": shape.__dict__, "dtype": str(dtype), "pool_GiB": pool_bytes / 2**30}
    out = args.out or (SELF_TEST_OUT if args.self_test else DEFAULT_OUT)
    report.write_results(out, gpu_run_metadata(), "Time to first token on a GPU: one prompt's "
                         "prefill, InfiniGen's path against dense", settings,
                         {"check": check, "contexts": results}, [markdown(results, check, args.self_test)])
    del owner  # the pinned pool's owner, kept until the runs are done
    print(check)
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
