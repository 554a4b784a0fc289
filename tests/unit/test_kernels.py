# SPDX-License-Identifier: Apache-2.0
"""The compiled CPU kernels against the pure-torch reference, on random inputs.

Selections must be identical (the same positions per KV head and the same
count per request); attention outputs agree within TOLERANCE of the dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import layouts
from tests.reference.selector import select_tokens as select_reference
from tests.reference.sparse_attention import attend_gathered
from vllm_infinigen.platforms.cpu import kernels
from vllm_infinigen.platforms.cpu.kernels import build
from vllm_infinigen import block_layout
from vllm_infinigen.worker.step_plan import token_budget

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of an attention output against the float32 reference of the same inputs.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2),
             torch.float16: (3e-3, 3e-3)}
BLOCK = 32


class Case:
    """A pool with ragged requests in shuffled blocks; optional capped row map."""

    def __init__(self, *, seed: int, dtype: torch.dtype, num_kv_heads: int, group: int,
                 head_size: int, context_lens: list[int], rank: int = 6,
                 evict_fraction: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.num_kv_heads, self.group = dtype, num_kv_heads, group
        self.head_size, self.rank = head_size, rank
        self.context_lens = torch.tensor(context_lens, dtype=torch.int64)
        # Each row's own token sits at position context_len: blocks for it too.
        blocks_per_row = max(n // BLOCK + 1 for n in context_lens) + 1
        num_rows = len(context_lens)
        self.num_blocks = num_rows * blocks_per_row + 3
        order = torch.randperm(self.num_blocks, generator=gen)[: num_rows * blocks_per_row]
        self.block_table = order.view(num_rows, blocks_per_row).to(torch.int32)
        shape = (self.num_blocks, num_kv_heads, BLOCK, 2 * head_size)
        self.kv_pool = torch.randn(shape, generator=gen).to(dtype)
        self.partial_keys = torch.randn((self.num_blocks, num_kv_heads, rank, BLOCK),
                                        generator=gen).to(dtype)
        self.row_map = None
        if evict_fraction:
            # Capped: each head's rows are a permutation of the pool's rows, some
            # evicted (-1); each row's own token is always held.
            per_head = self.num_blocks * BLOCK
            rows = torch.stack([torch.randperm(per_head, generator=gen)
                                for _ in range(num_kv_heads)]).to(torch.int32)
            rows = rows.view(num_kv_heads, self.num_blocks, BLOCK).permute(1, 0, 2)
            evicted = torch.rand(rows.shape, generator=gen) < evict_fraction
            block_ids, offsets = block_layout.block_coordinates(
                self.context_lens[:, None], self.block_table, BLOCK)
            evicted[block_ids[:, 0], :, offsets[:, 0]] = False
            rows = rows.masked_fill(evicted, -1)
            self.row_map = rows.contiguous()
        self.query = torch.randn((num_rows, num_kv_heads * group, head_size),
                                 generator=gen).to(dtype)
        self.scale = head_size ** -0.5

    def entries(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = block_layout.entries_of(self.kv_pool, self.block_table, positions, self.row_map)
        return rows[..., : self.head_size], rows[..., self.head_size:]

    def pool_row(self, block: int, head: int, offset: int) -> tuple[int, int] | None:
        """(unit, offset) in the pool of an entry; None where a capped pool evicted it."""
        if self.row_map is None:
            return block, offset
        mapped = int(self.row_map[block, head, offset])
        return None if mapped < 0 else divmod(mapped, BLOCK)

    def hold_step_rows(self, seq_lens, new_rows) -> None:
        """A capped pool's map holding each request's last ``new_rows`` of its
        ``seq_lens`` tokens, as a step's write admits them (rows past the pool's where
        they were evicted: a prompt step's attention reads the rows by the map alone)."""
        for req, (seq_len, rows) in enumerate(zip(seq_lens, new_rows)):
            positions = torch.arange(seq_len - rows, seq_len)[None]
            blocks, offsets = block_layout.block_coordinates(
                positions, self.block_table[req:req + 1], BLOCK)
            held = self.row_map[blocks[0], :, offsets[0]]
            fresh = torch.arange(held.numel(), dtype=torch.int32).view_as(held) + 7
            self.row_map[blocks[0], :, offsets[0]] = torch.where(held < 0, fresh, held)

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        own = self.context_lens[:, None, None].expand(-1, self.num_kv_heads, 1)
        keys, values = self.entries(own)
        return keys[:, :, 0], values[:, :, 0]


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# -- write ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capped", [False, True])
def test_write_places_rows_and_partial_keys(dtype, capped):
    case = Case(seed=1, dtype=dtype, num_kv_heads=2, group=2, head_size=32,
                context_lens=[70, 5], evict_fraction=0.3 if capped else 0.0)
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 5, 33, -1, 64 + 7, 31], dtype=torch.int64)
    slots = torch.where(slots < 0, slots, slots + BLOCK * 2)  # blocks 2..
    key = torch.randn((6, 2, 32), generator=gen).to(dtype)
    value = torch.randn((6, 2, 32), generator=gen).to(dtype)
    skew = torch.randn((2, 32, 6), generator=gen)
    pool, partial = case.kv_pool.clone(), case.partial_keys.clone()
    kernels.write_partial_keys(partial, key, skew, slots)
    kernels.write_pool(pool, key, value, slots, case.row_map)
    want_pool, want_partial = case.kv_pool.clone(), case.partial_keys.clone()
    projected = torch.einsum("thd,hdr->thr", key.float(), skew).to(dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK)
        want_partial[block, :, :, offset] = projected[t]
        for head in range(2):
            if (where := case.pool_row(block, head, offset)) is not None:
                want_pool[where[0], head, where[1]] = torch.cat([key[t, head], value[t, head]])
    assert torch.equal(pool, want_pool)
    _assert_close(partial, want_partial, dtype)


