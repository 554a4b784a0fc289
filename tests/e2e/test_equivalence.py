# SPDX-License-Identifier: Apache-2.0
"""With everything selected, InfiniGen's greedy output equals stock vLLM's."""

from __future__ import annotations

import pytest

from benchmarks.harness import paths
from tests.e2e.engines import SELECT_ALL, engine, greedy_tokens, random_prompts
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout, read_hf_config
from vllm_infinigen.scheduler.metrics import summarize

pytestmark = pytest.mark.slow

# Several lengths in one batch; with 128-token steps the long prompts are
# prefilled in chunks while the short ones already decode (mixed batches).
PROMPT_LENGTHS = [3, 40, 150, 333]
MAX_TOKENS = 40
BUDGET = 0.2


def _model_path(name: str, tiny_models: dict[str, str]) -> str:
    if name == "stories260k":
        return str(paths.BUNDLED_MODEL)
    return tiny_models[name]


def _counters_since(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per-layer counters accumulated between two ``summarize`` results."""
    return {name: {layer: value - before.get(name, {}).get(layer, 0)
                   for layer, value in after[name].items()
                   if value - before.get(name, {}).get(layer, 0)}
            for name in ("selected_tokens", "candidate_tokens")}


# llama-gqa last: its stock engine serves the preemption test next.
@pytest.mark.parametrize("name", ["llama-mha", "opt", "stories260k", "llama3-rope", "qwen3",
                                  "qwen3-moe", "gemma3", "llama-gqa"])
def test_select_all_equals_stock(name, tiny_models, shared_engine):
    """Select-all equals stock token for token (both speculation modes); then, in
    the same engine, budget 0.2 keeps every sparse layer within the budget.

    llama3-rope: Llama 3.1's rope scaling, which the speculation gets through
    the target layer's own ``rotary_emb``. qwen3, qwen3-moe: per-head q/k
    RMSNorm before RoPE, which the speculation applies with the layer's
    ``q_norm``. gemma3: sliding-window layers 0, 2, 4, 6 stay on vLLM's cache
    (the 333-token prompt reaches past their 64-token window); full-attention
    layers 1 and 3 are dense, 5 and 7 sparse (3 speculates for 5, 5 for 7).
    """
    model = _model_path(name, tiny_models)
    sparse_layers = (["5", "7"] if name == "gemma3" else
                     [str(idx) for idx in range(2, ModelLayout.of_model_dir(model).num_layers)])
    prompts = random_prompts(PROMPT_LENGTHS, seed=len(name))
    stock = greedy_tokens(shared_engine(model), prompts, MAX_TOKENS)
    with engine(model, **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, prompts, MAX_TOKENS)
        llm.collective_rpc("set_infinigen_selection", kwargs={"speculation": "same-layer"})
        same_layer = greedy_tokens(llm, prompts, MAX_TOKENS)
        counters = summarize(llm.get_metrics())
        llm.collective_rpc("set_infinigen_selection", kwargs={
            "speculation": "previous-layer", "budget": BUDGET, "alpha": 5.0,
            "recent_tokens": 0})
        greedy_tokens(llm, prompts, MAX_TOKENS)
        at_budget = _counters_since(counters, summarize(llm.get_metrics()))
    assert ours == stock
    assert same_layer == stock  # --infinigen-speculation same-layer
    # Every sparse layer ran and selected every candidate; no other layer counted.
    assert sorted(counters["candidate_tokens"], key=int) == sparse_layers
    for layer, candidates in counters["candidate_tokens"].items():
        assert candidates > 0
        assert counters["selected_tokens"][layer] == candidates
    # Budget 0.2: counted in the sparse layers only, each within the budget.
    assert sorted(at_budget["candidate_tokens"], key=int) == sparse_layers
    for layer, candidates in at_budget["candidate_tokens"].items():
        assert 0 < at_budget["selected_tokens"][layer] <= BUDGET * candidates


def test_select_all_equals_stock_through_preemption(tiny_models, shared_engine):
    """A KV space too small for the batch forces preemption and recompute: the
    pool slots of a preempted request are rewritten before they are read."""
    model = tiny_models["llama-gqa"]
    prompts = random_prompts([300, 280, 260, 240, 220, 200], seed=9)
    stock = greedy_tokens(shared_engine(model), prompts, 100)
    # 4 tiny-Llama layers, 2 dense: 128 KiB per block id (2 pages of 64 KiB)
    # plus the speculation keys of the 2 sparse layers' 128 tokens (float32),
    # so this holds 10 blocks; the batch needs 6 x 4 by the end.
    layout = ModelLayout.from_hf_config(read_hf_config(model),
                                        speculation_keys=InfiniGenConfig.speculation_keys)
    block_bytes = 128 * 1024 + 128 * layout.partial_bytes_per_token(4)
    with engine(model, kv_cache_memory_bytes=int(10.5 * block_bytes), **SELECT_ALL) as llm:
        ours = greedy_tokens(llm, prompts, 100)
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")
    assert preemptions > 0
    assert ours == stock
