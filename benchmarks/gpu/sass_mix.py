# SPDX-License-Identifier: Apache-2.0
"""The bound scoring's machine code for an H100/H200 (sm_90), read without a GPU: what each
form issues per byte of bounds, and the rate that bounds it if issue is the limit.

Triton's wheel carries ptxas and nvdisasm, so a CPU-only machine compiles a kernel for
sm_90 (pointer arguments 16-byte aligned, as Triton specialises them at a launch) and
counts the SASS instructions of one thread. The scoring kernel has no loop at one tile a
program (the tile loop runs once), so the static count is what each thread executes per
tile. Two limits follow per SM sub-partition (one warp each at 4 warps a program):

    issue       one warp instruction a cycle: the instructions per thread
    conversion  I2F / F2F (not I2FP) at 16 lanes a cycle per SM (a quarter of the
                integer rate; CUDA C Programming Guide, compute capability 9.0): 8
                cycles a warp instruction

The ceiling is the tile's bytes over the larger of the two, at the H200's 132 SMs and
1.98 GHz. It is a model of one limit, not a timing: loads' latency, occupancy and the
tensor cores are not in it (``kernel_candidates`` times the forms on a GPU).

``python -m benchmarks.gpu.sass_mix --out PATH [--before REV]`` writes PATH.json and PATH.md
(``--before``: also the tensor-core forms of the kernel at a git revision). It compiles with
the Triton it imports: ``PYTHONPATH=.venv/gpu-triton`` puts the lent GPUs' first (``make
setup`` installs it there).
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SMS, CLOCK_GHZ = 132, 1.98  # H200 (SXM)
STREAMING_TBPS = 4.23  # the streaming read measured on the H200 (results/gpu_throughput.md)
CONVERSIONS = ("I2F", "F2F")  # quarter rate; I2FP, F2FP run at the integer / FMA rates
SHOWN = ("I2F", "F2F", "I2FP", "F2FP", "PRMT", "LOP3", "HADD2", "FFMA", "FADD", "SHFL",
         "HMMA", "HGMMA", "LDG")
# (method, bits, units per tile) at 4 warps
FORMS = (("sums", 8, 32), ("sums", 8, 64), ("dot", 8, 32), ("dot", 8, 64), ("dot", 8, 128),
         ("dot", 4, 64), ("dot", 4, 128))


def _nvdisasm() -> Path:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        raise FileNotFoundError(f"{tool}: this Triton wheel carries no nvdisasm")
    return tool


@functools.lru_cache(maxsize=None)
def kernels_at(revision: str | None):
    """``triton_bounds`` of the tree, or as it was at a git ``revision`` (a copy
    imported under another name, to compare a form with the one it replaced)."""
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    if revision is None:
        return triton_bounds
    import importlib.util

    path = "vllm_infinigen/platforms/cuda/kernels/triton_bounds.py"
    source = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True,
                            text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    name = "bounds_" + re.sub(r"\W", "_", revision)
    folder = Path(tempfile.mkdtemp())
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sass_counts(method: str, bits: int, tile: int, *, head_size: int = 128,
                group: int = 4, warps: int = 4, module=None) -> collections.Counter:
    """Instruction mnemonics (the first part, e.g. ``I2F``) of one thread of
    ``_bound_scores`` compiled for sm_90, at the 8B model's shapes (``module``:
    ``kernels_at``'s, default the tree's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = (module or kernels_at(None))._bound_scores
    types = {"query": "*bf16", "bounds": "*u8", "scales": "*fp16", "table": "*i32",
             "context_lens": "*i64", "out": "*fp32", "block_out": "*fp32", "scale": "fp32",
             "query_row_stride": "i64", "table_stride": "i64", "num_units": "i32"}
    constants = {"H": 8, "G": group, "D": head_size, "HALF": head_size // 2,
                 "HALF_PAD": head_size // 2, "UNITS_PER_BLOCK": 1, "UNIT": 16, "BITS": bits,
                 "OFF": float(1 << (bits - 1)), "TILE": tile, "DOT": method == "dot",
                 "G_PAD": 16, "TILES": 1}
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    # Triton's launch marks a pointer or an int divisible by 16 so: the query's row stride
    # (H_q x D) is; the table's (the blocks of a row: 8,193 at 128K) need not be.
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
               if types.get(name, "").startswith("*") or name == "query_row_stride"}
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(_nvdisasm()), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    pattern = r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"
    return collections.Counter(match.group(1) for match in re.finditer(pattern, sass, re.M))


