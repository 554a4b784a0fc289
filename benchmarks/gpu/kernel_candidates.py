# SPDX-License-Identifier: Apache-2.0
"""Candidate forms of the decode step's kernels (the selection's scoring and block choice, the
cache placement, the attention), each checked against its torch reference on the device and then
timed, in one short GPU run.

    int_scores   ``triton_scoring``'s forms (dot in float16, the default; dot in
                 TF32 / TF32x3; float32 sums, the exact form) at a
                 few tiles and warps, at 1 and 8 rows (2-bit keys) and 1 row
                 (4-bit keys)
    select       the chunked threshold search (the kernel before) and the
                 register-resident one at a few warps, by halving or by byte
                 histograms (the default), at 1, 8 and 32 rows
    bound_scores ``triton_bounds``' forms (float32 sums per query head; float16
                 tensor-core dots, the default for a 16-bit query) at a few tiles and warps,
                 8-bit bounds of 16 tokens, at 1, 8 and 32 rows
    lookup       the cache placement's victims' search in 2 to 256 bins per pass,
                 at 32 rows from a worn cache (``step_candidates.py``)
    attend       the decode attention's splits, tokens per step, warps, stages
                 and merge (by the last split, the default, or a second launch),
                 at 1 row of 6,560 cached tokens (32K x 1 at budget 0.2) and 32
                 rows of 5,632 (``step_candidates.py``)

``python -m benchmarks.gpu.kernel_candidates --out PATH`` writes PATH.json and
PATH.md (command, commit, device, date: ``results.py``) (needs torch and Triton only, no vLLM);
``--self-test`` runs the same code at tiny sizes in Triton's interpreter on
the CPU (to check the code, not to time it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu import step_candidates

# (method, tokens per program, warps, the dot's precision) of the int scoring
SCORING = (("sums", 64, 4, None), ("sums", 32, 4, None), ("sums", 64, 8, None),
           ("dot", 64, 4, "tf32x3"), ("dot", 32, 4, "tf32x3"), ("dot", 64, 4, "tf32"),
           ("dot", 64, 4, "fp16"), ("dot", 128, 8, "fp16"))
# Each form against the float64 reference of the operands it multiplies (float16 for
# "fp16", float32 else: ``block_rule.int_token_scores``' operands), and the
# tolerance: one TF32 product rounds its float32 operands to 10 bits (~1e-3 off).
OPERANDS = {None: None, "tf32x3": None, "tf32": None, "fp16": "float16"}
TOLERANCE = {None: 1e-4, "tf32x3": 1e-4, "tf32": 5e-3, "fp16": 1e-4}
SELECT_WARPS = (4, 8, 16, 32)
# (method, units per tile, warps, tiles per program: a loop, its loads pipelined) of the
# bound scoring
BOUNDS = (("sums", 32, 4, 1), ("sums", 64, 4, 1), ("dot", 32, 4, 1), ("dot", 64, 4, 1),
          ("dot", 128, 4, 1), ("dot", 128, 8, 1), ("dot", 256, 8, 1), ("dot", 64, 4, 4),
          ("dot", 128, 4, 4))
REPEATS = {"cuda": 5, "cpu": 1}  # the CPU runs the interpreter: checks, not timings
KERNELS = ("int_scores", "select", "bound_scores", "lookup", "attend")


def _int_case(torch, device, *, rows, context, heads, group, head_size, bits, gen):
    """(query, codes, scales, table, context_lens) of ``rows`` rows of ``context`` tokens,
    each with its own blocks, the first row's context cut to a non-multiple of 16."""
    blocks = context // 16 + 1
    codes = torch.randint(0, 256, (rows * blocks, heads, 1, head_size, 2 * bits),
                          dtype=torch.uint8, device=device, generator=gen)
    scales = (torch.rand((rows * blocks, heads, 1, head_size), device=device,
                         generator=gen) / 16).half()
    table = torch.randperm(rows * blocks, device=device, generator=gen).view(rows, blocks)
    table = table.to(torch.int32)
    query = torch.randn(rows, heads, group, head_size, device=device, generator=gen)
    context_lens = torch.full((rows,), context, device=device)
    context_lens[0] = context - 5
    return query.to(torch.bfloat16), codes, scales, table, context_lens


