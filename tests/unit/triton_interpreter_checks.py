# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels of the CUDA platform against their torch references, on CPU tensors:
the data movement and attention (``kernels/triton_units.py``), the int keys' scoring
(``triton_scoring.py``), the bound keys (``triton_bounds.py``) and the device-only
selection and cache placement (``triton_select.py``).

Runs only in a process started with TRITON_INTERPRET=1 (Triton decides when it is
first imported whether ``@triton.jit`` compiles or interprets), so pytest does
not collect this file by name: ``test_cuda_kernels.py`` starts such a process on
it. The kernels see the same arguments as on a GPU.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.reference.cuda_kernel_cases import attention_case as _attention_case
from tests.reference.cuda_kernel_cases import fetch_case as _fetch_case
from tests.reference.cuda_kernel_cases import unit_score_case
from tests.reference.int_key_pools import BLOCK as POOL_BLOCK
from tests.reference.int_key_pools import Pool
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import block_rule, reference

# The int scoring's forms (method, the dot's precision), and the torch form's operands
# that each matches: float16 for the default's (its product rounds keys and query).
FORMS = [("dot", "fp16"), ("sums", None), ("dot", "tf32x3")]
OPERANDS = {None: None, "tf32x3": None, "fp16": torch.float16}

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 from the start of the process "
                       "(tests/unit/test_cuda_kernels.py does)")


@pytest.fixture(scope="module")
def triton_units():
    from vllm_infinigen.platforms.cuda.kernels import triton_units

    return triton_units


@pytest.fixture(scope="module")
def triton_attend():
    from vllm_infinigen.platforms.cuda.kernels import triton_attend

    return triton_attend


@pytest.fixture(scope="module")
def triton_prompt():
    from vllm_infinigen.platforms.cuda.kernels import triton_prompt

    return triton_prompt


@pytest.fixture(scope="module")
def triton_scoring():
    from vllm_infinigen.platforms.cuda.kernels import triton_scoring

    return triton_scoring


@pytest.fixture(scope="module")
def triton_select():
    from vllm_infinigen.platforms.cuda.kernels import triton_select

    return triton_select


@pytest.fixture(scope="module")
def triton_lru():
    from vllm_infinigen.platforms.cuda.kernels import triton_lru

    return triton_lru


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctas", [1, 3])
def test_gather_equals_the_reference(triton_units, dtype, ctas):
    pool, cache, units, slots, count = _fetch_case(dtype)
    expected = cache.clone()
    reference.gather_units_reference(pool, expected, units, slots, count)
    words, chunk = kernels.unit_words(4, 8, dtype)
    triton_units.gather_units(pool.view(torch.int32), cache.view(torch.int32), units, slots,
                              count, num_ctas=ctas, unit_words=words, chunk_words=chunk,
                              per_step=2)
    assert torch.equal(cache[:-1], expected[:-1])  # the reference's scratch: the last unit


def test_gather_copies_units_in_chunks(triton_units):
    """A unit of 40 words copied 8 at a time (``unit_words``' chunk for D = 10)."""
    pool, cache, units, slots, count = _fetch_case(torch.bfloat16, head_size=10)
    expected = cache.clone()
    reference.gather_units_reference(pool, expected, units, slots, count)
    words, chunk = kernels.unit_words(4, 10, torch.bfloat16)
    assert (words, chunk) == (40, 8)
    triton_units.gather_units(pool.view(torch.int32), cache.view(torch.int32), units, slots,
                              count, num_ctas=2, unit_words=words, chunk_words=chunk,
                              per_step=2)
    assert torch.equal(cache[:-1], expected[:-1])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("group,head_size", [(3, 8), (4, 16), (2, 12)])
def test_attention_equals_the_reference(triton_attend, splits, group, head_size, fused):
    """The splits merged by the last of each sequence's programs (fused), or by a
    second launch."""
    query, units, table, seq_lens = _attention_case(group, head_size)
    per_split = -(-table.shape[1] // splits)
    partial = torch.full((3, splits, group, head_size), float("nan"))  # a merge too early
    maxima = torch.full((3, splits, group), float("nan"))  # would read these
    sums = torch.full((3, splits, group), float("nan"))
    got = torch.empty_like(query)
    triton_attend.attend_units(query, units, table, seq_lens, got, partial, maxima, sums,
                               num_kv_heads=1, scale=0.3, blocks_per_split=per_split,
                               fused_merge=fused)
    expected = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=1,
                                                scale=0.3)
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_fused_merge_leaves_its_counters_at_zero(triton_attend):
    """Launch after launch (other split counts, other sequences), each sequence's last
    program merges and sets its arrival counter back: the counters are zero between
    launches, and a counter left wrong would merge early (or never) in the next."""
    query, units, table, seq_lens = _attention_case(3, 8)
    expected = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=1,
                                                scale=0.3)
    for splits in (3, 2, 4, 3):
        per_split = -(-table.shape[1] // splits)
        got = torch.full_like(query, 9.0)
        nan = float("nan")
        triton_attend.attend_units(query, units, table, seq_lens, got,
                                   torch.full((3, splits, 3, 8), nan),
                                   torch.full((3, splits, 3), nan),
                                   torch.full((3, splits, 3), nan), num_kv_heads=1, scale=0.3,
                                   blocks_per_split=per_split, fused_merge=True)
        assert torch.allclose(got, expected, atol=1e-5)
        counters = triton_attend.arrivals(query.device, 3)
        assert counters.numel() >= 3 and not counters.any()


def test_attention_reads_bfloat16_units(triton_attend):
    query, units, table, seq_lens = _attention_case()
    units = units.to(torch.bfloat16)
    partial = torch.empty(3, 2, 3, 8)
    maxima, sums = torch.empty(3, 2, 3), torch.empty(3, 2, 3)
    got = torch.empty_like(query)
    triton_attend.attend_units(query, units, table, seq_lens, got, partial, maxima, sums,
                               num_kv_heads=1, scale=0.3, blocks_per_split=2)
    expected = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=1,
                                                scale=0.3)
    assert torch.allclose(got, expected, atol=1e-5)


