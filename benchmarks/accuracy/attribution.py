# SPDX-License-Identifier: Apache-2.0
"""Where InfiniGen's selection loses accuracy: each approximation alone, the others exact.

A sparse layer should attend to the tokens its own query scores highest.
InfiniGen approximates that choice five ways:

1. speculation: the query is built from the previous layer's attention input
   (``--infinigen-speculation previous-layer``), not the layer's own;
2. speculation keys: scores use compressed keys, ``int`` (every channel in
   4 bits in a float32 cache, the default) or ``partial`` (r x head_dim
   skewed channels, ``--infinigen-partial-ratio``), not the full keys;
3. alpha count: it keeps as many tokens as score within alpha of the best
   (capped by the budget), not a fixed k = budget x context;
4. calibration text: the skew of the partial keys comes from a text;
5. dense layers: the first ``--infinigen-dense-layers`` layers attend densely.

The exact reference selects, per KV head, the top floor(budget x context)
tokens by the layer's own query and full keys: ``same-layer``, partial keys
at r = 1 (the skew is then an orthogonal rotation, so the scores are exact
whatever the calibration), alpha 1e4 (the count is always the cap: fixed k)
and 2 dense layers. Each factor is then switched to InfiniGen's setting alone::

    exact                 same-layer      r = 1        fixed k   2 dense
    (1) speculation       previous-layer  r = 1        fixed k   2 dense
    (2) speculation keys  same-layer      int, r < 1   fixed k   2 dense   in-domain skew
    (3) alpha count       same-layer      r = 1        alpha 5   2 dense
    (4) calibration       same-layer      r = 0.2      fixed k   2 dense   each text
    (5) dense layers      same-layer      r = 1        fixed k   each --dense-layers-factor
    defaults              previous-layer  int          alpha 5   2 dense   (r 0.2 beside)

Tasks (``--tasks``): ``recall`` and ``recall-12l``, the answer accuracy of
recall-llama-1k and recall-llama-12l on the same 1,024-token prompts (the
answer is predicted in a decode step, ``retrieval.py``; per needle bucket
too); ``book``, gutenberg-llama-2k's perplexity on held-out Frankenstein
(evaluation mode, ``perplexity.py``). One engine per (keys, r, calibration,
dense layers), swept over speculation x rule x budget with
``set_infinigen_selection`` (``Variant.combos``: the full 2 x 2 where a row
or the previous-layer comparison reads it, only what the factor's rows read
elsewhere); dense vLLM and a select-all control (must equal dense) per task.
Calibration texts (partial keys only): the task's own kind of text
(``in-domain``: synthetic recall sequences from a seeded generator, not the
evaluation file; Frankenstein past the scored windows), the bundled book
excerpt (``book``) and the children's story bundled before it (``story``);
a text the product refuses (English for the recall models' word-level
tokenizer) is recorded as refused. Example (about two hours on 2 cores)::

    flock /tmp/engine.lock python -m benchmarks.accuracy.attribution

Results: ``benchmarks/results/attribution.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.accuracy import attribution_report, perplexity, retrieval, sweeps
from benchmarks.harness import paths, report
from benchmarks.harness.engines import SELECT_ALL
from vllm_infinigen.config import PAPER_ALPHA_ROPE, InfiniGenConfig

FULL_KEYS = 1.0
DEFAULT_RATIO = InfiniGenConfig.partial_ratio
DEFAULT_KEYS = InfiniGenConfig.speculation_keys
FIXED_K_ALPHA = SELECT_ALL["alpha"]  # every score within reach: the budget is the count
RULES = {"fixed-k": FIXED_K_ALPHA, "alpha": PAPER_ALPHA_ROPE}  # every model uses RoPE
SPECULATIONS = ("same-layer", "previous-layer")
CALIBRATIONS = ("in-domain", "book", "story")
EVERY_COMBO = tuple((spec, rule) for spec in SPECULATIONS for rule in RULES)
FIXED_K_COMBOS = tuple((spec, "fixed-k") for spec in SPECULATIONS)
DEFAULT_OUT = paths.RESULTS / "attribution"


@dataclass
class Task:
    """One model and its metric; ``score`` returns the metric and the measured density."""

    name: str
    model: Path
    metric: str
    higher_is_better: bool
    max_model_len: int
    data: Any = None
    score: Callable[[Any, Any, dict | None], dict] | None = None
    in_domain: list[str] | None = None  # calibration texts of the task's own kind


@dataclass(frozen=True)
class Variant:
    """One InfiniGen engine and the (speculation, rule) pairs it is swept over.

    ``keys`` "int" has no r and no calibration; "partial" at r with a skew
    calibrated on ``calibration``.
    """

    keys: str
    r: float | None
    calibration: str | None
    dense_layers: int
    combos: tuple[tuple[str, str], ...] = EVERY_COMBO


# What the report needs of each task (``--render`` builds tasks from this alone).
TASK_INFO = {"recall": (retrieval.DEFAULT_MODEL, "accuracy", True, 1088),
             "book": (perplexity.GUTENBERG, "perplexity", False, 1025),
             "recall-12l": (paths.shared_path("models/recall-llama-12l"), "accuracy", True, 1088)}


def recall_task(args: argparse.Namespace, name: str = "recall") -> Task:
    rows = retrieval.load_examples(retrieval.DEFAULT_DATA, args.limit)

    def score(llm, data, setting):
        with sweeps.SelectionMeter(llm) as meter:
            predictions, logprobs = retrieval.answer(
                llm, data, 3, args.batch_size, f"{name} {_short(setting)}")
        correct = [p == row["answer_token_ids"][0] for p, row in zip(predictions, data)]
        accuracy = retrieval.bucket_accuracy(data, correct)
        return {"value": accuracy["all"]["acc"], "density": meter.fraction,
                "buckets": {b: accuracy[b]["acc"] for b in retrieval.BUCKETS},
                "mean_answer_logprob": sum(logprobs) / len(logprobs)}

    # Two 1,024-token sequences in the task's layout, seeds unlike the evaluation file's.
    in_domain = [retrieval.synthetic_recall_text(seed) for seed in (12345, 23456)]
    return Task(name, *TASK_INFO[name], rows, score, in_domain)


def book_task(args: argparse.Namespace) -> Task:
    text = perplexity.FRANKENSTEIN.read_text(encoding="utf-8")
    ids = perplexity.tokenize_text(str(perplexity.GUTENBERG), text)
    windows = perplexity.cut_windows(ids, 64, 960, args.num_windows)
    scored_chars = len(text) * (len(windows) * 1024) // len(ids)

    def score(llm, data, setting):
        kv_manager = "vllm" if setting is None else "infinigen"
        result = perplexity.score(llm, data, kv_manager, setting, "eval-prefill")
        return {"value": result["perplexity"], "density": result["selected_fraction"],
                "mean_nll": result["mean_nll"]}

    # The held-out book past the scored windows (which start at its beginning).
    start = max(scored_chars * 2, len(text) // 2)
    return Task("book", *TASK_INFO["book"], windows, score, [text[start:]])


TASKS = {"recall": recall_task, "book": book_task,
         "recall-12l": lambda args: recall_task(args, "recall-12l")}


def _short(setting: dict | None) -> str:
    if setting is None:
        return "dense"
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in setting.items())


def calibration_texts(task: Task, calibration: str) -> list[str]:
    if calibration == "in-domain":
        return task.in_domain
    if calibration == "book":
        from vllm_infinigen.skewing.calibration import CALIBRATION_TEXT

        return [CALIBRATION_TEXT.read_text(encoding="utf-8")]
    return [paths.STORY_TEXT.read_text(encoding="utf-8")]


def engine_variants(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(r, calibration) of each partial-keys engine: full keys, the r sweep on
    in-domain text, the calibration sweep at the default r."""
    variants = [(FULL_KEYS, "in-domain")]
    variants += [(r, "in-domain") for r in args.partial_ratio]
    variants += [(DEFAULT_RATIO, c) for c in args.calibration]
    return list(dict.fromkeys(variants))


