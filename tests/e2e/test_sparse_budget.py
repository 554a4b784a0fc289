# SPDX-License-Identifier: Apache-2.0
"""At budget 0.2 on long prompts, sparse layers read at most 20% of the context."""

from __future__ import annotations

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL, STORY_TEXT
from tests.e2e.engines import engine, greedy_tokens, random_prompts
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow
BUDGET = 0.2
PROMPT_TOKENS = [400, 430, 460]
MAX_TOKENS = 48
RECENT_TOKENS = InfiniGenConfig().recent_tokens


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(BUNDLED_MODEL)(STORY_TEXT.read_text()).input_ids
    return [{"prompt_token_ids": ids[start : start + n]}
            for start, n in zip((0, 700, 1400), PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def eager_run(prompts):
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen", infinigen_budget=BUDGET) as llm:
        tokens = greedy_tokens(llm, prompts, MAX_TOKENS)
        text = llm.get_tokenizer().decode(tokens[0])
        return tokens, summarize(llm.get_metrics()), text


def test_selected_fraction_within_budget(eager_run):
    _, counters, _ = eager_run
    assert sorted(counters["candidate_tokens"], key=int) == ["2", "3", "4"]
    for layer, candidates in counters["candidate_tokens"].items():
        # Every decode step of every request: at least 400 context tokens.
        assert candidates >= len(PROMPT_TOKENS) * (MAX_TOKENS - 1) * 400
        # The budget, and on top of it at most the recent window (the default
        # --infinigen-recent-tokens) per row and step.
        window = RECENT_TOKENS * len(PROMPT_TOKENS) * MAX_TOKENS
        assert BUDGET * candidates <= counters["selected_tokens"][layer] <= (
            BUDGET * candidates + window)


def test_output_is_story_text(eager_run):
    _, _, text = eager_run
    words = [w.strip('.,!?"') for w in text.split()]
    known = set(STORY_TEXT.read_text().replace("\n", " ").split())
    known |= {w.strip('.,!?"') for w in known}
    assert len(words) >= 20
    assert sum(w in known for w in words) >= 0.6 * len(words), text


def test_compiled_engine_selects_the_same(prompts, eager_run):
    """The qkv_proj capture hook survives torch.compile (vLLM's default on CPU)."""
    tokens, counters, _ = eager_run
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen", infinigen_budget=BUDGET,
                enforce_eager=False) as llm:
        assert greedy_tokens(llm, prompts, MAX_TOKENS) == tokens
        assert summarize(llm.get_metrics()) == counters


def test_compiled_equals_eager_when_buffers_alias(tiny_models):
    """hidden == H_q * D here, so the compiler could hand the captured input's
    buffer to the attention output; the capture op keeps a private copy."""
    prompts = random_prompts([300, 420], seed=3)
    model = tiny_models["llama-gqa"]
    runs = []
    for eager in (True, False):
        with engine(model, kv_manager="infinigen", infinigen_budget=BUDGET,
                    enforce_eager=eager) as llm:
            runs.append((greedy_tokens(llm, prompts, 24), summarize(llm.get_metrics())))
    assert runs[0] == runs[1]


def test_copy_transfer_selects_and_outputs_the_same(prompts, eager_run):
    """Staging the selected entries through the copy worker changes nothing."""
    tokens, counters, _ = eager_run
    with engine(str(BUNDLED_MODEL), kv_manager="infinigen", infinigen_budget=BUDGET,
                infinigen_transfer="copy") as llm:
        assert greedy_tokens(llm, prompts, MAX_TOKENS) == tokens
        copied = summarize(llm.get_metrics())
    for name in ("selected_tokens", "candidate_tokens", "selected_kv_bytes"):
        assert copied[name] == counters[name]
    assert sum(copied["fetch_wait_us"].values()) > 0


def test_the_cuda_data_path_keeps_the_budget_in_whole_blocks(prompts):
    """The CUDA platform's data path (``cuda_path_worker.py``, on CPU tensors)
    in a real engine: each row keeps its budget rounded up to whole blocks
    plus its first and own blocks (``kernels.window_blocks``), finds them in
    its block cache (where the prompt's blocks were placed as it was written,
    ``platforms/cuda/prompts.py``), and still writes story text. vLLM's CPU
    blocks are 128 tokens: a row of 400-508 context tokens has 4 blocks and
    keeps 3 (0.2 x 508 < 128), so it leaves out one whole block. No recent
    window: its block before the own one would be the fourth."""
    from tests.e2e.cuda_path_worker import with_cuda_data_path

    with with_cuda_data_path(), engine(str(BUNDLED_MODEL), kv_manager="infinigen",
                                       infinigen_budget=BUDGET,
                                       infinigen_recent_tokens=0) as llm:
        tokens = greedy_tokens(llm, prompts, MAX_TOKENS)
        counters = summarize(llm.get_metrics())
        text = llm.get_tokenizer().decode(tokens[0])
    block_size = 128
    for layer, candidates in counters["candidate_tokens"].items():
        assert candidates >= len(PROMPT_TOKENS) * (MAX_TOKENS - 1) * 400
        selected = counters["selected_tokens"][layer]
        assert BUDGET * candidates <= selected <= (1 - block_size / 508) * candidates
        assert counters["cache_hits"][layer] > 0
    words = [w.strip('.,!?"') for w in text.split()]
    known = {w.strip('.,!?"') for w in STORY_TEXT.read_text().replace("\n", " ").split()}
    assert sum(w in known for w in words) >= 0.6 * len(words) >= 12, text
