# SPDX-License-Identifier: Apache-2.0
"""Candidate forms of the two other kernels of a batch's step at 128K (issue 44): the
cache placement (``triton_lru``) and the decode attention over cached units
(``triton_attend.attend_units``), each checked against its torch reference on the
device and then timed, at the shapes of the batch-32 point (8 KV heads x 4 query
heads x 128, 16-token blocks, a 4,096-token cap). ``kernel_candidates`` runs them
beside the scoring's and the rule's forms, in the same table.

    lookup   the victims' search halving by comparison (0 bins: the kernel
             before), in 2 bins (halving by a histogram), 16, 64 (the default) and
             256 per pass, on 4 warps 1,024 slots a loop step (the default), on 8
             and 16 warps 2,048 and 4,096 (fewer serial steps); from a worn
             cache (every slot held, last used over the last 200 steps, 6 % of
             the step's entries missing) at tick 100 and 100,000 (a server's
             uptime in steps: the halving search makes log2 of it passes)
    attend   the attention's splits per SM (2: the default), tokens per loop
             step (64: the default), warps, pipelining stages, and the splits
             merged by the last of them (the default) or by a second launch

The placement changes the cache it reads, so each timed call first restores the
worn state (a copy, timed alone and subtracted).
"""

from __future__ import annotations

from typing import Any

# (bins, warps, slots a loop step) of the placement's passes: the passes over the head's
# slots are serial, so a wider step with more warps makes fewer of them
LOOKUP = ((0, 4, 1024), (2, 4, 1024), (16, 4, 1024), (64, 4, 1024), (256, 4, 1024),
          (64, 8, 2048), (64, 16, 4096))
LOOKUP_TICKS = (100, 100_000)
# (splits per SM, tokens per loop step, warps, stages: None Triton's default, merge: the
# last split's (fused, the default) or a second launch's (the form before))
ATTEND = ((2, 64, 4, None, True), (2, 64, 4, None, False), (4, 64, 4, None, True),
          (4, 64, 4, None, False), (1, 64, 4, None, True), (2, 128, 4, None, True),
          (4, 64, 4, 2, True))
BLOCK = 16


def worn_cache(torch, device, *, rows: int, width: int, heads: int, row_blocks: int,
               tick: int, miss_share: float, gen):
    """(state, ids): a cache of 2 x width slots per row and head, every slot held by a
    block of its row, last used over the last 200 steps in ticks 3 apart (so many
    tie); and a step's selection ids [rows, heads, width] of distinct blocks, a
    ``miss_share`` of each row's not cached. state: (slot_of, block_of, last_used,
    ticks, counters) as ``DeviceBlockCache`` holds them for one layer."""
    capacity, misses = rows * 2 * width, max(1, round(miss_share * width))
    order = torch.rand(heads, rows, row_blocks, device=device, generator=gen).argsort(dim=-1)
    blocks = order + torch.arange(rows, device=device).view(1, rows, 1) * row_blocks
    held = blocks[..., :2 * width]  # [H, R, 2W]: the slots' blocks, row by row
    block_of = torch.full((heads, capacity + 1), -1, dtype=torch.int64, device=device)
    block_of[:, :capacity] = held.reshape(heads, capacity)
    oldest = max(1, min(200, tick - 1))
    age = torch.randint(0, oldest, (heads, capacity), device=device, generator=gen) // 3 * 3 + 1
    last_used = torch.full_like(block_of, -1)
    last_used[:, :capacity] = tick - age
    slot_of = torch.full((rows * row_blocks * heads + 1,), -1, dtype=torch.int32, device=device)
    head = torch.arange(heads, device=device).view(heads, 1)
    slot_of[block_of[:, :capacity] * heads + head] = torch.arange(
        capacity, dtype=torch.int32, device=device).expand(heads, -1)
    ids = torch.cat([held[..., :width - misses], blocks[..., 2 * width:2 * width + misses]],
                    dim=-1).permute(1, 0, 2).contiguous()  # [R, H, W]
    ticks = torch.full((heads,), tick, dtype=torch.int64, device=device)
    counters = torch.zeros(heads, 4, dtype=torch.int64, device=device)
    return (slot_of, block_of, last_used, ticks, counters), ids