def variants(args: argparse.Namespace) -> list[Variant]:
    """Every InfiniGen engine, the exact reference first (it runs the control).

    Full keys, int keys and r 0.2 on in-domain text: the whole grid (the
    factors, the defaults and the previous-layer comparison read them). The
    other r: fixed k, both speculations (the keys factor and its prefetch
    counterpart). Other calibrations: the calibration factor and the partial
    keys' default. The dense-layers factor: full keys, fixed k.
    """
    out = []
    for r, calibration in engine_variants(args):
        if calibration == "in-domain" and r in (FULL_KEYS, DEFAULT_RATIO):
            combos = EVERY_COMBO
        elif calibration == "in-domain":
            combos = FIXED_K_COMBOS
        else:
            combos = (("same-layer", "fixed-k"), ("previous-layer", "alpha"))
        out.append(Variant("partial", r, calibration, args.dense_layers, combos))
        if r == FULL_KEYS:
            out.append(Variant("int", None, None, args.dense_layers))
    out += [Variant("partial", FULL_KEYS, "in-domain", n, FIXED_K_COMBOS)
            for n in args.dense_layers_factor if n != args.dense_layers]
    return out


def grid(budgets: Sequence[float], combos: Sequence[tuple[str, str]] = EVERY_COMBO) -> list[dict]:
    return [{"speculation": spec, "alpha": RULES[rule], "budget": budget}
            for spec, rule in combos for budget in budgets]


