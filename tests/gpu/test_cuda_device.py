# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform on a CUDA GPU, without vLLM (``pytest -m gpu``): each Triton kernel
against its torch reference on CUDA tensors, the data path's decode step planned on the
device (select-all equals dense attention), and that step captured in a CUDA graph
giving what the eager step gives."""

from __future__ import annotations

import pytest
import torch

from tests.reference.cuda_kernel_cases import attention_case, fetch_case, unit_score_case
from tests.reference.device_step import DecodeStep, config
from tests.reference.int_key_pools import BLOCK as POOL_BLOCK
from tests.reference.int_key_pools import Pool
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import block_rule
from vllm_infinigen.platforms.cuda.kernels import reference as cuda_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU, the optional device this machine lacks (run `pytest -m gpu` "
    "where one is)")]

CUDA = torch.device("cuda")


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    got, expected = got.cpu().float(), expected.cpu().float()
    assert torch.equal(got.isinf(), expected.isinf())
    finite = ~expected.isinf()
    torch.testing.assert_close(got[finite], expected[finite], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (2, torch.bfloat16)])
def test_int_scores_alpha_counts_and_select_equal_the_references(bits, dtype):
    pool = Pool(seed=7, bits=bits, dtype=dtype, num_kv_heads=2, head_size=128,
                context_lens=[95, 16, 7, 64])
    context_lens = pool.context_lens.clone()
    context_lens[2] = -1  # a padding row
    query = torch.randn(4, 2, 4, 128, generator=torch.Generator().manual_seed(8))
    tokens = block_rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                         context_lens, scale=0.09)
    blocks = block_rule.block_scores(tokens, context_lens, POOL_BLOCK)
    on = {name: value.to(CUDA) for name, value in (
        ("query", query), ("codes", pool.codes), ("scales", pool.scales),
        ("table", pool.block_table), ("context", context_lens))}
    got_tokens, got_blocks = kernels.int_scores(on["query"], on["codes"], on["scales"],
                                                on["table"], on["context"], scale=0.09)
    _close(got_tokens, tokens)
    _close(got_blocks, blocks)
    # The exact form (float32 channel sums) against the float32 torch form.
    from vllm_infinigen.platforms.cuda.kernels import triton_scoring

    exact = block_rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                        context_lens, scale=0.09, operands=None)
    got_exact = torch.empty(exact.shape, device=CUDA)
    triton_scoring.int_scores(on["query"], on["codes"], on["scales"], on["table"],
                              on["context"], got_exact, None, scale=0.09, method="sums")
    _close(got_exact, exact)
    settings = kernels.settings_tensor(2.0, 0.3, 0, "cpu")
    counts = kernels.alpha_counts(tokens, blocks, context_lens, settings, block_size=POOL_BLOCK)
    got_counts = kernels.alpha_counts(got_tokens, got_blocks, on["context"],
                                      settings.to(CUDA), block_size=POOL_BLOCK)
    assert torch.equal(got_counts.cpu(), counts)
    expected = kernels.select(blocks, counts, context_lens, pool.block_table, settings,
                              block_size=POOL_BLOCK, width=3, sink_blocks=1, recent_blocks=1)
    got = kernels.select(blocks.to(CUDA), counts.to(CUDA), on["context"], on["table"],
                         settings.to(CUDA), block_size=POOL_BLOCK, width=3, sink_blocks=1,
                         recent_blocks=1)
    for part, reference in zip(got, expected):
        assert torch.equal(part.cpu(), reference)


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (2, torch.bfloat16)])
def test_the_data_paths_gated_scoring_and_counts_equal_the_references(bits, dtype):
    """As ``CudaDataPath.select`` calls them (the settings given): alpha off writes
    no token score and counts every encoded token; alpha on writes and counts them."""
    pool = Pool(seed=5, bits=bits, dtype=dtype, num_kv_heads=2, head_size=128,
                context_lens=[95, 16, 7, 64])
    query = torch.randn(4, 2, 4, 128, generator=torch.Generator().manual_seed(3))
    tokens = block_rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                         pool.context_lens, scale=0.09)
    blocks = block_rule.block_scores(tokens, pool.context_lens, POOL_BLOCK)
    for alpha in (float("inf"), 2.0):
        settings = kernels.settings_tensor(alpha, 0.3, 0, "cpu")
        got_tokens, got_blocks = kernels.int_scores(
            query.to(CUDA), pool.codes.to(CUDA), pool.scales.to(CUDA),
            pool.block_table.to(CUDA), pool.context_lens.to(CUDA), scale=0.09,
            settings=settings.to(CUDA))
        _close(got_blocks, blocks)
        if alpha < float("inf"):
            _close(got_tokens, tokens)
        got_counts = kernels.alpha_counts(got_tokens, got_blocks, pool.context_lens.to(CUDA),
                                          settings.to(CUDA), block_size=POOL_BLOCK)
        counts = kernels.alpha_counts(tokens, blocks, pool.context_lens, settings,
                                      block_size=POOL_BLOCK)
        assert torch.equal(got_counts.cpu(), counts)


@pytest.mark.parametrize("bits,dtype", [(8, torch.float32), (4, torch.float32),
                                        (4, torch.bfloat16), (8, torch.bfloat16)])
def test_bound_kernels_equal_the_references(bits, dtype):
    """The bounds (the default keys) on CUDA tensors: ``encode_bounds`` writes the CPU
    kernels' bytes, ``bound_scores`` the torch form's unit and block scores (a query
    of the model's dtype: the float32 sums for float32, the tensor-core form for
    bfloat16)."""
    from tests.reference.bound_pools import BLOCK, BoundPool

    pool = BoundPool(seed=7, unit=16, bits=bits, dtype=dtype, num_kv_heads=2, head_size=128,
                     context_lens=[230, 16, 7, 64])
    bounds = torch.zeros_like(pool.bounds, device=CUDA)
    scales = torch.zeros_like(pool.scales, device=CUDA)
    kv_pool = pool.kv_pool.to(CUDA)
    for row in range(len(pool.context_lens)):
        kernels.encode_bounds(bounds, scales, kv_pool, pool.slots_of(row).to(CUDA))
    torch.cuda.synchronize()
    assert torch.equal(scales.cpu(), pool.scales)
    assert torch.equal(bounds.cpu(), pool.bounds)
    query = torch.randint(-3, 4, (5, 2, 4, 128), generator=torch.Generator().manual_seed(2))
    query = query.to(dtype)
    context = torch.cat([pool.context_lens, torch.tensor([-1])])  # a padding row
    table = torch.cat([pool.block_table, pool.block_table[:1]]).contiguous()
    units, blocks = kernels.bound_scores(query.to(CUDA), bounds, scales, table.to(CUDA),
                                         context.to(CUDA), scale=0.25, block_size=BLOCK)
    want = block_rule.bound_unit_scores(query, pool.bounds, pool.scales, table, context,
                                        scale=0.25, block_size=BLOCK)
    _close(units, want)
    _close(blocks, block_rule.unit_block_scores(want, BLOCK // 16))


@pytest.mark.parametrize("radix", [True, False])
def test_select_counts_the_bound_units_and_finds_the_threshold(radix):
    """``select_blocks`` from the bound keys' unit scores (their alpha counts taken in
    the same launch, alpha 2 and off), its threshold by byte histograms (the default,
    ``triton_select.RADIX``) or by halving, against the reference; scores with ties,
    rows of several lengths, a padding row."""
    from vllm_infinigen.platforms.cuda.kernels import triton_select

    unit, table_blocks = 16, 300
    context = torch.tensor([4700, 150, 7, -1, 3000])
    units, blocks, table, _ = unit_score_case(context.tolist(), unit=unit,
                                              table_blocks=table_blocks, ids=2000)
    for alpha, budget in ((2.0, 1.0), (float("inf"), 0.2), (float("inf"), 1.0)):
        settings = kernels.settings_tensor(alpha, budget, 0, "cpu")
        width = kernels.static_width(table_blocks, 32, budget=budget, min_context=0,
                                     sink_blocks=1, recent_blocks=1)
        expected = block_rule.select_reference(
            blocks, block_rule.unit_alpha_counts(units, settings[0], unit), context, table,
            settings, block_size=32, width=width, sink_blocks=1, recent_blocks=1)
        got = tuple(torch.empty_like(part, device=CUDA) for part in expected)
        triton_select.select_blocks(blocks.to(CUDA), units.to(CUDA), context.to(CUDA),
                                    table.to(CUDA), settings.to(CUDA), *got, block_size=32,
                                    sink_blocks=1, recent_blocks=1, unit=unit, radix=radix)
        for got_part, expected_part in zip(got, expected):
            assert torch.equal(got_part.cpu(), expected_part), (alpha, budget)


@pytest.mark.parametrize("shared", [False, True])
def test_lookup_lru_equals_the_reference_over_steps(shared):
    """Shared: the rows' first two blocks the same (a prefix-cache hit's), claimed by
    the first copy with an atomic minimum while the warps run in parallel."""
    from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache

    gen = torch.Generator().manual_seed(9)
    caches = [DeviceBlockCache(1, 2, 12, 40, device) for device in ("cpu", "cuda")]
    for cache in caches:  # a long-running server's ticks: the victims' search narrows 6 times
        cache.ticks.fill_(2**33)
    for step in range(8):
        ids = torch.stack([torch.randperm(20, generator=gen)[:5] + 20 * row
                           for row in range(2) for _ in range(2)]).view(2, 2, 5)
        if shared:
            ids[1, :, :2] = ids[0, :, :2]
        seq_lens = torch.randint(1, 20, (4,), generator=gen, dtype=torch.int32)
        context_lens = torch.tensor([17, 30])
        got = [cache.place(0, ids.to(cache.device), seq_lens.to(cache.device),
                           context_lens.to(cache.device)) for cache in caches]
        assert torch.equal(got[1].slots.cpu(), got[0].slots)
        assert torch.equal(got[1].num_fetch.cpu(), got[0].num_fetch)
        for head in range(2):
            count = int(got[0].num_fetch[head])
            assert torch.equal(got[1].fetch_units[head, :count].cpu(),
                               got[0].fetch_units[head, :count])
    for name in ("slot_of", "ticks", "counters"):
        assert torch.equal(getattr(caches[1], name).cpu(), getattr(caches[0], name)), name
    # Per-slot tables: the real slots (the last column is scratch: duplicate
    # writes land there in an order CUDA does not fix, and nothing reads it).
    for name in ("block_of", "last_used"):
        assert torch.equal(getattr(caches[1], name)[..., :-1].cpu(),
                           getattr(caches[0], name)[..., :-1]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_from_a_pinned_pool_and_attention_equal_the_references(dtype):
    from vllm_infinigen.platforms.cuda import host_pool

    pool, cache, units, slots, count = fetch_case(dtype)
    pinned = host_pool.allocate_host_pool(6, 2, 4, 8, dtype)
    pinned.tensor.copy_(pool)
    expected = cache.clone()
    cuda_reference.gather_units_reference(pool, expected, units, slots, count)
    got = cache.to(CUDA)
    kernels.gather_units(pinned.tensor, got, units.to(CUDA), slots.to(CUDA), count.to(CUDA))
    assert torch.equal(got[:-1].cpu(), expected[:-1])
    pinned.close()
    query, units, table, seq_lens = attention_case()
    expected = cuda_reference.attend_units_reference(query, units.to(dtype), table, seq_lens,
                                                     num_kv_heads=1, scale=0.3)
    got = kernels.attend_units(query.to(CUDA), units.to(dtype).to(CUDA), table.to(CUDA),
                               seq_lens.to(CUDA), num_kv_heads=1, scale=0.3).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:  # the dots' operands in bf16 (query and weights rounded): relative L2
        assert float((got - expected).norm() / expected.norm()) < 1e-2


def test_the_last_split_merges_launch_after_launch_and_in_a_graph():
    """The fused merge under real concurrency (the interpreter runs programs one by
    one): 16 sequences of up to 4,096 bfloat16 tokens in 64 splits each (short ones
    too, whose late splits read nothing and land first), two queries in turn, launched
    200 times eagerly and replayed 200 times in a CUDA graph, the split buffers filled
    with NaN before each launch (inside the graph too), so a merge that read a split
    before it landed would give NaN or another launch's values. The merge's order is
    fixed, so every launch equals the first bit for bit; the first is close to the
    two-launch form's; the arrival counters are zero after each run."""
    from vllm_infinigen.platforms.cuda.kernels import triton_attend

    gen = torch.Generator().manual_seed(5)
    rows, heads, group, head_size, block, width = 2, 8, 4, 128, 16, 256
    units = torch.randn(rows * heads * width + 1, block, 2 * head_size, generator=gen)
    units = units.to(torch.bfloat16).to(CUDA)
    table = torch.randperm(rows * heads * width, generator=gen).view(rows * heads, width)
    table = table.to(CUDA)
    seq_lens = torch.randint(1, width * block + 1, (rows * heads,), generator=gen)
    seq_lens[:4] = torch.tensor([77, 1, 16 * 65, width * block])
    seq_lens = seq_lens.to(torch.int32).to(CUDA)
    queries = [torch.randn(rows, heads * group, head_size, generator=gen).to(torch.bfloat16)
               .to(CUDA) for _ in range(2)]
    splits, per_split = 64, width // 64
    nan = float("nan")

    def attend(fused: bool, query: torch.Tensor, out: torch.Tensor) -> None:
        partial = torch.full((rows * heads, splits, group, head_size), nan, device=CUDA)
        maxima = torch.full((rows * heads, splits, group), nan, device=CUDA)
        triton_attend.attend_units(query, units, table, seq_lens, out, partial, maxima,
                                   torch.full_like(maxima, nan), num_kv_heads=heads, scale=0.1,
                                   blocks_per_split=per_split, fused_merge=fused)

    wants = []
    for query in queries:
        fused, launched = torch.empty_like(query), torch.empty_like(query)
        attend(True, query, fused)
        attend(False, query, launched)
        torch.testing.assert_close(fused, launched, atol=2e-2, rtol=2e-2)  # bf16 rows
        wants.append(fused)
    counters = triton_attend.arrivals(CUDA, rows * heads)
    got = torch.empty_like(queries[0])
    for launch in range(200):
        got.fill_(nan)
        attend(True, queries[launch % 2], got)
        assert torch.equal(got, wants[launch % 2]), launch
    assert not counters.any()
    graphs = []
    for query in queries:
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            attend(True, query, got)
    for replay in range(200):
        got.fill_(nan)
        graphs[replay % 2].replay()
        assert torch.equal(got, wants[replay % 2]), replay
    torch.cuda.synchronize()
    assert not counters.any()


