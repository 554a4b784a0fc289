# SPDX-License-Identifier: Apache-2.0
"""Accuracy harness logic on hand-written inputs (no engine).

Prompt construction per task (lm-eval's plain-text rendering), lm-eval's
acc / acc_norm arithmetic, lm-eval's context/continuation split, needle
buckets, the top-k KL estimate and top-1 agreement, the results files and the
plot; lm_eval_serve.py's task YAMLs, the requests lm-eval builds from them
(recorded in tests/reference; rebuilt by lm-eval itself where it is
installed) and its reading of lm-eval's output.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import random
import subprocess

import pytest

from benchmarks.accuracy import (
    agreement,
    lm_eval_serve,
    lm_eval_tasks,
    mc_prompts,
    mc_tasks,
    perplexity,
    retrieval,
)
from benchmarks.harness import engines, report
from benchmarks.accuracy.teacher_forcing import split_for_decode
from tests.reference import lm_eval_requests
from tests.reference.lm_eval_requests import COPA, OBQA, PIQA, RTE, WINO

MATPLOTLIB_EXTRA = "matplotlib is not installed (the test and bench extras)"


# -- prompt construction, one hand-written example per task --------------------

def test_copa_requests_keep_lm_evals_double_space():
    # lm-eval's COPA choices start with a space and the target delimiter adds one.
    requests = mc_prompts.build_requests(mc_prompts.TASKS["copa"], COPA, [])
    assert requests == [
        ("The man turned on the faucet, therefore", "  the toilet filled with water."),
        ("The man turned on the faucet, therefore", "  water flowed from the spout."),
    ]
    assert mc_prompts.gold_index(mc_prompts.TASKS["copa"], COPA) == 1


def test_openbookqa_requests():
    requests = mc_prompts.build_requests(mc_prompts.TASKS["openbookqa"], OBQA, [])
    assert requests == [("Predators eat", " lions"), ("Predators eat", " humans"),
                        ("Predators eat", " bunnies"), ("Predators eat", " grass")]


def test_piqa_requests_rebuild_lm_evals_question_answer_prompt():
    requests = mc_prompts.build_requests(mc_prompts.TASKS["piqa"], PIQA, [])
    assert requests == [("Question: How do I open a jar?\nAnswer:", " Twist the lid."),
                        ("Question: How do I open a jar?\nAnswer:", " Bake the lid.")]
    with pytest.raises(ValueError):
        mc_prompts.TASKS["piqa"].doc_to_text({"query": "How do I open a jar?"})


def test_winogrande_puts_the_options_in_the_contexts():
    task = mc_prompts.TASKS["winogrande"]
    requests = mc_prompts.build_requests(task, WINO, [])
    assert requests == [
        ("Sarah was a better surgeon than Maria so Sarah", " always got the harder cases."),
        ("Sarah was a better surgeon than Maria so Maria", " always got the harder cases."),
    ]
    assert mc_prompts.gold_index(task, WINO) == 0


def test_rte_requests_and_label_mapping():
    task = mc_prompts.TASKS["rte"]
    context = "Bacteria mutate fast.\nQuestion: Bacteria are winning. True or False?\nAnswer:"
    assert mc_prompts.build_requests(task, RTE, []) == [(context, " True"), (context, " False")]
    assert mc_prompts.gold_index(task, RTE) == 1  # GLUE label 1 = not entailment = False


def test_fewshot_prefix_renders_solved_examples():
    piqa = mc_prompts.TASKS["piqa"]
    shot = {"query": "Question: Boil water?\n", "gold": 1, "choices": ["Freeze it.", "Heat it."]}
    context, continuation = mc_prompts.build_requests(piqa, PIQA, [shot, shot])[0]
    one = "Question: Boil water?\nAnswer: Heat it.\n\n"
    assert context == one + one + "Question: How do I open a jar?\nAnswer:"
    assert continuation == " Twist the lid."
    # Multiple input: the shot's gold context, then its continuation.
    wino = mc_prompts.TASKS["winogrande"]
    wino_shot = {"context_options": ["A so B", "A so C"], "continuation": "won.", "gold": 1}
    context, _ = mc_prompts.build_requests(wino, WINO, [wino_shot])[1]
    assert context == "A so C won.\n\nSarah was a better surgeon than Maria so Maria"
    # COPA's answer keeps lm-eval's double space in the shots too.
    copa_shot = {"query": "It rained, therefore", "gold": 0, "choices": ["we got wet.", "x."]}
    context, _ = mc_prompts.build_requests(mc_prompts.TASKS["copa"], COPA, [copa_shot])[0]
    assert context.startswith("It rained, therefore  we got wet.\n\n")


def test_fewshot_sampler_excludes_the_document_and_is_seeded():
    docs = [{"i": i} for i in range(8)]
    first = [mc_prompts.sample_fewshot(docs, d, 5, random.Random(1234)) for d in docs]
    again = [mc_prompts.sample_fewshot(docs, d, 5, random.Random(1234)) for d in docs]
    assert first == again
    for doc, shots in zip(docs, first):
        assert len(shots) == 5 and doc not in shots
        assert len({s["i"] for s in shots}) == 5
    # lm-eval draws n + 1 and drops the document: same draw as rng.sample(docs, 6).
    rng = random.Random(1234)
    drawn = random.Random(1234).sample(docs, 6)
    assert mc_prompts.sample_fewshot(docs, docs[0], 5, rng) == [d for d in drawn if d != docs[0]][:5]
    assert mc_prompts.sample_fewshot(docs, docs[0], 0, rng) == []


def test_load_docs_reads_glue_tsv_with_quotes(tmp_path):
    (tmp_path / "rte_dev.tsv").write_text(
        'sentence1\tsentence2\tlabel\tidx\nHe said "hi.\tHe spoke.\t0\t0\n')
    docs = mc_prompts.load_docs(mc_prompts.TASKS["rte"], tmp_path)
    assert docs == [{"sentence1": 'He said "hi.', "sentence2": "He spoke.", "label": "0",
                     "idx": "0"}]


# -- tokenization: lm-eval's context / continuation split ----------------------

def _char_encode(text: str) -> list[int]:
    """A toy tokenizer: BOS (1), then one id per character, "ab" merged into 2."""
    ids, i = [1], 0
    while i < len(text):
        if text.startswith("ab", i):
            ids.append(2)
            i += 2
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def test_encode_pair_moves_trailing_spaces_and_splits_the_whole():
    context, continuation = mc_prompts.encode_pair(_char_encode, "xy  ", "z")
    assert context == [1, ord("x"), ord("y")]
    assert continuation == [ord(" "), ord(" "), ord("z")]
    # The continuation is what follows the context in the encoded whole,
    # even where a merge crosses the boundary ("a" + "b" -> one token).
    context, continuation = mc_prompts.encode_pair(_char_encode, "xa", "b")
    assert context == [1, ord("x"), ord("a")] and continuation == []
    with pytest.raises(ValueError):
        mc_prompts.encode_pair(_char_encode, "", "b")


def test_truncate_left_keeps_the_last_tokens():
    assert mc_prompts.truncate_left([1, 2, 3, 4], [5, 6], 10) == ([1, 2, 3, 4], [5, 6])
    assert mc_prompts.truncate_left([1, 2, 3, 4], [5, 6], 5) == ([3, 4], [5, 6])
    with pytest.raises(ValueError):
        mc_prompts.truncate_left([1], [5, 6, 7], 4)


def test_split_for_decode_moves_the_prompt_tail_into_the_forced_part():
    assert split_for_decode([1, 2, 3, 4], [9], 3) == ([1], [2, 3, 4, 9])
    assert split_for_decode([1, 2, 3, 4], [9, 8], 0) == ([1, 2, 3, 4], [9, 8])
    with pytest.raises(ValueError):
        split_for_decode([1, 2], [9], 2)


# -- lm-eval's acc / acc_norm / acc_bytes --------------------------------------

def test_acc_and_acc_norm_follow_lm_eval():
    # Raw: choice 0 wins (-4 > -6). Per character: -4/2 = -2 vs -6/12 = -0.5, choice 1 wins.
    metrics = mc_prompts.mc_metrics([-4.0, -6.0], ["ab", "abcdefghijkl"], gold=1)
    assert metrics == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 1.0}
    metrics = mc_prompts.mc_metrics([-4.0, -6.0], ["ab", "abcdefghijkl"], gold=0)
    assert metrics == {"acc": 1.0, "acc_norm": 0.0, "acc_bytes": 0.0}


def test_acc_norm_counts_characters_and_acc_bytes_counts_bytes():
    # "é" is 1 character but 2 UTF-8 bytes.
    choices = ["ééé", "ab"]  # 3 characters / 6 bytes vs 2 / 2
    lls = [-4.0, -2.0]  # per character -1.33 vs -1.0 -> 1; per byte -0.67 vs -1.0 -> 0
    metrics = mc_prompts.mc_metrics(lls, choices, gold=0)
    assert metrics["acc"] == 0.0 and metrics["acc_norm"] == 0.0 and metrics["acc_bytes"] == 1.0


def test_ties_go_to_the_first_choice_and_multiple_input_has_no_norm():
    assert mc_prompts.mc_metrics([-1.0, -1.0], ["a", "b"], gold=0)["acc"] == 1.0
    assert mc_prompts.mc_metrics([-1.0, -1.0], ["a", "b"], gold=1)["acc"] == 0.0
    metrics = mc_prompts.mc_metrics([-2.0, -1.0], ["long context", "c"], 1, multiple_input=True)
    assert metrics == {"acc": 1.0, "acc_norm": None, "acc_bytes": None}
    with pytest.raises(ValueError):
        mc_prompts.mc_metrics([-1.0], ["a", "b"], gold=0)


def test_aggregate_averages_over_documents():
    task = mc_prompts.TASKS["openbookqa"]
    docs = [OBQA, {**OBQA, "gold": 0}]
    requests = [mc_prompts.Request("openbookqa", d, c, [1], [2], False)
                for d in range(2) for c in range(4)]
    # doc 0: choice 2 best (gold 2) -> acc 1; doc 1: choice 2 best (gold 0) -> acc 0.
    lls = [-9.0, -9.0, -1.0, -9.0] * 2
    out = mc_prompts.aggregate(task, docs, requests, lls)
    assert out["num_docs"] == 2 and out["acc"] == 0.5 and out["chance"] == 0.25


# -- retrieval: buckets, window membership, calibration sequence ---------------

@pytest.mark.parametrize("depth, bucket", [
    (0.0, "first_quarter"), (0.2499, "first_quarter"), (0.25, "middle"),
    (0.5, "middle"), (0.7499, "middle"), (0.75, "last_quarter"), (0.999, "last_quarter"),
])
def test_depth_bucket(depth, bucket):
    assert retrieval.depth_bucket(depth) == bucket


def test_depth_bucket_rejects_out_of_range():
    with pytest.raises(ValueError):
        retrieval.depth_bucket(1.5)


def test_load_examples_checks_buckets(tmp_path):
    good = {"prompt_token_ids": [1] * 100, "answer_token_ids": [300],
            "answer_positions": [30], "bucket": "middle", "needle_depth": 0.3}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "answer_positions": [80],
                                                           "bucket": "last_quarter"}) + "\n")
    assert len(retrieval.load_examples(path, None)) == 2
    assert len(retrieval.load_examples(path, 1)) == 1
    path.write_text(json.dumps({**good, "bucket": "first_quarter"}) + "\n")
    with pytest.raises(ValueError, match="bucket"):
        retrieval.load_examples(path, None)
    zipped = tmp_path / "r.jsonl.gz"  # the committed 8K prompts' form
    zipped.write_bytes(gzip.compress((json.dumps(good) + "\n").encode()))
    assert retrieval.load_examples(zipped, None) == [good]


def test_a_linear_rope_factor_reaches_both_engines(monkeypatch, tmp_path):
    """``--rope-linear-factor``: vLLM's ``hf_overrides`` with the model's RoPE theta
    kept, for the dense engine and InfiniGen's alike; none without it."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "rope_theta": 500.0}))  # a legacy top-level theta
    started = []

    @contextlib.contextmanager
    def start_engine(model, kv_manager, **kwargs):
        started.append((kv_manager, kwargs.get("hf_overrides")))
        yield None

    monkeypatch.setattr(retrieval.sweeps, "start_engine", start_engine)
    monkeypatch.setattr(retrieval.sweeps, "sweep", lambda llm, kv_manager, settings: [])
    args = retrieval.parse_args(["--model", str(tmp_path), "--rope-linear-factor", "2",
                                 "--budget", "0.2", "--no-select-all-control"])
    retrieval.run_engine(args, "vllm", [], None, None)
    retrieval.run_engine(args, "infinigen", [], {"dense_layers": 2}, None)
    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}
    assert started == [("vllm", linear), ("infinigen", linear)]
    assert retrieval.rope_overrides(tmp_path, None) == {}


