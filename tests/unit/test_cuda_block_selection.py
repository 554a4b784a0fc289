# SPDX-License-Identifier: Apache-2.0
"""The block rule of the CUDA platform (pure torch) against loop-by-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_infinigen.platforms.cuda.kernels import block_rule as rule
from vllm_infinigen.platforms.cuda.kernels import widths

BLOCK = 4


def _loop_token_scores(query, partial_keys, block_table, scale):
    """[S][H][token] best over the group's query heads of q . k, with loops."""
    num_rows, num_heads, group, _ = query.shape
    out = []
    for s in range(num_rows):
        per_head = []
        for h in range(num_heads):
            scores = []
            for block in block_table[s].tolist():
                for offset in range(BLOCK):
                    key = partial_keys[block, h, :, offset]
                    scores.append(max(float(query[s, h, g] @ key) for g in range(group)) * scale)
            per_head.append(scores)
        out.append(per_head)
    return torch.tensor(out)


def test_token_scores_take_the_best_query_head_through_the_block_table():
    torch.manual_seed(0)
    query = torch.randn(2, 3, 2, 5)  # [S, H_kv, G, R]
    partial_keys = torch.randn(7, 3, 5, BLOCK)  # [blocks, H_kv, R, block]
    table = torch.tensor([[6, 2, 0], [1, 5, 3]])
    got = rule.partial_token_scores(query, partial_keys, table, scale=0.5)
    assert torch.allclose(got, _loop_token_scores(query, partial_keys, table, 0.5), atol=1e-5)


def test_block_scores_ignore_the_own_token_and_later_positions():
    scores = torch.zeros(1, 1, 12)
    scores[0, 0, 9] = 100.0  # position 9: the row's own token (context 9)
    scores[0, 0, 11] = 200.0  # past it
    scores[0, 0, 5] = 3.0
    got = rule.block_scores(scores, torch.tensor([9]), BLOCK)
    assert got.tolist() == [[[0.0, 3.0, 0.0]]]  # block 2 holds token 8 (score 0) only
    empty = rule.block_scores(scores, torch.tensor([8]), BLOCK)
    assert empty[0, 0, 2] == float("-inf")  # no context token in the own block


def _loop_select(scores, context_lens, caps, sink, recent):
    """{(s, h): kept logical blocks} by the rule's definition, with loops."""
    kept = {}
    for s, (context, cap) in enumerate(zip(context_lens, caps)):
        blocks = context // BLOCK + 1
        forced = {j for j in range(blocks) if j < sink or j >= blocks - recent}
        total = min(math.ceil(cap / BLOCK) + len(forced), blocks)
        for h in range(scores.shape[1]):
            rest = sorted((j for j in range(blocks) if j not in forced),
                          key=lambda j: -float(scores[s, h, j]))
            kept[s, h] = sorted(forced | set(rest[: total - len(forced)]))
    return kept


@pytest.mark.parametrize("sink,recent", [(0, 1), (1, 1), (2, 3)])
def test_select_blocks_matches_the_loop_reference(sink, recent):
    torch.manual_seed(1)
    context_lens, caps = [3, 17, 30, 45], [1, 5, 9, 13]
    scores = torch.randn(4, 3, 12)
    width = widths.step_width(context_lens, caps, BLOCK, sink_blocks=sink,
                              recent_blocks=recent)
    got = rule.select_blocks(scores, torch.tensor(context_lens), torch.tensor(caps),
                             block_size=BLOCK, width=width, sink_blocks=sink,
                             recent_blocks=recent)
    expected = _loop_select(scores, context_lens, caps, sink, recent)
    for (s, h), blocks in expected.items():
        row = got.logical[s, h].tolist()
        assert row == blocks + [-1] * (width - len(blocks)), (s, h)
        assert int(got.num_selected[s]) == len(blocks)


def test_sink_and_own_blocks_are_kept_when_they_score_lowest():
    scores = torch.arange(10, dtype=torch.float32).flip(0).view(1, 1, 10)  # block 0 best
    scores[0, 0, 0] = -50.0
    scores[0, 0, 9] = -60.0
    got = rule.select_blocks(scores, torch.tensor([36]), torch.tensor([4]), block_size=BLOCK,
                             width=3, sink_blocks=1, recent_blocks=1)
    assert got.logical.tolist() == [[[0, 1, 9]]]  # sink, the best other, the own block (9)