def _write_case(dtype: torch.dtype):
    """Tokens of two requests in shuffled blocks (32 tokens each, head_size 24: a
    padded D), one padding row; the second call closes groups opened by the first."""
    gen = torch.Generator().manual_seed(11)
    heads, head_size, block = 2, 24, 32
    pool = torch.zeros(6, heads, block, 2 * head_size, dtype=dtype)
    key = torch.randn(50, heads, head_size, generator=gen)
    key[:16, 0] = torch.randint(-7, 8, (16, head_size), generator=gen).float()
    key[:16, 0, 0] = 7.5  # scale 1: integer keys round at x.5, to the even code
    slots = torch.cat([torch.arange(4 * block, 4 * block + 40), torch.arange(block, block + 9),
                       torch.tensor([-1])])
    return pool, key.to(dtype), torch.randn(50, heads, head_size, generator=gen).to(dtype), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_tokens_equals_the_reference_write_through(triton_units, dtype):
    pool, key, value, slots = _write_case(dtype)
    expected = pool.clone()
    reference.write_pool(expected, key, value, slots)
    triton_units.write_tokens(pool, None, None, key, value, slots, capacity=0)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 4), (torch.bfloat16, 2),
                                        (torch.float32, 1)])
def test_encode_groups_equals_the_reference_byte_for_byte(triton_units, dtype, bits):
    """Over two calls (a group opened in the first closes in the second), with
    round-half-to-even ties: the codes and scales of reference.write_int_keys (itself
    held to the CPU kernel, test_cuda_writes.py)."""
    pool, key, value, slots = _write_case(dtype)
    groups, head_size = pool.shape[2] // 16, key.shape[-1]
    got = (torch.zeros(6, 2, groups, head_size, 2 * bits, dtype=torch.uint8),
           torch.zeros(6, 2, groups, head_size, dtype=torch.float16))
    expected = (got[0].clone(), got[1].clone())
    for part in (slice(0, 20), slice(20, 50)):
        reference.write_pool(pool, key[part], value[part], slots[part])
        reference.write_int_keys(*expected, pool, slots[part])
        triton_units.encode_groups(pool, *got, slots[part])
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0], expected[0])
    assert (expected[1] != 0).sum() > 0


@pytest.mark.parametrize("bits,dtype,head_size", [(4, torch.float32, 32),
                                                  (2, torch.bfloat16, 24)])
@pytest.mark.parametrize("method,precision,tile", [
    ("sums", None, 16), ("sums", None, 64), ("sums", None, 256), ("dot", "tf32x3", 32),
    ("dot", "fp16", 32), ("dot", "fp16", 64)])
def test_int_token_scores_equal_the_torch_form(triton_units, bits, dtype, head_size, method,
                                               precision, tile):
    """The int keys read in place: the torch form's scores (it dequantizes every
    block; its operands rounded as the form's: float16 for the default), open
    groups -inf, 3 query heads per KV head, a padded head size."""
    from tests.reference.int_key_pools import Pool

    pool = Pool(seed=7, bits=bits, dtype=dtype, num_kv_heads=2, head_size=head_size,
                context_lens=[95, 16, 7, 64])
    query = torch.randn(4, 2, 3, head_size, generator=torch.Generator().manual_seed(8))
    expected = block_rule.int_token_scores(query, pool.codes, pool.scales,
                                           pool.block_table, pool.context_lens, scale=0.25,
                                           operands=OPERANDS[precision])
    got = torch.empty_like(expected)
    table = pool.block_table if tile == 16 else pool.block_table.long()  # either index dtype
    from vllm_infinigen.platforms.cuda.kernels import triton_scoring

    triton_scoring.int_scores(query, pool.codes, pool.scales, table, pool.context_lens, got, None,
                              scale=0.25, tile=tile, method=method,
                              precision=precision or "tf32x3")
    assert torch.equal(got == float("-inf"), expected == float("-inf"))
    finite = expected > float("-inf")
    assert finite.sum() > 0
    assert torch.allclose(got[finite], expected[finite], atol=1e-5, rtol=1e-5)


# -- the device-only step's kernels (triton_select.py and the step's data movement)


@pytest.mark.parametrize("bits,dtype,head_size", [(4, torch.float32, 32),
                                                  (2, torch.bfloat16, 24), (1, torch.float32, 16)])
@pytest.mark.parametrize("method,precision", FORMS)
def test_int_scores_and_block_maxima_equal_the_torch_form(triton_scoring, bits, dtype, head_size,
                                                          method, precision):
    """Token scores and each block's best, a padding row (context -1) all -inf,
    the query a strided view (a row of a wider tensor)."""
    pool = Pool(seed=7, bits=bits, dtype=dtype, num_kv_heads=2, head_size=head_size,
                context_lens=[95, 16, 7, 64])
    context_lens = pool.context_lens.clone()
    context_lens[2] = -1
    wide = torch.randn(4, 2 * 3 * head_size + 5, generator=torch.Generator().manual_seed(8))
    query = wide[:, : 2 * 3 * head_size].view(4, 2, 3, head_size)
    tokens = block_rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                         context_lens, scale=0.25,
                                         operands=OPERANDS[precision])
    blocks = block_rule.block_scores(tokens, context_lens, POOL_BLOCK)
    got_tokens, got_blocks = torch.empty_like(tokens), torch.empty_like(blocks)
    triton_scoring.int_scores(query, pool.codes, pool.scales, pool.block_table, context_lens,
                              got_tokens, got_blocks, scale=0.25, method=method,
                              precision=precision or "tf32x3")
    for got, expected in ((got_tokens, tokens), (got_blocks, blocks)):
        assert torch.equal(got == float("-inf"), expected == float("-inf"))
        finite = expected > float("-inf")
        assert finite.sum() > 0
        assert torch.allclose(got[finite], expected[finite], atol=1e-5, rtol=1e-5)
    assert (got_tokens[2] == float("-inf")).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_each_form_rounds_what_its_torch_form_rounds(triton_scoring, bits):
    """Scales that float16 keys cannot hold exactly (random halves, not the test pools'
    powers of two): the float16 dot equals the torch form with float16 operands,
    the float32 forms the exact one, and the two differ."""
    from benchmarks.gpu.kernel_candidates import _int_case

    gen = torch.Generator().manual_seed(11)
    query, codes, scales, table, lens = _int_case(torch, "cpu", rows=2, context=75, heads=2,
                                                  group=3, head_size=32, bits=bits, gen=gen)
    references = {operands: block_rule.int_token_scores(
        query, codes, scales, table, lens, scale=0.25, compute_dtype=torch.float64,
        operands=operands) for operands in (torch.float16, None)}
    finite = references[None] > float("-inf")
    assert not torch.allclose(references[torch.float16][finite], references[None][finite],
                              rtol=1e-5, atol=1e-5)
    for method, precision in FORMS:
        got = torch.empty(references[None].shape)
        triton_scoring.int_scores(query, codes, scales, table, lens, got, None, scale=0.25,
                                  method=method, precision=precision or "tf32x3")
        expected = references[OPERANDS[precision]]
        assert torch.equal(got == float("-inf"), expected == float("-inf")), method
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5,
                                   atol=1e-5, msg=f"{method} {precision}")


