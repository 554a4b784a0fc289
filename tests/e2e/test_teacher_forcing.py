# SPDX-License-Identifier: Apache-2.0
"""Teacher-forced scoring measures InfiniGen's decode attention, not dense attention.

Two engines, one after the other: stock vLLM, then InfiniGen at budget 0.05.
The InfiniGen worker is then switched to the evaluation mode (prompt rows past
a dense prefix attend like decode rows) and to select everything (budget 1.0,
alpha 1e4) with the worker's ``set_infinigen_selection``, so the file starts
only two engines.
"""

from __future__ import annotations

import pytest

from benchmarks.accuracy.perplexity import tokenize_text
from benchmarks.accuracy.sweeps import selection_counts
from benchmarks.accuracy.teacher_forcing import (
    engine_kwargs,
    prefill_scores,
    score_continuations,
)
from benchmarks.harness import paths
from benchmarks.harness.engines import SELECT_ALL
from tests.e2e.engines import engine

pytestmark = pytest.mark.slow

# The bundled stories260K and the TinyStories-style story of the repository
# (2,713 tokens, one story).
MODEL = str(paths.BUNDLED_MODEL)
TEXT = paths.STORY_TEXT
PROMPT_TOKENS = 64
# Windows end at different steps, so the batch shrinks and is condensed
# (requests removed and moved) while the others are still being forced.
SCORE_TOKENS = [400, 150, 275]
LONG_WINDOW = 0
SMALL_BUDGET = 0.05


def _score_with_fraction(llm, windows) -> tuple[list[list[float]], float]:
    """Scores, and the selected fraction of this call alone."""
    selected_before, candidates_before = selection_counts(llm)
    scores = score_continuations(llm, *zip(*windows))
    selected, candidates = selection_counts(llm)
    assert candidates > candidates_before, "no sparse decode step ran"
    return scores, (selected - selected_before) / (candidates - candidates_before)


@pytest.fixture(scope="module")
def model() -> str:
    return MODEL


