# SPDX-License-Identifier: Apache-2.0
"""Long-range retrieval accuracy (recall-llama-1k) per needle depth, answered in decode steps.

Each prompt of ``recall-1k.jsonl`` is 1,024 tokens: a body of 24 ``SEP k v``
pairs in filler, then ``QUERY k ANSWER``; the expected next token is ``v``.
Prefill is dense, so the query is moved into decode::

    prompt  [<s> ... body ... | QUERY k ANSWER]  answer v
            prefilled (dense)   teacher-forced through decode, v forced last

At the last forced step (input ANSWER) the model's distribution over the
answer is computed under InfiniGen's selection; the prediction is its argmax
(the rank-1 token, from vLLM's raw logprobs), correct if it is ``v``.
Accuracy is reported per needle bucket (needle depth = key position / prompt
length: first quarter < 0.25 <= middle < 0.75 <= last quarter).

Settings: dense vLLM; each ``--policy`` (InfiniGen, or the runtime's
baselines H2O, StreamingLLM, Quest) at each ``--budget`` (one engine per
``--dense-layers`` and ``--calibration`` value, budgets swept on it).
``--calibration default`` (the default) runs the engine's own speculation keys
(the bounds, no skew); ``synthetic`` runs the partial keys with a skew
(partial-channel choice) calibrated on one 1,024-token sequence in the task's
format from a seeded generator (not from the evaluation file), prepared with
``vllm_infinigen.skewing`` as ``vllm-infinigen prepare`` does (results files
before the bounds were the product's default ran ``synthetic``, labelled so). With ``--streaming-approx``,
InfiniGen at budget 0.001 (1 selected token) plus sink 4 + recent 128: an
*approximation* of a StreamingLLM cache (first 4 + last 128 tokens) in the
sparse layers only (the dense layers still see everything, and the current
token and the one speculated token are attended too). Example::

    flock /tmp/engine.lock python -m benchmarks.accuracy.retrieval \\
        --budget 0.05 0.1 0.2 --dense-layers 2 1 --calibration default synthetic \\
        --streaming-approx
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.accuracy import sweeps
from benchmarks.harness import paths, report
from vllm_infinigen.config import SPECULATIONS, InfiniGenConfig

DEFAULT_MODEL = paths.shared_path("models/recall-llama-1k")
DEFAULT_DATA = paths.shared_path("data/recall/recall-1k.jsonl")
DEFAULT_OUT = paths.RESULTS / "retrieval"
BUCKETS = ("first_quarter", "middle", "last_quarter")
STREAMING_APPROX = {"budget": 0.001, "sink_tokens": 4, "recent_tokens": 128}
SEP, QUERY, ANSWER = 3, 4, 5
FILLERS, KEYS, VALUES = range(6, 16), range(16, 256), range(256, 512)


def depth_bucket(depth: float) -> str:
    """The needle bucket of a depth in [0, 1): quarter, half, quarter."""
    if not 0 <= depth <= 1:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    if depth < 0.25:
        return "first_quarter"
    return "middle" if depth < 0.75 else "last_quarter"


def load_examples(path: Path, limit: int | None) -> list[dict]:
    """The first ``limit`` rows of a ``.jsonl`` (or ``.jsonl.gz``) file, with ``bucket``
    checked against the depth rule."""
    rows = paths.read_jsonl(path)[:limit]
    for index, row in enumerate(rows):
        position = row["answer_positions"][0]
        depth = position / len(row["prompt_token_ids"])
        if depth_bucket(depth) != row["bucket"]:
            raise ValueError(f"row {index}: depth {depth:.4f} is not in bucket {row['bucket']}")
    return rows


def in_recent_window(row: dict, recent_tokens: int) -> bool:
    """Whether the needle's value token is among the last ``recent_tokens`` context tokens.

    At the answer step the context is the whole prompt but its last token
    (ANSWER, the current token); the value sits one after the key.
    """
    context = len(row["prompt_token_ids"]) - 1
    return row["answer_positions"][0] + 1 >= context - recent_tokens


def synthetic_recall_ids(seed: int = 12345, length: int = 1024, num_pairs: int = 24,
                         num_queries: int = 8) -> list[int]:
    """A sequence in the task's layout (README of recall-llama-1k), BOS excluded.

    Filler with ``num_pairs`` ``SEP k v`` pairs at random places (distinct
    keys), then ``num_queries`` ``QUERY k ANSWER v`` for keys of the body.
    """
    rng = random.Random(seed)
    body_len = length - 1 - 4 * num_queries
    keys = rng.sample(list(KEYS), num_pairs)
    values = [rng.choice(VALUES) for _ in keys]
    filler = [rng.choice(FILLERS) for _ in range(body_len - 3 * num_pairs)]
    slots = sorted(rng.sample(range(len(filler) + 1), num_pairs))  # pairs never nest
    body, start = [], 0
    for slot, key, value in zip(slots, keys, values):
        body += filler[start:slot] + [SEP, key, value]
        start = slot
    body += filler[start:]
    queries = []
    for index in rng.sample(range(num_pairs), num_queries):
        queries += [QUERY, keys[index], ANSWER, values[index]]
    return body + queries


def synthetic_recall_text(seed: int = 12345) -> str:
    """``synthetic_recall_ids`` as text: the model's word-level tokenizer reads
    ids written as "t<id>" and adds no BOS."""
    return "<s> " + " ".join(f"t{token}" for token in synthetic_recall_ids(seed))


def calibration_skew_file(model: Path, out_dir: Path) -> Path:
    """Skew tables calibrated on ``synthetic_recall_text`` (as ``vllm-infinigen prepare``)."""
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import save_skew_tables

    text = synthetic_recall_text()
    path = Path(out_dir) / "recall-synthetic.skew.safetensors"
    save_skew_tables(compute_skew_tables(str(model), 0.2, text, 1024), str(path))
    return path


def forced_pair(row: dict, decode_prompt_tokens: int) -> tuple[list[int], list[int]]:
    """(prefilled tokens, forced tokens): the prompt's tail and the answer go to decode."""
    from benchmarks.accuracy.teacher_forcing import split_for_decode

    return split_for_decode(row["prompt_token_ids"], row["answer_token_ids"][:1],
                            decode_prompt_tokens)


