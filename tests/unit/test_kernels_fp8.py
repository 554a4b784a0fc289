# SPDX-License-Identifier: Apache-2.0
"""The compiled CPU kernels over an FP8 pool (``--kv-cache-dtype fp8``,
``fp8_e4m3``, ``fp8_e5m2``), against the same kernels or the torch reference
over a float32 pool holding the same values.

An FP8 element widens to float32 exactly, so every op that reads the pool
into floats (the speculation keys' encoders, the int keys' open group) must
give exactly what it gives over the widened pool; the attention outputs agree
within the query dtype's tolerance, as the kernels' own tests allow.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.fp8_attention import toward_zero
from tests.reference.sparse_attention import attend_gathered
from tests.unit.test_kernels import BLOCK, TOLERANCE, Case, _random_positions
from vllm_infinigen import block_layout
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.worker.step_plan import token_budget

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
QUERY_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fp8_case(fp8: torch.dtype, query_dtype: torch.dtype, **kwargs) -> Case:
    """``Case`` whose pool is FP8 (values rounded from the random float32
    pool) and whose query stays in ``query_dtype``."""
    case = Case(dtype=query_dtype, **kwargs)
    case.kv_pool = case.kv_pool.float().to(fp8)
    return case


def every_byte(fp8: torch.dtype) -> torch.Tensor:
    """[256] every finite value of the format, in byte order (NaN bytes as 0)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    return torch.where(values.isfinite(), values, 0.0)


def own_entries(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bfloat16 K and V [B, H_kv, D] of each row's own token, and its slot [B]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(case.context_lens), case.num_kv_heads, case.head_size)
    key = torch.randn(shape, generator=gen).to(torch.bfloat16)
    value = torch.randn(shape, generator=gen).to(torch.bfloat16)
    blocks, offsets = block_layout.block_coordinates(case.context_lens[:, None],
                                                     case.block_table, BLOCK)
    return key, value, (blocks[:, 0].to(torch.int64) * BLOCK + offsets[:, 0]).contiguous()


@pytest.mark.parametrize("fp8", FP8)
def test_every_byte_widens_exactly(fp8):
    """A row attending only its own token returns that token's V: 256 channels
    holding every byte of the format (the vector path and, at head size 260,
    the tail)."""
    for head_size in (256, 260):
        values = torch.cat([every_byte(fp8), every_byte(fp8)[:head_size - 256]])
        pool = torch.zeros((2, 1, BLOCK, 2 * head_size), dtype=fp8)
        pool[1, 0, 0, head_size:] = values.to(fp8)
        query = torch.zeros((1, 1, head_size))
        got = kernels.attend_decode(query, pool, torch.tensor([[1]], dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int64), None, scale=1.0)
        assert torch.equal(got[0, 0], values), head_size


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("capped", [False, True])
def test_write_rounds_to_the_pool_format(fp8, query_dtype, capped):
    """The model's K/V rounded toward zero, as vLLM's CPU build writes its FP8
    pages, saturating at the format's largest finite value (values past it in
    the first key)."""
    case = fp8_case(fp8, query_dtype, seed=1, num_kv_heads=2, group=2, head_size=32,
                    context_lens=[70, 5], evict_fraction=0.3 if capped else 0.0)
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 5, 33, -1, 64 + 7, 31], dtype=torch.int64) + BLOCK * 2
    slots[3] = -1
    key = (torch.randn((6, 2, 32), generator=gen) * 4).to(query_dtype)
    value = torch.randn((6, 2, 32), generator=gen).to(query_dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 6e4, -7e4]).to(query_dtype)  # past e4m3's 448
    pool = case.kv_pool.clone()
    kernels.write_pool(pool, key, value, slots, case.row_map)
    want = case.kv_pool.clone()
    largest = torch.finfo(fp8).max
    new = toward_zero(torch.cat([key, value], dim=-1).float(), fp8)
    assert new.float().isfinite().all() and (new.float().abs() == largest).sum() >= 2
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK)
        for head in range(2):
            if (where := case.pool_row(block, head, offset)) is not None:
                want[where[0], head, where[1]] = new[t, head]
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))