def _agrees(torch, got, expected, tolerance=1e-4) -> tuple[bool, float]:
    """(same -inf pattern and within tolerance, max abs error)."""
    same = torch.equal(got.isinf(), expected.isinf())
    finite = ~expected.isinf()
    error = (got[finite].double() - expected[finite]).abs()
    bound = tolerance * (1 + expected[finite].abs())
    return same and bool((error <= bound).all()), float(error.max()) if error.numel() else 0.0


def _checked_then_timed(torch, device, row: dict[str, Any], launch, check,
                        key_bytes: float | None = None) -> dict[str, Any]:
    """``row`` with the launch's check (``check()``: agrees, max abs error or None) and,
    when it agrees, its time (and GB/s of ``key_bytes``); a candidate that fails to
    compile is reported, not raised."""
    from benchmarks.gpu.kernel_limits import timed

    try:
        launch()
        ok, error = check()
        row["correct"] = ok
        if error is not None:
            row["max_abs_error"] = error
        if ok:
            ms = timed(launch, device, repeats=REPEATS[device.type])
            row.update(ms=float(ms), timing=ms.method)
            if key_bytes:
                row["GBps"] = key_bytes / ms / 1e6
    except Exception as error:
        row.update(correct=False, error=f"{type(error).__name__}: {str(error)[:200]}")
    return row


def scoring_rows(torch, device, sizes: dict[str, int], rows_list, bits: int, gen):
    """Each candidate's rows: checked on the device, then timed."""
    from vllm_infinigen.platforms.cuda.kernels import block_rule, triton_scoring

    out = []
    for rows in rows_list:
        query, codes, scales, table, lens = _int_case(torch, device, rows=rows, bits=bits,
                                                      gen=gen, **sizes)
        references = {operands: block_rule.int_token_scores(
            query, codes, scales, table, lens, scale=0.09, compute_dtype=torch.float64,
            operands=getattr(torch, operands) if operands else None)
            for operands in set(OPERANDS.values())}
        shape = references[None].shape
        tokens = torch.empty(shape, dtype=torch.float32, device=device)
        blocks = torch.empty(shape[:-1] + (table.shape[1],), dtype=torch.float32, device=device)
        key_bytes = codes.numel() + scales.numel() * 2
        launches = [(f"{method}{f' ({precision})' if precision else ''}, tile {tile}, "
                     f"{warps} warps", TOLERANCE[precision], references[OPERANDS[precision]],
                     lambda m=method, t=tile, w=warps, p=precision: triton_scoring.int_scores(
                         query, codes, scales, table, lens, tokens, blocks, scale=0.09,
                         method=m, tile=t, num_warps=w, precision=p or "tf32x3"))
                    for method, tile, warps, precision in SCORING]
        for name, tolerance, expected, launch in launches:
            def check(expected=expected, tolerance=tolerance):
                ok, error = _agrees(torch, tokens, expected, tolerance)
                ok_blocks, _ = _agrees(torch, blocks, block_rule.block_scores(
                    expected, lens, 16), tolerance)
                return ok and ok_blocks, error

            tokens.fill_(7.0)
            out.append(_checked_then_timed(
                torch, device, {"kernel": "int_scores", "form": name, "rows": rows,
                                "bits": bits, "MB": key_bytes / 1e6}, launch, check, key_bytes))
        del references, launches
    return out