def top1(step: dict[int, Any]) -> int:
    """The rank-1 token of a step's vLLM logprobs (top-1 requested)."""
    ranked = [token for token, logprob in step.items() if logprob.rank == 1]
    if ranked:
        return min(ranked)
    return max(step, key=lambda token: step[token].logprob)


def bucket_accuracy(rows: Sequence[dict], correct: Sequence[bool]) -> dict[str, Any]:
    """Accuracy and count per bucket and overall."""
    out: dict[str, Any] = {}
    for bucket in BUCKETS:
        hits = [ok for row, ok in zip(rows, correct) if row["bucket"] == bucket]
        out[bucket] = {"n": len(hits), "acc": sum(hits) / len(hits) if hits else None}
    out["all"] = {"n": len(correct), "acc": sum(correct) / len(correct) if correct else None}
    return out


def answer(llm, rows: Sequence[dict], decode_prompt_tokens: int, batch_size: int,
           desc: str) -> tuple[list[int], list[float]]:
    """Argmax prediction and the answer's logprob at the answer step, per row."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import force_continuations

    predictions, logprobs = [], []
    with tqdm(total=len(rows), desc=desc, unit="prompt", file=sys.stderr) as bar:
        for chunk in sweeps.batched(rows, batch_size):
            pairs = [forced_pair(row, decode_prompt_tokens) for row in chunk]
            steps = force_continuations(llm, *zip(*pairs), num_logprobs=1)
            for row, sequence in zip(chunk, steps):
                last = sequence[-1]
                predictions.append(top1(last))
                logprobs.append(last[row["answer_token_ids"][0]].logprob)
            bar.update(len(chunk))
    return predictions, logprobs


def setting_label(setting: dict | None, variant: dict | None,
                  kv_cache_dtype: str = "auto") -> str:
    """"dense", or the policy (control, streaming approximation) and the engine
    variant; then the K/V format where it is not the model's."""
    cache = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} K/V"
    return _setting_label(setting, variant) + cache