def form_row(method: str, bits: int, tile: int, warps: int = 4,
             revision: str | None = None, head_size: int = 128) -> dict[str, Any]:
    """One form's counts and its issue-model ceiling (module docstring), of the tree's
    kernel or ``revision``'s. Cycles are a sub-partition's (4 a SM, warps / 4 warps each)."""
    counts = sass_counts(method, bits, tile, warps=warps, head_size=head_size,
                         module=kernels_at(revision))
    per_thread = sum(counts.values())
    tile_bytes = tile * 2 * head_size * bits // 8  # a unit's maxima and minima
    conversion_cycles = 8 * sum(counts[name] for name in CONVERSIONS) * warps / 4
    cycles = max(per_thread * warps / 4, conversion_cycles)
    ceiling = tile_bytes / cycles * CLOCK_GHZ * SMS / 1e3  # TB/s
    return {"method": method + (f" ({revision})" if revision else ""), "bits": bits,
            "tile": tile, "warps": warps,
            "instructions": per_thread, "tile_bytes": tile_bytes,
            "instructions_per_byte": per_thread * warps * 32 / tile_bytes,
            "issue_cycles": per_thread * warps / 4, "conversion_cycles": conversion_cycles,
            "ceiling_TBps": ceiling, "mix": {name: counts[name] for name in SHOWN}}


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| form | bits | tile | instructions / thread | lane instr. / byte | issue cycles "
            "| conversion cycles | ceiling TB/s | x streaming | " + " | ".join(SHOWN) + " |")
    lines = [head, "|" + "---|" * (9 + len(SHOWN))]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['bits']} | {row['tile']} | {row['instructions']} | "
            f"{row['instructions_per_byte']:.1f} | {row['issue_cycles']:.0f} | "
            f"{row['conversion_cycles']:.0f} | {row['ceiling_TBps']:.2f} | "
            f"{row['ceiling_TBps'] / STREAMING_TBPS:.2f} | "
            + " | ".join(str(row["mix"][name]) for name in SHOWN) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sass_mix"),
                        help="results path without suffix (.json and .md are written)")
    parser.add_argument("--before", metavar="REV",
                        help="also the tensor-core forms of the kernel at git revision REV")
    args = parser.parse_args(argv)
    from benchmarks.harness import report

    import triton

    rows = [form_row(*form) for form in FORMS]
    if args.before:
        rows += [form_row(*form, revision=args.before) for form in FORMS if form[0] == "dot"]
    text = markdown(rows)
    report.write_results(args.out, report.source_metadata(triton=triton.__version__),
                         "The bound scoring's SASS on sm_90 "
                         "(compiled on the CPU, not run)",
                         {"sms": SMS, "clock_GHz": CLOCK_GHZ, "streaming_TBps": STREAMING_TBPS,
                          "forms": FORMS, "before": args.before}, rows,
                         [f"Compiled by Triton {triton.__version__} from "
                          f"{Path(triton.__file__).parent} (the lent GPUs run 3.6). "
                          f"At 4 warps a program, {SMS} SMs at "
                          f"{CLOCK_GHZ} GHz; "
                          f"'x streaming' against the H200's measured {STREAMING_TBPS} TB/s "
                          "streaming read. A model of the issue limit only (module docstring).",
                          text])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
