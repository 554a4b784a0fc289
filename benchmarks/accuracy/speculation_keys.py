# SPDX-License-Identifier: Apache-2.0
"""Which form of InfiniGen's speculation keys keeps the needle at today's bytes (issue #24).

A torch-only harness (no vLLM engine): ``sparse_llama.SparseLlama`` runs a
Hugging Face Llama in float32 with the product's selection in every layer past
the first ``--dense-layers`` (previous-layer speculation: layer l's query from
layer l-1's attention input, RoPE at the row's position, scored per KV head as
the max over its query group against layer l's keys in the candidate form,
``speculative_selection``), sequentially layer by layer. Candidate forms
(``key_forms``) are compared at the bytes per token per KV head of today's
partial keys, r x D channels (r 0.2) in the cache's dtype: 32 R bits in a
float32 cache, 16 R bits in a bfloat16 one (R = int(0.2 D): 12 of 64, 6 of 32).

Tasks, as the product's benchmarks run them:

- ``recall-llama-12l``, ``recall-llama-1k``: ``recall-1k.jsonl``; the prompt
  is dense but its last 3 tokens, which attend over their selections as the
  decode steps of ``retrieval.py`` do; the answer is the argmax at the last one.
- ``gutenberg-llama-2k``: perplexity of held-out Frankenstein, windows of
  64 + 960 tokens, every row past the 64-token dense prefix over its own
  selection (``--infinigen-eval-dense-prefix 64``).

Skews are calibrated on task-style text: ``retrieval.synthetic_recall_text``
(seeds 12345 and 23456, 2,048 tokens) for the recall models, 2,048 tokens of
Pride and Prejudice (a training book) for gutenberg. Each setting is a form x
budget x rule: ``alpha`` (alpha 5, capped by the budget: the product's
default) or ``cap`` (alpha 1000: k = floor(budget x context)). A control (full
keys, select all) must equal dense. Example (about 75 minutes, 1 thread)::

    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.accuracy.speculation_keys

Results: ``benchmarks/results/speculation_keys.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.accuracy import retrieval, speculation_keys_report
from benchmarks.accuracy.key_forms import FormSpec, KeyForm
from benchmarks.accuracy.sparse_llama import Selector, SparseLlama
from benchmarks.accuracy.speculative_selection import (
    CAP_BINDING_ALPHA,
    SelectionCounts,
    make_selector,
)
from benchmarks.harness import paths, report

DEFAULT_OUT = paths.RESULTS / "speculation_keys"
PARTIAL_RATIO = 0.2
RULES = {"alpha": 5.0, "cap": CAP_BINDING_ALPHA}
RECALL_DECODE_ROWS = 3  # QUERY k ANSWER go through decode (retrieval.py)
BOOK_PREFIX, BOOK_SCORED = 64, 960
CALIBRATION_TOKENS = 2048
RECALL_SEEDS = (12345, 23456)  # attribution.py's in-domain texts; retrieval.py uses the first

# (cache dtype whose bytes the form matches, form). Channel fractions are of
# head_dim D; R = int(0.2 D); 0.375 D = 2R for D = 64 and 32.
FORMS: list[tuple[str, FormSpec]] = [
    ("reference", FormSpec("full keys fp32", "identity", "fp32", 1.0)),
    ("fp32", FormSpec("today: skew r0.2 fp32", "skew-today", "fp32")),
    ("fp32", FormSpec("skew |qV| r0.2 fp32", "skew-q", "fp32")),
    ("fp32", FormSpec("skew artifact union fp32", "skew-union", "fp32")),
    ("fp32", FormSpec("skew union-matched r0.2 fp32", "skew-union-matched", "fp32")),
    ("fp32", FormSpec("lowrank R fp32", "lowrank", "fp32")),
    ("fp32", FormSpec("skew 2R bf16", "skew-today", "bf16", 0.375)),
    ("fp32", FormSpec("lowrank 2R bf16", "lowrank", "bf16", 0.375)),
    ("fp32", FormSpec("skew all int4 asym/blk", "skew-all", "block-int", 1.0, 4, True)),
    ("fp32", FormSpec("raw all int4 asym/blk", "identity", "block-int", 1.0, 4, True)),
    ("fp32", FormSpec("skew all int5 sym/blk", "skew-all", "block-int", 1.0, 5)),
    ("fp32", FormSpec("skew all int4 sym/blk", "skew-all", "block-int", 1.0, 4)),
    ("fp32", FormSpec("raw all int4 sym/blk", "identity", "block-int", 1.0, 4)),
    ("fp32", FormSpec("hadamard all int4 sym/token", "hadamard", "token-int", 1.0, 4)),
    ("fp32", FormSpec("hadamard all int5 sym/token", "hadamard", "token-int", 1.0, 5)),
    ("fp32", FormSpec("today fp32 + rerank 2x", "skew-today", "fp32", rerank=2)),
    ("fp32", FormSpec("today fp32 + rerank 4x", "skew-today", "fp32", rerank=4)),
    ("bf16", FormSpec("today: skew r0.2 bf16", "skew-today", "bf16")),
    ("bf16", FormSpec("lowrank R bf16", "lowrank", "bf16")),
    ("bf16", FormSpec("skew 2R fp8", "skew-today", "fp8", 0.375)),
    ("bf16", FormSpec("lowrank 2R fp8", "lowrank", "fp8", 0.375)),
    ("bf16", FormSpec("skew all int2 sym/blk", "skew-all", "block-int", 1.0, 2)),
    ("bf16", FormSpec("raw all int2 sym/blk", "identity", "block-int", 1.0, 2)),
    ("bf16", FormSpec("skew D/2 int4 asym/blk", "skew-all", "block-int", 0.5, 4, True)),
    ("bf16", FormSpec("skew 3D/4 int3 sym/blk", "skew-all", "block-int", 0.75, 3)),
    ("bf16", FormSpec("hadamard all int2 asym/token", "hadamard", "token-int", 1.0, 2, True)),
    ("bf16", FormSpec("today bf16 + rerank 2x", "skew-today", "bf16", rerank=2)),
    ("bf16", FormSpec("today bf16 + rerank 4x", "skew-today", "bf16", rerank=4)),
]
CONTROL = FormSpec("control: full keys, select all", "identity", "fp32", 1.0)


@dataclass(frozen=True)
class Task:
    name: str
    model: Path
    metric: str  # accuracy | perplexity


TASKS = {
    "recall-llama-12l": Task("recall-llama-12l", paths.shared_path("models/recall-llama-12l"),
                             "accuracy"),
    "recall-llama-1k": Task("recall-llama-1k", retrieval.DEFAULT_MODEL, "accuracy"),
    "gutenberg-llama-2k": Task("gutenberg-llama-2k", paths.GUTENBERG, "perplexity"),
}


def calibration_texts(task: Task, recall_seeds: int = 2,
                      override: Path | None = None) -> list[str]:
    if override is not None:
        return [override.read_text(encoding="utf-8")]
    if task.metric == "accuracy":
        return [retrieval.synthetic_recall_text(seed) for seed in RECALL_SEEDS[:recall_seeds]]
    return [paths.shared_path("data/text/gutenberg-pride-and-prejudice.txt").read_text()]


def sequences(task: Task, args, data: Path = retrieval.DEFAULT_DATA) -> list[dict]:
    """Token ids, dense rows P, and what is scored, per sequence (``data``: the recall
    prompts; the book's windows come from Frankenstein)."""
    if task.metric == "accuracy":
        rows = retrieval.load_examples(data, args.limit)
        return [{"ids": row["prompt_token_ids"],
                 "num_dense": len(row["prompt_token_ids"]) - RECALL_DECODE_ROWS,
                 "answer": row["answer_token_ids"][0], "bucket": row["bucket"]}
                for row in rows]
    from benchmarks.accuracy import perplexity

    ids = perplexity.tokenize_text(str(task.model), perplexity.FRANKENSTEIN.read_text())
    windows = perplexity.cut_windows(ids, BOOK_PREFIX, BOOK_SCORED, args.num_windows)
    return [{"ids": prompt + scored, "num_dense": BOOK_PREFIX} for prompt, scored in windows]


@dataclass
class Run:
    """One setting's sparse passes: its tally, its selector (made with ``counts=`` the
    tally's counts, fresh per sequence) and whose query speculates; ``control`` runs
    are checked against dense."""

    tally: Tally
    selector: Callable[[SelectionCounts], Selector]
    speculation: str
    control: bool = False


def tally_sequences(sparse_model: SparseLlama, data: list[dict], runs: list[Run],
                    dense: Tally, name: str) -> float:
    """Per sequence a dense pass (into ``dense``), then every run's sparse pass over the
    rows past its dense prefix (into the run's tally), with progress on stderr.

    Returns:
        The control runs' max |logit - dense| over every sequence.
    """
    max_control_diff = 0.0
    start = time.perf_counter()
    for index, seq in enumerate(data):
        prefix = sparse_model.dense_pass(seq["ids"])
        first = seq["num_dense"]
        dense_logits = prefix.logits[first - 1:]
        dense.add(seq, dense_logits)
        for run in runs:
            began = time.perf_counter()
            logits = sparse_model.sparse_pass(prefix, first, run.selector(counts=run.tally.counts),
                                              run.speculation)
            logits = torch.cat([prefix.logits[first - 1:first], logits])
            run.tally.add(seq, logits)
            run.tally.seconds += time.perf_counter() - began
            if run.control:
                max_control_diff = max(max_control_diff,
                                       float((logits - dense_logits).abs().max()))
        print(f"[{name}] {index + 1}/{len(data)} sequences, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return max_control_diff


class Tally:
    """One setting's running metric over the sequences."""

    def __init__(self, metric: str):
        self.metric = metric
        self.hits: dict[str, list[int]] = {}
        self.nll = 0.0
        self.num_tokens = 0
        self.counts = SelectionCounts()
        self.seconds = 0.0

    def add(self, seq: dict, logits: torch.Tensor) -> None:
        """``logits``: [T - P + 1, V], rows P-1 .. T-1."""
        if self.metric == "accuracy":
            hit = int(int(logits[-1].argmax()) == seq["answer"])
            for key in ("all", seq["bucket"]):
                self.hits.setdefault(key, []).append(hit)
            return
        targets = torch.as_tensor(seq["ids"][seq["num_dense"]:])
        logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
        self.nll -= float(logprobs.gather(1, targets[:, None]).sum())
        self.num_tokens += targets.shape[0]

    def result(self) -> dict:
        out = {"density": self.counts.density, "seconds": round(self.seconds, 1)}
        if self.counts.reranked:
            out["rerank_density"] = self.counts.rerank_density
        if self.counts.per_layer:
            out["density_per_layer"] = {str(layer): s / c for layer, (s, c)
                                        in sorted(self.counts.per_layer.items())}
        if self.metric == "accuracy":
            out["value"] = sum(self.hits["all"]) / len(self.hits["all"])
            out["buckets"] = {b: sum(h) / len(h) for b, h in self.hits.items() if b != "all"}
            out["n"] = len(self.hits["all"])
        else:
            out["mean_nll"] = self.nll / self.num_tokens
            out["value"] = math.exp(out["mean_nll"])
            out["num_scored_tokens"] = self.num_tokens
        return out


def run_task(task: Task, args) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_infinigen.skewing.calibration import calibration_chunks

    model = AutoModelForCausalLM.from_pretrained(
        str(task.model), dtype=getattr(torch, args.model_dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(task.model))
    sparse_model = SparseLlama(model, args.dense_layers)
    chunks = calibration_chunks(tokenizer, calibration_texts(task, args.recall_seeds,
                                                  args.calibration_text),
                                CALIBRATION_TOKENS,
                                model.config.max_position_embeddings)
    calibration = sparse_model.calibration_activations(chunks)
    head_dim = sparse_model.head_dim
    partial = max(1, int(head_dim * PARTIAL_RATIO))
    layers = range(args.dense_layers, sparse_model.num_layers)
    wanted = [(group, spec) for group, spec in FORMS
              if not args.forms or any(f in spec.name for f in args.forms) or group == "reference"]
    forms = [(group, spec, KeyForm(spec, calibration, partial, layers)) for group, spec in wanted]
    control = KeyForm(CONTROL, calibration, partial, layers)
    settings = [(group, spec, form, budget, rule) for group, spec, form in forms
                for budget in args.budget for rule in args.rules]
    settings.append(("control", CONTROL, control, 1.0, "cap"))
    tallies = [Tally(task.metric) for _ in settings]
    dense = Tally(task.metric)
    data = sequences(task, args)
    runs = [Run(tally, functools.partial(
                make_selector, form, scale=sparse_model.scale, alpha=RULES[rule],
                budget=budget, rerank=spec.rerank, block_size=args.block_size),
                args.speculation, control=group == "control")
            for (group, spec, form, budget, rule), tally in zip(settings, tallies)]
    max_control_diff = tally_sequences(sparse_model, data, runs, dense, task.name)
    results = [{"task": task.name, "group": "dense", "form": "dense", **dense.result()}]
    for (group, spec, form, budget, rule), tally in zip(settings, tallies):
        results.append({"task": task.name, "group": group, "form": spec.name,
                        "spec": asdict(spec), "budget": budget, "rule": rule,
                        "bits_per_token": form.bits, "mean_channels": form.mean_channels,
                        **tally.result()})
    info = {"head_dim": head_dim, "partial_channels": partial,
            "num_kv_heads": sparse_model.num_kv_heads, "group": sparse_model.group,
            "sparse_layers": list(layers), "calibration_tokens": sum(map(len, chunks)),
            "num_sequences": len(data), "max_control_logit_diff": max_control_diff,
            "budget_bits": {"fp32": 32 * partial, "bf16": 16 * partial}}
    return results, info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--rules", nargs="+", choices=sorted(RULES), default=["alpha", "cap"])
    parser.add_argument("--forms", nargs="*", default=None,
                        help="only forms whose name contains one of these (and the reference)")
    parser.add_argument("--speculation", choices=("previous-layer", "same-layer"),
                        default="previous-layer")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=0,
                        help="select whole blocks of this many tokens (0: tokens, the "
                        "CPU build's rule; 16: a device block cache's)")
    parser.add_argument("--limit", type=int, default=None, help="recall: first N prompts")
    parser.add_argument("--num-windows", type=int, default=4,
                        help="gutenberg: windows of 64 + 960 tokens")
    parser.add_argument("--calibration-text", type=Path, default=None,
                        help="calibrate every task on this file instead of its own kind of text "
                        "(e.g. vllm_infinigen/assets/calibration.txt: how much a wrong text costs)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's weights and activations (bfloat16: as vLLM on CPU "
                        "runs these float32 checkpoints)")
    parser.add_argument("--recall-seeds", type=int, choices=(1, 2), default=2,
                        help="recall calibration texts (1: retrieval.py's single sequence)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md from the .json at --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        meta, settings, payload = saved["meta"], saved["settings"], saved["results"]
    else:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        meta = report.run_metadata()  # the source as it was when the run started
        payload = {"results": [], "tasks": {}}
        for name in args.tasks:
            results, info = run_task(TASKS[name], args)
            payload["results"] += results
            payload["tasks"][name] = info
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    sections = speculation_keys_report.sections(payload, settings)
    report.write_results(args.out, meta, "Speculation keys that find the needle (issue #24)",
                         settings, payload, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