def _magnitudes(count: int, seed: int) -> torch.Tensor:
    """[count] float32 of either sign over 2^-24 .. 2^20: every FP8 subnormal,
    normal and saturated range, and values on and between the formats' grids."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.exp2(torch.empty(count).uniform_(-24, 20, generator=gen))
    values[: count // 4] = torch.randint(-255, 256, (count // 4,), generator=gen) / 64
    return values * torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("fp8", FP8)
def test_toward_zero_is_the_largest_code_not_past_the_value(fp8):
    """The reference rounding itself, against every code of the format: each value's
    code is the one of largest magnitude not past it (its sign kept), or the
    format's largest."""
    x = _magnitudes(4096, seed=5)
    got = toward_zero(x, fp8).float()
    codes = torch.arange(128, dtype=torch.uint8).view(fp8).float()  # non-negative, ascending
    codes = codes[codes <= torch.finfo(fp8).max]  # (not NaN, nor e5m2's infinity)
    below = (codes[None, :] <= x.abs()[:, None]).sum(dim=1) - 1
    assert torch.equal(got.abs(), codes[below])
    assert torch.equal(torch.signbit(got) | (got == 0), torch.signbit(x) | (got == 0))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
def test_write_rounds_every_range_toward_zero(fp8, query_dtype):
    """Subnormal, normal and saturated values of either sign, with scales."""
    x = _magnitudes(64 * 32, seed=6).to(query_dtype).view(64, 1, 32)
    for scale in (1.0, 0.37, 2.5):
        pool = torch.zeros((1, 1, 64, 64), dtype=fp8)
        kernels.write_pool(pool, x, x, torch.arange(64), key_scale=scale, value_scale=scale)
        inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
        want = toward_zero(x.float() * inverse, fp8)
        assert torch.equal(pool[0, 0, :, :32].float(), want[:, 0].float()), scale
        assert torch.equal(pool[0, 0, :, 32:].float(), want[:, 0].float()), scale


def _vllm_page_bytes(x: torch.Tensor, fmt: str, scale: float, head_size: int) -> torch.Tensor:
    """[T, D] the FP8 codes vLLM's CPU cache write stores for ``x`` [T, 1, D], read
    back through its page layout (located with values each channel alone holds)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from benchmarks.harness.fp8_attention import FORMATS

    fp8, block_size = FORMATS[fmt], 128
    isa = _get_attn_isa(x.dtype, block_size, head_size, fmt)
    page = torch.zeros((1, 1, 2 * block_size, head_size), dtype=torch.uint8)
    keys, values = page.chunk(2, dim=2)
    marks = torch.tensor([sign * mantissa * 2.0 ** exponent for sign in (1, -1)
                          for exponent in range(-6, 9) for mantissa in (1, 1.25, 1.5, 1.75)])
    marks = marks[:head_size]  # distinct, and exact in both formats and every dtype
    codes = torch.empty((x.shape[0], head_size), dtype=fp8)
    for token in range(x.shape[0]):
        page.zero_()
        slot = torch.tensor([token % block_size])
        ops.cpu_attn_reshape_and_cache(marks.to(x.dtype).view(1, 1, -1), x[token:token + 1],
                                       keys, values, slot, isa, 1.0, 1.0, fmt)
        where = [int((keys.reshape(-1).view(fp8).float() == mark).nonzero())
                 for mark in marks.tolist()]
        page.zero_()
        ops.cpu_attn_reshape_and_cache(x[token:token + 1], x[token:token + 1], keys, values,
                                       slot, isa, scale, scale, fmt)
        codes[token] = keys.reshape(-1).view(fp8)[torch.tensor(where)]
    return codes


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
def test_write_holds_what_vllm_writes_in_its_fp8_pages(fmt, query_dtype):
    """Our pool's FP8 values are vLLM's CPU pages' for the same K, scales and
    dtype (vLLM's AVX-512 / AMX kernel; its AVX2 build has none)."""
    from benchmarks.harness import fp8_attention

    if not fp8_attention.native():
        pytest.skip("this host's vLLM has no CPU FP8 kernel (it needs AVX-512 or AMX): "
                    "the pool's rounding is checked against toward_zero only")
    fp8, head_size = fp8_attention.FORMATS[fmt], 64
    x = _magnitudes(48 * head_size, seed=7).to(query_dtype).view(48, 1, head_size)
    for scale in (1.0, 0.37, 2.5):
        pool = torch.zeros((1, 1, 64, 2 * head_size), dtype=fp8)
        kernels.write_pool(pool, x, x, torch.arange(48), key_scale=scale, value_scale=scale)
        vllm_codes = _vllm_page_bytes(x, fmt, scale, head_size)
        # (values: vLLM writes a float16 -0.0 as +0)
        assert torch.equal(pool[0, 0, :48, :head_size].float(), vllm_codes.float()), scale


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_size"), [(4, 1, 32), (2, 4, 64),
                                                                  (1, 12, 36)])