def test_registered_pool_is_pinned_and_readable_by_the_gather():
    from vllm_infinigen.platforms.cuda import host_pool

    pool = host_pool.allocate_host_pool(8, 2, 16, 64, torch.bfloat16)
    pool.tensor.copy_(torch.randn(pool.tensor.shape).to(torch.bfloat16))
    assert pool.tensor.is_pinned()
    cache = torch.zeros(4, 16, 128, dtype=torch.bfloat16, device="cuda")
    units = torch.tensor([3, 9, 15], device="cuda")
    slots = torch.tensor([2, 0, 1], device="cuda")
    kernels.gather_units(pool.tensor, cache, units, slots, torch.tensor([3], device="cuda"))
    torch.cuda.synchronize()
    flat = pool.tensor.view(-1, 16, 128)
    assert torch.equal(cache[[2, 0, 1]].cpu(), flat[[3, 9, 15]])
    pool.close()


def test_the_device_step_on_cuda_equals_its_cpu_run():
    """The same steps (the pool's contents, the queries, the selection) on both devices."""
    outputs = []
    for device in ("cpu", "cuda"):
        step = DecodeStep(config(), device=device)
        outputs.append([step.run(seed=seed).cpu() for seed in (1, 2, 3)])
    for cpu, cuda in zip(*outputs):
        torch.testing.assert_close(cuda, cpu, atol=1e-3, rtol=1e-3)