def rule_of(setting: dict) -> str:
    return "fixed-k" if setting["alpha"] == FIXED_K_ALPHA else "alpha"


def artifact_density(budget: float, prompt_tokens: int = 64, score_tokens: int = 960) -> float:
    """Density the artifact's cap gives a window of scored rows at a nominal budget.

    The artifact caps every row at budget x the final length (rows shorter
    than that attend densely); ours caps a row at budget x its own context.
    Mean over the scored rows (context p = prompt_tokens .. P + S - 1) of
    min(1, budget x (P + S) / p), for a fixed k.
    """
    final = prompt_tokens + score_tokens
    contexts = range(prompt_tokens, final)
    return sum(min(1.0, budget * final / p) for p in contexts) / len(contexts)


def infinigen_settings(variant: Variant, skew_file: str | None) -> dict:
    """Start-up settings of a variant's engine."""
    if variant.keys == "int":
        return {"speculation_keys": "int", "dense_layers": variant.dense_layers}
    return {"speculation_keys": "partial", "partial_ratio": variant.r, "skew_file": skew_file,
            "dense_layers": variant.dense_layers}


def run_engine(task: Task, args, variant: Variant | None, skew_file: str | None,
               settings: Sequence[tuple[str, dict]]) -> list[dict]:
    """Scores ``settings`` ((kind, setting) pairs) on one engine; dense vLLM without variant."""
    infinigen = None if variant is None else infinigen_settings(variant, skew_file)
    engine_fields = {"keys": None, "r": None, "calibration": None, "dense_layers": None}
    if variant is not None:
        engine_fields = {"keys": variant.keys, "r": variant.r,
                         "calibration": variant.calibration, "dense_layers": variant.dense_layers}
    results = []
    with sweeps.start_engine(str(task.model), "infinigen" if infinigen else "vllm",
                             max_model_len=task.max_model_len, infinigen=infinigen,
                             kv_cache_memory_bytes=args.kv_cache_bytes) as llm:
        pending = list(settings)
        while pending:
            kind, setting = pending.pop(0)
            if setting is not None:
                llm.collective_rpc("set_infinigen_selection", kwargs={
                    k: v for k, v in setting.items() if k != "matched_budget"})
            start = time.perf_counter()
            scored = task.score(llm, task.data, setting)
            result = {"task": task.name, "kind": kind, **engine_fields, **(setting or {}),
                      "rule": rule_of(setting) if setting else None,
                      **scored, "seconds": time.perf_counter() - start}
            results.append(result)
            print(f"[{task.name} {engine_fields} {kind} {_short(setting)}] "
                  f"{task.metric} {scored['value']:.4f} density "
                  f"{report.cell(scored['density'], '.3f')}", file=sys.stderr, flush=True)
            if variant is not None and variant.dense_layers == args.dense_layers:
                pending += follow_ups(task, variant.r, kind, setting, scored)
    return results


def follow_ups(task: Task, r: float | None, kind: str, setting: dict | None,
               scored: dict) -> list[tuple[str, dict]]:
    """Density-matched settings a result asks for (same engine, run after the grid).

    ``r`` is the partial ratio, None for the int keys. Full keys, same-layer,
    alpha rule at density d < budget: fixed k at budget d (is the alpha count
    worse than keeping as many of the best?). Book task, previous-layer and
    alpha with the int keys (the defaults) or the partial keys at the default
    r: the same at the artifact's density for the nominal budget.
    """
    if kind != "grid" or setting is None or rule_of(setting) != "alpha":
        return []
    out = []
    density = scored["density"]
    if (r == FULL_KEYS and setting["speculation"] == "same-layer" and density
            and density < 0.95 * setting["budget"]):
        out.append(("density-matched", {"speculation": "same-layer", "alpha": FIXED_K_ALPHA,
                                        "budget": round(density, 4),
                                        "matched_budget": setting["budget"]}))
    if (task.name == "book" and r in (None, DEFAULT_RATIO)
            and setting["speculation"] == "previous-layer"):
        out.append(("artifact-density", {**setting,
                                         "budget": round(artifact_density(setting["budget"]), 4),
                                         "matched_budget": setting["budget"]}))
    return out