def select_rows(torch, device, context: int, heads: int, rows_list, gen):
    """The chunked and the register-resident threshold search, checked, then timed."""
    from vllm_infinigen.platforms.cuda import kernels
    from vllm_infinigen.platforms.cuda.kernels import block_rule, triton_select

    out = []
    blocks = context // 16 + 1
    for rows in rows_list:
        scores = (torch.randn(rows, heads, blocks, device=device, generator=gen) * 8).round()
        table = torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks)
        lens = torch.full((rows,), context, device=device)
        counts = torch.full((rows * heads,), context, dtype=torch.int32, device=device)
        settings = kernels.settings_tensor(5.0, 0.2, 0, device)
        width = kernels.static_width(blocks, 16, budget=0.2, min_context=0,
                                     sink_blocks=1, recent_blocks=1)
        expected = block_rule.select_reference(scores, counts, lens, table, settings,
                                                block_size=16, width=width, sink_blocks=1,
                                                recent_blocks=1)
        got = tuple(torch.empty_like(part) for part in expected)
        forms = [("before (chunked, 1024), 4 warps", 0, 4, False)] + [
            (f"resident, {warps} warps", triton_select.RESIDENT_BLOCKS, warps, False)
            for warps in SELECT_WARPS] + [
            (f"resident, by bytes, {warps} warps", triton_select.RESIDENT_BLOCKS, warps, True)
            for warps in SELECT_WARPS[:3]]
        for name, resident, warps, radix in forms:
            def launch(resident=resident, warps=warps, radix=radix):
                triton_select.select_blocks(scores, counts, lens, table, settings, *got,
                                            block_size=16, sink_blocks=1, recent_blocks=1,
                                            num_warps=warps, resident=resident, radix=radix)
            out.append(_checked_then_timed(
                torch, device, {"kernel": "select", "form": name, "rows": rows, "width": width,
                                "MB": scores.numel() * 4 / 1e6}, launch,
                lambda: (all(torch.equal(a, b) for a, b in zip(got, expected)), None)))
    return out