def _setting_label(setting: dict | None, variant: dict | None) -> str:
    if setting is None or variant is None:
        return "dense"
    keys = (f"{InfiniGenConfig.speculation_keys} keys" if variant["calibration"] == "default"
            else f"partial keys, {variant['calibration']} skew")  # default: no skew file
    engine = f"{variant['dense_layers']} dense layers, {keys}"
    cap = setting.get("budget_tokens", variant.get("budget_tokens"))
    if cap:
        engine += f", cap {cap} tokens"
    if variant.get("speculation"):
        engine += f", {variant['speculation']}"
    if sweeps.is_control(setting):
        return f"select all (control), {engine}"
    if setting.get("recent_tokens"):
        return (f"streaming approx (sink {setting['sink_tokens']} + recent "
                f"{setting['recent_tokens']}), {engine}")
    return f"{sweeps.policy_of(setting)}, {engine}"


def evaluate(llm, rows, args, kv_manager: str, setting: dict | None,
             variant: dict | None) -> dict:
    label = setting_label(setting, variant, args.kv_cache_dtype)
    start = time.perf_counter()
    with sweeps.SelectionMeter(llm) as meter:
        predictions, logprobs = answer(llm, rows, args.decode_prompt_tokens, args.batch_size,
                                       f"{label} b={(setting or {}).get('budget', 1):g}")
    correct = [p == row["answer_token_ids"][0] for p, row in zip(predictions, rows)]
    result = {
        "label": label, "kv_manager": kv_manager, **(variant or {}),
        "budget": None, "sink_tokens": None, "recent_tokens": None, **(setting or {}),
        "policy": sweeps.policy_of(setting),
        "accuracy": bucket_accuracy(rows, correct),
        "mean_answer_logprob": sum(logprobs) / len(logprobs),
        "selected_fraction": meter.fraction,
        "seconds": time.perf_counter() - start,
        "correct": correct,
    }
    if setting and setting.get("recent_tokens"):
        inside = [in_recent_window(row, setting["recent_tokens"])
                  for row in rows]
        result["needles_in_recent_window"] = sum(inside)
        result["acc_needle_in_window"] = _mean([c for c, i in zip(correct, inside) if i])
        result["acc_needle_outside_window"] = _mean([c for c, i in zip(correct, inside) if not i])
    return result