def run_task(task: Task, args, tmp: Path) -> list[dict]:
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import save_skew_tables

    results = run_engine(task, args, None, None, [("dense", None)])
    calibration_tokens: dict[tuple[float, str], int] = {}
    for index, variant in enumerate(variants(args)):
        path = None
        if variant.keys == "partial":
            path = tmp / f"{task.name}-r{variant.r}-{variant.calibration}.safetensors"
            if (variant.r, variant.calibration) not in calibration_tokens:
                try:
                    tables = compute_skew_tables(str(task.model), variant.r,
                                                 calibration_texts(task, variant.calibration))
                except ValueError as e:  # the product refuses text the tokenizer cannot read
                    results.append({"task": task.name, "kind": "refused", "keys": "partial",
                                    "r": variant.r, "calibration": variant.calibration,
                                    "dense_layers": variant.dense_layers, "error": str(e)})
                    print(f"[{task.name} {variant}] refused: {e}", file=sys.stderr, flush=True)
                    continue
                save_skew_tables(tables, str(path))
                calibration_tokens[(variant.r, variant.calibration)] = tables.calibration_tokens
        settings = [("grid", s) for s in grid(args.budget, variant.combos)]
        if index == 0:
            settings.append(("control", {"speculation": "previous-layer", **SELECT_ALL}))
        engine_results = run_engine(task, args, variant, path and str(path), settings)
        for result in engine_results:
            result["calibration_tokens"] = calibration_tokens.get((variant.r, variant.calibration))
        results += engine_results
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--partial-ratio", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5],
                        help="r values below 1 (in-domain skew); r = 1 always runs")
    parser.add_argument("--calibration", nargs="+", choices=CALIBRATIONS,
                        default=list(CALIBRATIONS), help="texts compared at the default r")
    parser.add_argument("--dense-layers", type=int, default=InfiniGenConfig.dense_layers)
    parser.add_argument("--dense-layers-factor", type=int, nargs="*", default=[1],
                        help="dense layers compared with --dense-layers (full keys, fixed k); "
                             "one engine each")
    parser.add_argument("--limit", type=int, default=None, help="recall: first N prompts")
    parser.add_argument("--num-windows", type=int, default=4,
                        help="book: windows of 64 + 960 tokens")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--batch-size", type=int, default=50,
                        help="recall: requests per engine call (progress granularity)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="results stem: writes .json, .md and .png")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md and .png from the .json at --out")
    args = parser.parse_args(argv)
    sweeps.check_budgets(parser, args.budget)
    if not all(0 < r < 1 for r in args.partial_ratio):
        parser.error("--partial-ratio values must be in (0, 1); r = 1 always runs")
    if min(args.dense_layers, *args.dense_layers_factor) < 1:
        parser.error("--dense-layers and --dense-layers-factor values must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        meta, settings, results = report.read_results(args.out)
        args = argparse.Namespace(**{**settings, "out": args.out})
        tasks = [Task(name, *TASK_INFO[name]) for name in args.tasks]
    else:
        tasks = [TASKS[name](args) for name in args.tasks
                 if not sweeps.inputs_missing(TASK_INFO[name][0])]
        results = []
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            for task in tasks:
                results += run_task(task, args, Path(tmp))
        meta = report.run_metadata(run_minutes=round((time.perf_counter() - start) / 60, 1))
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        settings["tasks"] = [task.name for task in tasks]
    sections, control_ok = attribution_report.sections(tasks, results, args)
    if meta.get("run_minutes") is not None:
        sections.insert(0, f"Run time: {meta['run_minutes']:g} minutes (every engine and "
                        "calibration, under the engine lock on this machine).")
    png = report.try_plot(args.out.with_suffix(".png"),
                          attribution_report.panels(tasks, results, args), "accuracy attribution")
    if png:
        sections.append(f"![metric vs attended density]({png.name})")
    report.write_results(args.out, meta, "Where InfiniGen's selection loses accuracy",
                         settings, results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0 if control_ok else 1


if __name__ == "__main__":
    sys.exit(main())
