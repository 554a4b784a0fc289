# SPDX-License-Identifier: Apache-2.0
"""Every Triton kernel of the CUDA platform compiles for an H100/H200 (sm_90), on a machine
without a GPU: Triton's NVIDIA backend and ptxas come with the wheel, so what the
interpreter tolerates and the compiler refuses (a plain global inside a jitted function,
a loop-carried variable changing type, a dot of the wrong shape) fails here, not on the
GPU. The arguments are the launches' at the 8B model's shapes (8 KV heads, 4 query heads
each, head_dim 128, 16-token blocks), bf16 and float32, and FP8 pools (float8_e4m3fn,
float8_e5m2) beside bf16 queries and keys."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_infinigen.platforms.cuda.kernels import (  # noqa: E402
    triton_attend,
    triton_bounds,
    triton_lru,
    triton_prompt,
    triton_scoring,
    triton_select,
    triton_units,
)

SM90 = GPUTarget("cuda", 90, 32)
HEADS = {"H": 8, "G": 4, "D": 128, "D_PAD": 128, "BLOCK": 16}
NOT_FP8 = {"FP8_M": 0, "FP8_EMIN": 0, "FP8_MAX": 0.0}


def _attend_case(query: str, units: str, constants: dict):
    """The decode attention's launch (``triton_attend._attend_units``)."""
    return (triton_attend._attend_units,
            {"query": f"*{query}", "units": f"*{units}", "table": "*i64", "seq_lens": "*i32",
             "partial": "*fp32", "maxima": "*fp32", "sums": "*fp32", "out": f"*{query}",
             "arrivals": "*i32", "scale": "fp32", "value_scale": "fp32",
             "query_row_stride": "i64", "table_stride": "i64", "out_row_stride": "i64",
             "blocks_per_split": "i32"},
            {**HEADS, "G_PAD": 16, "UNITS": 4, **constants})


def _unit_cases(query: str, units: str, ieee: bool, fp8: dict):
    """The ops on pool units for a query and pool (units) element type."""
    i32, i64 = "i32", "i64"
    is_fp8 = fp8["FP8_M"] > 0
    yield _attend_case(query, units, {"IEEE": ieee, "FP8": is_fp8, "MERGE": True})
    yield (triton_prompt._attend_prompt,
           {"query": f"*{query}", "units": f"*{units}", "table": "*i64", "out": f"*{query}",
            "scale": "fp32", "value_scale": "fp32", "first": i32, "seq_len": i32,
            "num_rows": i32, "query_row_stride": i64, "out_row_stride": i64,
            "table_stride": i64},
           {"G": 4, "D": 128, "D_PAD": 128, "BLOCK": 16, "BLOCK_M": 64, "BLOCK_N": 64,
            "IEEE": ieee, "FP8": is_fp8})
    yield (triton_units._write_tokens,
           {"pool": f"*{units}", "units": f"*{units}", "slot_of": "*i32", "key": f"*{query}",
            "value": f"*{query}", "slots": "*i64", "key_row_stride": i64,
            "value_row_stride": i64, "capacity": i32, "key_inverse": "fp32",
            "value_inverse": "fp32"},
           {"H": 8, "BLOCK": 16, "D": 128, "D_PAD": 128, "POOL": True, "CACHED": True, **fp8})
    yield (triton_units._write_tokens,  # the cached copies alone (kernels.write_cached_tokens)
           {"pool": f"*{units}", "units": f"*{units}", "slot_of": "*i32", "key": f"*{query}",
            "value": f"*{query}", "slots": "*i64", "key_row_stride": i64,
            "value_row_stride": i64, "capacity": i32, "key_inverse": "fp32",
            "value_inverse": "fp32"},
           {"H": 8, "BLOCK": 16, "D": 128, "D_PAD": 128, "POOL": False, "CACHED": True, **fp8})