@pytest.mark.parametrize("method,precision", FORMS)
def test_token_scores_are_written_only_while_alpha_is_on(triton_select, triton_scoring, method,
                                                         precision):
    """Gated by the settings (the data path's call): alpha off writes no token score
    (alpha_counts reads none then) and the same block scores; alpha on writes them."""
    pool = Pool(seed=7, bits=2, dtype=torch.bfloat16, num_kv_heads=2, head_size=24,
                context_lens=[95, 16, 7, 64])
    query = torch.randn(4, 2, 3, 24, generator=torch.Generator().manual_seed(8))
    tokens = block_rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                         pool.context_lens, scale=0.25,
                                         operands=OPERANDS[precision])
    blocks = block_rule.block_scores(tokens, pool.context_lens, POOL_BLOCK)
    for alpha, written in ((float("inf"), False), (5.0, True)):
        settings = kernels.settings_tensor(alpha, 0.2, 0, "cpu")
        got_tokens, got_blocks = torch.full_like(tokens, 7.0), torch.empty_like(blocks)
        triton_scoring.int_scores(query, pool.codes, pool.scales, pool.block_table,
                                  pool.context_lens, got_tokens, got_blocks, scale=0.25,
                                  settings=settings, method=method,
                                  precision=precision or "tf32x3")
        torch.testing.assert_close(got_blocks, blocks, atol=1e-5, rtol=1e-5)
        if written:
            torch.testing.assert_close(got_tokens, tokens, atol=1e-5, rtol=1e-5)
        else:
            assert (got_tokens == 7.0).all()
        counts = torch.empty(8, dtype=torch.int32)
        triton_select.alpha_counts(got_tokens, got_blocks, pool.context_lens, settings, counts,
                                   block_size=POOL_BLOCK)
        expected = kernels.alpha_counts(tokens, blocks, pool.context_lens, settings,
                                        block_size=POOL_BLOCK)
        assert torch.equal(counts, expected)


@pytest.mark.parametrize("bits,dtype,head_size", [(4, torch.float32, 32),
                                                  (2, torch.bfloat16, 24)])
def test_the_replaced_int_scoring_kept_for_the_benchmark_equals_the_new_one(
        triton_scoring, bits, dtype, head_size):
    """``benchmarks/gpu/baseline_kernels.py`` (the per-token kernel a GPU run measures
    the new one against) computes the same scores; its benchmark rows run."""
    from benchmarks.gpu import baseline_kernels, kernel_limits

    pool = Pool(seed=7, bits=bits, dtype=dtype, num_kv_heads=2, head_size=head_size,
                context_lens=[95, 16, 7, 64])
    query = torch.randn(4, 2, 3, head_size, generator=torch.Generator().manual_seed(8))
    num_blocks = pool.block_table.shape[1]
    results = []
    exact = functools.partial(triton_scoring.int_scores, method="sums")
    for launch in (exact, baseline_kernels.int_scores_per_token):
        tokens = torch.empty(4, 2, num_blocks * POOL_BLOCK)
        blocks = torch.empty(4, 2, num_blocks)
        launch(query, pool.codes, pool.scales, pool.block_table, pool.context_lens, tokens,
               blocks, scale=0.25)
        results.append((tokens, blocks))
    for new, old in zip(*results):
        assert torch.equal(new == float("-inf"), old == float("-inf"))
        torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    rows = kernel_limits._int_scores_rows(pool.codes, pool.scales, query[:1], 64, POOL_BLOCK,
                                          0.25, torch.Generator().manual_seed(1))
    assert [row["kernel"] for row in rows] == [
        "int_scores x1, per token (the kernel before)", "int_scores x8",
        "int_scores x8, per token (the kernel before)"]
    assert all(row["ms"] > 0 for row in rows)


def test_alpha_counts_equal_the_reference(triton_select):
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.tensor([95, 16, -1, 40])
    tokens = (torch.randn(4, 2, 6 * 32, generator=gen) * 3).round()  # ties at best - alpha
    encoded = context_lens.clamp(min=0) // 16 * 16
    tokens = tokens.masked_fill(torch.arange(6 * 32)[None, None] >= encoded[:, None, None],
                                float("-inf"))
    blocks = block_rule.block_scores(tokens, context_lens, 32)
    # 2.0: some scores sit exactly at best - alpha, not above; inf: the default (alpha
    # off), every encoded token counts
    for alpha in (0.5, 2.0, float("inf")):
        settings = kernels.settings_tensor(alpha, 0.2, 0, "cpu")
        expected = kernels.alpha_counts(tokens, blocks, context_lens, settings, block_size=32)
        got = torch.empty_like(expected)
        triton_select.alpha_counts(tokens, blocks, context_lens, settings, got, block_size=32,
                                   chunk=64)
        assert torch.equal(got, expected)
    assert got.view(4, 2)[:, 0].tolist() == encoded.tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,min_context,sink,recent,cap", [
    (0.2, 0, 1, 1, None), (0.05, 30, 2, 1, None), (0.5, 0, 1, 3, None), (1.0, 0, 1, 1, None),
    (0.5, 0, 1, 1, 20)])