def _mean(values: Sequence[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def run_engine(args, kv_manager: str, rows: Sequence[dict], variant: dict | None,
               skew_file: Path | None) -> list[dict]:
    """One engine: dense, or one InfiniGen variant (dense layers, calibration) swept."""
    settings = sweeps.selection_grid(args.budget, args.policy)
    if len(args.budget_tokens or []) > 1:  # the caps swept on the engine, each budget's
        settings = [{**setting, "budget_tokens": cap} for setting in settings
                    for cap in args.budget_tokens]
    if args.streaming_approx:
        explicit = {"policy": "infinigen"} if "policy" in settings[0] else {}
        settings.append({**explicit, **STREAMING_APPROX})
    if args.select_all_control:
        settings += [{**control, **({"budget_tokens": None} if args.budget_tokens else {})}
                     for control in sweeps.selection_grid([], args.policy,
                                                          select_all_control=True)]
    infinigen = None
    if kv_manager == "infinigen":
        infinigen = {"budget": args.budget[0], "dense_layers": variant["dense_layers"],
                     "min_context": args.min_context,
                     "budget_tokens": variant.get("budget_tokens"),
                     "speculation": variant.get("speculation")}
        if skew_file:  # a calibrated skew: the partial keys it is made for
            infinigen.update(speculation_keys="partial", skew_file=str(skew_file))
    with sweeps.start_engine(str(args.model), kv_manager, max_model_len=args.max_model_len,
                             infinigen=infinigen, kv_cache_memory_bytes=args.kv_cache_bytes,
                             kv_cache_dtype=args.kv_cache_dtype,
                             **rope_overrides(args.model, args.rope_linear_factor)) as llm:
        return [evaluate(llm, rows, args, kv_manager, setting, variant)
                for setting in sweeps.sweep(llm, kv_manager, settings)]


def rope_overrides(model: Path, factor: float | None) -> dict[str, Any]:
    """``LLM`` keyword arguments reading ``model`` with its RoPE positions interpolated
    linearly by ``factor`` (vLLM's ``hf_overrides``; what ``recall_lengths`` and the
    frontier measure with ``--rope-linear-factor``), or none."""
    if factor is None:
        return {}
    from benchmarks.accuracy.recall_lengths import model_config

    # the normalised config's rope_parameters: a legacy top-level theta kept
    return {"hf_overrides": {"rope_parameters": model_config(model, factor).rope_parameters}}


def results_table(results: Sequence[dict]) -> str:
    rows = []
    for r in results:
        acc = r["accuracy"]
        rows.append([r["label"], report.cell(r["budget"], "g"),
                     *[f"{acc[b]['acc']:.3f}" for b in (*BUCKETS, "all")],
                     f"{r['mean_answer_logprob']:.3f}",
                     report.cell(r["selected_fraction"], ".3f")])
    n = results[0]["accuracy"]
    return report.markdown_table(
        ["setting", "budget", f"first quarter (n={n['first_quarter']['n']})",
         f"middle (n={n['middle']['n']})", f"last quarter (n={n['last_quarter']['n']})",
         f"all (n={n['all']['n']})", "mean log p(answer)", "selected fraction"], rows)


def plot_panels(results: Sequence[dict]) -> list[report.Panel]:
    """Per bucket and overall: accuracy vs measured selected fraction; dense as a line.

    The x axis is the selected fraction of the sparse layers' context
    (counters), not the requested budget, so that the streaming approximation
    (budget 0.001 plus a 132-token window) sits at its real cost.
    """
    panels = []
    for bucket in (*BUCKETS, "all"):
        panel = report.Panel(bucket.replace("_", " "), "accuracy",
                             xlabel="selected fraction (sparse layers, measured)",
                             xscale="linear")
        for r in results:
            value = r["accuracy"][bucket]["acc"]
            if r["budget"] is None:
                panel.references["dense"] = value
            elif sweeps.is_control(r):
                continue  # the control equals dense; it is in the table
            elif r.get("recent_tokens"):
                panel.series.setdefault(
                    f"streaming approx, {r['dense_layers']} dense, {r['calibration']} skew",
                    []).append((r["selected_fraction"], value))
            else:
                panel.series.setdefault(r["label"], []).append((r["selected_fraction"], value))
        panels.append(panel)
    return panels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts (default: all)")
    parser.add_argument("--kv-manager", nargs="+", default=list(sweeps.KV_MANAGERS),
                        choices=sweeps.KV_MANAGERS)
    sweeps.add_selection_options(parser, [0.05, 0.1, 0.2])
    parser.add_argument("--dense-layers", type=int, nargs="+", default=[2],
                        help="InfiniGen dense layers; one engine per value")
    parser.add_argument("--budget-tokens", type=int, nargs="+", default=None,
                        help="--infinigen-budget-tokens: a cap in tokens beside each budget; "
                             "several: each swept on the engine (default: none)")
    parser.add_argument("--speculation", default=None, choices=SPECULATIONS,
                        help="--infinigen-speculation (default: the engine's, previous-layer)")
    sweeps.add_kv_cache_dtype_option(parser)
    parser.add_argument("--calibration", nargs="+", default=["default"],
                        choices=["default", "synthetic"],
                        help="default: the engine's speculation keys; synthetic: partial "
                             "keys with a skew calibrated on a synthetic recall sequence; "
                             "one engine per value")
    parser.add_argument("--streaming-approx", action="store_true",
                        help="also budget 0.001 + sink 4 + recent 128 (StreamingLLM-like, "
                             "sparse layers only)")
    parser.add_argument("--min-context", type=int, default=None,
                        help="--infinigen-min-context (default: 0, selecting at every "
                        "context; the product's default is 4096)")
    parser.add_argument("--rope-linear-factor", type=float, default=None,
                        help="read --model with its RoPE positions interpolated linearly by "
                        "this factor, in both engines (vLLM's --hf-overrides)")
    parser.add_argument("--decode-prompt-tokens", type=int, default=3,
                        help="prompt tokens forced through decode before the answer "
                             "(3: QUERY k ANSWER)")
    sweeps.add_run_options(parser, max_model_len=1088, kv_cache_bytes=256 << 20, batch_size=50,
                           out=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sweeps.check_budgets(parser, args.budget)
    if args.decode_prompt_tokens < 1:
        parser.error("--decode-prompt-tokens must be >= 1: the answer would come from "
                     "the dense prefill")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sweeps.inputs_missing(args.model, args.data):
        return 0
    rows = load_examples(args.data, args.limit)
    results = []
    with tempfile.TemporaryDirectory() as tmp, \
            sweeps.kv_cache_dtype_run(args.kv_cache_dtype) as attention:
        skew_files = {"default": None}
        if "infinigen" in args.kv_manager and "synthetic" in args.calibration:
            skew_files["synthetic"] = calibration_skew_file(args.model, Path(tmp))
        for kv_manager in args.kv_manager:
            if kv_manager != "infinigen":
                results += run_engine(args, kv_manager, rows, None, None)
                continue
            for dense_layers in args.dense_layers:
                for calibration in args.calibration:
                    variant = {"dense_layers": dense_layers, "calibration": calibration,
                               "budget_tokens": (args.budget_tokens or [None])[0],
                               "speculation": args.speculation}
                    results += run_engine(args, kv_manager, rows, variant,
                                          skew_files[calibration])

    meta = report.run_metadata(model=str(args.model), data=str(args.data))
    sections = [
        f"{len(rows)} prompts of {args.data.name} ({len(rows[0]['prompt_token_ids']):,} "
        f"tokens; needle = the queried key's position), model {args.model.name}"
        + (f" read with its RoPE positions interpolated linearly by {args.rope_linear_factor:g}"
           if args.rope_linear_factor else "") + "; InfiniGen "
        f"selects from context {args.min_context or 0} (--infinigen-min-context). The last {args.decode_prompt_tokens} prompt tokens and the answer are "
        "teacher-forced through decode, so the answer is predicted in a decode step under the "
        "selection; correct = argmax is the expected value token."
        + (f" {attention}." if attention else ""),
        "## Accuracy per needle bucket", results_table(results),
    ]
    streaming = [r for r in results if r.get("recent_tokens")]
    sections.append("'select all (control)': InfiniGen at budget 1 with alpha 1e4, which "
                    "selects every token and so must match dense.")
    if streaming:
        sections.append(
            "The streaming rows are an **approximation** of a StreamingLLM cache "
            "(first 4 + last 128 tokens): InfiniGen at budget 0.001 (1 speculated token) "
            "plus a 4-token sink and 128-token recent window, in the sparse layers only; "
            "the dense layers attend to everything. Needle value inside the last 128 "
            "context tokens: " + "; ".join(
                f"{r['label']}: {r['needles_in_recent_window']} needles, "
                f"acc {report.cell(r['acc_needle_in_window'], '.3f')} inside, "
                f"{report.cell(r['acc_needle_outside_window'], '.3f')} outside"
                for r in streaming) + ".")
    png = report.try_plot(args.out.with_suffix(".png"), plot_panels(results),
                          f"{args.model.name} retrieval, {len(rows)} prompts")
    if png:
        sections.append(f"![accuracy vs budget]({png.name})")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report.write_results(args.out, meta, f"Long-range retrieval ({args.model.name}) under "
                         "decode-time selection", settings, results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