def test_the_data_path_makes_the_attention_counters_before_any_capture():
    """vLLM may capture a decode graph before any eager attention: configuring the data
    path makes the fused merge's counters, zero, so a capture never has to."""
    from vllm_infinigen.platforms.cuda.kernels import triton_attend

    triton_attend._ARRIVALS.clear()
    DecodeStep(config(), device="cuda")  # "cuda": the data path's device, unindexed
    counters = triton_attend._ARRIVALS[torch.device("cuda", torch.cuda.current_device())]
    assert counters.numel() >= 1 << 16 and not counters.any()
    assert triton_attend.arrivals(torch.zeros(1, device=CUDA).device, 1) is counters


def test_a_captured_step_replays_what_the_eager_step_computes():
    """Two eager steps, then the third captured in a CUDA graph and replayed, against
    three eager steps of another runtime over the same inputs (the cache's state,
    the ticks and the counters advance on the device alike)."""
    eager, captured = (DecodeStep(config(), device="cuda") for _ in range(2))
    inputs = [step.inputs(seed=1) for step in (eager, captured)]
    for _ in range(3):
        expected = eager.step(*inputs[0]).clone()
    for _ in range(2):
        captured.step(*inputs[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = captured.step(*inputs[1])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(output, expected)
    assert output.abs().sum() > 0
    counters = [step.runtime.take_counters() for step in (eager, captured)]
    assert counters[0] == counters[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first,rows", [(0, 300), (1000, 200)])
def test_prompt_attention_equals_the_reference(dtype, first, rows):
    """The flash-attention kernel of prompt rows at the 8B model's head shapes
    (tensor cores in bf16), a first chunk and a later one."""
    gen = torch.Generator().manual_seed(rows)
    kv_heads, group, head_size, block = 8, 4, 128, 16
    seq_len = first + rows
    blocks = -(-seq_len // block)
    units = torch.randn(kv_heads * blocks, block, 2 * head_size, generator=gen).to(dtype)
    table = torch.randperm(kv_heads * blocks, generator=gen).view(kv_heads, blocks)
    query = torch.randn(rows, kv_heads * group, head_size, generator=gen).to(dtype)
    expected = cuda_reference.attend_prompt_units_reference(query, units, table, first=first,
                                                            seq_len=seq_len, scale=0.088)
    got = kernels.attend_prompt_units(query.to(CUDA), units.to(CUDA), table.to(CUDA),
                                      first=first, seq_len=seq_len, scale=0.088)
    tolerance = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tolerance,
                               rtol=tolerance)


def test_counters_reach_the_host_one_drain_late_and_none_is_lost():
    """``worker/counters.py`` on CUDA: a drain returns what the previous one
    copied; ``wait`` returns the rest; the runtime's counts of a device step
    add up to the CPU run's."""
    from vllm_infinigen.worker.counters import CounterDrain

    drain, counts = CounterDrain(), torch.zeros(3, 2, dtype=torch.float64, device=CUDA)
    counts += 1
    assert drain(counts) is None
    counts += 2
    assert drain(counts).tolist() == [[1.0, 1.0]] * 3
    counts += 4
    assert drain(counts, wait=True).tolist() == [[6.0, 6.0]] * 3
    assert counts.abs().sum() == 0

    totals = []
    for device in ("cpu", "cuda"):
        step = DecodeStep(config(), device=device)
        seen: dict[str, float] = {}
        for seed in range(3):
            step.run(seed=seed + 1)
            for key, value in step.runtime.take_counters().items():
                seen[key] = seen.get(key, 0) + value
        for key, value in step.runtime.take_counters(wait=True).items():
            seen[key] = seen.get(key, 0) + value
        totals.append({"candidates": sum(v for k, v in seen.items()
                                         if k.startswith("candidate_tokens.")),
                       "lookups": sum(v for k, v in seen.items()
                                      if k.startswith(("cache_hits.", "cache_misses.")))})
    assert totals[0] == totals[1] and totals[0]["lookups"] > 0


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_writes_gather_and_attention_equal_the_references(fmt):
    """``--kv-cache-dtype fp8``: the write-through into a pinned FP8 pool byte for
    byte the reference's (rounded to nearest, saturating: sm_90's conversion after
    ``_round_fp8``), its gather, and the decode and prompt attention over FP8 units
    (widened to bf16 on the tensor cores) within bf16's tolerance of float32."""
    from vllm_infinigen.platforms.cuda import host_pool

    gen = torch.Generator().manual_seed(3)
    heads, head_size, block, blocks = 8, 128, 16, 12
    scales = {"key_scale": 0.37, "value_scale": 2.5}
    key = (torch.randn(blocks * block, heads, head_size, generator=gen) * 30).to(torch.bfloat16)
    value = torch.randn(blocks * block, heads, head_size, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(blocks * block, generator=gen)
    expected = torch.zeros(blocks, heads, block, 2 * head_size, dtype=fmt)
    cuda_reference.write_pool(expected, key, value, slots, **scales)
    pinned = host_pool.allocate_host_pool(blocks, heads, block, head_size, fmt)
    pinned.tensor.zero_()
    kernels.write_tokens(pinned.tensor, key.to(CUDA), value.to(CUDA), slots.to(CUDA), **scales)
    torch.cuda.synchronize()
    assert torch.equal(pinned.tensor.view(torch.uint8), expected.view(torch.uint8))
    count = blocks * heads
    cache = torch.zeros(count + 1, block, 2 * head_size, dtype=fmt, device=CUDA)
    kernels.gather_units(pinned.tensor, cache, torch.arange(count, device=CUDA),
                         torch.arange(count, device=CUDA), torch.tensor([count], device=CUDA))
    torch.cuda.synchronize()
    assert torch.equal(cache[:-1].cpu().view(torch.uint8),
                       expected.view(-1, block, 2 * head_size).view(torch.uint8))
    pinned.close()
    query = torch.randn(2, heads * 4, head_size, generator=gen).to(torch.bfloat16)
    table = torch.arange(count).view(blocks, heads).t().repeat(2, 1)  # [2 * H, blocks]
    seq_lens = torch.tensor([blocks * block] * heads + [100] * heads, dtype=torch.int32)
    want = cuda_reference.attend_units_reference(query, cache.cpu(), table, seq_lens,
                                                 num_kv_heads=heads, scale=0.088, **scales)
    got = kernels.attend_units(query.to(CUDA), cache, table.to(CUDA), seq_lens.to(CUDA),
                               num_kv_heads=heads, scale=0.088, **scales).cpu()
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    rows = torch.randn(50, heads * 4, head_size, generator=gen).to(torch.bfloat16)
    want = cuda_reference.attend_prompt_units_reference(
        rows, cache.cpu(), table[:heads], first=blocks * block - 50, seq_len=blocks * block,
        scale=0.088, **scales)
    got = kernels.attend_prompt_units(rows.to(CUDA), cache, table[:heads].to(CUDA),
                                      first=blocks * block - 50, seq_len=blocks * block,
                                      scale=0.088, **scales).cpu()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