@pytest.mark.parametrize("resident,radix", [(0, False), (64, False), (64, True)])
def test_select_equals_the_reference(triton_select, seed, budget, min_context, sink, recent, cap,
                                     resident, radix):
    """Random scores with ties (rounded), -inf blocks, a padding row, rows below
    min_context, a chunk smaller than the row (the threshold search crosses chunks), or
    the row's keys held at once (resident: 64 >= the 40 blocks, padded), searched by
    halving or by bytes (radix)."""
    gen = torch.Generator().manual_seed(seed)
    block, table_blocks, heads = 4, 40, 3
    context_lens = torch.tensor([159, 100, 3, -1, 29, 64])
    scores = (torch.randn(6, heads, table_blocks, generator=gen) * 4).round()
    scores[1, 0, 5:9] = float("-inf")
    table = torch.stack([torch.randperm(300, generator=gen)[:table_blocks] for _ in range(6)])
    counts = torch.randint(0, 80, (6 * heads,), generator=gen, dtype=torch.int32)
    settings = kernels.settings_tensor(5.0, budget, min_context, "cpu", cap)
    width = kernels.static_width(table_blocks, block, budget=budget,
                                 min_context=min_context, sink_blocks=sink,
                                 recent_blocks=recent, budget_tokens=cap)
    expected = block_rule.select_reference(scores, counts, context_lens, table.int(), settings,
                                           block_size=block, width=width, sink_blocks=sink,
                                           recent_blocks=recent)
    got = (torch.empty_like(expected[0]), torch.empty_like(expected[1]),
           torch.empty_like(expected[2]))
    triton_select.select_blocks(scores, counts, context_lens, table.int(), settings, *got,
                                block_size=block, sink_blocks=sink, recent_blocks=recent,
                                chunk=16, resident=resident, radix=radix)
    for got_part, expected_part in zip(got, expected):
        assert torch.equal(got_part, expected_part)


@pytest.mark.parametrize("resident", [0, 64])
@pytest.mark.parametrize("alpha", [0.5, 2.0, float("inf")])
def test_select_counts_the_bound_units_itself(triton_select, alpha, resident):
    """``select_blocks`` given the bound keys' unit scores (``unit``) selects as the
    reference given their alpha counts (``unit_alpha_counts``): units exactly at best -
    alpha (not above), rows short of a unit, a padding row, chunks shorter than a row;
    alpha off (the default) every complete unit counts, and no score is read (finite
    scores planted past the complete units, which would count, change nothing)."""
    block, unit, table_blocks = 16, 8, 12
    context_lens = torch.tensor([150, 7, 64, -1, 180])
    units, block_scores, table, past = unit_score_case(context_lens.tolist(), unit=unit,
                                                       table_blocks=table_blocks, ids=80)
    settings = kernels.settings_tensor(alpha, 1.0, 0, "cpu")
    width = kernels.static_width(table_blocks, block, budget=1.0, min_context=0,
                                 sink_blocks=0, recent_blocks=0)
    counts = block_rule.unit_alpha_counts(units, settings[0], unit)
    expected = block_rule.select_reference(block_scores, counts, context_lens, table,
                                           settings, block_size=block, width=width,
                                           sink_blocks=0, recent_blocks=0)
    if alpha == float("inf"):
        units = units.masked_fill(past, 0.0)  # read, they would count
    got = tuple(torch.empty_like(part) for part in expected)
    triton_select.select_blocks(block_scores, units, context_lens, table, settings, *got,
                                block_size=block, sink_blocks=0, recent_blocks=0, unit=unit,
                                chunk=16, resident=resident)
    for got_part, expected_part in zip(got, expected):
        assert torch.equal(got_part, expected_part)
    assert len(set(counts.tolist())) >= 3  # the counts differ, and decide the sizes


@pytest.mark.parametrize("spread", ["low byte", "any bits"])
@pytest.mark.parametrize("radix", [False, True])
def test_select_separates_scores_that_differ_in_any_byte(triton_select, spread, radix):
    """Scores one float32 step apart (keys differing in their lowest byte only, with
    ties) or of random bits of both signs: the resident search, by halving or by bytes,
    picks the reference's blocks."""
    gen = torch.Generator().manual_seed(5)
    block, table_blocks, heads, rows = 4, 200, 2, 3
    if spread == "low byte":
        steps = torch.randint(0, 60, (rows, heads, table_blocks), generator=gen)
        scores = (1.5 + steps.double() * 2.0**-23).float()
    else:
        bits = torch.randint(-2**31, 2**31 - 1, (rows, heads, table_blocks), generator=gen)
        scores = bits.to(torch.int32).view(torch.float32)
        scores = torch.where(scores.isnan() | scores.isinf(), 0.25, scores)
    context_lens = torch.tensor([799, 512, 77])
    table = torch.stack([torch.randperm(900, generator=gen)[:table_blocks] for _ in range(rows)])
    counts = torch.full((rows * heads,), 150, dtype=torch.int32)
    settings = kernels.settings_tensor(5.0, 0.2, 0, "cpu")
    width = kernels.static_width(table_blocks, block, budget=0.2, min_context=0,
                                 sink_blocks=1, recent_blocks=1)
    expected = block_rule.select_reference(scores, counts, context_lens, table.int(), settings,
                                           block_size=block, width=width, sink_blocks=1,
                                           recent_blocks=1)
    got = tuple(torch.empty_like(part) for part in expected)
    triton_select.select_blocks(scores, counts, context_lens, table.int(), settings, *got,
                                block_size=block, sink_blocks=1, recent_blocks=1,
                                resident=256, radix=radix)
    for got_part, expected_part in zip(got, expected):
        assert torch.equal(got_part, expected_part)


def _cache_state(heads: int, capacity: int, num_blocks: int):
    return (torch.full((num_blocks * heads + 1,), -1, dtype=torch.int32),
            torch.full((heads, capacity + 1), -1, dtype=torch.int64),
            torch.full((heads, capacity + 1), -1, dtype=torch.int64),
            torch.zeros(heads, dtype=torch.int64))


def _lookup_both(triton_lru, states, counters, ids, seq_lens, context_lens, *, capacity: int,
                 bins: int, chunk: int = 4) -> torch.Tensor:
    """One step placed by the reference (``states[0]``) and the kernel (``states[1]``),
    both cache states and everything the step writes held equal; the step's misses."""
    heads, entries = ids.shape[1], ids.shape[0] * ids.shape[2]
    outputs = []
    for (slot_of, block_of, last_used, ticks), counter, kernel in zip(
            states, counters, (False, True)):
        slots = torch.empty_like(ids)
        units = torch.full((heads, entries), -1, dtype=torch.int64)
        destinations, num_fetch = units.clone(), torch.empty(heads, dtype=torch.int64)
        args = (ids, slots, slot_of, block_of, last_used, ticks)
        if kernel:
            triton_lru.lookup_lru(*args, torch.empty_like(units), units, destinations, num_fetch,
                                  counter, seq_lens, context_lens, capacity=capacity,
                                  chunk=chunk, bins=bins)
        else:
            reference.place_lru_reference(*args, units, destinations, num_fetch, counter,
                                          seq_lens, context_lens, capacity=capacity)
        outputs.append((slots, units, destinations, num_fetch))
    for a, b in zip(*states):
        assert torch.equal(a[:-1] if a.dim() == 1 else a[:, :capacity],
                           b[:-1] if b.dim() == 1 else b[:, :capacity])
    assert torch.equal(counters[0], counters[1])
    (slots, units, destinations, num_fetch), got = outputs
    assert torch.equal(got[0], slots) and torch.equal(got[3], num_fetch)
    for head in range(heads):
        count = int(num_fetch[head])
        assert torch.equal(got[1][head, :count], units[head, :count])
        assert torch.equal(got[2][head, :count], destinations[head, :count])
    return num_fetch