@pytest.fixture(scope="module")
def windows(model) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) token windows cut one after another from the text."""
    token_ids = tokenize_text(model, TEXT.read_text(encoding="utf-8"))
    out, start = [], 0
    for num_scored in SCORE_TOKENS:
        end = start + PROMPT_TOKENS + num_scored
        assert end <= len(token_ids), "the sample text is too short"
        out.append((token_ids[start : start + PROMPT_TOKENS],
                    token_ids[start + PROMPT_TOKENS : end]))
        start = end
    return out


def _prefill_scores(llm, windows) -> list[list[float]]:
    """Prompt logprobs of every continuation token, prompt and continuation in one prefill."""
    return prefill_scores(llm, *zip(*windows))


def _one_token_last_chunk(llm, token_ids: list[int]) -> dict[int, float]:
    """Top logprobs of a prompt whose last chunk is one token, beside a decoding request.

    Steps of 128 tokens: step 1 prefills A (8 tokens) and B's first 120; step 2
    decodes A and prefills B's next 127; step 3 decodes A and prefills B's last
    token alone: a one-token prompt chunk, which must stay dense.
    """
    from vllm import SamplingParams

    first, second = token_ids[:8], token_ids[8 : 8 + 248]
    outputs = llm.generate(
        [{"prompt_token_ids": first}, {"prompt_token_ids": second}],
        [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)],
        use_tqdm=False,
    )
    return {token: lp.logprob for token, lp in outputs[1].outputs[0].logprobs[0].items()}


@pytest.fixture(scope="module")
def dense(model, windows) -> dict:
    """Engine 1 (stock vLLM): teacher-forced logprobs and prefill logprobs."""
    with engine(model, kv_manager="vllm", **engine_kwargs()) as llm:
        forced = score_continuations(llm, *zip(*windows))
        prefill = _prefill_scores(llm, windows)
        last_chunk = _one_token_last_chunk(llm, windows[0][0] + windows[0][1])
    return {"forced": forced, "prefill": prefill, "last_chunk": last_chunk}


@pytest.fixture(scope="module")
def infinigen(model, windows) -> dict:
    """Engine 2 (InfiniGen): scores at budget 0.05 (evaluation mode, then decode),
    then with everything selected."""
    with engine(
        model,
        kv_manager="infinigen",
        infinigen_budget=SMALL_BUDGET,
        infinigen_recent_tokens=0,  # the budget alone (the window: test_sparse_budget.py)
        enable_prefix_caching=False,  # evaluation mode is switched on at run time
        **engine_kwargs(),
    ) as llm:
        last_chunk = _one_token_last_chunk(llm, windows[0][0] + windows[0][1])
        # Evaluation mode first, on a fresh pool: no stale entries to hide a
        # row that reads another step's keys.
        llm.collective_rpc("set_infinigen_selection",
                           kwargs={"eval_dense_prefix": PROMPT_TOKENS})
        selected_before, candidates_before = selection_counts(llm)
        eval_prefill = _prefill_scores(llm, windows)
        selected, candidates = selection_counts(llm)
        llm.collective_rpc("set_infinigen_selection", kwargs={"eval_dense_prefix": None})
        sparse, sparse_fraction = _score_with_fraction(llm, windows)
        # Default mode: prompt rows are dense, whatever the budget.
        plain_prefill = _prefill_scores(llm, windows)
        baselines = {}
        for policy in ("quest", "streaming"):
            llm.collective_rpc("set_infinigen_selection",
                               kwargs={"policy": policy, "eval_dense_prefix": PROMPT_TOKENS})
            evaluated = _prefill_scores(llm, windows)
            llm.collective_rpc("set_infinigen_selection", kwargs={"eval_dense_prefix": None})
            baselines[policy] = (evaluated, score_continuations(llm, *zip(*windows)))
        llm.collective_rpc("set_infinigen_selection", kwargs={"policy": "infinigen", **SELECT_ALL})
        full, full_fraction = _score_with_fraction(llm, windows)
    return {"sparse": sparse, "sparse_fraction": sparse_fraction,
            "plain_prefill": plain_prefill, "eval_prefill": eval_prefill,
            "eval_fraction": (selected - selected_before) / (candidates - candidates_before),
            "eval_candidates": candidates - candidates_before,
            "last_chunk": last_chunk, "baselines": baselines, "full": full, "full_fraction": full_fraction}


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def _largest_diffs(a: list[list[float]], b: list[list[float]], count: int = 4) -> str:
    """Where two score lists differ most (for a failure message): window, token, both values."""
    diffs = sorted(((abs(x - y), w, i, x, y) for w, (row_a, row_b) in enumerate(zip(a, b))
                    for i, (x, y) in enumerate(zip(row_a, row_b))), reverse=True)
    median = diffs[len(diffs) // 2][0]
    return (f"median |diff| {median:.2e}; largest: "
            + ", ".join(f"window {w} token {i}: {x:.6f} vs {y:.6f}" for _, w, i, x, y in diffs[:count]))


def test_dense_teacher_forcing_equals_prefill_logprobs(dense):
    # The same conditional log-probabilities, once by decode and once by prefill:
    # the forced tokens are fed back and the logprobs are read unmasked.
    assert [len(row) for row in dense["forced"]] == SCORE_TOKENS
    assert _max_abs_diff(dense["forced"], dense["prefill"]) < 1e-4


def test_small_budget_changes_decode_logprobs(dense, infinigen):
    # Budget 0.05 keeps about 5% of the context in the sparse layers ...
    assert 0 < infinigen["sparse_fraction"] <= SMALL_BUDGET
    # ... and the per-token logprobs of a long window move with it.
    long_dense = dense["forced"][LONG_WINDOW]
    long_sparse = infinigen["sparse"][LONG_WINDOW]
    num_changed = sum(abs(x - y) > 1e-2 for x, y in zip(long_dense, long_sparse))
    assert num_changed > len(long_dense) // 4
    # The first token is scored from the dense prefill: identical.
    assert long_sparse[0] == pytest.approx(long_dense[0], abs=1e-5)


def test_selecting_everything_equals_dense(dense, infinigen):
    assert infinigen["full_fraction"] == 1.0
    assert _max_abs_diff(infinigen["full"], dense["forced"]) < 1e-3, \
        _largest_diffs(infinigen["full"], dense["forced"])


def test_prompt_logprobs_are_dense_outside_the_evaluation_mode(dense, infinigen):
    assert _max_abs_diff(infinigen["plain_prefill"], dense["prefill"]) < 1e-3, \
        _largest_diffs(infinigen["plain_prefill"], dense["prefill"])


def test_evaluation_mode_equals_teacher_forcing(dense, infinigen):
    # Prompt rows past the dense prefix select like decode rows at the same
    # context, so one prefill gives the teacher-forced decode's logprobs ...
    assert 0 < infinigen["eval_fraction"] <= SMALL_BUDGET
    # ... every scored row but the first (scored from the dense prefix) was a
    # selecting row in every sparse layer (three on stories260K: 5 layers, 2 dense).
    sparse_layers = 3
    expected_rows = sum(SCORE_TOKENS) - len(SCORE_TOKENS)
    assert infinigen["eval_candidates"] >= sparse_layers * expected_rows * PROMPT_TOKENS
    forced, evaluated = infinigen["sparse"], infinigen["eval_prefill"]
    diffs = [abs(x - y) for row_f, row_e in zip(forced, evaluated)
             for x, y in zip(row_f, row_e)]
    # Batched matmuls round differently from one-row ones: a near-tie can
    # select another token now and then, so allow a few outliers.
    assert sorted(diffs)[len(diffs) // 2] < 1e-4
    assert sum(d > 1e-2 for d in diffs) <= len(diffs) // 50
    # ... and not dense attention's: a harness reading the evaluation mode
    # would catch an engine that silently stayed dense.
    long_dense = dense["prefill"][LONG_WINDOW]
    long_eval = evaluated[LONG_WINDOW]
    assert sum(abs(x - y) > 1e-2 for x, y in zip(long_dense, long_eval)) > len(long_dense) // 4


@pytest.mark.parametrize("policy", ["quest", "streaming"])
def test_evaluation_mode_equals_teacher_forcing_for_baselines(infinigen, policy):
    # Quest's last page is bounded by the keys up to the row, as in decode.
    evaluated, forced = infinigen["baselines"][policy]
    diffs = [abs(x - y) for row_e, row_f in zip(evaluated, forced) for x, y in zip(row_e, row_f)]
    assert sorted(diffs)[len(diffs) // 2] < 1e-4
    assert sum(d > 1e-2 for d in diffs) <= len(diffs) // 50


def test_one_token_prompt_chunk_is_dense(dense, infinigen):
    # vLLM's metadata counts a one-token prompt chunk as a decode; it is a
    # prompt row, dense by design, whatever the budget.
    assert infinigen["last_chunk"].keys() == dense["last_chunk"].keys()
    for token, logprob in dense["last_chunk"].items():
        assert infinigen["last_chunk"][token] == pytest.approx(logprob, abs=1e-4)