def test_attend_selected_over_fp8(fp8, query_dtype, num_kv_heads, group, head_size):
    case = fp8_case(fp8, query_dtype, seed=8, num_kv_heads=num_kv_heads, group=group,
                    head_size=head_size, context_lens=[130, 3, 64, 257])
    positions = _random_positions(case, 0.3, seed=9)
    probs = torch.zeros(positions.shape)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                positions, scale=case.scale, probs=probs)
    keys, values = case.entries(positions.to(torch.int64))
    want, want_probs = attend_gathered(
        case.query.float(), keys.float(), values.float(), positions >= 0,
        *[t.float() for t in case.current()], case.scale, return_probs=True)
    assert got.dtype == query_dtype
    atol, rtol = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(probs, want_probs.masked_fill(positions < 0, 0.0), atol=1e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("capped", [False, True])
def test_attend_dense_over_fp8_equals_the_widened_pool(fp8, capped):
    """Float32 queries: the FP8 pool gives what its float32 widening gives."""
    case = fp8_case(fp8, torch.float32, seed=10, num_kv_heads=2, group=2, head_size=64,
                    context_lens=[1, 45, 200], evict_fraction=0.4 if capped else 0.0)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                None, scale=case.scale, row_map=case.row_map)
    widened = kernels.attend_decode(case.query, case.kv_pool.float(), case.block_table,
                                    case.context_lens, None, scale=case.scale,
                                    row_map=case.row_map)
    torch.testing.assert_close(got, widened, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capped", [False, True])
def test_prefill_over_fp8_equals_the_widened_pool(fp8, query_dtype, capped):
    seq_lens, new_rows = [50, 170], [50, 40]
    case = fp8_case(fp8, query_dtype, seed=14, num_kv_heads=2, group=2, head_size=64,
                    context_lens=[n - 1 for n in seq_lens], evict_fraction=0.3 if capped else 0.0)
    if case.row_map is not None:  # this step's rows were just written: held
        case.hold_step_rows(seq_lens, new_rows)
    gen = torch.Generator().manual_seed(15)
    query = torch.randn((sum(new_rows), 4, 64), generator=gen).to(query_dtype)
    args = (case.block_table, torch.tensor([0, 50, 90], dtype=torch.int64),
            torch.tensor(seq_lens), torch.tensor([0, 1], dtype=torch.int64))
    got, want = torch.zeros_like(query), torch.zeros_like(query)
    kernels.attend_prefill(query, got, case.kv_pool, *args, scale=case.scale,
                           row_map=case.row_map)
    # The widened pool in the query's dtype holds the same values (FP8 fits in each).
    kernels.attend_prefill(query, want, case.kv_pool.to(query_dtype), *args, scale=case.scale,
                           row_map=case.row_map)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("keys", ["bounds", "int"])
def test_speculation_keys_from_fp8_equal_those_from_the_widened_pool(fp8, keys):
    """The bounds and the int keys are encoded from the pool's values: the same
    codes and scales as from a float32 pool of those values, and the int keys'
    selection (its open group read from the pool) the same positions."""
    case = fp8_case(fp8, torch.float32, seed=3, num_kv_heads=2, group=2, head_size=64,
                    context_lens=[100, 37, 250])
    widened = case.kv_pool.float()
    slots = torch.arange(case.num_blocks * BLOCK, dtype=torch.int64)  # every unit closes
    if keys == "bounds":
        units = BLOCK // 16
        make = lambda: (torch.zeros((case.num_blocks, 2, units, 2, 64), dtype=torch.uint8),
                        torch.zeros((case.num_blocks, 2, units), dtype=torch.float16))
        write = kernels.write_bounds
    else:
        make = lambda: (torch.zeros((case.num_blocks, 2, BLOCK // 16, 64, 8), dtype=torch.uint8),
                        torch.zeros((case.num_blocks, 2, BLOCK // 16, 64), dtype=torch.float16))
        write = kernels.write_int_keys
    got, want = make(), make()
    write(*got, case.kv_pool, slots)
    write(*want, widened, slots)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].any()
    if keys == "int":
        query = torch.randn((3, 2, 2, 64), generator=torch.Generator().manual_seed(4))
        caps = token_budget(case.context_lens, 0.2)
        select = lambda pool: kernels.select_tokens_int(
            query, *got, pool, case.block_table, case.context_lens, caps, scale=case.scale,
            alpha=4.0)
        for a, b in zip(select(case.kv_pool), select(widened)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", FP8)
def test_decode_short_over_fp8(fp8):
    """The short path's one op: the write rounded to the pool, then dense attention."""
    case = fp8_case(fp8, torch.bfloat16, seed=20, num_kv_heads=2, group=2, head_size=64,
                    context_lens=[20, 50])
    key, value, slots = own_entries(case, seed=21)
    pool = case.kv_pool.clone()
    got = kernels.decode_short(case.query, key, value, pool, slots, case.block_table,
                               case.context_lens, scale=case.scale)
    want_pool = case.kv_pool.clone()
    kernels.write_pool(want_pool, key, value, slots)
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))
    want = kernels.attend_decode(case.query, want_pool, case.block_table, case.context_lens,
                                 None, scale=case.scale)
    assert torch.equal(got, want)


def test_a_wide_pool_and_another_query_dtype_are_refused():
    pool = torch.zeros((1, 1, BLOCK, 64), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one dtype, or an FP8 pool"):
        kernels.attend_decode(torch.zeros(1, 1, 32), pool, torch.zeros(1, 1, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int64), None, scale=1.0)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        kernels.write_pool(pool, torch.zeros(1, 1, 32), torch.zeros(1, 1, 32),
                           torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("fp8", FP8)
def test_kv_scales_divide_the_write_and_multiply_the_attention_back(fp8):
    """vLLM's k_scale / v_scale: the pool holds K / k_scale and V / v_scale,
    and every attention op reads K and V as the pool's values times them."""
    k_scale, v_scale = 2.5, 0.375
    case = fp8_case(fp8, torch.bfloat16, seed=30, num_kv_heads=2, group=2, head_size=64,
                    context_lens=[20, 70])
    key, value, slots = own_entries(case, seed=31)
    gen = torch.Generator().manual_seed(32)
    scales = {"key_scale": k_scale, "value_scale": v_scale}
    pool = case.kv_pool.clone()
    kernels.write_pool(pool, key, value, slots, **scales)
    unscaled = case.kv_pool.clone()
    kernels.write_pool(unscaled, (key.float() / k_scale).to(torch.bfloat16),
                       (value.float() / v_scale).to(torch.bfloat16), slots)
    # The division in float32 before the rounding: at most one FP8 step apart.
    assert (pool.float() - unscaled.float()).abs().max() <= (unscaled.float().abs() / 4).max()
    # What the scaled attention must equal: the float32 pool of K * k_scale, V * v_scale.
    rescaled = pool.float()
    rescaled[..., :64] *= k_scale
    rescaled[..., 64:] *= v_scale
    query = case.query.float()
    got = kernels.attend_decode(query, pool, case.block_table, case.context_lens, None,
                                scale=case.scale, **scales)
    want = kernels.attend_decode(query, rescaled, case.block_table, case.context_lens, None,
                                 scale=case.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    short_pool = case.kv_pool.clone()
    short = kernels.decode_short(query, key.float(), value.float(), short_pool, slots,
                                 case.block_table, case.context_lens, scale=case.scale, **scales)
    assert torch.equal(short_pool.view(torch.uint8), pool.view(torch.uint8))
    torch.testing.assert_close(short, want, atol=1e-5, rtol=1e-5)
    prompt = torch.randn((20, 4, 64), generator=gen)
    args = (case.block_table, torch.tensor([0, 20], dtype=torch.int64),
            torch.tensor([21], dtype=torch.int64), torch.tensor([0], dtype=torch.int64))
    got_prompt, want_prompt = torch.zeros_like(prompt), torch.zeros_like(prompt)
    kernels.attend_prefill(prompt, got_prompt, pool, *args, scale=case.scale, **scales)
    kernels.attend_prefill(prompt, want_prompt, rescaled, *args, scale=case.scale)
    torch.testing.assert_close(got_prompt, want_prompt, atol=1e-5, rtol=1e-5)