def _kernel_cases():
    """(kernel, argument types, constexprs) of each launch."""
    i32, i64 = "i32", "i64"
    for dtype, ieee in (("bf16", False), ("fp32", True)):
        yield from _unit_cases(dtype, dtype, ieee, NOT_FP8)
        # The splits merged by a second launch (FUSED_MERGE off, the form before).
        yield _attend_case(dtype, dtype, {"IEEE": ieee, "FP8": False, "MERGE": False})
        yield (triton_attend._merge_splits,
               {"partial": "*fp32", "maxima": "*fp32", "sums": "*fp32", "out": f"*{dtype}",
                "out_row_stride": i64, "num_splits": i32},
               {"H": 8, "G": 4, "G_PAD": 4, "D": 128, "D_PAD": 128})
        bits = 2 if dtype == "bf16" else 4
        yield (triton_units._encode_groups,
               {"pool": f"*{dtype}", "codes": "*u8", "scales": "*fp16", "slots": "*i64"},
               {"H": 8, "BLOCK": 16, "D": 128, "D_PAD": 128, "BITS": bits,
                "HALF": ((1 << bits) - 1) / 2, "TOP": float((1 << bits) - 1)})
        for bound_bits in (8, 4):
            yield (triton_bounds._encode_bounds,
                   {"pool": f"*{dtype}", "bounds": "*u8", "scales": "*fp16", "slots": "*i64"},
                   {"H": 8, "BLOCK": 16, "UNIT": 16, "D": 128, "HALF": 64, "HALF_PAD": 64,
                    "BITS": bound_bits, "OFF": float(1 << (bound_bits - 1))})
            for dot in (False, True):  # per query head's sums; tensor-core dots (16-bit query)
                yield (triton_bounds._bound_scores,
                       {"query": f"*{dtype}", "bounds": "*u8", "scales": "*fp16", "table": "*i32",
                        "context_lens": "*i64", "out": "*fp32", "block_out": "*fp32",
                        "scale": "fp32", "query_row_stride": i64, "table_stride": i64,
                        "num_units": i32},
                       {"H": 8, "G": 4, "D": 128, "HALF": 64, "HALF_PAD": 64,
                        "UNITS_PER_BLOCK": 1, "UNIT": 16, "BITS": bound_bits,
                        "OFF": float(1 << (bound_bits - 1)), "TILE": 64 if dot else 32,
                        "DOT": dot, "G_PAD": 16, "TILES": 4 if dot else 1})
        for method, heads_pad, precision in (("sums", 4, "tf32x3"), ("dot", 16, "tf32x3"),
                                             ("dot", 16, "tf32"), ("dot", 16, "fp16")):
            yield (triton_scoring.KERNELS[method], {
                "query": f"*{dtype}", "codes": "*i32", "scales": "*fp16", "table": "*i32",
                "context_lens": "*i64", "token_out": "*fp32", "block_out": "*fp32",
                "settings": "*fp64", "scale": "fp32", "query_row_stride": i64,
                "table_stride": i64, "num_tokens": i32, "num_blocks": i32},
                {**HEADS, "HEADS_PAD": heads_pad, "BITS": bits, "HALF": ((1 << bits) - 1) / 2,
                 "TILE": 64, "WRITE_BLOCKS": True, "GATED": True, "PRECISION": precision})
    # 1-bit int keys (the reference supports them): 16-bit words, 64-token blocks,
    # ungated (the benchmark's and the references' call).
    for method, heads_pad in (("sums", 4), ("dot", 16)):
        yield (triton_scoring.KERNELS[method],
               {"query": "*bf16", "codes": "*i16", "scales": "*fp16", "table": "*i32",
                "context_lens": "*i64", "token_out": "*fp32", "block_out": "*fp32",
                "settings": "*fp64", "scale": "fp32", "query_row_stride": i64,
                "table_stride": i64, "num_tokens": i32, "num_blocks": i32},
               {**HEADS, "HEADS_PAD": heads_pad, "BLOCK": 64, "BITS": 1, "HALF": 0.5,
                "TILE": 64, "WRITE_BLOCKS": True, "GATED": False, "PRECISION": "tf32x3"})
    # A float32 query over bf16 units (the GPU tests' case): the dot's operands in bf16.
    yield _attend_case("fp32", "bf16", {"IEEE": False, "FP8": False, "MERGE": True})
    # FP8 pools (--kv-cache-dtype fp8 / fp8_e5m2): bf16 and fp16 queries widen the
    # units to their type; a float32 query runs the dots in float32 (IEEE; e4m3's
    # only: the prompt kernel's float32 compile takes ~16 s).
    for fp8, formats, queries in (("fp8e4nv", (3, -6, 448.0), ("bf16", "fp16", "fp32")),
                                  ("fp8e5", (2, -14, 57344.0), ("bf16", "fp16"))):
        constants = dict(zip(("FP8_M", "FP8_EMIN", "FP8_MAX"), formats))
        for query in queries:
            yield from _unit_cases(query, fp8, query == "fp32", constants)
        yield (triton_units._encode_groups,
               {"pool": f"*{fp8}", "codes": "*u8", "scales": "*fp16", "slots": "*i64"},
               {"H": 8, "BLOCK": 16, "D": 128, "D_PAD": 128, "BITS": 2, "HALF": 1.5,
                "TOP": 3.0})
        yield (triton_bounds._encode_bounds,
               {"pool": f"*{fp8}", "bounds": "*u8", "scales": "*fp16", "slots": "*i64"},
               {"H": 8, "BLOCK": 16, "UNIT": 16, "D": 128, "HALF": 64, "HALF_PAD": 64,
                "BITS": 8, "OFF": 128.0})
    yield (triton_units._read_bytes, {"source": "*u8", "offsets": "*i64", "out": "*u8"},
           {"N": 2})
    yield (triton_units._gather_units,
           {"pool": "*i32", "cache": "*i32", "fetch_units": "*i64", "fetch_slots": "*i64",
            "num_fetch": "*i64", "list_len": i32, "programs_per_list": i32},
           {"UNIT": 2048, "CHUNK": 2048, "PER_STEP": 2})
    yield (triton_select._alpha_counts,
           {"token_scores": "*fp32", "block_scores": "*fp32", "context_lens": "*i64",
            "settings": "*fp64", "counts": "*i32", "num_tokens": i32, "num_blocks": i32},
           {"H": 8, "BLOCK": 16, "CHUNK": 1024})
    # The counts given (int keys), or counted from the bound keys' unit scores.
    for counts, unit in (("*i32", 0), ("*fp32", 16)):
        select = {"block_scores": "*fp32", "counts": counts, "context_lens": "*i64",
                  "table": "*i32", "settings": "*fp64", "logical": "*i64", "physical": "*i64",
                  "seq_lens": "*i32", "num_blocks": i32, "table_stride": i32, "width": i32,
                  "sink_blocks": i32, "recent_blocks": i32, "num_units": i32}
        yield (triton_select._select_blocks, select,
               {"H": 8, "H_PAD": 8, "BLOCK": 16, "UNIT": unit, "CHUNK": 1024})
        for radix in (False, True):  # halving; byte histograms (the default)
            yield (triton_select._select_resident, select,
                   {"H": 8, "H_PAD": 8, "BLOCK": 16, "UNIT": unit, "CHUNK": 1024,
                    "BLOCKS_PAD": 16384, "RADIX": radix})
    for bins, rounds in ((64, 12), (0, 64)):  # histograms (the default); halving
        yield (triton_lru._lookup_lru,
               {"ids": "*i64", "slots": "*i64", "slot_of": "*i32", "block_of": "*i64",
                "last_used": "*i64", "ticks": "*i64", "victims": "*i64",
                "fetch_units": "*i64", "fetch_slots": "*i64", "num_fetch": "*i64",
                "counters": "*i64", "seq_lens": "*i32", "context_lens": "*i64",
                "num_rows": i32, "width": i32, "capacity": i32},
               {"H": 8, "CHUNK": 1024, "BINS": bins, "ROUNDS": rounds})


