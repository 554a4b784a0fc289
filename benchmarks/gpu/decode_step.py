# SPDX-License-Identifier: Apache-2.0
"""ms per decode step of a 32-layer Llama-3.1-8B-shaped decoder: dense, offloaded, InfiniGen.

python -m benchmarks.gpu.decode_step [--contexts 32768 131072] [--batches 1 8]
    [--modes eager graph] [--profile] [--kernels]
python -m benchmarks.gpu.decode_step --self-test      # CPU, tiny shapes, references

Needs torch (and Triton on CUDA), not vLLM. Random bf16 weights (RoPE left
out), one token per row per step at a fixed context. For every (context,
batch) and mode (eager; ``graph``: the whole 32-layer step captured in one
CUDA graph and replayed): ``variants.py``'s dense (where it fits),
dense_units and full offload, and InfiniGen: the product's runtime and CUDA
data path (``product.py``), driven per layer as vLLM drives them, its
selections computed (the default keys, the block rule) and then replaced by
selections recorded on a trained model (``selection_trace.py``:
recall-llama-12l-4k at 4K, the trace recorded at ``--budget``'s fraction,
scaled to the context), so the device block cache sees real step-to-step reuse. Reported per variant: ms per step
(median, CUDA events, a host sync per step as a serving engine has), host
enqueue time, bytes over PCIe per step, GB/s, the PCIe bound (bytes / the
H2D limit measured in the same run), the cache's hit rate and size; with
``--profile``, kernel launches and host synchronizations per step (torch
profiler). First, select-all (budget 1) must give dense's logits in every
variant, and a captured step the eager step's. Writes
benchmarks/results/gpu_decode_step.{json,md} (command, commit, device,
date); ``--self-test`` writes ..._selftest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import checks, kernel_limits, selection_trace
from benchmarks.gpu.measure import (
    DEFAULT_KEYS,
    DEFAULT_OUT,
    KEYS,
    MODES,
    VARIANTS,
    measure_config,
    open_gpu_bench,
)
from benchmarks.gpu.report import markdown_sections
from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.harness import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true",
                        help="tiny shapes on the CPU with the references (no GPU needed)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="eager, and/or graph: the whole step captured in one CUDA graph")
    parser.add_argument("--profile", action="store_true",
                        help="kernel launches and host synchronizations per step")
    parser.add_argument("--kernels", action="store_true",
                        help="each kernel's bytes and GB/s against the streaming read and the "
                        "pinned copy, and a prompt's attention against SDPA "
                        "(benchmarks/gpu/kernel_limits.py), at each context")
    parser.add_argument("--budget", type=float, default=0.2,
                        help="the computed selection's budget (its cost is measured)")
    parser.add_argument("--keys", choices=KEYS, default=DEFAULT_KEYS,
                        help="speculation keys the computed selection scores (the product's "
                        "--infinigen-speculation-keys; default: its default)")
    parser.add_argument("--traces", type=Path, nargs="+", default=selection_trace.recorded_traces(),
                        help="recorded selections to replay, the one at --budget's fraction "
                        "(default: recall-llama-12l-4k's, benchmarks/gpu/traces/)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--host-pool-gib", type=float, default=48.0,
                        help="pinned host memory for the K/V; layers share it when it is smaller")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.self_test:
        result = checks.self_test(args.out or checks.SELF_TEST_OUT, args.traces)
        print(result)
        return 0 if result["passed"] else 1
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU self-test: --self-test)")
    bench = open_gpu_bench(args.batches, args.contexts, args.host_pool_gib)
    device, dtype, shape, streams = bench.device, bench.dtype, bench.shape, bench.streams
    layers, lm_head, pool, limits = bench.layers, bench.lm_head, bench.pool, bench.limits
    setup_info = bench.setup
    small = {"batch": 2, "context": checks.check_context(shape, args.traces), "streams": streams}
    results: dict[str, Any] = {
        "h2d_limits": limits, "setup": setup_info,
        "select_all": checks.select_all_check(shape, layers, lm_head, pool, device, dtype,
                                              keys=args.keys, **small),
        "graph_vs_eager": (checks.graph_check(shape, layers, lm_head, pool, device, dtype,
                                              budget=args.budget, traces=args.traces, **small)
                           if "graph" in args.modes else None),
        "configs": []}
    print(results["select_all"], results["graph_vs_eager"], limits, flush=True)
    if args.kernels:
        results["kernel_limits"] = [
            kernel_limits.kernel_limits(device, dtype, context=context,
                                        pinned_copy_GBps=limits["copy_GBps"])
            for context in args.contexts]
        print(results["kernel_limits"], flush=True)
    for context in args.contexts:
        for batch in args.batches:
            config = measure_config(shape, layers, lm_head, pool, device, dtype, batch=batch,
                                    context=context, args=args, streams=streams, limits=limits)
            results["configs"].append(config)
            print(config, flush=True)
    meta = gpu_run_metadata()
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "shape": shape.__dict__, "dtype": str(dtype)}
    report.write_results(args.out or DEFAULT_OUT, meta,
                         "InfiniGen decode step on a GPU: dense, offloaded, the product's step",
                         settings, results, markdown_sections(results, self_test=False))
    graphs = results["graph_vs_eager"]
    return 0 if results["select_all"]["passed"] and (graphs is None or graphs["passed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
