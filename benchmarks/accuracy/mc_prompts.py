# SPDX-License-Identifier: Apache-2.0
"""The multiple-choice tasks of mc_tasks.py as lm-eval defines them: prompts, few-shot, metrics.

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

"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUM_FEWSHOT = 5
FEWSHOT_SEED = 1234  # lm-eval's default few-shot seed
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"

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