def test_perplexity_starts_infinigen_with_the_engines_sink_and_recent_window(
        monkeypatch, tmp_path):
    """A perplexity run of the default selection is the product's default (its
    16 recent tokens): the harness passes no window of its own unless asked
    (it passed 0, so `perplexity_default` ran without the window)."""
    started = []

    @contextlib.contextmanager
    def start_engine(model, kv_manager, **kwargs):
        started.append(kwargs["infinigen"])
        yield None

    monkeypatch.setattr(perplexity.sweeps, "start_engine", start_engine)
    monkeypatch.setattr(perplexity.sweeps, "sweep", lambda llm, kv_manager, settings: [])
    model = ["--model", str(tmp_path), "--text", str(tmp_path)]
    perplexity.run_engine(perplexity.parse_args(model), "infinigen", [])
    perplexity.run_engine(perplexity.parse_args([*model, "--recent-tokens", "0"]),
                          "infinigen", [])
    kwargs = [engines.infinigen_kwargs(settings) for settings in started]
    assert "infinigen_recent_tokens" not in kwargs[0]
    assert "infinigen_sink_tokens" not in kwargs[0]
    assert kwargs[1]["infinigen_recent_tokens"] == 0


def test_bucket_accuracy_and_recent_window():
    rows = [{"bucket": "first_quarter"}, {"bucket": "first_quarter"}, {"bucket": "middle"},
            {"bucket": "last_quarter"}]
    acc = retrieval.bucket_accuracy(rows, [True, False, True, True])
    assert acc["first_quarter"] == {"n": 2, "acc": 0.5}
    assert acc["middle"] == {"n": 1, "acc": 1.0}
    assert acc["all"] == {"n": 4, "acc": 0.75}
    # 1,024-token prompt: context at the answer step is 1,023 tokens; the value
    # (key + 1) is in the last 128 iff value >= 895.
    row = {"prompt_token_ids": [0] * 1024, "answer_positions": [894]}
    assert retrieval.in_recent_window(row, 128)
    assert not retrieval.in_recent_window({**row, "answer_positions": [893]}, 128)


