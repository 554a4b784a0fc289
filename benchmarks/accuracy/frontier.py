# SPDX-License-Identifier: Apache-2.0
"""The accuracy-speed frontier of InfiniGen's selection rules (issue #33).

Every selection rule that matters, at each budget (and token cap), on the four
shared models: retrieval on ``recall-llama-12l`` (1K prompts),
``recall-llama-12l-4k`` (4K prompts) and ``recall-llama-1k``, perplexity on
``gutenberg-llama-2k``; the density each keeps; and the CPU decode step at
that density on the 16K benchmark model, read off paired decode runs
(``decode_latency --paired``, ``--speed``). ``--recall-model DIR --recall-prompts
FILE`` runs a recall model of the project's own (``benchmarks/models/``, with
its held-out prompts) as one more task, named after its folder.

The accuracy runs are torch-only (``sparse_llama``: the model in float32, the
product's rule of ``speculative_selection`` over the product's default
speculation keys, every key channel in 4 bits with one scale per channel and
16 tokens as a float32 cache holds them, ``--infinigen-speculation-keys int``),
so that about 30 settings x 4 models run in one sitting on two cores; the
chosen default is then checked through the product itself
(``benchmarks.accuracy.retrieval``). Sparse from the first token
(``--infinigen-min-context 0``): the recall prompts' last 3 tokens
(QUERY k ANSWER) attend over their selections, as in ``retrieval.py``'s
decode steps; the book's rows past a 64-token dense prefix attend over theirs
(``--infinigen-eval-dense-prefix 64``). A select-all control must equal dense.

Rules (``RULES``): the alpha count (today's default alpha 5, and larger
alphas), the budget binding (k = budget x context: alpha 1e3), a floor on the
kept fraction (alpha 5, but at least half the budget), each also over blocks
of 16 (the CUDA build's block-granular rule), same-layer speculation with
the binding as the reference without prefetch, unit summaries (issue 45), and
two-level rules (the units of the best super-units only: a cheaper scoring,
``frontier_two_level_4k.md``). Example (about an hour)::

    OMP_NUM_THREADS=1 python -m benchmarks.accuracy.frontier --threads 2

Results: ``benchmarks/results/frontier.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.accuracy import frontier_report, retrieval, speculation_keys
from benchmarks.accuracy.key_forms import FormSpec, KeyForm
from benchmarks.accuracy.sparse_llama import SparseLlama
from benchmarks.accuracy.speculation_keys import Run, Tally, tally_sequences
from benchmarks.accuracy.speculative_selection import (
    CAP_BINDING_ALPHA,
    make_selector,
    make_unit_selector,
    summary_bytes,
)
from benchmarks.harness import paths, report

DEFAULT_OUT = paths.RESULTS / "frontier"
# The product's --infinigen-speculation-keys int in a float32 cache.
PRODUCT_KEYS = FormSpec("int keys, 4 bits", "identity", "block-int", 1.0, 4)
CONTROL = speculation_keys.CONTROL
# The bytes column: a Llama-3-8B-like head (128 channels) with the int keys a
# bfloat16 cache stores (2 bits; 48 B per token and KV head).
BYTES_HEAD_DIM, BYTES_BITS = 128, 2
# The CPU step with the product's default keys (bounds), float32, 16K x 1: the
# default layers at budget 0.2 and at 1.6 % kept; one dense layer, previous- and
# same-layer. A rule's estimate reads the points of its own layers and speculation.
DEFAULT_SPEED = [paths.RESULTS / f"decode_paired_gqa128_{name}.json" for name in (
    "default_16k", "query_op_low", "dense1_low", "dense1_same_layer_low")]


@dataclass(frozen=True)
class Rule:
    """How a row's k and its tokens are chosen (``speculative_selection.make_selector``).

    ``floor``: k is at least this fraction of the budget (x context).
    """

    name: str
    alpha: float = 5.0
    floor: float = 0.0
    block_size: int = 0
    speculation: str = "previous-layer"
    # Unit summaries (``make_unit_selector``): units of ``unit`` tokens scored by
    # ``summary`` (coarse), then, when ``fine`` > 0, the int keys over the best
    # units covering fine x k tokens.
    unit: int = 0
    summary: str = "bound"
    fine: float = 0.0
    summary_bits: int = 16
    # The last context tokens kept on top of k (``--infinigen-recent-tokens``).
    recent: int = 0
    # Two-level bounds (``coarse_candidates``): only the units of each head's best
    # ``coarse``-token super-units, ``over`` x k tokens of them, are scored.
    coarse: int = 0
    over: float = 0.0
    coarse_summary: str = "bound"


BINDING = CAP_BINDING_ALPHA
RULES = {rule.name: rule for rule in (
    Rule("alpha 5 (paper)"),
    Rule("alpha 10", alpha=10.0),
    Rule("alpha 20", alpha=20.0),
    Rule("alpha 5, floor budget/2", floor=0.5),
    Rule("budget binding", alpha=BINDING),
    Rule("alpha 5, blocks of 16", block_size=16),
    Rule("budget binding, blocks of 16", alpha=BINDING, block_size=16),
    Rule("same-layer, budget binding (no prefetch)", alpha=BINDING, speculation="same-layer"),
    Rule("bound, units of 16", alpha=BINDING, unit=16),
    Rule("bound, units of 32", alpha=BINDING, unit=32),
    Rule("bound, units of 64", alpha=BINDING, unit=64),
    Rule("bound 8-bit, units of 16", alpha=BINDING, unit=16, summary_bits=8),
    Rule("bound 4-bit, units of 16", alpha=BINDING, unit=16, summary_bits=4),
    Rule("bound 8-bit, units of 32", alpha=BINDING, unit=32, summary_bits=8),
    Rule("budget binding, recent 16", alpha=BINDING, recent=16),
    Rule("bound 8-bit, units of 16, recent 16", alpha=BINDING, unit=16, summary_bits=8,
         recent=16),
    Rule("bound 8-bit, units of 16, recent 16, same-layer", alpha=BINDING, unit=16,
         summary_bits=8, recent=16, speculation="same-layer"),
    Rule("bound 4-bit, units of 16, recent 16", alpha=BINDING, unit=16, summary_bits=4,
         recent=16),
    Rule("mean, units of 16", alpha=BINDING, unit=16, summary="mean"),
    Rule("mean, units of 32", alpha=BINDING, unit=32, summary="mean"),
    Rule("mean, units of 64", alpha=BINDING, unit=64, summary="mean"),
    Rule("mean 32, then int keys over 2x", alpha=BINDING, unit=32, summary="mean", fine=2.0),
    Rule("bound 64, then int keys over 2x", alpha=BINDING, unit=64, fine=2.0),
    Rule("bound 32, then int keys over 2x", alpha=BINDING, unit=32, fine=2.0),
    *(Rule(f"bound 8-bit 16 within 8-bit {coarse} x{over:g}, recent 16", alpha=BINDING,
           unit=16, summary_bits=8, recent=16, coarse=coarse, over=over)
      for coarse, over in ((64, 4.0), (128, 4.0), (256, 4.0), (256, 8.0))),
    *(Rule(f"bound 8-bit 16 within mean {coarse} x{over:g}, recent 16", alpha=BINDING,
           unit=16, summary_bits=8, recent=16, coarse=coarse, over=over, coarse_summary="mean")
      for coarse, over in ((64, 4.0), (128, 4.0), (256, 4.0), (256, 8.0))),
)}
# The select-all control: alpha infinite, every token within reach (at 1,000, the budget
# binding's, a score further below the best was dropped: the 12-layer recall models'
# layers 8-10 span about 1,560).
CONTROL_RULE = Rule("control", math.inf)
TWO_LEVEL_RULES = tuple(name for name, rule in RULES.items() if rule.coarse)
CAP_RULES = ("budget binding", "alpha 5 (paper)", "budget binding, blocks of 16",
             "bound, units of 16", "bound 8-bit, units of 16", "bound 4-bit, units of 16",
             "budget binding, recent 16", "bound 8-bit, units of 16, recent 16",
             "bound 8-bit, units of 16, recent 16, same-layer",
             "bound 4-bit, units of 16, recent 16", *TWO_LEVEL_RULES)


@dataclass(frozen=True)
class Task:
    name: str
    model: Path
    data: Path | None  # recall prompts; None: the book's perplexity
    metric: str  # accuracy | perplexity
    # RoPE positions divided by this factor (``recall_lengths.linear_rope``), or None
    rope_linear_factor: float | None = None


TASKS = {task.name: task for task in (
    Task("recall-llama-12l", paths.shared_path("models/recall-llama-12l"),
         paths.shared_path("data/recall/recall-1k.jsonl"), "accuracy"),
    Task("recall-llama-12l-4k", paths.shared_path("models/recall-llama-12l-4k"),
         paths.shared_path("data/recall/recall-4k.jsonl"), "accuracy"),
    Task("recall-llama-1k", retrieval.DEFAULT_MODEL, retrieval.DEFAULT_DATA, "accuracy"),
    Task("gutenberg-llama-2k", paths.GUTENBERG, None, "perplexity"),
)}


@dataclass(frozen=True)
class Setting:
    rule: str
    budget: float
    token_cap: int | None = None

    @property
    def label(self) -> str:
        cap = f", cap {self.token_cap}" if self.token_cap else ""
        return f"{self.rule} @ {self.budget:g}{cap}"


def settings_grid(rules: list[str], budgets: list[float], caps: list[int]) -> list[Setting]:
    """Every rule at every budget; the token caps at the largest budget, for ``CAP_RULES``,
    and alone (budget 1: the budget given in tokens) with the binding."""
    grid = [Setting(rule, budget) for rule in rules for budget in budgets]
    grid += [Setting(rule, max(budgets), cap) for rule in rules if rule in CAP_RULES
             for cap in caps]
    if "budget binding" in rules:
        grid += [Setting("budget binding", 1.0, cap) for cap in caps]
    return grid


def run_task(task: Task, grid: list[Setting], args) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    from benchmarks.accuracy.recall_lengths import model_config

    config = model_config(task.model, task.rope_linear_factor)
    model = AutoModelForCausalLM.from_pretrained(str(task.model), config=config,
                                                 dtype=torch.float32).eval()
    sparse_model = SparseLlama(model, args.dense_layers)
    layers = range(args.dense_layers, sparse_model.num_layers)
    # The int keys and the control need no calibration: identity projections.
    shapes = [(torch.zeros(sparse_model.num_heads, 1, sparse_model.head_dim),
               torch.zeros(sparse_model.num_kv_heads, 1, sparse_model.head_dim))
              for _ in range(sparse_model.num_layers)]
    keys = KeyForm(PRODUCT_KEYS, shapes, 1, layers)
    control = KeyForm(CONTROL, shapes, 1, layers)
    tallies = [Tally(task.metric) for _ in grid]
    dense, select_all = Tally(task.metric), Tally(task.metric)
    data = speculation_keys.sequences(task, args, task.data)

    def run(setting: Setting, tally: Tally, form: KeyForm, rule: Rule,
            control: bool = False) -> Run:
        if rule.unit:
            return Run(tally, functools.partial(
                make_unit_selector, form, scale=sparse_model.scale, budget=setting.budget,
                unit=rule.unit, summary=rule.summary, fine=rule.fine, bits=rule.summary_bits,
                token_cap=setting.token_cap, recent_tokens=rule.recent, coarse=rule.coarse,
                over=rule.over, coarse_summary=rule.coarse_summary), rule.speculation, control)
        return Run(tally, functools.partial(
            make_selector, form, scale=sparse_model.scale, alpha=rule.alpha,
            budget=setting.budget, block_size=rule.block_size, token_cap=setting.token_cap,
            floor=rule.floor * setting.budget, recent_tokens=rule.recent), rule.speculation,
            control)

    runs = [run(s, t, keys, RULES[s.rule]) for s, t in zip(grid, tallies)]
    runs.append(run(Setting("control", 1.0), select_all, control, CONTROL_RULE,
                    control=True))
    max_control_diff = tally_sequences(sparse_model, data, runs, dense, task.name)
    results = [{"task": task.name, "rule": "dense", **dense.result()},
               {"task": task.name, "rule": "control", "budget": 1.0, **select_all.result()}]
    for setting, tally in zip(grid, tallies):
        result = tally.result()
        results.append({"task": task.name, **asdict(setting), "label": setting.label,
                        "rule_spec": asdict(RULES[setting.rule]), **result,
                        "bytes_per_token": selection_bytes(RULES[setting.rule], result)})
    info = {"num_sequences": len(data), "sparse_layers": list(layers),
            "head_dim": sparse_model.head_dim, "num_kv_heads": sparse_model.num_kv_heads,
            "group": sparse_model.group, "max_control_logit_diff": max_control_diff,
            "context": len(data[0]["ids"]) if data else 0,
            "rope_linear_factor": task.rope_linear_factor}
    return results, info


def int_key_bytes(head_dim: int, bits: int) -> float:
    """Bytes per token and KV head of the int keys: ``bits`` per channel and a float16
    scale per channel and 16 tokens (``layout.key_bytes_per_group`` / 16)."""
    return head_dim * (bits / 8 + 2 / 16)


def selection_bytes(rule: Rule, result: dict, head_dim: int = BYTES_HEAD_DIM,
                    bits: int = BYTES_BITS) -> float:
    """Bytes the rule reads per context token and KV head per step, at ``head_dim``
    with ``bits``-bit int keys: every token's int keys; a unit summary; or a summary
    and the int keys of the fine pass's candidates (their measured fraction)."""
    if not rule.unit:
        return int_key_bytes(head_dim, bits)
    if rule.coarse:  # the super-units' summaries, then the units' of their candidates
        fine = summary_bytes(head_dim, rule.unit, rule.summary, rule.summary_bits)
        coarse_bits = rule.summary_bits if rule.coarse_summary == "bound" else 16
        return (summary_bytes(head_dim, rule.coarse, rule.coarse_summary, coarse_bits)
                + result.get("rerank_density", 0.0) * fine)
    coarse = summary_bytes(head_dim, rule.unit, rule.summary, rule.summary_bits)
    return coarse + result.get("rerank_density", 0.0) * int_key_bytes(head_dim, bits)