# -- select -----------------------------------------------------------------------

def _selections(case: Case, *, alpha: float, budget: float, sink: int = 0,
                recent: int = 0):
    gen = torch.Generator().manual_seed(7)
    query = torch.randn((len(case.context_lens), case.num_kv_heads, case.group, case.rank),
                        generator=gen)
    positions, num_selected = kernels.select_tokens(
        query, case.partial_keys, case.block_table, case.context_lens,
        token_budget(case.context_lens, budget), scale=case.scale, alpha=alpha,
        sink_tokens=sink, recent_tokens=recent, row_map=case.row_map)
    width = int(case.context_lens.max())
    present = None
    if case.row_map is not None:
        present = layouts.present_of(case.row_map, case.block_table, width)
    want = select_reference(
        query.reshape(len(case.context_lens), -1, case.rank),
        layouts.partial_keys_of(case.partial_keys, case.block_table, width),
        case.context_lens, scale=case.scale, alpha=alpha, budget=budget, width=width,
        sink_tokens=sink, recent_tokens=recent, present=present)
    return positions, num_selected, want


def _kept(positions: torch.Tensor, valid: torch.Tensor | None = None) -> list[list[set]]:
    valid = positions >= 0 if valid is None else valid
    return [[set(positions[b, h][valid[b, h]].tolist()) for h in range(positions.shape[1])]
            for b in range(positions.shape[0])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize(("alpha", "budget"), [(1.0, 0.2), (3.0, 0.05), (0.5, 1.0),
                                             (math.inf, 0.2)])
def test_select_matches_reference(dtype, num_kv_heads, group, alpha, budget):
    case = Case(seed=3, dtype=dtype, num_kv_heads=num_kv_heads, group=group, head_size=32,
                context_lens=[300, 17, 1, 129])
    positions, num_selected, want = _selections(case, alpha=alpha, budget=budget)
    assert num_selected.tolist() == want.num_selected.tolist()
    if math.isinf(alpha):  # the default (alpha off): every row keeps its budget
        assert num_selected.tolist() == token_budget(case.context_lens, budget).tolist()
    assert positions.shape[-1] == int(want.num_selected.max())  # sized by the count
    assert _kept(positions) == _kept(want.positions, want.valid)
    for row in positions.view(-1, positions.shape[-1]):  # ascending, padding last
        kept = row[row >= 0]
        assert torch.equal(kept, kept.sort().values) and bool((row[len(kept):] < 0).all())


@pytest.mark.parametrize(("sink", "recent"), [(4, 0), (0, 8), (2, 3)])
def test_select_window_matches_reference(sink, recent):
    case = Case(seed=4, dtype=torch.float32, num_kv_heads=2, group=2, head_size=64,
                context_lens=[200, 9, 64])
    positions, num_selected, want = _selections(case, alpha=2.0, budget=0.1, sink=sink,
                                                recent=recent)
    assert num_selected.tolist() == want.num_selected.tolist()
    assert _kept(positions) == _kept(want.positions, want.valid)


@pytest.mark.parametrize("seed", [5, 6])
def test_select_never_picks_evicted_entries(seed):
    case = Case(seed=seed, dtype=torch.float32, num_kv_heads=2, group=2, head_size=32,
                context_lens=[250, 90], evict_fraction=0.5)
    positions, num_selected, want = _selections(case, alpha=4.0, budget=0.5, recent=4)
    assert num_selected.tolist() == want.num_selected.tolist()
    assert _kept(positions) == _kept(want.positions, want.valid)
    present = layouts.present_of(case.row_map, case.block_table, 250)
    for b, h, p in (positions >= 0).nonzero().tolist():
        assert bool(present[b, positions[b, h, p], h])


# -- attend -----------------------------------------------------------------------

def _random_positions(case: Case, fraction: float, seed: int) -> torch.Tensor:
    """Ascending random subsets of each row's context, -1 padded: [B, H_kv, K]."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    width = max(1, int(case.context_lens.max() * fraction))
    for n in case.context_lens.tolist():
        heads = []
        for _ in range(case.num_kv_heads):
            chosen = torch.randperm(n, generator=gen)[: int(n * fraction)].sort().values
            heads.append(torch.cat([chosen, torch.full((width - len(chosen),), -1)]))
        rows.append(torch.stack(heads))
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [32, 36, 64, 128])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (2, 4), (1, 12)])
def test_attend_selected_matches_reference(dtype, head_size, num_kv_heads, group):
    case = Case(seed=8, dtype=dtype, num_kv_heads=num_kv_heads, group=group,
                head_size=head_size, context_lens=[130, 3, 64, 257])
    positions = _random_positions(case, 0.3, seed=9)
    stats = torch.zeros(2, dtype=torch.float64)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                positions, scale=case.scale, stats=stats)
    keys, values = case.entries(positions.to(torch.int64))
    want = attend_gathered(case.query.float(), keys.float(), values.float(), positions >= 0,
                           *[t.float() for t in case.current()], case.scale)
    assert got.dtype == dtype
    _assert_close(got, want, dtype)
    assert stats.tolist() == [float((positions >= 0).sum()), float(case.context_lens.sum())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capped", [False, True])
def test_attend_dense_matches_reference(dtype, capped):
    case = Case(seed=10, dtype=dtype, num_kv_heads=2, group=2, head_size=32,
                context_lens=[1, 45, 200], evict_fraction=0.4 if capped else 0.0)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                None, scale=case.scale, row_map=case.row_map)
    width = int(case.context_lens.max())
    everything = torch.arange(width).expand(3, 2, width).clone()
    valid = everything < case.context_lens[:, None, None]
    if case.row_map is not None:
        valid &= layouts.present_of(case.row_map, case.block_table, width).permute(0, 2, 1)
    keys, values = case.entries(everything)
    want = attend_gathered(case.query.float(), keys.float(), values.float(), valid,
                           *[t.float() for t in case.current()], case.scale)
    _assert_close(got, want, dtype)


# (dtype, group, head size): the compiled groups (4: the common GQA ratio, at the
# common head size, in bfloat16 too), a group of the generic path past one
# register tile (12), and head sizes that end in a partial vector.
@pytest.mark.parametrize(("dtype", "group", "head_size"), [
    (torch.float32, 4, 64), (torch.bfloat16, 4, 128), (torch.float32, 1, 40),
    (torch.bfloat16, 2, 36), (torch.float32, 8, 40), (torch.float32, 12, 36)])
def test_attend_returns_each_positions_probability(dtype, group, head_size):
    # Contexts over several 16-row chunks, with partial last chunks and vectors of probs.
    case = Case(seed=11, dtype=dtype, num_kv_heads=2, group=group, head_size=head_size,
                context_lens=[90, 33, 211])
    positions = _random_positions(case, 0.5, seed=12)
    probs = torch.full(positions.shape, -1.0)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                positions, scale=case.scale, probs=probs)
    keys, values = case.entries(positions.to(torch.int64))
    out, want = attend_gathered(case.query.float(), keys.float(), values.float(),
                                positions >= 0, *[t.float() for t in case.current()],
                                case.scale, return_probs=True)
    _assert_close(got, out, dtype)
    torch.testing.assert_close(probs, want.masked_fill(positions < 0, 0.0), atol=1e-6,
                               rtol=1e-5)


def test_attend_with_nothing_selected_attends_its_own_token():
    case = Case(seed=13, dtype=torch.float32, num_kv_heads=2, group=2, head_size=32,
                context_lens=[40])
    none = torch.full((1, 2, 3), -1, dtype=torch.int32)
    got = kernels.attend_decode(case.query, case.kv_pool, case.block_table, case.context_lens,
                                none, scale=case.scale)
    _, current_value = case.current()
    want = current_value.repeat_interleave(2, dim=1)  # each query head: its KV head's V
    torch.testing.assert_close(got, want)


# -- prefill -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_size"), [(2, 1, 32), (2, 4, 64),
                                                                  (1, 2, 128)])
@pytest.mark.parametrize("capped", [False, True])
def test_prefill_matches_causal_reference(dtype, num_kv_heads, group, head_size, capped):
    # Three requests: a first chunk, a later chunk (context before it), a decode row.
    seq_lens = [50, 170, 90]
    new_rows = [50, 40, 1]
    case = Case(seed=14, dtype=dtype, num_kv_heads=num_kv_heads, group=group,
                head_size=head_size, context_lens=[n - 1 for n in seq_lens],
                evict_fraction=0.3 if capped else 0.0)
    if case.row_map is not None:  # this step's rows were just written: held
        for req, (seq_len, rows) in enumerate(zip(seq_lens, new_rows)):
            positions = torch.arange(seq_len - rows, seq_len)[None]
            blocks, offsets = block_layout.block_coordinates(positions, case.block_table[req:req + 1],
                                                          BLOCK)
            held = case.row_map[blocks[0], :, offsets[0]]
            fresh = torch.arange(held.numel(), dtype=torch.int32).view_as(held)
            case.row_map[blocks[0], :, offsets[0]] = torch.where(held < 0, fresh + 7, held)
    gen = torch.Generator().manual_seed(15)
    total = sum(new_rows)
    query = torch.randn((total, num_kv_heads * group, head_size), generator=gen).to(dtype)
    query_start = torch.tensor([0, 50, 90, 91], dtype=torch.int64)
    output = torch.zeros_like(query)
    requests = torch.tensor([0, 1], dtype=torch.int64)  # the decode row is not a prompt row
    kernels.attend_prefill(query, output, case.kv_pool, case.block_table, query_start,
                           torch.tensor(seq_lens), requests, scale=case.scale,
                           row_map=case.row_map)
    for req in (0, 1):
        start, end, seq_len = int(query_start[req]), int(query_start[req + 1]), seq_lens[req]
        everything = torch.arange(seq_len).expand(1, num_kv_heads, seq_len).clone()
        rows = block_layout.entries_of(case.kv_pool, case.block_table[req:req + 1], everything,
                                    case.row_map)[0].float()  # [H_kv, L, 2D]
        present = torch.ones(num_kv_heads, seq_len, dtype=torch.bool)
        if case.row_map is not None:
            present = layouts.present_of(case.row_map, case.block_table[req:req + 1],
                                           seq_len)[0].t()
        first = seq_len - (end - start)
        causal = torch.arange(seq_len)[None] <= first + torch.arange(end - start)[:, None]
        mask = (causal[None] & present[:, None]).repeat_interleave(group, 0)
        keys = rows[..., :head_size].repeat_interleave(group, 0)
        values = rows[..., head_size:].repeat_interleave(group, 0)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).float(), keys, values, attn_mask=mask,
            scale=case.scale).transpose(0, 1)
        _assert_close(output[start:end], want, dtype)
    assert bool((output[90:] == 0).all())


def test_kernels_report_the_instruction_set():
    assert kernels.load() in build.ISA_FLAGS
    assert math.isfinite(kernels.attend_decode(
        torch.ones(1, 1, 32), torch.ones(1, 1, BLOCK, 64), torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int64), None, scale=1.0).sum().item())


def test_a_missing_compiler_is_named(monkeypatch):
    import shutil

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"C\+\+ compiler .*apt-get install g\+\+.* ninja"):
        build._check_toolchain()


def test_the_build_targets_atens_own_instruction_set(monkeypatch):
    for capability, isa in [("AVX512", "AVX512"), ("AVX2", "AVX2"), ("DEFAULT", "DEFAULT"),
                            ("ZVECTOR", "DEFAULT")]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert build.target_isa() == isa
    assert all("-march" not in flag for flags in build.ISA_FLAGS.values() for flag in flags)


def lesser_instruction_sets() -> list[str]:
    """The instruction sets below this machine's own build: those it also runs."""
    order = ["AVX512", "AVX2", "DEFAULT"]
    return order[order.index(build.target_isa()) + 1:]


@pytest.mark.slow
@pytest.mark.parametrize("capability", lesser_instruction_sets())
def test_other_instruction_sets_build_and_agree(capability, background_result):
    """The same source, built for another ISA this machine runs, passes these tests,
    the int keys' (whose code unpacking has a SIMD path and a portable one) and
    the FP8 pool's (whose widening has both too): built and run in a subprocess
    that starts with the unit tests (tests/unit/conftest.py)."""
    code, out = background_result
    assert code == 0, out[-3000:]
    assert " passed" in out


def test_record_uses_equals_the_pools_own_bookkeeping():
    from vllm_infinigen.platforms.cpu.pool_index import CappedPoolIndex

    gen = torch.Generator().manual_seed(16)
    pools = [CappedPoolIndex(1, 2, num_slots=8 * BLOCK, num_rows=3 * BLOCK, policy="counter",
                             block_size=BLOCK) for _ in range(2)]
    block_table = torch.tensor([[5, 2, 7], [0, 3, 6]], dtype=torch.int32)
    for pool in pools:  # every token of both requests, then some evicted
        for row in block_table.tolist():
            for block in row:
                pool.admit(torch.arange(block * BLOCK, (block + 1) * BLOCK))
    for _ in range(3):
        positions = torch.randint(-1, 3 * BLOCK, (2, 2, 20), generator=gen).to(torch.int32)
        kernel, torch_path = pools
        kernel.record_selection(0, positions.contiguous(), block_table)
        heads = torch.arange(2)[None, :, None].expand_as(positions)
        block_ids, offsets = block_layout.block_coordinates(positions, block_table, BLOCK)
        rows = torch_path.row_map[0][block_ids, heads, offsets].to(torch.int64)
        valid = (positions >= 0) & (rows >= 0)
        torch_path.record_use(0, rows.clamp(min=0), valid)
        assert int(valid.sum()) > 0 and bool((rows < 0).any())  # some evicted
    assert torch.equal(pools[0].count, pools[1].count)
    assert torch.equal(pools[0].last_used, pools[1].last_used)


def test_each_source_version_builds_in_its_own_directory(monkeypatch, tmp_path):
    """Two installs or checkouts sharing the cache never rebuild over each other."""
    for name in build.SOURCES + ("cpu/common.h",):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"// {name}\n")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    key = build.build_key("AVX2")
    assert build.build_key("AVX2") == key
    assert build.build_key("DEFAULT") != key  # other flags
    (tmp_path / "cpu/common.h").write_text("// changed\n")
    assert build.build_key("AVX2") != key
    changed = build.build_key("AVX2")
    (tmp_path / "notes.txt").write_text("not a source")
    assert build.build_key("AVX2") == changed
    other = tmp_path / "checkout"  # the same sources elsewhere: ninja would rebuild them
    other.mkdir()
    for path in [*tmp_path.glob("*.*"), *tmp_path.glob("cpu/*.*")]:
        (other / path.relative_to(tmp_path)).parent.mkdir(exist_ok=True)
        (other / path.relative_to(tmp_path)).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "CSRC", other)
    assert build.build_key("AVX2") != changed


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path):
    """torch's ``lock`` file left by a killed build is removed once nobody builds."""
    build_dir = tmp_path / "vllm_infinigen_C_avx2-0123456789ab"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")
    with build.exclusive_build(build_dir):
        assert not (build_dir / "lock").exists()
    assert not (build_dir / "lock").exists()


def test_a_live_build_is_waited_for_not_broken(tmp_path):
    """While another process builds (holds the flock, its ``lock`` file present),
    entering waits until it finishes and leaves its file alone meanwhile."""
    import subprocess
    import sys

    build_dir = tmp_path / "vllm_infinigen_C_avx2-0123456789ab"
    build_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"handle = open({str(build_dir) + '.flock'!r}, 'w')\n"
         "fcntl.flock(handle, fcntl.LOCK_EX)\n"
         f"open({str(build_dir / 'lock')!r}, 'w').close()\n"
         "print('holding', flush=True)\n"
         "time.sleep(1.0)\n"
         f"os.remove({str(build_dir / 'lock')!r})\n"
         "open(os.path.join(" + repr(str(build_dir)) + ", 'built'), 'w').close()\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with build.exclusive_build(build_dir):
            assert (build_dir / "built").exists()  # entered only after the holder finished
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0
