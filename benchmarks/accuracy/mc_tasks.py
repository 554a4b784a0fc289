# SPDX-License-Identifier: Apache-2.0
"""5-shot log-likelihood multiple choice (COPA, OpenBookQA, PIQA, WinoGrande, RTE) under selection.

Scored as lm-evaluation-harness 0.4 scores these tasks (its task configs
``copa``, ``openbookqa``, ``piqa``, ``winogrande`` and ``rte`` (GLUE); written
here from its definitions, not imported): per choice, the summed log-likelihood
of the continuation tokens given the context, then

- ``acc``: the choice with the largest summed log-likelihood is the gold one;
- ``acc_norm``: the same after dividing each by the choice's length in
  characters (lm-eval's ``acc_norm``: ``len(choice)``, not bytes);
- ``acc_bytes``: divided by the choice's length in UTF-8 bytes (lm-eval's
  ``acc_bytes``; equal to ``acc_norm`` on ASCII text).

lm-eval's own configs report ``acc`` and ``acc_norm`` for OpenBookQA and
PIQA, ``acc`` alone for COPA, WinoGrande and RTE. WinoGrande puts the choices
in the context (partial evaluation: one context per option, the same
continuation), so it has no length-normalised score here.

Prompts (lm-eval's plain-text rendering, no chat template)::

    shot_1 ... shot_5 (each: text + " " + answer + "\\n\\n") + text   |   " " + choice

Few-shot examples come from the evaluated file itself (no training split is
available here), drawn as lm-eval's default sampler does when the few-shot
split is the test split: one ``random.Random(1234)`` over the task, n + 1
drawn per document, the document itself removed. Tokens: the tokenizer's
defaults (BOS for Llama tokenizers, as lm-eval's vLLM backend), trailing
context spaces moved into the continuation, the continuation's tokens taken
from the encoded whole; over-long inputs lose tokens on the left.

Scoring (``--scoring``):

- ``decode`` (default): InfiniGen sparsifies decode only, so the last
  ``--decode-context-tokens`` of the context and every continuation token are
  teacher-forced through decode: each continuation token is predicted in a
  decode step, under the selection; the rest of the context is prefilled densely;
- ``eval-prefill``: each (context, continuation) in one prefill, scored from
  its prompt logprobs (what lm-eval reads from ``/v1/completions``), on an
  engine in InfiniGen's evaluation mode with ``--eval-dense-prefix N``: every
  row at position >= N, context included, attends over the selection as a
  decode row would. H2O has no evaluation mode and is scored by decode; dense
  vLLM is scored from its (dense) prompt logprobs.

``--policy`` adds the runtime's baseline rules (H2O, StreamingLLM, Quest) at
the same budgets, switched on the same engine. Example::

    flock /tmp/engine.lock python benchmarks/accuracy/mc_tasks.py --limit 20 \\
        --kv-manager vllm infinigen --budget 0.05 0.1 0.2
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.accuracy import report  # noqa: E402
from benchmarks.accuracy.harness import (  # noqa: E402
    KV_MANAGERS,
    POLICIES,
    SelectionMeter,
    batched,
    default_path,
    is_control,
    policy_of,
    selection_grid,
    start_engine,
    sweep,
)

DEFAULT_MODEL = default_path("models/gutenberg-llama-2k")
DEFAULT_DATA = default_path("data/lm-eval")
DEFAULT_OUT = report.RESULTS_DIR / "mc_tasks"
NUM_FEWSHOT = 5
FEWSHOT_SEED = 1234  # lm-eval's default few-shot seed
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
SCORINGS = ("decode", "eval-prefill")


@dataclass(frozen=True)
class Task:
    """One task in lm-eval's terms, over the local file's rows.

    ``doc_to_text`` returns the context text, or (multiple input, WinoGrande)
    the gold index into ``doc_to_choice``, whose entries are then contexts.
    ``doc_to_target`` returns the gold index, or (multiple input) the
    continuation shared by every context.
    """

    name: str
    file: str
    doc_to_text: Callable[[dict], str | int]
    doc_to_choice: Callable[[dict], list[str]]
    doc_to_target: Callable[[dict], int | str]
    multiple_input: bool = False
    lm_eval_metrics: tuple[str, ...] = ("acc",)


def _piqa_text(doc: dict) -> str:
    # The file holds "Question: {goal}\n"; lm-eval's text is "Question: {goal}\nAnswer:".
    query = doc["query"]
    if not (query.startswith("Question: ") and query.endswith("\n")):
        raise ValueError(f"unexpected PIQA query {query!r}")
    goal = query[len("Question: "):-1]
    return f"Question: {goal}\nAnswer:"


TASKS: dict[str, Task] = {
    # lm-eval super_glue/copa: premise without its period + " because"/" therefore"
    # (the file's query); choices " " + choice with a lower-cased first letter (the
    # file's choices, lower-cased already). With the " " target delimiter the
    # continuation starts with two spaces, as in lm-eval.
    "copa": Task("copa", "copa.jsonl", lambda d: d["query"],
                 lambda d: [" " + c for c in d["choices"]], lambda d: d["gold"]),
    # lm-eval openbookqa: question_stem | choices.text
    "openbookqa": Task("openbookqa", "openbookqa.jsonl", lambda d: d["query"],
                       lambda d: list(d["choices"]), lambda d: d["gold"],
                       lm_eval_metrics=("acc", "acc_norm")),
    # lm-eval piqa: "Question: {goal}\nAnswer:" | [sol1, sol2]
    "piqa": Task("piqa", "piqa.jsonl", _piqa_text, lambda d: list(d["choices"]),
                 lambda d: d["gold"], lm_eval_metrics=("acc", "acc_norm")),
    # lm-eval winogrande: contexts sentence[:blank] + option | the rest of the sentence
    "winogrande": Task("winogrande", "winogrande.jsonl", lambda d: d["gold"],
                       lambda d: list(d["context_options"]), lambda d: d["continuation"],
                       multiple_input=True),
    # lm-eval glue/rte: "{s1}\nQuestion: {s2} True or False?\nAnswer:" | True/False
    "rte": Task("rte", "rte_dev.tsv",
                lambda d: f"{d['sentence1']}\nQuestion: {d['sentence2']} True or False?\nAnswer:",
                lambda d: ["True", "False"], lambda d: int(d["label"])),
}


def load_docs(task: Task, data_dir: Path) -> list[dict]:
    """The task's rows: JSON lines, or (RTE) GLUE's tab-separated file."""
    path = Path(data_dir) / task.file
    if path.suffix == ".tsv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def sample_fewshot(docs: Sequence[dict], doc: dict, num_fewshot: int,
                   rng: random.Random) -> list[dict]:
    """lm-eval's default sampler over the evaluated split: n + 1 drawn, ``doc`` removed."""
    if num_fewshot == 0:
        return []
    drawn = rng.sample(list(docs), num_fewshot + 1)
    shots = [d for d in drawn if d != doc][:num_fewshot]
    if len(shots) < num_fewshot:  # duplicates of doc were drawn
        shots = rng.sample([d for d in docs if d != doc], num_fewshot)
    return shots