def speed_points(paths_: list[Path], context: int, dtype: str) -> list[dict]:
    """(selected fraction, ms per step, ÷ dense) of InfiniGen's rows at ``context`` x 1,
    from paired decode results files that exist (their provenance, dense layers and
    speculation kept: ``frontier_report`` estimates a rule from its own)."""
    points = []
    for path in paths_:
        if not Path(path).exists():
            print(f"speed: {path} is absent, not used", file=sys.stderr)
            continue
        saved = json.loads(Path(path).read_text())
        for row in saved["results"]:
            if (row.get("context") != context or row.get("batch") != 1
                    or row.get("dtype") != dtype or not row.get("paired_speedup")
                    or row.get("selected_fraction") is None):
                continue
            points.append({"density": row["selected_fraction"],
                           "ms_per_step": row["decode_ms_per_step"],
                           "vs_dense": 1.0 / row["paired_speedup"], "config": row["config"],
                           "file": str(Path(path).name),
                           "commit": saved["meta"].get("repo_commit"),
                           "dense_layers": saved["settings"].get("dense_layers"),
                           "speculation": (saved["settings"].get("speculation")
                                           or "previous-layer")})
    return sorted(points, key=lambda p: p["density"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None,
                        help="default: every task, or none beside --recall-model")
    parser.add_argument("--recall-model", type=Path, default=None,
                        help="a recall model's folder (one this project trained, e.g. "
                        "benchmarks/models/...), run as a task beside --tasks")
    parser.add_argument("--recall-prompts", type=Path, default=None,
                        help="its recall prompts (jsonl, the training script's held-out form)")
    parser.add_argument("--rope-linear-factor", type=float, default=None,
                        help="read --recall-model with its RoPE positions interpolated "
                        "linearly by this factor (recall_lengths)")
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--token-caps", type=int, nargs="*", default=[256, 512, 1024],
                        help="--infinigen-budget-tokens values, at the largest budget")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="recall: first N prompts")
    parser.add_argument("--num-windows", type=int, default=4,
                        help="gutenberg: windows of 64 + 960 tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speed", type=Path, nargs="*", default=DEFAULT_SPEED,
                        help="paired decode results files (decode_latency --paired) whose "
                        "16K x 1 rows give the step time at a density")
    parser.add_argument("--speed-context", type=int, default=16384)
    parser.add_argument("--speed-dtype", default="float32")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md and .png from the .json at --out "
                        "(re-reading --speed)")
    args = parser.parse_args(argv)
    if (args.recall_model is None) != (args.recall_prompts is None):
        parser.error("--recall-model and --recall-prompts go together")
    if args.rope_linear_factor is not None and args.recall_model is None:
        parser.error("--rope-linear-factor applies to --recall-model")
    if args.recall_model is not None and args.recall_model.name in TASKS:
        parser.error(f"--recall-model's folder name {args.recall_model.name!r} is a named task's "
                     "(--tasks): the results are keyed by it; use another folder name")
    args.task_table = dict(TASKS)  # the named tasks and the --recall-model one
    if args.recall_model is not None:
        args.task_table[args.recall_model.name] = Task(
            args.recall_model.name, args.recall_model, args.recall_prompts, "accuracy",
            args.rope_linear_factor)
    if args.tasks is None:
        args.tasks = [args.recall_model.name] if args.recall_model else list(TASKS)
    elif args.recall_model is not None:
        args.tasks.append(args.recall_model.name)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budget):
        print("--budget values must be in (0, 1]", file=sys.stderr)
        return 2
    if args.render:
        meta, settings, payload = report.read_results(args.out)
    else:
        tasks = [args.task_table[name] for name in args.tasks]
        missing = [str(p) for task in tasks for p in (task.model, task.data)
                   if p is not None and not Path(p).exists()]
        if missing:
            print(f"frontier: missing {', '.join(missing)} (the named tasks' models and "
                  "prompts are in ../shared)", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        meta = report.run_metadata()
        grid = settings_grid(args.rules, args.budget, args.token_caps)
        payload = {"results": [], "tasks": {}}
        for name in args.tasks:
            results, info = run_task(args.task_table[name], grid, args)
            payload["results"] += results
            payload["tasks"][name] = info
        settings = {k: [str(x) for x in v] if isinstance(v, list) and v
                    and isinstance(v[0], Path) else str(v) if isinstance(v, Path) else v
                    for k, v in vars(args).items() if k != "task_table"}
    payload["speed"] = speed_points(args.speed, args.speed_context, args.speed_dtype)
    sections = frontier_report.sections(payload, args.out.with_suffix(".png").name)
    report.write_results(args.out, meta, "The accuracy-speed frontier of the selection rules",
                         settings, payload, sections)
    frontier_report.plot(args.out.with_suffix(".png"), payload)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