def test_budget_rounds_up_to_whole_blocks():
    scores = torch.randn(1, 1, 20)
    for cap, expected in [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)]:
        got = rule.select_blocks(scores, torch.tensor([79]), torch.tensor([cap]),
                                 block_size=BLOCK, width=20, sink_blocks=0, recent_blocks=1)
        assert int(got.num_selected[0]) == expected + 1  # + the own block


def test_blocks_past_a_rows_context_are_never_selected():
    scores = torch.full((1, 2, 10), 5.0)
    scores[:, :, 4:] = 100.0  # only blocks past the row (context 10: blocks 0-2)
    got = rule.select_blocks(scores, torch.tensor([10]), torch.tensor([40]), block_size=BLOCK,
                             width=10, sink_blocks=0, recent_blocks=1)
    assert got.logical[0, :, :3].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert (got.logical[0, :, 3:] == -1).all()


def test_recent_blocks_below_one_are_refused():
    with pytest.raises(ValueError, match="own block"):
        rule.select_blocks(torch.zeros(1, 1, 2), torch.tensor([4]), torch.tensor([1]),
                           block_size=BLOCK, width=2, recent_blocks=0)


def test_alpha_caps_count_tokens_within_alpha_of_each_heads_best():
    scores = torch.tensor([[[10.0, 9.0, 4.0, 0.0, 99.0],  # head 0: 2 within 5 (99 is past)
                            [1.0, 0.5, 0.2, -4.5, 99.0]]])  # head 1: 3 within 5
    caps = rule.alpha_token_caps(scores, torch.tensor([4]), 5.0, torch.tensor([10]))
    assert caps.tolist() == [2]  # floor(mean(2, 3))
    assert rule.alpha_token_caps(scores, torch.tensor([4]), 5.0, torch.tensor([1])).tolist() == [1]


def test_step_width_bounds_every_row_and_is_reached():
    context_lens, caps = [3, 17, 60], [1, 3, 12]
    width = widths.step_width(context_lens, caps, BLOCK, sink_blocks=1, recent_blocks=1)
    got = rule.select_blocks(torch.randn(3, 1, 16), torch.tensor(context_lens),
                             torch.tensor(caps), block_size=BLOCK, width=width)
    assert int(got.num_selected.max()) == width == 5  # 3 blocks for 12 tokens + 2 forced


def test_physical_block_ids_map_through_each_rows_table():
    logical = torch.tensor([[[0, 2, -1]], [[1, -1, -1]]])
    table = torch.tensor([[7, 8, 9], [4, 5, 6]])
    assert rule.physical_block_ids(logical, table).tolist() == [[[7, 9, -1]], [[5, -1, -1]]]


def test_the_rule_needs_no_host_sync():
    """Meta tensors have no values: any .item()/.tolist() in the rule would raise."""
    scores = torch.empty(2, 3, 8, device="meta")
    lens = torch.empty(2, dtype=torch.int64, device="meta")
    got = rule.select_blocks(scores, lens, lens, block_size=BLOCK, width=4)
    table = torch.empty(2, 8, dtype=torch.int64, device="meta")
    assert rule.physical_block_ids(got.logical, table).shape == (2, 3, 4)
    query = torch.empty(2, 3, 2, 5, device="meta")
    keys = torch.empty(9, 3, 5, BLOCK, device="meta")
    tokens = rule.partial_token_scores(query, keys, table, scale=1.0)
    assert rule.block_scores(tokens, lens, BLOCK).shape == (2, 3, 8)
    assert rule.alpha_token_caps(tokens, lens, 5.0, lens).shape == (2,)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_token_scores_equal_the_int_keys_reference(bits, dtype):
    """The CUDA rule scores the int keys that the CPU kernels write as the
    reference dequantizes them; the open group (not encoded yet) scores -inf."""
    from tests.reference import int_keys as reference
    from tests.reference.int_key_pools import BLOCK, Pool

    pool = Pool(seed=3, bits=bits, dtype=dtype, num_kv_heads=2, head_size=32,
                context_lens=[95, 16, 7, 64])
    query = torch.randint(-3, 4, (4, 2, 3, 32), generator=torch.Generator().manual_seed(4)).float()
    got = rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                pool.context_lens, scale=0.25, operands=None)  # exact
    assert got.shape == (4, 2, pool.block_table.shape[1] * BLOCK)
    keys = reference.keys_for_scoring(pool.kv_pool, pool.codes, pool.scales, pool.block_table,
                                      pool.context_lens)  # [S, N, H, D]
    want = torch.einsum("shgd,snhd->shgn", query, keys).amax(dim=2) * 0.25
    for row, context in enumerate(pool.context_lens.tolist()):
        encoded = context // 16 * 16
        assert torch.equal(got[row, :, :encoded], want[row, :, :encoded]), row
        assert bool((got[row, :, encoded:] == float("-inf")).all()), row
    assert (pool.context_lens % 16 != 0).any() and (pool.context_lens % 16 == 0).any()
    with pytest.raises(ValueError, match="operands"):  # the kernels multiply float16 or float32
        rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                              pool.context_lens, scale=0.25, operands=torch.bfloat16)