def test_forced_pair_puts_the_query_and_answer_in_decode():
    row = {"prompt_token_ids": [1, 7, 3, 20, 300, 8, 4, 20, 5], "answer_token_ids": [300]}
    assert retrieval.forced_pair(row, 3) == ([1, 7, 3, 20, 300, 8], [4, 20, 5, 300])


def test_synthetic_calibration_sequence_has_the_task_layout():
    ids = retrieval.synthetic_recall_ids(seed=3, length=256, num_pairs=6, num_queries=2)
    assert len(ids) == 255  # BOS is added in front
    body, queries = ids[:-8], ids[-8:]
    pairs = {body[i + 1]: body[i + 2] for i, t in enumerate(body) if t == retrieval.SEP}
    assert len(pairs) == 6 and all(k in retrieval.KEYS for k in pairs)
    assert all(v in retrieval.VALUES for v in pairs.values())
    for i in range(0, 8, 4):
        query, key, marker, value = queries[i:i + 4]
        assert (query, marker) == (retrieval.QUERY, retrieval.ANSWER) and pairs[key] == value


def test_top1_uses_the_rank():
    class Lp:
        def __init__(self, logprob, rank):
            self.logprob, self.rank = logprob, rank

    assert retrieval.top1({300: Lp(-3.0, 4), 301: Lp(-0.1, 1)}) == 301