CASES = list(_kernel_cases())


@pytest.mark.parametrize("kernel,types,constants", CASES,
                         ids=[f"{case[0].fn.__name__}-{i}" for i, case in enumerate(CASES)])
def test_each_kernel_compiles_for_sm90(kernel, types, constants):
    names = kernel.arg_names
    assert set(names) == set(types) | set(constants), (kernel.fn.__name__, names)
    signature = {name: types.get(name, "constexpr") for name in names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants), target=SM90)
    assert "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 0


def test_the_fused_merge_orders_its_stores_before_the_arrival_in_sm90_code():
    """The last-split merge's ordering, which the interpreter ignores, in the PTX: every
    thread's split stores, a CTA barrier, the arrival as an acquire-release atomic at GPU
    scope, then the splits read past L1 (``.cg``)."""
    import re

    kernel, types, constants = _attend_case("bf16", "bf16",
                                            {"IEEE": False, "FP8": False, "MERGE": True})
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    ptx = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                         target=SM90).asm["ptx"]
    arrival = re.search(r"atom\.global\.[\w.]*add", ptx)
    assert arrival is not None
    line = ptx[ptx.rfind("\n", 0, arrival.start()):ptx.find("\n", arrival.end())]
    assert "acq_rel" in line and ".gpu" in line, line
    before = ptx[:arrival.start()]
    assert "bar.sync" in before[before.rfind("st.global"):]  # the barrier after the stores
    assert "ld.global.cg" in ptx[arrival.end():]