def lookup_rows(torch, device, *, rows: int, width: int, heads: int, row_blocks: int, gen,
                checked_then_timed) -> list[dict[str, Any]]:
    """Each (bins, warps) of ``LOOKUP`` at each tick of ``LOOKUP_TICKS``: checked against
    ``reference.place_lru_reference`` from the same worn state, then timed."""
    from benchmarks.gpu.kernel_limits import timed
    from vllm_infinigen.platforms.cuda.kernels import reference, triton_lru

    out = []
    for tick in LOOKUP_TICKS:
        state, ids = worn_cache(torch, device, rows=rows, width=width, heads=heads,
                                row_blocks=row_blocks, tick=tick, miss_share=0.06, gen=gen)
        capacity = rows * 2 * width
        seq_lens = torch.full((rows * heads,), width * BLOCK, dtype=torch.int32, device=device)
        context_lens = torch.full((rows,), row_blocks * BLOCK - 1, device=device)
        work = tuple(part.clone() for part in state)
        expected_state = tuple(part.clone() for part in state)
        lists = [torch.full((heads, rows * width), -1, dtype=torch.int64, device=device)
                 for _ in range(3)]
        slots, num_fetch = torch.empty_like(ids), torch.empty(heads, dtype=torch.int64,
                                                              device=device)
        expected = (torch.empty_like(ids), *(part.clone() for part in lists[:2]),
                    num_fetch.clone())
        slot_of, block_of, last_used, ticks, counters = expected_state
        reference.place_lru_reference(ids, expected[0], slot_of, block_of, last_used, ticks,
                                      expected[1], expected[2], expected[3], counters, seq_lens,
                                      context_lens, capacity=capacity)

        def restore():
            for target, source in zip(work, state):
                target.copy_(source)

        restoring = timed(restore, device, repeats=3)
        for bins, warps, chunk in LOOKUP:
            def launch(bins=bins, warps=warps, chunk=chunk):
                restore()
                slot_of, block_of, last_used, ticks, counters = work
                triton_lru.lookup_lru(ids, slots, slot_of, block_of, last_used, ticks,
                                      lists[0], lists[1], lists[2], num_fetch, counters,
                                      seq_lens, context_lens, capacity=capacity,
                                      num_warps=warps, bins=bins, chunk=chunk)

            def check():
                count = int(expected[3].max())
                same = (torch.equal(slots, expected[0]) and torch.equal(num_fetch, expected[3])
                        and torch.equal(lists[1][:, :count], expected[1][:, :count])
                        and torch.equal(lists[2][:, :count], expected[2][:, :count]))
                tables = zip((work[0][:-1], work[1][:, :-1], work[2][:, :-1], *work[3:]),
                             (expected_state[0][:-1], expected_state[1][:, :-1],
                              expected_state[2][:, :-1], *expected_state[3:]))
                return same and all(torch.equal(a, b) for a, b in tables), None

            row = checked_then_timed(torch, device, {
                "kernel": "lookup", "rows": rows, "bits": "",
                "form": f"{bins} bins, {warps} warps, {chunk} a step, tick {tick:,}",
                "MB": (heads * capacity * 8 + ids.numel() * 20) / 1e6},
                launch, check)
            if "ms" in row:
                row["ms"] = max(row["ms"] - float(restoring), 0.0)
                row["timing"] += f", less the restore's {float(restoring):.4f} ms"
            out.append(row)
    return out


def attend_rows(torch, device, *, rows: int, heads: int, group: int, head_size: int,
                tokens: int, num_sms: int | None, gen, checked_then_timed) -> list[dict[str, Any]]:
    """Each form of ``ATTEND`` over ``tokens`` cached tokens per (row, KV head), checked
    against ``reference.attend_units_reference``, then timed (GB/s of the K/V read)."""
    from vllm_infinigen.platforms.cuda.kernels import attention, reference, triton_attend

    sequences, width = rows * heads, -(-tokens // BLOCK)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = torch.randn(sequences * width + 1, BLOCK, 2 * head_size, device=device,
                        generator=gen).to(dtype)
    table = torch.randperm(sequences * width, device=device, generator=gen).view(sequences,
                                                                                  width)
    seq_lens = torch.full((sequences,), tokens, dtype=torch.int32, device=device)
    seq_lens[0] = tokens - 5
    query = torch.randn(rows, heads * group, head_size, device=device, generator=gen).to(dtype)
    expected = reference.attend_units_reference(query, cache, table, seq_lens,
                                                num_kv_heads=heads, scale=0.09)
    out = torch.empty_like(query)
    kv_bytes = sequences * tokens * 2 * head_size * cache.element_size()
    found = []
    for per_sm, step, warps, stages, fused in ATTEND:
        if num_sms is None:  # the interpreter: a few splits, to check the merge
            num_splits, per_split = 3, -(-width // 3)
        else:  # the product's rule at ``per_sm``
            num_splits, per_split = attention.attention_splits(sequences, width, num_sms,
                                                               per_sm)
        partial = torch.empty(sequences, num_splits, group, head_size, dtype=torch.float32,
                              device=device)
        maxima = torch.empty(sequences, num_splits, group, dtype=torch.float32, device=device)
        sums = torch.empty_like(maxima)

        def launch(per_split=per_split, partial=partial, maxima=maxima, sums=sums, step=step,
                   warps=warps, stages=stages, fused=fused):
            triton_attend.attend_units(query, cache, table, seq_lens, out, partial, maxima,
                                       sums, num_kv_heads=heads, scale=0.09,
                                       blocks_per_split=per_split, num_warps=warps,
                                       tokens_per_step=step, num_stages=stages,
                                       fused_merge=fused)

        def check():
            error = float((out.float() - expected.float()).abs().max())
            return error <= (2e-2 if dtype == torch.bfloat16 else 1e-4), error

        out.fill_(7.0)
        found.append(checked_then_timed(torch, device, {
            "kernel": "attend", "rows": rows, "bits": "", "MB": kv_bytes / 1e6,
            "form": f"{per_sm} splits/SM ({num_splits} of {per_split} blocks), {step} tokens "
                    f"a step, {warps} warps, stages {stages or 'default'}, merged by "
                    + ("the last split" if fused else "a second launch")},
            launch, check, kv_bytes))
    return found