# -- agreement: KL estimate and top-1 ------------------------------------------

def _log(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_kl_is_exact_on_the_full_vocabulary():
    p, q = {0: 0.5, 1: 0.3, 2: 0.2}, {0: 0.2, 1: 0.5, 2: 0.3}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    kl, covered = agreement.kl_lower_bound(_log(p), _log(q))
    assert kl == pytest.approx(exact, abs=1e-12) and covered == pytest.approx(1.0)
    assert agreement.kl_lower_bound(_log(p), _log(p))[0] == pytest.approx(0.0, abs=1e-12)


def test_kl_on_top_k_coarse_grains_the_rest_and_bounds_from_below():
    p = {0: 0.5, 1: 0.3, 2: 0.1, 3: 0.1}
    q = {0: 0.4, 1: 0.1, 2: 0.3, 3: 0.2}
    # Top-2 of each side: dense knows {0, 1}, InfiniGen knows {0, 2}: known = {0}.
    kl, covered = agreement.kl_lower_bound(_log({0: 0.5, 1: 0.3}), _log({0: 0.4, 2: 0.3}))
    by_hand = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
    assert kl == pytest.approx(by_hand, abs=1e-12) and covered == pytest.approx(0.5)
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert kl <= exact


def test_top1_and_per_position_comparison_skip_the_prefill_step():
    dense = [_log({5: 0.9, 6: 0.1}), _log({5: 0.6, 6: 0.4}), _log({5: 0.3, 6: 0.7})]
    sparse = [_log({5: 0.1, 6: 0.9}), _log({5: 0.4, 6: 0.6}), _log({5: 0.2, 6: 0.8})]
    positions = agreement.compare_steps(dense, sparse)
    assert len(positions) == 2  # step 0 (prefill) left out
    assert [p["top1_agree"] for p in positions] == [0.0, 1.0]
    assert positions[0]["kl"] == pytest.approx(0.6 * math.log(1.5) + 0.4 * math.log(0.4 / 0.6))
    summary = agreement.summarize_positions(positions)
    assert summary["top1_agreement"] == 0.5 and summary["num_positions"] == 2
    assert summary["mean_kl"] == pytest.approx((positions[0]["kl"] + positions[1]["kl"]) / 2)
    assert agreement.top1_token({3: -1.0, 2: -1.0, 9: -2.0}) == 2  # ties: lowest id
    with pytest.raises(ValueError):
        agreement.compare_steps(dense, sparse[:2])


# -- results files and plot -----------------------------------------------------

def test_markdown_table_and_cells():
    table = report.markdown_table(["a", "b"], [["1", report.cell(None)], ["2", report.cell(0.5, ".2f")]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 |  |", "| 2 | 0.50 |"]
    with pytest.raises(ValueError):
        report.markdown_table(["a"], [["1", "2"]])


def test_write_results_records_provenance(tmp_path):
    meta = {"command": "python x.py", "machine": "m", "cpus": 2, "runtime": {"path": "/r"}}
    json_path, md_path = report.write_results(
        tmp_path / "sub" / "res", meta, "Title", {"k": 1}, [{"v": 2}], ["## S", "body"])
    data = json.loads(json_path.read_text())
    assert data == {"meta": meta, "settings": {"k": 1}, "results": [{"v": 2}]}
    text = md_path.read_text()
    assert text.startswith("# Title") and "`python x.py`" in text and "body" in text


def test_run_metadata_names_versions_and_runtime():
    meta = report.run_metadata(model="m")
    assert meta["model"] == "m" and meta["vllm"] and meta["torch"] and meta["cpus"]
    assert meta["runtime"]["path"].endswith("vllm_infinigen")


def test_gpu_runs_share_the_one_provenance_writer(tmp_path, monkeypatch):
    """A GPU benchmark's metadata is ``source_metadata``'s plus the device; on a
    lent machine whose .git is a stale copy, ``INFINIGEN_COMMIT`` names the
    commit; its Markdown names the device above the machine."""
    from benchmarks.gpu.results import gpu_run_metadata

    monkeypatch.setenv("INFINIGEN_COMMIT", "abc1234")
    meta = gpu_run_metadata(shape="TINY")
    assert meta["repo_commit"] == "abc1234" and meta["repo_uncommitted_changes"] is False
    assert meta["device"] and meta["torch"] and meta["shape"] == "TINY"
    _, md_path = report.write_results(tmp_path / "gpu", {**meta, "device": "H200",
                                                          "sm_count": 132}, "T", {}, {}, [])
    lines = md_path.read_text().splitlines()
    device = next(i for i, line in enumerate(lines) if line.startswith("- device: H200 (132 SMs"))
    assert lines[device + 1].startswith("- machine: ")
    assert "- repository commit: abc1234;" in md_path.read_text()


def test_the_markdown_keeps_the_checkouts_and_the_runtimes_changes_apart(tmp_path):
    """Uncommitted changes in the repository and in the imported runtime are two
    facts: each is said on its own line, neither hides the other."""
    base = {"command": "c", "machine": "m", "cpus": 2, "python": "3", "repo_commit": "abc",
            "date_utc": "d"}
    cases = [(True, False), (False, True), (True, True), (False, False)]
    for repo_dirty, runtime_dirty in cases:
        meta = {**base, "repo_uncommitted_changes": repo_dirty,
                "runtime": {"path": "/p", "commit": "abc", "uncommitted_changes": runtime_dirty}}
        line = next(line for line in report.metadata_markdown(meta).splitlines()
                    if line.startswith("- repository commit:"))
        repo_part, _, runtime_part = line.partition("; vllm_infinigen from ")
        assert ("+ uncommitted changes" in repo_part) == repo_dirty, line
        assert ("+ uncommitted changes" in runtime_part) == runtime_dirty, line


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_EXTRA)
    panel = report.Panel("t", "acc", {"infinigen": [(0.2, 0.9), (0.05, 0.5)]}, {"dense": 1.0})
    path = report.plot_quality_vs_budget(tmp_path / "p.png", [panel, panel], "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        report.plot_quality_vs_budget(tmp_path / "q.png", [])


def test_try_plot_without_matplotlib_reports_and_returns_none(tmp_path, monkeypatch, capsys):
    def unavailable():
        raise report.PlotUnavailable("plots need matplotlib")

    monkeypatch.setattr(report, "_pyplot", unavailable)
    panel = report.Panel("t", "acc", {"x": [(0.1, 0.5)]})
    assert report.try_plot(tmp_path / "p.png", [panel]) is None
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_prediction_agreement_with_dense():
    dense = [[-1.0, -2.0], [-3.0, -1.0, -2.0]]
    sparse = [[-1.5, -1.2], [-3.0, -1.0, -2.5]]
    out = mc_prompts.prediction_agreement(dense, sparse)
    assert out["same_choice"] == 0.5  # doc 0 flips to choice 1
    assert out["mean_abs_delta"] == pytest.approx((0.5 + 0.8 + 0 + 0 + 0.5) / 5)
    with pytest.raises(ValueError):
        mc_prompts.prediction_agreement(dense, sparse[:1])
    results = [{"task": "t", "kv_manager": "vllm", "doc_loglikelihoods": dense},
               {"task": "t", "kv_manager": "infinigen", "doc_loglikelihoods": sparse}]
    mc_prompts.add_dense_agreement(results)
    assert results[0]["vs_dense_same_choice"] == 1.0
    assert results[1]["vs_dense_same_choice"] == 0.5


def test_selection_grid_names_policies_only_when_swept():
    from benchmarks.accuracy import sweeps

    assert sweeps.selection_grid([0.1, 0.2]) == [{"budget": 0.1}, {"budget": 0.2}]
    assert sweeps.selection_grid([0.1], select_all_control=True) == [
        {"budget": 0.1}, {"budget": 1.0, "alpha": 1e4}]
    grid = sweeps.selection_grid([0.1, 0.2], ["infinigen", "h2o"], select_all_control=True)
    # beside a baseline InfiniGen keeps no recent window on top of the budget
    assert grid == [{"policy": "infinigen", "budget": 0.1, "recent_tokens": 0},
                    {"policy": "infinigen", "budget": 0.2, "recent_tokens": 0},
                    {"policy": "h2o", "budget": 0.1}, {"policy": "h2o", "budget": 0.2},
                    {"policy": "infinigen", "budget": 1.0, "alpha": 1e4}]
    assert [sweeps.policy_of(s) for s in grid] == ["infinigen"] * 2 + ["h2o"] * 2 + ["infinigen"]
    assert sweeps.policy_of(None) is None and sweeps.policy_of({"budget": 0.1}) == "infinigen"
    assert [sweeps.is_control(s) for s in grid] == [False] * 4 + [True]
    assert not sweeps.is_control(None) and not sweeps.is_control({"budget": 1.0})
    with pytest.raises(ValueError, match="unknown"):
        sweeps.selection_grid([0.1], ["snapkv"])


def test_mode_and_setting_labels():
    assert mc_tasks.mode_label("vllm", None) == "vllm"
    assert mc_tasks.mode_label("infinigen", {"budget": 0.1}) == "infinigen"
    assert mc_tasks.mode_label("infinigen", {"policy": "quest", "budget": 0.1}) == "quest"
    assert mc_tasks.mode_label("infinigen", {"budget": 1.0, "alpha": 1e4}).endswith("(control)")
    variant = {"dense_layers": 2, "calibration": "synthetic"}
    assert retrieval.setting_label(None, None) == "dense"
    assert retrieval.setting_label({"policy": "h2o", "budget": 0.1}, variant) == (
        "h2o, 2 dense layers, partial keys, synthetic skew")
    assert retrieval.setting_label({"budget": 0.2}, {**variant, "calibration": "default"}) == (
        "infinigen, 2 dense layers, bounds keys")
    assert retrieval.setting_label(dict(retrieval.STREAMING_APPROX), variant).startswith(
        "streaming approx (sink 4 + recent 128)")
    fastest = {"dense_layers": 1, "calibration": "default", "budget_tokens": 256,
               "speculation": "same-layer"}
    assert retrieval.setting_label({"budget": 0.2}, fastest) == (
        "infinigen, 1 dense layers, bounds keys, cap 256 tokens, same-layer")
    # a cap swept on the engine is the setting's, and names the row
    assert retrieval.setting_label({"budget": 0.2, "budget_tokens": 128}, fastest) == (
        "infinigen, 1 dense layers, bounds keys, cap 128 tokens, same-layer")
    assert retrieval.setting_label({"budget": 1.0, "alpha": 1e4, "budget_tokens": None},
                                   fastest).startswith("select all (control), 1 dense layers, "
                                                       "bounds keys, same-layer")
    args = retrieval.parse_args(["--budget-tokens", "256", "--speculation", "same-layer"])
    assert (args.budget_tokens, args.speculation, args.kv_cache_dtype) == ([256], "same-layer",
                                                                          "auto")
    assert retrieval.parse_args(["--budget-tokens", "64", "128"]).budget_tokens == [64, 128]
    with pytest.raises(SystemExit):
        retrieval.parse_args(["--speculation", "next-layer"])
    assert retrieval.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        retrieval.parse_args(["--kv-cache-dtype", "int8"])
    assert retrieval.setting_label(None, None, "fp8") == "dense, fp8 K/V"
    assert retrieval.setting_label({"budget": 0.2}, fastest, "fp8_e5m2").endswith(
        "same-layer, fp8_e5m2 K/V")


def test_fp8_reports_name_the_attention_they_ran(monkeypatch):
    from benchmarks.harness import fp8_attention

    assert fp8_attention.described("auto") == ""
    monkeypatch.setattr(fp8_attention, "native", lambda: False)
    assert "**emulated**" in fp8_attention.described("fp8")
    monkeypatch.setattr(fp8_attention, "native", lambda: True)
    assert fp8_attention.described("fp8_e5m2") == (
        "--kv-cache-dtype fp8_e5m2: vLLM's own CPU FP8 attention")


def test_perplexity_windows_and_scoring_modes():
    windows = perplexity.cut_windows(list(range(25)), prompt_tokens=3, score_tokens=5,
                                     num_windows=None)
    assert windows == [([0, 1, 2], [3, 4, 5, 6, 7]), ([8, 9, 10], [11, 12, 13, 14, 15]),
                       ([16, 17, 18], [19, 20, 21, 22, 23])]
    with pytest.raises(ValueError, match="4 wanted"):
        perplexity.cut_windows(list(range(25)), 3, 5, num_windows=4)
    # Dense vLLM and H2O are always scored by decode.
    assert perplexity.scoring_of("eval-prefill", None) == "decode"
    assert perplexity.scoring_of("eval-prefill", {"policy": "h2o", "budget": 0.1}) == "decode"
    assert perplexity.scoring_of("eval-prefill", {"budget": 0.1}) == "eval-prefill"
    assert perplexity.scoring_of("decode", {"policy": "quest", "budget": 0.1}) == "decode"


def _ppl_result(policy, budget, value):
    return {"label": policy or "vllm", "policy": policy, "budget": budget, "scoring": "decode",
            "mean_nll": math.log(value), "perplexity": value, "selected_fraction": None,
            "score_seconds": 1.0}


def test_perplexity_tables_and_plot(tmp_path):
    results = [_ppl_result(None, None, 10.0), _ppl_result("infinigen", 0.1, 12.0),
               _ppl_result("infinigen", 0.2, 11.0), _ppl_result("h2o", 0.1, 15.0),
               _ppl_result("infinigen", 1.0, 10.0) | {"label": "control", "alpha": 1e4}]
    table = perplexity.budget_table(results)
    assert "| infinigen | 12.000 | 11.000 |" in table
    assert "| h2o | 15.000 |  |" in table
    assert "1.200" in perplexity.results_table(results)  # 12 / 10 (÷ dense)
    panels = perplexity.plot_panels(results)
    assert panels[0].references == {"dense vLLM": 10.0, "select-all control": 10.0}
    assert sorted(panels[0].series["infinigen"]) == [(0.1, 12.0), (0.2, 11.0)]
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_EXTRA)
    assert report.plot_quality_vs_budget(tmp_path / "p.png", panels).stat().st_size > 0


def test_mc_scoring_for_each_setting():
    assert mc_tasks.scoring_for("decode", {"budget": 0.1}) == "decode"
    # Dense vLLM keeps eval-prefill: its prompt logprobs are dense, as it serves them.
    assert mc_tasks.scoring_for("eval-prefill", None) == "eval-prefill"
    assert mc_tasks.scoring_for("eval-prefill", {"policy": "quest", "budget": 0.1}) == (
        "eval-prefill")
    assert mc_tasks.scoring_for("eval-prefill", {"policy": "h2o", "budget": 0.1}) == "decode"
    with pytest.raises(ValueError, match="scoring"):
        mc_tasks.scoring_for("prefill", None)


# -- lm_eval_serve.py: lm-eval's side ------------------------------------------

def test_task_yamls_use_the_local_files_and_the_evaluated_split_for_shots(tmp_path):
    import yaml  # vLLM's own dependency
    texts = lm_eval_tasks.write_task_yamls(tmp_path / "tasks", tmp_path, list(mc_prompts.TASKS))
    for name, text in texts.items():
        config = yaml.safe_load((tmp_path / "tasks" / f"local_{name}.yaml").read_text())
        assert config == yaml.safe_load(text)
        assert config["task"] == f"local_{name}"
        assert config["fewshot_split"] == config["test_split"] == "test"
        assert config["dataset_kwargs"]["data_files"] == {
            "test": str(tmp_path / mc_prompts.TASKS[name].file)}
        assert [m["metric"] for m in config["metric_list"]] == list(
            mc_prompts.TASKS[name].lm_eval_metrics)
    rte = yaml.safe_load(texts["rte"])
    assert rte["dataset_path"] == "csv" and rte["dataset_kwargs"]["sep"] == "\t"
    assert yaml.safe_load(texts["copa"])["dataset_path"] == "json"


def test_ours_equal_the_requests_lm_eval_built(tmp_path):
    """Our (context, continuation) pairs equal those lm-eval's own TaskManager
    built from our YAMLs (recorded in tests/reference, lm-eval 0.4.13 as pinned)."""
    recorded = lm_eval_requests.load_recorded()
    provenance = recorded["provenance"]
    assert provenance["lm_eval"] == "0.4.13"
    assert (provenance["limit"], provenance["num_fewshot"], provenance["fewshot_seed"]) == (
        lm_eval_requests.LIMIT, lm_eval_requests.NUM_FEWSHOT, mc_prompts.FEWSHOT_SEED)
    assert sorted(recorded["requests"]) == sorted(mc_prompts.TASKS)
    lm_eval_requests.write_task_files(tmp_path / "data")
    for name, theirs in recorded["requests"].items():
        ours = lm_eval_serve.our_prompts(name, tmp_path / "data", limit=lm_eval_requests.LIMIT,
                                         num_fewshot=lm_eval_requests.NUM_FEWSHOT)
        assert len(theirs) == lm_eval_requests.LIMIT
        assert lm_eval_requests.as_lists({name: ours})[name] == theirs, name


def test_lm_eval_builds_the_same_requests_as_mc_tasks(tmp_path, monkeypatch):
    """lm-eval's own TaskManager on our YAMLs: the same contexts, shots and
    continuations as ours, and as the recording the test above reads."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (the bench extra)")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    theirs = lm_eval_requests.lm_eval_requests(tmp_path)
    assert sorted(theirs) == sorted(mc_prompts.TASKS)
    for name, docs in theirs.items():
        ours = lm_eval_serve.our_prompts(name, tmp_path / "data", limit=lm_eval_requests.LIMIT,
                                         num_fewshot=lm_eval_requests.NUM_FEWSHOT)
        assert docs == [list(map(tuple, doc)) for doc in ours], name
    assert lm_eval_requests.as_lists(theirs) == lm_eval_requests.load_recorded()["requests"]


def _lm_eval_output(out_dir, lls: list[list[float]]) -> None:
    """A minimal lm-eval 0.4 output: results_*.json and samples_local_copa_*.jsonl."""
    model_dir = out_dir / "tiny"
    model_dir.mkdir(parents=True)
    (model_dir / "results_2026-01-01T00-00-00.json").write_text(json.dumps(
        {"results": {"local_copa": {"alias": "local_copa", "acc,none": 0.5,
                                    "acc_stderr,none": 0.5}}}))
    samples = [{"doc_id": doc_id, "arguments": {
                    f"gen_args_{i}": {"arg_0": "ctx", "arg_1": f" c{i}"} for i in range(2)},
                "filtered_resps": [[str(ll), "False"] for ll in doc_lls]}
               for doc_id, doc_lls in reversed(list(enumerate(lls)))]
    (model_dir / "samples_local_copa_2026-01-01T00-00-00.jsonl").write_text(
        "\n".join(json.dumps(s) for s in samples) + "\n")


def test_read_lm_eval_output_and_compare_with_ours(tmp_path):
    _lm_eval_output(tmp_path, [[-1.0, -2.0], [-3.0, -2.5]])
    out = lm_eval_tasks.read_lm_eval_output(tmp_path)
    assert out["copa"]["acc"] == 0.5 and out["copa"]["acc_norm"] is None
    assert [d["doc_id"] for d in out["copa"]["docs"]] == [0, 1]  # sorted
    assert out["copa"]["docs"][1]["loglikelihoods"] == [-3.0, -2.5]
    assert out["copa"]["docs"][0]["requests"] == [("ctx", " c0"), ("ctx", " c1")]
    ours = {"acc": 0.5, "acc_norm": 1.0, "doc_loglikelihoods": [[-1.0, -2.0], [-2.0, -2.5]]}
    prompts = [[("ctx", " c0"), ("ctx", " c1")], [("ctx", " c0"), ("ctx", " other")]]
    row = lm_eval_serve.compare_task(out["copa"], ours, prompts)
    assert row["acc_equal"] and row["ours_acc_norm"] is None  # lm-eval reports no acc_norm
    assert (row["docs_compared"], row["same_choice"], row["same_prompts"]) == (2, 1, 1)
    assert row["max_abs_dll"] == 1.0
    with pytest.raises(FileNotFoundError):
        lm_eval_tasks.read_lm_eval_output(tmp_path / "empty")


def test_serve_configs_and_lm_eval_command():
    infinigen = lm_eval_serve.ServeConfig("infinigen", 0.2)
    assert infinigen.label == "infinigen b=0.2" and infinigen.mode == "infinigen"
    assert infinigen.serve_args(16) == [
        "--kv-manager", "infinigen", "--infinigen-policy", "infinigen", "--infinigen-budget",
        "0.2", "--infinigen-eval-dense-prefix", "16", "--infinigen-min-context", "0"]
    dense = lm_eval_serve.ServeConfig()
    assert (dense.label, dense.mode, dense.serve_args(16)) == ("dense", "vllm", [])
    command = lm_eval_tasks.lm_eval_command(
        "http://127.0.0.1:8000", "/m", ["copa", "rte"], limit=20, num_fewshot=5,
        max_length=2048, batch_size=1, include_path="/t", output_path="/o")
    model_args = dict(arg.split("=", 1) for arg in command[command.index("--model_args") + 1]
                      .split(","))
    assert model_args["base_url"] == "http://127.0.0.1:8000/v1/completions"
    assert (model_args["tokenized_requests"], model_args["add_bos_token"],
            model_args["max_length"], model_args["tokenizer"]) == ("True", "True", "2048", "/m")
    assert command[command.index("--tasks") + 1] == "local_copa,local_rte"
    assert "--log_samples" in command and command[1] == "run"


def test_comparison_rows_tables_and_notes(tmp_path):
    _lm_eval_output(tmp_path, [[-1.0, -2.0], [-3.0, -2.5]])
    lm_eval = {"dense": lm_eval_tasks.read_lm_eval_output(tmp_path),
               "infinigen b=0.2": lm_eval_tasks.read_lm_eval_output(tmp_path)}
    ours = [{"kv_manager": "vllm", "task": "copa", "acc": 0.5, "acc_norm": 0.5,
             "doc_loglikelihoods": [[-1.0, -2.0], [-3.0, -2.5]]},
            {"kv_manager": "infinigen", "task": "copa", "acc": 0.0, "acc_norm": 0.0,
             "doc_loglikelihoods": [[-2.5, -2.0], [-3.0, -2.5]]}]
    batched = [dict(r, doc_loglikelihoods=[[x + 1e-5 for x in doc] for doc in
                                            r["doc_loglikelihoods"]]) for r in ours]
    configs = [lm_eval_serve.ServeConfig(), lm_eval_serve.ServeConfig("infinigen", 0.2)]
    rows = lm_eval_serve.comparison(configs, lm_eval, ours, {}, batched)
    assert [(r["config"], r["acc_equal"], r["same_choice"]) for r in rows] == [
        ("dense", True, 2), ("infinigen b=0.2", False, 1)]
    assert rows[1]["batched_max_abs_dll"] == pytest.approx(1.5 - 1e-5)
    table = lm_eval_serve.comparison_table(rows)
    assert "| copa | infinigen b=0.2 | 2 | 0.500 / 0.000 **differ** |  |" in table
    assert "| dense | 1 | 0.500 | 0.500 | yes |" in lm_eval_serve.mean_table(rows)
    note = lm_eval_serve.batching_note(rows, 1)
    assert "within 1.0e-05 nats" in note and "Answers changed: 1." in note
    assert "N = 16" in lm_eval_serve.DENSE_PREFIX_NOTE.format(n=16, shortest=100, longest=700)


def test_a_tree_whose_only_changes_are_results_is_clean(tmp_path, monkeypatch):
    """A benchmark that rewrites its own results files as it goes (vllm_bench.sh) still
    names a clean tree; any other tracked change makes it dirty."""

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.md").write_text("old\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    monkeypatch.delenv("INFINIGEN_COMMIT", raising=False)
    monkeypatch.setattr(report, "REPO", tmp_path)
    (tmp_path / "benchmarks" / "results" / "run.md").write_text("new\n")
    assert report.repository_state()["repo_uncommitted_changes"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert report.repository_state()["repo_uncommitted_changes"] is True


def test_results_name_the_processor_and_its_vector_set(tmp_path):
    """The same code runs about twice as fast on an AVX-512 host as on an AVX2 one:
    the machine line names which, from /proc/cpuinfo's first processor."""
    info = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma avx512f\n\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert report.processor(info) == {"cpu_model": "AMD EPYC", "cpu_vectors": "AVX-512"}
    assert report.processor(info.replace(" avx512f", ""))["cpu_vectors"] == "AVX2"
    assert report.processor("model name\t: X\nflags\t: fpu sse\n")["cpu_vectors"] is None
    meta = report.run_metadata()
    assert "cpu_model" in meta and "cpu_vectors" in meta
    base = {"command": "c", "machine": "Linux", "cpus": 2, "python": "3", "date_utc": "d"}
    line = next(line for line in report.metadata_markdown(
        {**base, "cpu_model": "AMD EPYC", "cpu_vectors": "AVX2"}).splitlines()
        if line.startswith("- machine:"))
    assert line.startswith("- machine: Linux, 2 CPUs (AMD EPYC, AVX2); python 3")
    old = next(line for line in report.metadata_markdown(base).splitlines()
               if line.startswith("- machine:"))
    assert old.startswith("- machine: Linux, 2 CPUs; python 3")  # results written before