@pytest.mark.parametrize("bins,first_tick", [(64, 0), (2, 0), (4, 2**40 + 3), (0, 2**40 + 3)])
def test_lookup_lru_equals_the_reference_over_steps(triton_lru, bins, first_tick):
    """Eight steps of two rows' selections over a cache of 12 slots per head:
    hits, LRU evictions with ties, the maps, the fetch lists and the counters; the
    victims' search halving its range (2 bins), or in quarters from a tick past 2^40
    (a long-running server's: about 20 passes narrow the range), or halving it by
    comparison (0 bins, the kernel before)."""
    gen = torch.Generator().manual_seed(9)
    heads, capacity, num_blocks, rows, width = 2, 12, 40, 2, 5
    states = [_cache_state(heads, capacity, num_blocks) for _ in range(2)]
    for state in states:
        state[3].fill_(first_tick)
    counters = [torch.zeros(heads, 4, dtype=torch.int64) for _ in range(2)]
    for step in range(8):
        ids = torch.stack([torch.randperm(20, generator=gen)[:width] + 20 * row
                           for row in range(rows) for _ in range(heads)]).view(rows, heads, width)
        ids[1, 1, 3:] = -1
        seq_lens = torch.randint(1, 20, (rows * heads,), generator=gen, dtype=torch.int32)
        context_lens = torch.tensor([17, -1 if step == 3 else 30])
        _lookup_both(triton_lru, states, counters, ids, seq_lens, context_lens,
                     capacity=capacity, bins=bins)
    assert counters[0][:, 2].sum() > 0 and counters[0][:, 3].sum() > 2 * capacity  # evicted


@pytest.mark.parametrize("chunk", [4, 16])
def test_lookup_lru_shares_a_block_rows_repeat_as_the_reference(triton_lru, chunk):
    """Rows sharing their first two blocks (a prefix-cache hit's), over steps, equal
    to the reference: one slot and one fetch a shared block (the first copy in entry
    order claims it: across the kernel's chunks at 4 entries, within one at 16), the
    later copies its slot, counted as hits."""
    gen = torch.Generator().manual_seed(4)
    heads, capacity, num_blocks, rows, width = 2, 16, 40, 3, 5
    states = [_cache_state(heads, capacity, num_blocks) for _ in range(2)]
    counters = [torch.zeros(heads, 4, dtype=torch.int64) for _ in range(2)]
    for step in range(6):
        shared = torch.randperm(num_blocks, generator=gen)[:2]
        others = [torch.randperm(num_blocks, generator=gen) for _ in range(rows * heads)]
        ids = torch.stack([torch.cat([shared, rest[~torch.isin(rest, shared)][:width - 2]])
                           for rest in others]).view(rows, heads, width)
        ids[2, 1, 4] = -1
        seq_lens = torch.randint(1, 20, (rows * heads,), generator=gen, dtype=torch.int32)
        misses = _lookup_both(triton_lru, states, counters, ids, seq_lens,
                              torch.tensor([30] * rows), capacity=capacity, bins=64, chunk=chunk)
        slot_of, block_of = states[1][0], states[1][1]
        for head in range(heads):
            held = block_of[head, :capacity]
            assert (held[held >= 0].unique(return_counts=True)[1] == 1).all()  # one slot each
            unique = ids[:, head][ids[:, head] >= 0].unique()
            assert int(misses[head]) <= unique.numel()
    assert counters[1][:, 2].sum() > 0 and counters[1][:, 3].sum() > capacity  # evicted


def test_lookup_lru_evicts_a_stale_copy_without_unmapping_its_block(triton_lru):
    """Slot 0 holds a stale copy of block 5, which slot 1 holds and its map names:
    the miss evicts slot 0 (the oldest) and block 5 stays mapped to slot 1."""
    state = _cache_state(1, 4, 16)
    slot_of, block_of, last_used, ticks = state
    block_of[0, :4] = torch.tensor([5, 5, 6, 7])
    last_used[0, :4] = torch.tensor([1, 3, 3, 3])
    slot_of[torch.tensor([5, 6, 7])] = torch.tensor([1, 2, 3], dtype=torch.int32)
    ticks.fill_(3)
    states = [state, tuple(part.clone() for part in state)]
    counters = [torch.zeros(1, 4, dtype=torch.int64) for _ in range(2)]
    _lookup_both(triton_lru, states, counters, torch.tensor([[[8, -1]]]),
                 torch.ones(1, dtype=torch.int32), torch.tensor([9]), capacity=4, bins=64)
    for slot_of, block_of, *_ in states:
        assert block_of[0, 0] == 8 and slot_of[8] == 0 and slot_of[5] == 1