def _loop_positions(token_scores, context_lens, caps, alpha, block, sink_tokens, recent_tokens):
    """{(s, h): selected positions}: the block rule over token scores, with loops."""
    out = {}
    for s, (context, cap) in enumerate(zip(context_lens, caps)):
        heads = range(token_scores.shape[1])
        row = [[float(x) for x in token_scores[s, h, :context]] for h in heads]
        counts = [sum(x > max(scores) - alpha for scores in [r] for x in r) for r in row]
        k = max(1, min(math.floor(sum(counts) / len(counts)), cap))
        blocks = context // block + 1
        forced = {j for j in range(blocks)
                  if j < max(1, -(-sink_tokens // block))
                  or j >= blocks - 1 - -(-recent_tokens // block)}
        total = min(-(-k // block) + len(forced), blocks)
        for h in heads:
            best = [max(row[h][j * block:(j + 1) * block], default=float("-inf"))
                    for j in range(blocks)]
            rest = sorted((j for j in range(blocks) if j not in forced), key=lambda j: -best[j])
            kept = sorted(forced | set(rest[: total - len(forced)]))
            out[s, h] = [p for j in kept for p in range(j * block, (j + 1) * block)
                         if p < context]
    return out


@pytest.mark.parametrize("sink,recent", [(0, 0), (40, 40)])
def test_the_block_rule_over_int_key_scores_equals_a_loop(sink, recent):
    """Token scores from the int keys, alpha capped by the budget
    (``alpha_token_caps``), whole blocks on top of the windows' (``select_blocks``):
    the context positions of the kept blocks, as a loop over the rule computes them."""
    from tests.reference.int_key_pools import BLOCK as POOL_BLOCK
    from tests.reference.int_key_pools import Pool

    pool = Pool(seed=5, bits=4, dtype=torch.float32, num_kv_heads=2, head_size=32,
                context_lens=[190, 16, 7, 70])
    query = torch.randn(4, 2, 3, 32, generator=torch.Generator().manual_seed(6))
    contexts = pool.context_lens.tolist()
    scores = rule.int_token_scores(query, pool.codes, pool.scales, pool.block_table,
                                   pool.context_lens, scale=0.25)
    caps = [max(1, int(n * 0.1)) for n in contexts]
    sink_blocks, recent_blocks = widths.window_blocks(sink, recent, POOL_BLOCK)
    chosen = rule.select_blocks(
        rule.block_scores(scores, pool.context_lens, POOL_BLOCK), pool.context_lens,
        rule.alpha_token_caps(scores, pool.context_lens, 2.0, torch.tensor(caps)),
        block_size=POOL_BLOCK, sink_blocks=sink_blocks, recent_blocks=recent_blocks,
        width=widths.step_width(contexts, caps, POOL_BLOCK, sink_blocks=sink_blocks,
                                recent_blocks=recent_blocks))
    expected = _loop_positions(scores, contexts, caps, 2.0, POOL_BLOCK, sink, recent)
    for (s, h), kept in expected.items():
        blocks = [int(j) for j in chosen.logical[s, h] if j >= 0]
        got = [p for j in blocks for p in range(j * POOL_BLOCK, (j + 1) * POOL_BLOCK)
               if p < contexts[s]]
        assert got == kept, (s, h)