def shot_text(task: Task, shot: dict) -> str:
    """A solved example: text + target delimiter + answer + few-shot delimiter."""
    text, choices, target = task.doc_to_text(shot), task.doc_to_choice(shot), task.doc_to_target(shot)
    if task.multiple_input:
        text, answer = choices[text], target
    else:
        answer = choices[target] if isinstance(target, int) else target
    return text + TARGET_DELIMITER + answer + FEWSHOT_DELIMITER


def build_requests(task: Task, doc: dict, shots: Sequence[dict]) -> list[tuple[str, str]]:
    """(context, continuation) per choice, as lm-eval's ``construct_requests``."""
    prefix = "".join(shot_text(task, shot) for shot in shots)
    choices = task.doc_to_choice(doc)
    if task.multiple_input:
        continuation = TARGET_DELIMITER + task.doc_to_target(doc)
        return [(prefix + context, continuation) for context in choices]
    context = prefix + task.doc_to_text(doc)
    return [(context, TARGET_DELIMITER + choice) for choice in choices]


def gold_index(task: Task, doc: dict) -> int:
    return task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)


def encode_pair(encode: Callable[[str], list[int]], context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair`` for causal models.

    Trailing spaces of the context move to the continuation; the whole text is
    encoded once and the continuation is what follows the encoded context.
    """
    if not context:
        raise ValueError("empty context")
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


def truncate_left(context_ids: Sequence[int], continuation_ids: Sequence[int],
                  max_model_len: int) -> tuple[list[int], list[int]]:
    """Keeps the last ``max_model_len - 1`` tokens (lm-eval's vLLM backend).

    Raises:
        ValueError: If no context token would be left.
    """
    keep = max_model_len - 1
    whole = list(context_ids) + list(continuation_ids)
    context_len = len(context_ids) - max(0, len(whole) - keep)
    if context_len < 1:
        raise ValueError(f"a {len(continuation_ids)}-token continuation leaves no context "
                         f"within {keep} tokens")
    kept = whole[-keep:]
    return kept[:context_len], kept[context_len:]


def first_argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first on ties (``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def mc_metrics(loglikelihoods: Sequence[float], choices: Sequence[str], gold: int,
               multiple_input: bool = False) -> dict[str, float | None]:
    """lm-eval's acc, acc_norm (per character) and acc_bytes of one document.

    The first maximum wins ties (``numpy.argmax``). Multiple-input tasks have no
    normalised scores (their choices are contexts, not continuations).
    """
    if len(loglikelihoods) != len(choices) or not 0 <= gold < len(choices):
        raise ValueError(f"{len(loglikelihoods)} scores, {len(choices)} choices, gold {gold}")

    result: dict[str, float | None] = {
        "acc": float(first_argmax(loglikelihoods) == gold), "acc_norm": None, "acc_bytes": None}
    if not multiple_input:
        per_char = [ll / len(c) for ll, c in zip(loglikelihoods, choices)]
        per_byte = [ll / len(c.encode("utf-8")) for ll, c in zip(loglikelihoods, choices)]
        result["acc_norm"] = float(first_argmax(per_char) == gold)
        result["acc_bytes"] = float(first_argmax(per_byte) == gold)
    return result


@dataclass
class Request:
    """One (document, choice) pair, tokenized."""

    task: str
    doc_index: int
    choice_index: int
    context_ids: list[int]
    continuation_ids: list[int]
    truncated: bool


def task_requests(task: Task, docs: Sequence[dict], limit: int | None,
                  encode: Callable[[str], list[int]], max_model_len: int,
                  num_fewshot: int = NUM_FEWSHOT) -> list[Request]:
    """Every (document, choice) request of the first ``limit`` documents."""
    rng = random.Random(FEWSHOT_SEED)
    requests = []
    for doc_index, doc in enumerate(docs[:limit]):
        shots = sample_fewshot(docs, doc, num_fewshot, rng)
        for choice_index, (context, continuation) in enumerate(build_requests(task, doc, shots)):
            context_ids, continuation_ids = encode_pair(encode, context, continuation)
            kept_context, kept_continuation = truncate_left(
                context_ids, continuation_ids, max_model_len)
            requests.append(Request(task.name, doc_index, choice_index, kept_context,
                                    kept_continuation, len(kept_context) < len(context_ids)))
    return requests


def score_requests(llm, requests: Sequence[Request], decode_context_tokens: int,
                   batch_size: int, desc: str) -> list[float]:
    """Summed continuation log-likelihood per request, every continuation token in decode."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import score_continuations, split_for_decode

    sums: list[float] = []
    with tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr) as bar:
        for chunk in batched(requests, batch_size):
            cut = [min(decode_context_tokens, len(r.context_ids) - 1) for r in chunk]
            pairs = [split_for_decode(r.context_ids, r.continuation_ids, n)
                     for r, n in zip(chunk, cut)]
            scores = score_continuations(llm, *zip(*pairs))
            sums += [sum(logprobs[n:]) for logprobs, n in zip(scores, cut)]
            bar.update(len(chunk))
    return sums


def score_requests_prefill(llm, requests: Sequence[Request], batch_size: int,
                           desc: str) -> list[float]:
    """Summed continuation log-likelihood per request, from one prefill's prompt logprobs."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import prefill_scores

    sums: list[float] = []
    with tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr) as bar:
        for chunk in batched(requests, batch_size):
            scores = prefill_scores(llm, [r.context_ids for r in chunk],
                                    [r.continuation_ids for r in chunk])
            sums += [sum(logprobs) for logprobs in scores]
            bar.update(len(chunk))
    return sums


def scoring_for(requested: str, setting: dict | None) -> str:
    """The scoring a setting gets: ``eval-prefill`` falls back to decode for H2O only.

    Dense vLLM (``setting`` None) keeps ``eval-prefill``: its prompt logprobs
    are dense attention, which is what dense vLLM serves.
    """
    if requested not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {requested!r}")
    if requested == "eval-prefill" and policy_of(setting) == "h2o":
        return "decode"
    return requested


def aggregate(task: Task, docs: Sequence[dict], requests: Sequence[Request],
              loglikelihoods: Sequence[float]) -> dict[str, Any]:
    """Mean acc / acc_norm / acc_bytes over the task's documents."""
    by_doc: dict[int, list[float]] = {}
    for request, ll in zip(requests, loglikelihoods):
        by_doc.setdefault(request.doc_index, []).append(ll)
    per_doc = [mc_metrics(lls, task.doc_to_choice(docs[i]), gold_index(task, docs[i]),
                          task.multiple_input) for i, lls in sorted(by_doc.items())]
    out: dict[str, Any] = {"num_docs": len(per_doc)}
    for metric in ("acc", "acc_norm", "acc_bytes"):
        values = [d[metric] for d in per_doc if d[metric] is not None]
        out[metric] = sum(values) / len(values) if values else None
    out["chance"] = sum(1 / len(task.doc_to_choice(docs[i])) for i in by_doc) / len(by_doc)
    out["doc_loglikelihoods"] = [by_doc[i] for i in sorted(by_doc)]
    return out


def prediction_agreement(reference: Sequence[Sequence[float]],
                         compared: Sequence[Sequence[float]]) -> dict[str, float]:
    """How often the compared run picks the reference's choice, and how far its scores move.

    Args:
        reference, compared: Per document, the summed log-likelihood of each choice.

    Returns:
        ``same_choice``: fraction of documents with the same (first) argmax;
        ``mean_abs_delta``: mean |difference| of the choices' log-likelihoods.
    """
    if [len(d) for d in reference] != [len(d) for d in compared]:
        raise ValueError("the runs scored different documents or choices")
    same = [first_argmax(a) == first_argmax(b) for a, b in zip(reference, compared)]
    deltas = [abs(x - y) for a, b in zip(reference, compared) for x, y in zip(a, b)]
    return {"same_choice": sum(same) / len(same), "mean_abs_delta": sum(deltas) / len(deltas)}


def add_dense_agreement(results: Sequence[dict]) -> None:
    """Adds ``prediction_agreement`` with the dense (vllm) run of the same task, in place."""
    dense = {r["task"]: r for r in results if r["kv_manager"] == "vllm"}
    for r in results:
        if r["task"] in dense:
            r.update({f"vs_dense_{k}": v for k, v in prediction_agreement(
                dense[r["task"]]["doc_loglikelihoods"], r["doc_loglikelihoods"]).items()})


def mode_label(kv_manager: str, setting: dict | None) -> str:
    """"vllm" (dense), the selection policy, or the select-all control."""
    if setting is None:
        return kv_manager
    if is_control(setting):
        return "infinigen select-all (control)"
    return policy_of(setting)


def run_engine(args: argparse.Namespace, kv_manager: str,
               work: dict[str, tuple[Task, list[dict], list[Request]]]) -> list[dict]:
    """One engine; per selection setting, every task."""
    infinigen = {"budget": args.budget[0]} if kv_manager == "infinigen" else None
    results = []
    eval_mode = {"eval_dense_prefix": args.eval_dense_prefix}
    with start_engine(str(args.model), kv_manager, max_model_len=args.max_model_len,
                      infinigen=infinigen, kv_cache_memory_bytes=args.kv_cache_bytes) as llm:
        for setting in sweep(llm, kv_manager, selection_grid(
                args.budget, args.policy, args.select_all_control)):
            mode = mode_label(kv_manager, setting)
            label = mode if setting is None else f"{mode} b={setting['budget']:g}"
            scoring = scoring_for(args.scoring, setting)
            switch = scoring == "eval-prefill" and setting is not None
            if switch:
                llm.collective_rpc("set_infinigen_selection", kwargs=eval_mode)
            for name, (task, docs, requests) in work.items():
                start = time.perf_counter()
                with SelectionMeter(llm) as meter:
                    if scoring == "eval-prefill":
                        lls = score_requests_prefill(llm, requests, args.batch_size,
                                                     f"{name} [{label}, eval-prefill]")
                    else:
                        lls = score_requests(llm, requests, args.decode_context_tokens,
                                             args.batch_size, f"{name} [{label}]")
                results.append({
                    "kv_manager": mode, "budget": (setting or {}).get("budget"),
                    "task": name, "scoring": scoring,
                    **aggregate(task, docs, requests, lls),
                    "selected_fraction": meter.fraction,
                    "seconds": time.perf_counter() - start,
                })
            if switch:
                llm.collective_rpc("set_infinigen_selection",
                                   kwargs={"eval_dense_prefix": None})
    return results


def results_table(results: Sequence[dict]) -> str:
    rows = [[r["task"], r["kv_manager"], report.cell(r["budget"], "g"), r["scoring"],
             str(r["num_docs"]),
             f"{r['acc']:.3f}", report.cell(r["acc_norm"], ".3f"), f"{r['chance']:.3f}",
             report.cell(r.get("vs_dense_same_choice"), ".3f"),
             report.cell(r.get("vs_dense_mean_abs_delta"), ".3f"),
             report.cell(r["selected_fraction"], ".3f")] for r in results]
    return report.markdown_table(
        ["task", "mode", "budget", "scoring", "docs", "acc", "acc_norm", "chance",
         "same choice as dense", "mean abs dLL vs dense", "selected fraction"], rows)


def mean_table(results: Sequence[dict]) -> tuple[str, dict[tuple, dict]]:
    """Mean acc / acc_norm over the tasks, per (mode, budget)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kv_manager"], r["budget"]), []).append(r)
    means = {}
    rows = []
    for (mode, budget), group in groups.items():
        norms = [r["acc_norm"] for r in group if r["acc_norm"] is not None]
        means[(mode, budget)] = {
            "acc": sum(r["acc"] for r in group) / len(group),
            "acc_norm": sum(norms) / len(norms) if norms else None}
        rows.append([mode, report.cell(budget, "g"), str(len(group)),
                     f"{means[(mode, budget)]['acc']:.3f}",
                     report.cell(means[(mode, budget)]["acc_norm"], ".3f")])
    return report.markdown_table(
        ["mode", "budget", "tasks", "mean acc", "mean acc_norm (tasks that have it)"],
        rows), means


def plot_panels(results: Sequence[dict]) -> list[report.Panel]:
    """One panel per task (acc), dense as a reference line."""
    panels: dict[str, report.Panel] = {}
    for r in results:
        panel = panels.setdefault(r["task"], report.Panel(r["task"], "acc"))
        if r["budget"] is None:
            panel.references[f"{r['kv_manager']} (dense)"] = r["acc"]
        elif r["kv_manager"].endswith("(control)"):
            continue  # the select-all control equals dense; it is in the table
        else:
            panel.series.setdefault(r["kv_manager"], []).append((r["budget"], r["acc"]))
        panel.references.setdefault("chance", r["chance"])
    agree = report.Panel("all tasks: same choice as dense", "fraction of documents")
    by_mode: dict[str, dict[float, list[float]]] = {}
    for r in results:
        if (r["budget"] is not None and not r["kv_manager"].endswith("(control)")
                and r.get("vs_dense_same_choice") is not None):
            by_mode.setdefault(r["kv_manager"], {}).setdefault(r["budget"], []).append(
                r["vs_dense_same_choice"])
    for mode, by_budget in by_mode.items():
        agree.series[mode] = [(b, sum(v) / len(v)) for b, v in by_budget.items()]
    agree.references["vllm (dense)"] = 1.0
    return [*panels.values(), agree] if by_mode else list(panels.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--limit", type=int, default=None,
                        help="first N documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=NUM_FEWSHOT)
    parser.add_argument("--kv-manager", nargs="+", default=list(KV_MANAGERS),
                        choices=KV_MANAGERS, help="one engine each, one after the other")
    parser.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.1, 0.2],
                        help="InfiniGen budgets, swept on one engine")
    parser.add_argument("--policy", nargs="+", default=["infinigen"], choices=POLICIES,
                        help="selection rules (--infinigen-policy), swept on the InfiniGen engine")
    parser.add_argument("--no-select-all-control", dest="select_all_control",
                        action="store_false",
                        help="skip the control (budget 1, alpha 1e4: should equal dense)")
    parser.add_argument("--scoring", choices=SCORINGS, default="decode",
                        help="decode: teacher forcing; eval-prefill: prompt logprobs of one "
                             "prefill in InfiniGen's evaluation mode (H2O: decode)")
    parser.add_argument("--eval-dense-prefix", type=int, default=16,
                        help="eval-prefill: rows at positions >= N attend over the selection")
    parser.add_argument("--decode-context-tokens", type=int, default=8,
                        help="last context tokens forced through decode with the continuation")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="requests per engine call (progress granularity)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="results stem: writes .json, .md and .png")
    args = parser.parse_args(argv)
    if not all(0 < b <= 1 for b in args.budget):
        parser.error("--budget values must be in (0, 1]")
    if args.decode_context_tokens < 1:
        parser.error("--decode-context-tokens must be >= 1: the first continuation "
                     "token would be scored by the dense prefill")
    if args.eval_dense_prefix < 1:
        parser.error("--eval-dense-prefix must be >= 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (args.model, args.data_dir):
        if not path.exists():
            print(f"skipped: {path} is absent", file=sys.stderr)
            return 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))

    def encode(text: str) -> list[int]:
        return tokenizer(text).input_ids

    work = {}
    for name in args.tasks:
        task = TASKS[name]
        docs = load_docs(task, args.data_dir)
        work[name] = (task, docs, task_requests(task, docs, args.limit, encode,
                                                args.max_model_len, args.num_fewshot))
    results = [r for kv in args.kv_manager for r in run_engine(args, kv, work)]
    add_dense_agreement(results)

    stats = {name: {"requests": len(reqs), "truncated": sum(r.truncated for r in reqs),
                    "mean_context_tokens": sum(len(r.context_ids) for r in reqs) / len(reqs),
                    "mean_continuation_tokens":
                        sum(len(r.continuation_ids) for r in reqs) / len(reqs)}
             for name, (_, _, reqs) in work.items()}
    mean_md, _ = mean_table(results)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta = report.run_metadata(model=str(args.model))
    if args.scoring == "eval-prefill":
        how = (f"each request is scored from the prompt logprobs of one prefill in InfiniGen's "
               f"evaluation mode (rows at positions >= {args.eval_dense_prefix}, context "
               "included, attend over the selection; H2O by decode, dense vLLM from its dense "
               "prompt logprobs)")
    else:
        how = (f"the last {args.decode_context_tokens} context tokens and every continuation "
               "token are teacher-forced through decode (InfiniGen's selection applies to "
               "every scored token)")
    sections = [
        f"Model `{args.model}`, {args.num_fewshot}-shot, first {args.limit or 'all'} "
        f"documents per task; {how}. acc_norm: lm-eval's per-character normalisation "
        "(none for WinoGrande). 'same choice as dense': fraction of documents where the "
        "run picks the choice dense vLLM picks; 'mean abs dLL': mean absolute change of a "
        "choice's summed log-likelihood (nats) against dense.",
        "## Per task", results_table(results),
        "## Mean over tasks", mean_md,
        "## Inputs", report.markdown_table(
            ["task", "requests", "truncated", "mean context tokens", "mean continuation tokens"],
            [[n, str(s["requests"]), str(s["truncated"]), f"{s['mean_context_tokens']:.0f}",
              f"{s['mean_continuation_tokens']:.1f}"] for n, s in stats.items()]),
    ]
    png = report.try_plot(args.out.with_suffix(".png"), plot_panels(results),
                          f"{args.num_fewshot}-shot multiple choice, {args.model.name}")
    if png:
        sections.append(f"![acc vs budget]({png.name})")
    report.write_results(args.out, meta, "Multiple choice (lm-eval style) under decode-time "
                         "selection", {**settings, "inputs": stats}, results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