@pytest.mark.parametrize("bins", [0, 2, 8, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_lru_victims_of_a_worn_cache_equal_the_reference(triton_lru, bins, seed):
    """One step on a cache that has served 10,000 steps: its slots last used over
    the last 300 (in ticks of 7 apart, so many tie) or free, the step's entries half
    hits: the victims (the oldest first, ties by slot) over chunks of 16 slots."""
    gen = torch.Generator().manual_seed(seed)
    heads, capacity, num_blocks, rows, width, tick = 3, 50, 200, 4, 6, 10_000
    state = _cache_state(heads, capacity, num_blocks)
    slot_of, block_of, last_used, ticks = state
    ticks.fill_(tick)
    ids = torch.full((rows, heads, width), -1, dtype=torch.int64)
    for head in range(heads):
        blocks = torch.randperm(num_blocks, generator=gen)
        free = torch.rand(capacity, generator=gen) < 0.1
        block_of[head, :capacity] = torch.where(free, -1, blocks[:capacity])
        age = torch.randint(1, 300, (capacity,), generator=gen) // 7 * 7 + 1
        last_used[head, :capacity] = torch.where(free, -1, tick - age)
        held = (~free).nonzero().flatten()
        slot_of[blocks[held] * heads + head] = held.to(torch.int32)
        wanted = torch.cat([blocks[held[:rows * width // 2]],
                            blocks[capacity:capacity + rows * width // 2]])
        ids[:, head] = wanted[torch.randperm(wanted.numel(), generator=gen)].view(rows, width)
    ids[2, 1, 4:] = -1
    states = [state, tuple(part.clone() for part in state)]
    counters = [torch.zeros(heads, 4, dtype=torch.int64) for _ in range(2)]
    seq_lens = torch.randint(1, 90, (rows * heads,), generator=gen, dtype=torch.int32)
    misses = _lookup_both(triton_lru, states, counters, ids, seq_lens, torch.tensor([80] * rows),
                          capacity=capacity, bins=bins, chunk=16)
    assert (misses >= rows * width // 2 - 2).all()  # the uncached half: victims searched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_of_per_head_lists_equals_the_reference(triton_units, dtype):
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(10, 2, 4, 16, generator=gen).to(dtype)
    units = torch.randint(0, 20, (2, 7), generator=gen)
    slots = torch.stack([torch.randperm(12, generator=gen)[:7] for _ in range(2)])
    count = torch.tensor([5, 2])
    cache, expected = torch.zeros(13, 4, 16, dtype=dtype), torch.zeros(13, 4, 16, dtype=dtype)
    reference.gather_units_reference(pool, expected, units, slots, count)
    words, chunk = kernels.unit_words(4, 8, dtype)
    triton_units.gather_units(pool.view(torch.int32), cache.view(torch.int32), units, slots,
                              count, num_ctas=4, unit_words=words, chunk_words=chunk,
                              per_step=2)
    assert torch.equal(cache[:12], expected[:12])
    assert cache[:12].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_with_strided_rows_and_empty_sequences_equals_the_reference(triton_attend,
                                                                               dtype, fused):
    """Query and output rows inside wider tensors, a -1 padded table, a row of
    length 0 (padding: 0 out), several splits merged by the last (fused) or a launch."""
    gen = torch.Generator().manual_seed(6)
    rows, heads, group, head_size, block = 3, 2, 3, 8, 4
    units = torch.randn(20, block, 2 * head_size, generator=gen).to(dtype)
    table = torch.randint(0, 20, (rows * heads, 5), generator=gen)
    seq_lens = torch.tensor([17, 3, 9, 20, 0, 0], dtype=torch.int32)
    table[1, 1:] = -1
    wide = torch.randn(rows, heads * group * head_size + 7, generator=gen).to(dtype)
    query = wide[:, : heads * group * head_size].view(rows, heads * group, head_size)
    expected = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=heads,
                                                scale=0.3)
    for splits in (1, 2, 5):
        out_wide = torch.full((rows, heads * group * head_size + 3), 9.0, dtype=dtype)
        out = out_wide[:, : heads * group * head_size].view(rows, heads * group, head_size)
        partial = torch.full((rows * heads, splits, group, head_size), float("nan"))
        maxima = torch.full((rows * heads, splits, group), float("nan"))
        triton_attend.attend_units(query, units, table, seq_lens, out, partial, maxima,
                                   torch.full_like(maxima, float("nan")), num_kv_heads=heads,
                                   scale=0.3, blocks_per_split=-(-5 // splits),
                                   fused_merge=fused)
        assert torch.allclose(out.float(), expected.float(), atol=2e-2 if dtype != torch.float32
                              else 1e-5)
        assert (out[2] == 0).all() and (out_wide[:, -3:] == 9.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_tokens_equals_the_reference(triton_units, dtype):
    """The write-through and the cached copies, strided K and V, a padding slot."""
    gen = torch.Generator().manual_seed(12)
    heads, head_size, block, capacity = 2, 12, 8, 3
    pool = torch.zeros(6, heads, block, 2 * head_size, dtype=dtype)
    units = torch.zeros(heads * capacity + 1, block, 2 * head_size, dtype=dtype)
    slot_of = torch.full((6 * heads + 1,), -1, dtype=torch.int32)
    slot_of[2 * heads + 1] = 2  # block 2, head 1 -> its slot 2
    slot_of[4 * heads + 0] = 0
    qkv = torch.randn(9, 3, heads, head_size, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([16, 17, 18, 33, 34, 5, 47, -1, 20])
    expected = (pool.clone(), units.clone())
    kernels.write_tokens(*expected[:1], key, value, slots, expected[1], slot_of, capacity)
    triton_units.write_tokens(pool, units, slot_of, key, value, slots, capacity=capacity)
    # (the reference writes uncached tokens into the scratch unit, the kernel skips them)
    assert torch.equal(pool, expected[0]) and torch.equal(units[:-1], expected[1][:-1])
    assert units[:-1].abs().sum() > 0
    # the cached copies alone (``kernels.write_cached_tokens``): the same units
    alone = torch.zeros_like(units)
    triton_units.write_tokens(None, alone, slot_of, key, value, slots, capacity=capacity)
    assert torch.equal(alone[:-1], expected[1][:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first,rows,group,head_size", [(0, 37, 2, 16), (45, 20, 4, 8),
                                                        (130, 70, 1, 24)])
def test_prompt_attention_equals_the_reference(triton_prompt, dtype, first, rows, group,
                                               head_size):
    """A request's prompt rows (a first chunk, or a later one of a chunked prefill),
    causal over its units in a shuffled table; tiles of 16 rows and 16 keys, so
    that rows and keys span several tiles; a padded head size."""
    gen = torch.Generator().manual_seed(first + rows)
    kv_heads, block = 2, 4
    seq_len = first + rows
    blocks = -(-seq_len // block)
    units = torch.randn(kv_heads * blocks + 3, block, 2 * head_size, generator=gen).to(dtype)
    table = torch.randperm(kv_heads * blocks + 3, generator=gen)[:kv_heads * blocks]
    table = table.view(kv_heads, blocks)
    wide = torch.randn(rows, kv_heads * group * head_size + 4, generator=gen).to(dtype)
    query = wide[:, : kv_heads * group * head_size].view(rows, kv_heads * group, head_size)
    expected = reference.attend_prompt_units_reference(query, units, table, first=first,
                                                       seq_len=seq_len, scale=0.4)
    got = torch.empty_like(expected)
    triton_prompt.attend_prompt(query, units, table, got, first=first, seq_len=seq_len,
                                scale=0.4, block_m=16, block_n=16)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("method,tiles", [("sums", 1), ("dot", 1), ("dot", 3)])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("unit", [16, 32])
def test_bound_kernels_equal_the_cpu_kernels(bits, unit, method, tiles):
    """``encode_bounds`` writes the CPU kernel's bytes; ``bound_scores`` gives the
    torch form's scores (-inf past each row's complete units and for padding), in
    both forms (the query's small integers are exact in the dots' float16), a
    program scoring one tile or looping over three (the last group past the row)."""
    from tests.reference.bound_pools import BLOCK, BoundPool
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    pool = BoundPool(seed=7, unit=unit, bits=bits, dtype=torch.bfloat16, num_kv_heads=2,
                     head_size=40, context_lens=[230, 16, 7, 64])
    bounds, scales = torch.zeros_like(pool.bounds), torch.zeros_like(pool.scales)
    for row in range(len(pool.context_lens)):
        slots = pool.slots_of(row)
        triton_bounds.encode_bounds(pool.kv_pool, bounds, scales, torch.cat([slots, -slots[:1] - 1]),
                                    unit=unit)
    assert torch.equal(scales, pool.scales)
    assert torch.equal(bounds, pool.bounds)
    gen = torch.Generator().manual_seed(2)
    query = torch.randint(-3, 4, (5, 2, 3, 40), generator=gen).float()
    context = torch.cat([pool.context_lens, torch.tensor([-1])])  # a padding row
    table = torch.cat([pool.block_table, pool.block_table[:1]]).contiguous()
    out = torch.empty((5, 2, table.shape[1] * (BLOCK // unit)), dtype=torch.float32)
    blocks = torch.empty((5, 2, table.shape[1]), dtype=torch.float32)
    triton_bounds.bound_scores(query, pool.bounds, pool.scales, table, context, out, blocks,
                               scale=0.25, unit=unit, tile=8, method=method,
                               tiles_per_program=tiles)
    want = block_rule.bound_unit_scores(query, pool.bounds, pool.scales, table, context,
                                        scale=0.25, block_size=BLOCK)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
    assert torch.equal(blocks, block_rule.unit_block_scores(want, BLOCK // unit))


@pytest.mark.parametrize("tiles", [1, 2])
def test_the_default_bound_form_over_several_tiles_equals_the_torch_form(tiles):
    """``selection.bound_scores``' CUDA launch (the tensor-core form, 64-unit tiles) over
    rows of 93 and 43 complete units: whole tiles, a partial one, one past the row."""
    from tests.reference.bound_pools import BLOCK, BoundPool
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    pool = BoundPool(seed=11, unit=16, bits=8, dtype=torch.bfloat16, num_kv_heads=2,
                     head_size=64, context_lens=[1500, 700])
    query = torch.randn(2, 2, 4, 64, generator=torch.Generator().manual_seed(4))
    query = query.to(torch.bfloat16)
    table_blocks = pool.block_table.shape[1]
    units = torch.empty((2, 2, table_blocks * (BLOCK // 16)), dtype=torch.float32)
    blocks = torch.empty((2, 2, table_blocks), dtype=torch.float32)
    triton_bounds.bound_scores(query, pool.bounds, pool.scales, pool.block_table,
                               pool.context_lens, units, blocks, scale=0.25, unit=16,
                               method="dot", tile=64, tiles_per_program=tiles)
    want = block_rule.bound_unit_scores(query, pool.bounds, pool.scales, pool.block_table,
                                        pool.context_lens, scale=0.25, block_size=BLOCK)
    torch.testing.assert_close(units, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(blocks, block_rule.unit_block_scores(units, BLOCK // 16))


def test_the_tensor_core_bound_form_clamps_a_query_beyond_float16():
    """A bfloat16 query part beyond float16's 65504 (inf in float16: inf x a centred
    code of 0 is NaN) scores as if clamped to it, finite; the float32 sums take it
    as it is."""
    from tests.reference.bound_pools import BLOCK, BoundPool
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    pool = BoundPool(seed=3, unit=16, bits=8, dtype=torch.bfloat16, num_kv_heads=2,
                     head_size=32, context_lens=[64, 40])
    query = torch.randint(-3, 4, (2, 2, 3, 32), generator=torch.Generator().manual_seed(1))
    query = query.to(torch.bfloat16)
    query[0, 1, 2, 5], query[1, 0, 0, 20] = 1.0e6, -3.0e5
    table_blocks = pool.block_table.shape[1]
    units = torch.empty((2, 2, table_blocks * (BLOCK // 16)), dtype=torch.float32)
    blocks = torch.empty((2, 2, table_blocks), dtype=torch.float32)
    triton_bounds.bound_scores(query, pool.bounds, pool.scales, pool.block_table,
                               pool.context_lens, units, blocks, scale=0.25, unit=16,
                               method="dot")
    clamped = query.float().clamp(-65504, 65504)
    want = block_rule.bound_unit_scores(clamped, pool.bounds, pool.scales, pool.block_table,
                                        pool.context_lens, scale=0.25, block_size=BLOCK)
    assert not units.isnan().any()
    torch.testing.assert_close(units, want, rtol=1e-6, atol=0)


# -- FP8 pools (--kv-cache-dtype fp8 / fp8_e5m2): K / key_scale, V / value_scale

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KEY_SCALE, VALUE_SCALE = 0.37, 2.5


def _fp8_tokens(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values across the FP8 range: ordinary, past the largest finite value
    (saturated), below the smallest normal (subnormal), exact ties, -0."""
    values = torch.randn(shape, generator=gen) * 10 ** torch.randint(-4, 5, shape,
                                                                     generator=gen).float()
    flat = values.view(-1)
    flat[:6] = torch.tensor([1e6, -1e6, 1.0625, -1.1875, 3e-4, -0.0])  # ties (e4m3), ...
    return values.to(dtype)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_write_tokens_equal_the_reference_byte_for_byte(triton_units, fmt, dtype):
    """The write-through and the cached copies of an FP8 pool: the model's K/V over
    their scales, rounded to nearest even and saturating (``_round_fp8``, whatever the
    interpreter's own rounding), byte for byte ``reference.pool_rows``."""
    gen = torch.Generator().manual_seed(21)
    heads, head_size, block, capacity = 2, 12, 8, 3
    pool = torch.zeros(6, heads, block, 2 * head_size, dtype=fmt)
    units = torch.zeros(heads * capacity + 1, block, 2 * head_size, dtype=fmt)
    slot_of = torch.full((6 * heads + 1,), -1, dtype=torch.int32)
    slot_of[2 * heads + 1] = 2
    slot_of[4 * heads + 0] = 0
    key = _fp8_tokens(gen, (9, heads, head_size), dtype)
    value = _fp8_tokens(gen, (9, heads, head_size), dtype)
    slots = torch.tensor([16, 17, 18, 33, 34, 5, 47, -1, 20])
    expected = (pool.clone(), units.clone())
    kernels.write_tokens(expected[0], key, value, slots, expected[1], slot_of, capacity,
                         key_scale=KEY_SCALE, value_scale=VALUE_SCALE)
    triton_units.write_tokens(pool, units, slot_of, key, value, slots, capacity=capacity,
                              key_scale=KEY_SCALE, value_scale=VALUE_SCALE)
    as_bytes = functools.partial(torch.Tensor.view, dtype=torch.uint8)
    assert torch.equal(as_bytes(pool), as_bytes(expected[0]))
    assert torch.equal(as_bytes(units[:-1]), as_bytes(expected[1][:-1]))
    alone = torch.zeros_like(units)  # the cached copies alone, byte for byte the same
    triton_units.write_tokens(None, alone, slot_of, key, value, slots, capacity=capacity,
                              key_scale=KEY_SCALE, value_scale=VALUE_SCALE)
    assert torch.equal(as_bytes(alone[:-1]), as_bytes(expected[1][:-1]))
    assert pool.float().abs().max() == torch.finfo(fmt).max  # saturated, not NaN
    assert not pool.float().isnan().any()


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_fp8_attention_equals_the_reference(triton_attend, fmt, query_dtype):
    """Decode attention over FP8 units, the key scale in the logits, the value
    scale in the output; strided rows, an empty sequence, several splits."""
    gen = torch.Generator().manual_seed(8)
    rows, heads, group, head_size, block = 3, 2, 3, 8, 4
    units = (torch.randn(20, block, 2 * head_size, generator=gen) * 4).to(fmt)
    table = torch.randint(0, 20, (rows * heads, 5), generator=gen)
    seq_lens = torch.tensor([17, 3, 9, 20, 0, 6], dtype=torch.int32)
    query = torch.randn(rows, heads * group, head_size, generator=gen).to(query_dtype)
    scales = {"key_scale": KEY_SCALE, "value_scale": VALUE_SCALE}
    expected = reference.attend_units_reference(query, units, table, seq_lens,
                                                num_kv_heads=heads, scale=0.3, **scales)
    unscaled = reference.attend_units_reference(query, units, table, seq_lens,
                                                num_kv_heads=heads, scale=0.3)
    assert not torch.allclose(expected.float(), unscaled.float(), atol=1e-2)
    tolerance = 1e-5 if query_dtype == torch.float32 else 2e-2
    for splits in (1, 2, 5):
        out = torch.full_like(query, 9.0)
        partial = torch.empty(rows * heads, splits, group, head_size)
        maxima = torch.empty(rows * heads, splits, group)
        triton_attend.attend_units(query, units, table, seq_lens, out, partial, maxima,
                                   torch.empty_like(maxima), num_kv_heads=heads,
                                   scale=0.3 * KEY_SCALE, blocks_per_split=-(-5 // splits),
                                   value_scale=VALUE_SCALE)
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance,
                                   rtol=tolerance)
        assert (out[2, :group] == 0).all()  # the empty sequence (row 2, KV head 0)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_prompt_attention_equals_the_reference(triton_prompt, fmt):
    gen = torch.Generator().manual_seed(9)
    kv_heads, group, head_size, block, first, rows = 2, 2, 16, 4, 45, 20
    seq_len = first + rows
    blocks = -(-seq_len // block)
    units = (torch.randn(kv_heads * blocks + 3, block, 2 * head_size, generator=gen) * 3).to(fmt)
    table = torch.randperm(kv_heads * blocks + 3, generator=gen)[:kv_heads * blocks]
    table = table.view(kv_heads, blocks)
    query = torch.randn(rows, kv_heads * group, head_size, generator=gen).to(torch.bfloat16)
    expected = reference.attend_prompt_units_reference(
        query, units, table, first=first, seq_len=seq_len, scale=0.4, key_scale=KEY_SCALE,
        value_scale=VALUE_SCALE)
    got = torch.empty_like(expected)
    triton_prompt.attend_prompt(query, units, table, got, first=first, seq_len=seq_len,
                                scale=0.4 * KEY_SCALE, value_scale=VALUE_SCALE, block_m=16,
                                block_n=16)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_pools_encode_the_references_keys(triton_units, fmt):
    """The int keys and the bounds of an FP8 pool's groups and units: its values
    (K / key_scale) widened, byte for byte the references'."""
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    pool32, key, value, slots = _write_case(torch.float32)
    pool = pool32.to(fmt)
    reference.write_pool(pool, key, value, slots, key_scale=KEY_SCALE)
    groups, head_size = pool.shape[2] // 16, key.shape[-1]
    codes = (torch.zeros(6, 2, groups, head_size, 4, dtype=torch.uint8),
             torch.zeros(6, 2, groups, head_size, dtype=torch.float16))
    expected = (codes[0].clone(), codes[1].clone())
    reference.write_int_keys(*expected, pool, slots)
    triton_units.encode_groups(pool, *codes, slots)
    assert torch.equal(codes[0], expected[0]) and torch.equal(codes[1], expected[1])
    bounds = (torch.zeros(6, 2, pool.shape[2] // 16, 2, head_size, dtype=torch.uint8),
              torch.zeros(6, 2, pool.shape[2] // 16, dtype=torch.float16))
    expected = (bounds[0].clone(), bounds[1].clone())
    reference.write_bounds(*expected, pool, slots)
    triton_bounds.encode_bounds(pool, *bounds, slots, unit=16)
    assert torch.equal(bounds[0], expected[0]) and torch.equal(bounds[1], expected[1])
    assert (expected[1] != 0).sum() > 0
