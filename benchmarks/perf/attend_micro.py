# SPDX-License-Identifier: Apache-2.0
"""The decode attention kernel alone: GB/s of its selected-row reads against a streaming read.

One decode row (batch 1) of one layer: ``--kv-heads`` KV heads of
``--group`` query heads each, ``--selected`` positions per KV head drawn at
random (sorted, as the selector returns them) from a ``--context``-token
context whose blocks sit at random places in the pool, so that every row
read is a scattered ``2 * head_size`` run, as in a real step. The pool is
``--layers`` layers' pools read in turn, so that a call does not find the
rows of the previous one in the cache; the streaming read is ``x.sum()``
over the same pools on one thread (``bandwidth.py``'s read). Everything runs
on one thread.

``--dtypes`` may name FP8 pools (``float8_e4m3fn``, ``float8_e5m2``: what
``--kv-cache-dtype fp8`` / ``fp8_e5m2`` keep), whose queries are
``--fp8-query-dtype`` (the model's). Every round times every dtype in turn,
so that their medians compare as a paired run's; ``--out`` writes them with
their provenance.

``--baseline REV`` also builds ``csrc/attend.cpp`` of git revision REV (with
its ``common.h`` / ``ops.h``) under its own op namespace, and times it
against the checkout's kernel in alternation, round by round: this machine's
speed drifts 20-40 % over minutes, so only interleaved medians compare.

Example: ``python -m benchmarks.perf.attend_micro --baseline HEAD``
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import report
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.platforms.cpu.kernels import build

CSRC_REL = "vllm_infinigen/platforms/cpu/kernels/csrc"


def attend_schema(ops_cpp: str) -> str:
    """attend_decode's schema as a revision's ``ops.cpp`` declares it (its
    ``m.def`` string literals joined)."""
    for block in ops_cpp.split("m.def(")[1:]:
        literals = re.findall(r'"((?:[^"\\]|\\.)*)"', block.split(");")[0])
        schema = "".join(literals)
        if schema.startswith("attend_decode("):
            return schema
    raise ValueError("ops.cpp declares no attend_decode")


def build_baseline(rev: str, build_root: Path):
    """attend_decode of revision ``rev``, as ``torch.ops.attend_baseline.attend_decode``."""
    repo = Path(__file__).resolve().parents[2]
    isa = build.target_isa()
    src = build_root / f"src-{rev}"
    src.mkdir(parents=True, exist_ok=True)
    def show(name: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{CSRC_REL}/{name}"], cwd=repo, check=True,
                              capture_output=True, text=True).stdout

    for name in ("attend.cpp", "common.h", "ops.h"):
        (src / name).write_text(show(name))
    (src / "register.cpp").write_text(
        '#include <torch/library.h>\n#include "ops.h"\n'
        f'TORCH_LIBRARY(attend_baseline, m) {{ m.def("{attend_schema(show("ops.cpp"))}"); }}\n'
        "TORCH_LIBRARY_IMPL(attend_baseline, CPU, m) {\n"
        '  m.impl("attend_decode", &infinigen::attend_decode);\n}\n')
    from torch.utils.cpp_extension import load as load_extension

    out = build_root / f"build-{rev}-{isa.lower()}"
    out.mkdir(parents=True, exist_ok=True)
    # Its own C++ namespace too, so that nothing binds to the checkout's symbols.
    load_extension(name=f"attend_baseline_{isa.lower()}",
                   sources=[str(src / "attend.cpp"), str(src / "register.cpp")],
                   extra_cflags=["-O3", "-fopenmp", "-std=c++17", *build.ISA_FLAGS[isa],
                                 "-Dinfinigen=infinigen_baseline"],
                   extra_ldflags=["-fopenmp"], extra_include_paths=[str(src)],
                   build_directory=str(out), is_python_module=False, verbose=False)
    return torch.ops.attend_baseline.attend_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--selected", type=int, default=3300, help="positions per KV head")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="pools read in turn")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="pool dtypes, comma-separated (FP8 ones too)")
    parser.add_argument("--fp8-query-dtype", default="bfloat16",
                        help="the queries' dtype beside an FP8 pool")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--probs", action="store_true", help="also return the probabilities")
    parser.add_argument("--baseline", metavar="REV", help="also time attend.cpp of this git revision")
    parser.add_argument("--out", type=Path, default=None, help="results stem (.json, .md)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    isa = kernels.load()
    fns = {"checkout": lambda *a: torch.ops.vllm_infinigen_C.attend_decode(*a)}
    if args.baseline:
        root = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "attend_micro"
        fns = {f"baseline {args.baseline}": build_baseline(args.baseline, root), **fns}
    gen = torch.Generator().manual_seed(0)
    num_blocks = args.context // args.block_size + 1
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
    lens = torch.tensor([args.context], dtype=torch.int64)
    positions = torch.stack([
        torch.randperm(args.context, generator=gen)[:args.selected].sort().values
        for _ in range(args.kv_heads)])[None].to(torch.int32).contiguous()
    scale = args.head_size ** -0.5
    cases = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        query_dtype = getattr(torch, args.fp8_query_dtype) if dtype.itemsize == 1 else dtype
        pools = [torch.randn(num_blocks, args.kv_heads, args.block_size, 2 * args.head_size,
                             generator=gen).to(dtype) for _ in range(args.layers)]
        query = torch.randn(1, args.kv_heads * args.group, args.head_size,
                            generator=gen).to(query_dtype)
        probs = torch.zeros(1, args.kv_heads, args.selected) if args.probs else None
        # The rows read: the selected ones and each head's own, K and V.
        nbytes = (args.selected + 1) * args.kv_heads * 2 * args.head_size * dtype.itemsize
        outs = [fn(query, pools[0], table, lens, positions, None, scale, probs, None).float()
                for fn in fns.values()]
        diff = max((out - outs[0]).abs().max().item() for out in outs)
        label = name if dtype == query_dtype else f"{name} ({args.fp8_query_dtype} queries)"
        cases[label] = dict(pools=pools, query=query, probs=probs, nbytes=nbytes, diff=diff,
                            stream=[], times={fn_name: [] for fn_name in fns})
    for _ in range(args.rounds):
        for case in cases.values():
            pools = case["pools"]
            start = time.perf_counter()
            for pool in pools:
                pool.view(-1).view(torch.float32).sum()
            case["stream"].append((time.perf_counter() - start) / len(pools))
            for name, fn in fns.items():
                best = float("inf")
                for k in range(2 * len(pools)):
                    start = time.perf_counter()
                    fn(case["query"], pools[k % len(pools)], table, lens, positions, None, scale,
                       case["probs"], None)
                    best = min(best, time.perf_counter() - start)
                case["times"][name].append(best)
    rows, results = [], []
    for label, case in cases.items():
        pool = case["pools"][0]
        stream_gb_s = pool.numel() * pool.element_size() / statistics.median(case["stream"]) / 1e9
        print(f"{isa} {label}: streaming read {stream_gb_s:.1f} GB/s (1 thread), "
              f"{case['nbytes'] / 1e6:.2f} MB of rows per call, max |diff| {case['diff']:.2g}")
        for name, samples in case["times"].items():
            seconds = statistics.median(samples)
            gb_s = case["nbytes"] / seconds / 1e9
            print(f"  {name:16s} {seconds * 1e3:7.3f} ms  {gb_s:6.1f} GB/s  "
                  f"{gb_s / stream_gb_s:.2f} of streaming  (median of {args.rounds} rounds' best)")
            results.append({"pool": label, "kernel": name, "ms": seconds * 1e3,
                            "rounds_ms": [t * 1e3 for t in samples], "gb_s": gb_s,
                            "stream_gb_s": stream_gb_s, "mb_per_call": case["nbytes"] / 1e6})
            rows.append([label, name, f"{seconds * 1e3:.3f}",
                         f"{min(samples) * 1e3:.3f}-{max(samples) * 1e3:.3f}",
                         f"{case['nbytes'] / 1e6:.2f}", f"{gb_s:.1f}",
                         f"{gb_s / stream_gb_s:.2f}"])
    if args.out:
        sections = [
            f"One decode row of one layer on one thread ({isa}): {args.kv_heads} KV heads x "
            f"{args.group} query heads, head_dim {args.head_size}, {args.selected} of "
            f"{args.context} positions per KV head, blocks of {args.block_size} at random "
            f"places, {args.layers} pools read in turn; each round times every pool dtype "
            f"in turn, the median over {args.rounds} rounds of each round's best call.",
            report.markdown_table(["pool", "kernel", "ms (median)", "rounds' range",
                                   "MB read per call", "GB/s", "of streaming"], rows)]
        report.write_results(args.out, report.run_metadata(), "The decode attention kernel "
                             "alone, per pool dtype", vars(args), results, sections)


if __name__ == "__main__":
    main()