def bound_rows(torch, device, sizes: dict[str, int], rows_list, gen):
    """The bound scoring's forms (``BOUNDS``), each checked against the torch form
    (``block_rule.bound_unit_scores``, float32) and timed; 8-bit bounds, a unit per
    16-token block, a bfloat16 query (exact in the dots' float16)."""
    from vllm_infinigen.platforms.cuda.kernels import block_rule, triton_bounds

    out = []
    context, heads, group, head_size = (sizes[k] for k in ("context", "heads", "group",
                                                             "head_size"))
    blocks = context // 16 + 1
    for rows in rows_list:
        bounds = torch.randint(0, 256, (rows * blocks, heads, 1, 2, head_size),
                               dtype=torch.uint8, device=device, generator=gen)
        scales = (torch.rand((rows * blocks, heads, 1), device=device, generator=gen)
                  / 64).half()
        table = torch.randperm(rows * blocks, device=device, generator=gen).view(rows, blocks)
        table = table.to(torch.int32)
        query = torch.randn(rows, heads, group, head_size, device=device,
                            generator=gen).to(torch.bfloat16)
        lens = torch.full((rows,), context, device=device)
        lens[0] = context - 5
        expected = torch.cat([block_rule.bound_unit_scores(
            query[r:r + 8], bounds, scales, table[r:r + 8], lens[r:r + 8], scale=0.09,
            block_size=16) for r in range(0, rows, 8)])
        units = torch.empty_like(expected)
        block_out = torch.empty_like(expected)  # a unit per block
        key_bytes = bounds.numel() + scales.numel() * 2
        for method, tile, warps, tiles in BOUNDS:
            def launch(method=method, tile=tile, warps=warps, tiles=tiles):
                triton_bounds.bound_scores(query, bounds, scales, table, lens, units,
                                           block_out, scale=0.09, unit=16, tile=tile,
                                           num_warps=warps, method=method,
                                           tiles_per_program=tiles)
            def check():
                ok, error = _agrees(torch, units, expected)
                return ok and torch.equal(block_out, units), error

            units.fill_(7.0)
            out.append(_checked_then_timed(
                torch, device, {"kernel": "bound_scores", "rows": rows, "bits": 8,
                                "form": f"{method}, tile {tile}, {warps} warps"
                                        + (f", {tiles} tiles a program" if tiles > 1 else ""),
                                "MB": key_bytes / 1e6}, launch, check, key_bytes))
        del bounds, expected, units, block_out
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Candidates on {result['device']} at {result['context']} tokens "
             f"(8B shapes: {result['sizes']}):", "",
             "| kernel | form | rows | bits | MB | correct | max abs error | ms | GB/s | timing |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for row in result["rows"]:
        ms = f"{row['ms']:.4f}" if "ms" in row else row.get("error", "")
        lines.append(f"| {row['kernel']} | {row['form']} | {row['rows']} | {row.get('bits', '')} "
                     f"| {row['MB']:.1f} | {row['correct']} | {row.get('max_abs_error', '')} | "
                     f"{ms} | {row.get('GBps', 0):.0f} | {row.get('timing', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernel_candidates"),
                        help="results path without suffix (.json and .md are written)")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--self-test", action="store_true",
                        help="tiny sizes in Triton's interpreter on the CPU")
    parser.add_argument("--only", nargs="+", choices=KERNELS, default=list(KERNELS),
                        help="the kernels whose forms run (default: all)")
    args = parser.parse_args(argv)
    if args.self_test:
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is first imported
        if "triton" in sys.modules:
            raise RuntimeError("--self-test must start before Triton is imported")
    import torch

    device = torch.device("cpu" if args.self_test else "cuda")
    sizes = ({"context": 75, "heads": 2, "group": 3, "head_size": 24} if args.self_test else
             {"context": args.context, "heads": 8, "group": 4, "head_size": 128})
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    if "int_scores" in args.only:
        rows += scoring_rows(torch, device, sizes, (1, 2) if args.self_test else (1, 8), 2, gen)
        rows += scoring_rows(torch, device, sizes, (1,), 4, gen)
    if "select" in args.only:
        rows += select_rows(torch, device, sizes["context"], sizes["heads"],
                            (1, 2) if args.self_test else (1, 8, 32), gen)
    if "bound_scores" in args.only:
        rows += bound_rows(torch, device, {**sizes, "head_size": max(32, sizes["head_size"])},
                           (1, 9) if args.self_test else (1, 8, 32), gen)
    batch = 2 if args.self_test else 32  # the batch-32 point at a 4,096-token cap
    if "lookup" in args.only:
        rows += step_candidates.lookup_rows(
            torch, device, rows=batch, width=5 if args.self_test else 270, heads=sizes["heads"],
            row_blocks=16 if args.self_test else sizes["context"] // 16 + 1, gen=gen,
            checked_then_timed=_checked_then_timed)
    # The attention at 32K x 1's budget 0.2, where the merge's share is largest (a few
    # sequences split many ways), and at the batch-32 point's cap.
    for attend_batch, tokens in ((1, 6560), (batch, 5632)) if "attend" in args.only else ():
        rows += step_candidates.attend_rows(
            torch, device, rows=attend_batch, heads=sizes["heads"], group=sizes["group"],
            head_size=max(32, sizes["head_size"]), tokens=40 if args.self_test else tokens,
            num_sms=None if args.self_test else torch.cuda.get_device_properties(
                device).multi_processor_count, gen=gen, checked_then_timed=_checked_then_timed)
    from benchmarks.gpu.results import gpu_run_metadata
    from benchmarks.harness import report

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    result = {"device": name, "context": sizes["context"], "sizes": sizes, "rows": rows}
    report.write_results(args.out, gpu_run_metadata(), "Selection kernels: candidate forms",
                         {"context": sizes["context"], "sizes": sizes}, result,
                         [markdown(result)])
    print(markdown(result))
    return 0 if all(row["correct"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
