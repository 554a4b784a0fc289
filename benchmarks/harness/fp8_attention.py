# SPDX-License-Identifier: Apache-2.0
"""vLLM's CPU FP8 attention where this host's vLLM has none: a double, for the
end-to-end tests (always) and the accuracy benchmarks (on AVX2 hosts).

vLLM 0.32's CPU backend runs FP8 K/V (``--kv-cache-dtype fp8``, ``fp8_e4m3``,
``fp8_e5m2``) only with AVX-512 or AMX (``cpu_attn._get_attn_isa`` refuses
otherwise, and its AVX2 library has no FP8 kernel). This project's machines
are AVX-512 some days and AVX2 on others, so the end-to-end FP8 tests run
vLLM's attention through this double, and so do the accuracy benchmarks on a
host without vLLM's own FP8 kernel (``native()``; their reports say which):

- the KV-cache write rounds K / k_scale and V / v_scale to the FP8 format in
  torch and widens them back times the scales (exact: each FP8 value is a
  float32, bfloat16 and float16 value), then writes them with vLLM's own kernel,
  ``kv_cache_dtype="auto"``, into a shadow of vLLM's byte pages in the model's
  dtype (vLLM's kernels keep their own layout in a page, so the double leaves
  the byte pages alone);
- the attention calls vLLM's own kernel on the shadow pages, ``"auto"``.

It rounds as vLLM's CPU FP8 write does (``toward_zero``: toward zero,
saturating; byte for byte vLLM's AVX-512 kernel's, checked where the host has it,
``tests/unit/test_kernels_fp8.py``), or, with ``rounding="nearest"``, as vLLM's
CUDA build does (to nearest, saturating: the tests of the CUDA platform's data
path inside a CPU-build engine). It is the arithmetic of a kernel that widens
FP8 inside (as InfiniGen's do) on those values, not vLLM's CPU FP8 kernel itself.
The tests use it on every host, AVX-512 ones too, so that they check the same
thing every day: the stock engine and InfiniGen's dense layers both go through
it, and select-all compares InfiniGen's FP8 pool with these FP8 pages; on a host
with vLLM's own FP8 kernel ``tests/e2e/test_fp8.py`` also compares with it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}


def toward_zero(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """float32 ``x`` in ``fmt`` as vLLM's CPU build writes its FP8 pages: rounded
    toward zero, saturating at the format's largest finite value (InfiniGen's CPU
    kernels' ``to_kv``)."""
    largest = torch.finfo(fmt).max
    nearest = x.clamp(-largest, largest).to(fmt)
    bits = nearest.view(torch.uint8).to(torch.int16)
    magnitude = bits & 0x7F
    rounded_up = (nearest.float().abs() > x.abs()) & (magnitude > 0)  # one code too far
    bits = (bits & 0x80) | torch.where(rounded_up, magnitude - 1, magnitude)
    return bits.to(torch.uint8).view(fmt)


ROUNDINGS = ("toward-zero", "nearest")


def _rounded(x: torch.Tensor, scale: float, fmt: torch.dtype, rounding: str) -> torch.Tensor:
    """``x`` as the FP8 pages hold it (x / scale, rounded, saturating), widened
    back times ``scale`` in ``x``'s dtype."""
    scaled = x.float() / scale
    if rounding == "nearest":
        largest = torch.finfo(fmt).max
        codes = scaled.clamp(-largest, largest).to(fmt)
    else:
        codes = toward_zero(scaled, fmt)
    return (codes.float() * scale).to(x.dtype)


def native() -> bool:
    """Whether this host's vLLM runs FP8 K/V itself (its own test of the host)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported())


def described(kv_cache_dtype: str) -> str:
    """What a report says of its FP8 attention: vLLM's own or this double."""
    if kv_cache_dtype not in FORMATS:
        return ""
    if native():
        return f"--kv-cache-dtype {kv_cache_dtype}: vLLM's own CPU FP8 attention"
    return (f"--kv-cache-dtype {kv_cache_dtype}: vLLM's CPU FP8 attention **emulated** "
            "(benchmarks/harness/fp8_attention.py: this host's vLLM has no FP8 kernel, it "
            "needs AVX-512 or AMX), engines in the benchmark's process")


@contextlib.contextmanager
def emulated(rounding: str = "toward-zero"):
    """vLLM's CPU attention with the double's FP8 write and read, restored
    afterwards. Engines in this process only: patches vLLM's module functions.

    Args:
        rounding: ``"toward-zero"``, vLLM's CPU build's; ``"nearest"``, its CUDA build's.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r}: one of {ROUNDINGS}")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    original_isa = cpu_attn._get_attn_isa
    original_write = ops.cpu_attn_reshape_and_cache
    original_attend = ops.cpu_attention_with_kv_cache
    original_metadata = ops.cpu_attn_get_scheduler_metadata

    def get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        if kv_cache_dtype in FORMATS and head_size is not None and head_size % 32:
            return original_isa(dtype, block_size, head_size, kv_cache_dtype)  # its refusal
        return original_isa(dtype, block_size, head_size,
                            "auto" if kv_cache_dtype in FORMATS else kv_cache_dtype)

    # Per byte pages' base tensor (the views differ per call), holding it
    # weakly: a later engine's pages may sit at a freed one's address, or
    # even reuse its id, and must not find its shadow.
    shadows: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor]] = {}

    def shadow(key_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) shadow pages of a layer's byte pages, in ``dtype``."""
        base = key_cache if key_cache._base is None else key_cache._base
        held = shadows.get(id(base))
        if (held is None or held[0]() is not base or held[1].shape != key_cache.shape
                or held[1].dtype != dtype):
            for gone in [key for key, (ref, *_) in shadows.items() if ref() is None]:
                del shadows[gone]  # an engine shut down: its shadows' memory back
            num_blocks, heads, block_size, head_size = key_cache.shape
            full = torch.zeros((num_blocks, heads, 2 * block_size, head_size), dtype=dtype)
            held = shadows[id(base)] = (weakref.ref(base), *full.chunk(2, dim=2))
        return held[1], held[2]

    def write(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0,
              kv_cache_dtype="auto"):
        if kv_cache_dtype not in FORMATS:
            return original_write(key, value, key_cache, value_cache, slot_mapping, isa,
                                  k_scale, v_scale, kv_cache_dtype)
        fmt = FORMATS[kv_cache_dtype]
        return original_write(_rounded(key, k_scale, fmt, rounding),
                              _rounded(value, v_scale, fmt, rounding),
                              *shadow(key_cache, key.dtype), slot_mapping, isa, 1.0, 1.0, "auto")

    def attend(query, key_cache, value_cache, output, *args, k_scale=1.0, v_scale=1.0,
               kv_cache_dtype="auto", **kwargs):
        if kv_cache_dtype in FORMATS:
            key_cache, value_cache = shadow(key_cache, query.dtype)
            kv_cache_dtype, k_scale, v_scale = "auto", 1.0, 1.0
        return original_attend(query, key_cache, value_cache, output, *args, k_scale=k_scale,
                               v_scale=v_scale, kv_cache_dtype=kv_cache_dtype, **kwargs)

    def metadata(*args, kv_cache_dtype="auto", **kwargs):
        return original_metadata(
            *args, kv_cache_dtype="auto" if kv_cache_dtype in FORMATS else kv_cache_dtype,
            **kwargs)

    patches = [(cpu_attn, "_get_attn_isa", get_attn_isa),
               (ops, "cpu_attn_reshape_and_cache", write),
               (ops, "cpu_attention_with_kv_cache", attend),
               (ops, "cpu_attn_get_scheduler_metadata", metadata)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
