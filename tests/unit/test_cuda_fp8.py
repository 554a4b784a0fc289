# SPDX-License-Identifier: Apache-2.0
"""``--kv-cache-dtype fp8`` on the CUDA platform's data path, on CPU tensors: the pool
and the device block cache in FP8 (K / k_scale, V / v_scale), against the CPU
platform's compiled kernels over the same tokens (the Triton kernels are held to
these torch paths in ``triton_interpreter_checks.py`` and compiled for sm_90 in
``test_triton_compile.py``).

Each platform rounds as its vLLM writes FP8 pages: the CUDA one to nearest, the CPU
one toward zero. The attention tests hand the CPU layer the CUDA pool's bytes, so
that both attend over the same values."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cuda_data_path import (
    BLOCK,
    DIM,
    HEADS,
    KV_HEADS,
    NUM_BLOCKS,
    _Case,
    _decode,
    _layer,
    _plan,
    _positions,
)
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.memory import PoolPlan
from vllm_infinigen.platforms.cpu.data_path import CpuDataPath
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.data_path import CudaDataPath
from vllm_infinigen.worker.step_plan import RowSet, build_plan

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = (0.37, 2.5)  # vLLM's k_scale, v_scale


def _pair(fmt: torch.dtype, contexts=((0, 13), (1, 9))):
    """The CUDA path and the CPU platform's, one FP8 layer each, the same tokens
    written (K/V x 40: past e4m3's 448 once over k_scale, so some saturate)."""
    case = _Case(kv_dtype=fmt, kv_scales=SCALES)
    case.keys, case.values = case.keys * 40, case.values * 40
    cpu, layer = CpuDataPath("in-place"), _layer(kv_scales=SCALES)
    layer.skew = case.layer.skew
    cpu.allocate(layer, _plan(), NUM_BLOCKS, torch.float32, fmt)
    for row, upto in contexts:
        _write_both(case, cpu, layer, row, 0, upto)
    return case, cpu, layer


def _write_both(case, cpu, layer, row: int, start: int, upto: int,
                same_bytes: bool = True) -> None:
    """The tokens written by both paths; ``same_bytes``: the CPU layer's pool then
    takes the CUDA pool's bytes (the platforms round FP8 differently)."""
    case.written[row] = start
    case.write(row, upto)
    slots = torch.tensor([case.slot(row, p) for p in range(start, upto)])
    cpu.write(layer, case.keys[row, start:upto], case.values[row, start:upto], slots, None)
    if same_bytes:
        layer.kv_pool.copy_(case.layer.kv_pool)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_platform_rounds_its_pool_as_its_vllm_writes_fp8_pages(fmt):
    """Both write K x (1 / k_scale) and V x (1 / v_scale), saturating; the CUDA path
    rounds to nearest (vLLM's CUDA build), the CPU kernels toward zero (vLLM's CPU
    build): the same codes or the next one toward zero."""
    case = _Case(kv_dtype=fmt, kv_scales=SCALES)
    case.keys, case.values = case.keys * 40, case.values * 40
    cpu, layer = CpuDataPath("in-place"), _layer(kv_scales=SCALES)
    layer.skew = case.layer.skew
    cpu.allocate(layer, _plan(), NUM_BLOCKS, torch.float32, fmt)
    for row, upto in ((0, 13), (1, 16)):
        _write_both(case, cpu, layer, row, 0, upto, same_bytes=False)
    cuda_pool, cpu_pool = case.layer.kv_pool, layer.kv_pool
    assert cuda_pool.dtype == fmt and cpu_pool.dtype == fmt
    assert cuda_pool.float().abs().max() > 0
    if fmt == torch.float8_e4m3fn:
        assert cuda_pool.float().abs().max() == 448.0  # saturated, not NaN
    assert cpu_pool.float().isfinite().all()
    towards_zero = cuda_pool.view(torch.uint8).to(torch.int16) - cpu_pool.view(torch.uint8)
    assert set(towards_zero.unique().tolist()) == {0, 1}  # (sign-magnitude codes)
    torch.testing.assert_close(case.layer.partial_keys, layer.partial_keys)


@pytest.mark.parametrize("fmt", FORMATS)
def test_selected_and_dense_attention_equal_the_cpu_kernels_over_an_fp8_pool(fmt):
    """Everything selected (through the cache, FP8 units) and the staged dense
    path give the CPU platform's attention over the same FP8 pool, the scales
    multiplied back; without them the outputs differ."""
    case, cpu, layer = _pair(fmt)
    everything = _positions([[list(range(13))] * 2, [list(range(9)) + [-1] * 4] * 2])
    query, selected = _decode(case, everything, [13, 9])  # writes the rows' own tokens
    rows = case.rows([13, 9])
    for row, context in enumerate([13, 9]):  # and so does the CPU layer
        cpu.write(layer, case.keys[row, context:context + 1],
                  case.values[row, context:context + 1],
                  torch.tensor([case.slot(row, context)]), None)
    layer.kv_pool.copy_(case.layer.kv_pool)  # (the CPU kernels round toward zero)
    assert torch.equal(case.layer.kv_pool.view(torch.uint8), layer.kv_pool.view(torch.uint8))
    expected = cpu.attend_dense(layer, rows, query, None)
    torch.testing.assert_close(selected, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(case.path.attend_dense(case.layer, rows, query, None), expected,
                               atol=1e-4, rtol=1e-4)
    case.layer._attn._v_scale_float = 1.0
    unscaled = case.path.attend_dense(case.layer, rows, query, None)
    assert not torch.allclose(unscaled, expected, atol=1e-2)


def test_prompt_rows_attend_as_the_cpu_platform_over_an_fp8_pool():
    fmt = torch.float8_e4m3fn
    case, cpu, layer = _pair(fmt, contexts=((0, 7), (1, 10)))
    config = InfiniGenConfig(alpha=1.0, min_context=0)
    metadata = type("Metadata", (), {"query_start_loc": torch.tensor([0, 1, 8]),
                                     "seq_lens": torch.tensor([7, 10]),
                                     "block_table": case.table})()
    plan = build_plan(metadata, config, BLOCK, lambda n: torch.tensor([3, 10]))
    query = torch.randn(8, HEADS, DIM)
    got, expected = torch.zeros_like(query), torch.zeros_like(query)
    case.path.attend_prompt(case.layer, plan, query, got, None)
    cpu.attend_prompt(layer, plan, query, expected, None)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got[1:].abs().sum() > 0


def test_the_speculation_scores_take_the_key_scale(monkeypatch):
    """The int keys (as the bounds) are encoded from the pool's values (K /
    k_scale): the scores' scale is the layer's times k_scale, as on the CPU build."""
    path, layer = CudaDataPath("cpu", 8), _layer(int_keys=True, kv_scales=SCALES)
    plan = PoolPlan(num_rows=64, num_slots=64, block_size=16, num_bytes=0, sized_by="")
    path.allocate(layer, plan, 4, torch.float32, torch.float8_e4m3fn)
    path.configure(InfiniGenConfig(alpha=1.0, min_context=0))
    path.write(layer, torch.randn(40, KV_HEADS, DIM), torch.randn(40, KV_HEADS, DIM),
               torch.arange(40), None)
    taken = []
    original = kernels.int_scores

    def int_scores(*args, **kwargs):
        taken.append(kwargs["scale"])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "int_scores", int_scores)
    lens = torch.tensor([40])
    rows = RowSet(tokens=torch.arange(1), context_lens=lens,
                  block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32), token_caps=lens,
                  caps_host=[40], context_host=[40])
    path.select(layer, rows, torch.randn(1, KV_HEADS, HEADS // KV_HEADS, DIM))
    assert taken == [pytest.approx(layer.scale * SCALES[0])]
    assert layer.key_scales.abs().sum() > 0  # encoded from the FP8 pool


def test_the_cache_moves_one_byte_an_element():
    """The units in FP8: the gather's bytes (``pcie_bytes``) half of bfloat16's."""
    case = _Case(kv_dtype=torch.float8_e5m2, kv_scales=SCALES)
    for row, context in enumerate([13, 9]):
        case.write(row, context)
    _decode(case, _positions([[[1, 9], [5]], [[2], [4, 6, 8]]]), [13, 9])
    stats = case.path.take_stats(wait=True)
    misses = sum(v for k, v in stats.items() if k.startswith("cache_misses"))
    pcie = sum(v for k, v in stats.items() if k.startswith("pcie_bytes"))
    assert misses > 0 and pcie == misses * BLOCK * 2 * DIM
