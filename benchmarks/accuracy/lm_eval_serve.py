# SPDX-License-Identifier: Apache-2.0
"""lm-evaluation-harness, a real client of `vllm serve` in InfiniGen's evaluation mode, beside mc_tasks.py.

Per configuration, one after the other (one heavy vLLM process at a time)::

    configuration      vllm serve MODEL ...
    dense              (stock vLLM)
    infinigen b=0.2    --kv-manager infinigen --infinigen-budget 0.2 --infinigen-eval-dense-prefix 16
    streaming b=0.2    ... --infinigen-policy streaming            (--policy infinigen streaming quest)

    lm_eval run --model local-completions --model_args base_url=.../v1/completions,...
        --tasks local_copa,... --num_fewshot 5 --limit L --include_path TMP --log_samples

lm-eval's loglikelihood reads the prompt logprobs of ``/v1/completions``
(``echo``, ``logprobs=1``, ``max_tokens=1``); in the evaluation mode every
prompt row past the dense prefix attends over the selection. The task YAMLs
(``lm_eval_tasks.py``, written to a temporary directory) reproduce lm-eval's
own prompts, choices, targets and metrics over the local files of
``mc_tasks.py``, with the evaluated split as the few-shot split (lm-eval then
drops the document from its own shots).
Requests go as token ids, encoded by lm-eval with the model's tokenizer and
its BOS (``add_bos_token=True``), as ``mc_tasks.py`` encodes them.

Then ``mc_tasks.py --scoring eval-prefill`` scores the same documents on an
offline engine in the same mode, and ``benchmarks/results/lm_eval_serve.{json,md}``
compares acc / acc_norm per task and configuration, the prompts lm-eval built
with ours, and the per-document log-likelihoods (``--log_samples``). Example::

    flock /tmp/engine.lock python -m benchmarks.accuracy.lm_eval_serve --limit 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.accuracy import mc_prompts, mc_tasks
from benchmarks.accuracy.lm_eval_tasks import (
    lm_eval_command,
    read_lm_eval_output,
    write_task_yamls,
)
from benchmarks.harness import paths, report
from benchmarks.harness.servers import SERVED_NAME, start_server, stop_server

DEFAULT_OUT = paths.RESULTS / "lm_eval_serve"
@dataclass(frozen=True)
class ServeConfig:
    """One server: dense vLLM (``policy`` None) or a policy at a budget in evaluation mode."""

    policy: str | None = None
    budget: float | None = None

    @property
    def label(self) -> str:
        return "dense" if self.policy is None else f"{self.policy} b={self.budget:g}"

    @property
    def mode(self) -> str:
        """mc_tasks.py's label of the same configuration."""
        return "vllm" if self.policy is None else self.policy

    def serve_args(self, eval_dense_prefix: int) -> list[str]:
        if self.policy is None:
            return []
        return ["--kv-manager", "infinigen", "--infinigen-policy", self.policy,
                "--infinigen-budget", f"{self.budget:g}",
                "--infinigen-eval-dense-prefix", str(eval_dense_prefix),
                # Select at every context, as the offline harness does.
                "--infinigen-min-context", "0"]


def our_prompts(name: str, data_dir: Path, limit: int, num_fewshot: int) -> list[list[tuple]]:
    """Per document, mc_tasks.py's (context, continuation) per choice."""
    task = mc_prompts.TASKS[name]
    docs = mc_prompts.load_docs(task, data_dir)
    rng = random.Random(mc_prompts.FEWSHOT_SEED)
    return [mc_prompts.build_requests(task, doc,
                                    mc_prompts.sample_fewshot(docs, doc, num_fewshot, rng))
            for doc in docs[:limit]]


def compare_task(lm_eval: dict[str, Any], ours: dict[str, Any],
                 prompts: Sequence[Sequence[tuple]] | None = None) -> dict[str, Any]:
    """lm-eval against mc_tasks.py for one task and configuration.

    Args:
        lm_eval: ``read_lm_eval_output``'s entry for the task.
        ours: mc_tasks.py's result (acc, acc_norm, doc_loglikelihoods).
        prompts: Our (context, continuation) pairs per document, checked
            against the requests lm-eval logged.

    Returns:
        Both accuracies, whether they are equal, and per document: the number
        of documents compared, with the same chosen answer, with identical
        prompts, and the largest |difference| of a choice's log-likelihood.
    """
    row: dict[str, Any] = {"lm_eval_acc": lm_eval["acc"], "ours_acc": ours["acc"],
                           "lm_eval_acc_norm": lm_eval["acc_norm"],
                           "ours_acc_norm": ours["acc_norm"] if lm_eval["acc_norm"] is not None
                           else None}
    row["acc_equal"] = (row["lm_eval_acc"] == row["ours_acc"]
                        and row["lm_eval_acc_norm"] == row["ours_acc_norm"])
    docs = lm_eval["docs"]
    if docs:
        theirs = [d["loglikelihoods"] for d in docs]
        mine = [ours["doc_loglikelihoods"][d["doc_id"]] for d in docs]
        agreement = mc_prompts.prediction_agreement(theirs, mine)
        row.update({
            "docs_compared": len(docs),
            "same_choice": round(agreement["same_choice"] * len(docs)),
            "max_abs_dll": max(abs(a - b) for x, y in zip(theirs, mine) for a, b in zip(x, y)),
        })
        if prompts is not None:
            row["same_prompts"] = sum(list(map(tuple, d["requests"])) ==
                                      list(map(tuple, prompts[d["doc_id"]])) for d in docs)
    return row


def run_lm_eval(config: ServeConfig, args: argparse.Namespace, work: Path,
                env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Starts the server, runs lm_eval against it, stops it; (parsed output, log)."""
    slug = config.label.replace(" ", "_").replace("=", "")
    log = work / f"serve_{slug}.log"
    serve_args = [*config.serve_args(args.eval_dense_prefix), "--max-model-len",
                  str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                  "--seed", "0"]
    progress(f"[{config.label}] vllm serve {args.model.name} {shlex.join(serve_args)} "
             f"(log: {log})")
    start = time.perf_counter()
    server = start_server(log, *serve_args, model=args.model)
    started = time.perf_counter() - start
    command = lm_eval_command(server.base_url, args.model, args.tasks, limit=args.limit,
                              num_fewshot=args.num_fewshot, max_length=args.max_model_len,
                              batch_size=args.lm_eval_batch_size, include_path=work / "tasks",
                              output_path=work / f"lm_eval_{slug}")
    progress(f"[{config.label}] server up in {started:.0f} s; {shlex.join(command)}")
    try:
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True)
        seconds = time.perf_counter() - start
    finally:
        stop_server(server)
    progress(f"[{config.label}] lm_eval done in {seconds:.0f} s")
    return read_lm_eval_output(work / f"lm_eval_{slug}"), {
        "lm_eval_command": shlex.join(command), "serve_args": shlex.join(serve_args),
        "server_start_seconds": started, "lm_eval_seconds": seconds}


def run_ours(configs: Sequence[ServeConfig], args: argparse.Namespace, work: Path,
             env: dict[str, str], batch_size: int) -> tuple[list[dict], dict[str, Any]]:
    """mc_tasks.py --scoring eval-prefill for every configuration (one engine per KV manager)."""
    policies = [c.policy for c in configs if c.policy is not None]
    kv_managers = (["vllm"] if any(c.policy is None for c in configs) else []) + (
        ["infinigen"] if policies else [])
    command = [sys.executable, "-m", "benchmarks.accuracy.mc_tasks", "--model",
               str(args.model), "--data-dir", str(args.data_dir), "--tasks", *args.tasks,
               "--limit", str(args.limit), "--num-fewshot", str(args.num_fewshot),
               "--kv-manager", *kv_managers, "--budget", f"{args.budget:g}",
               "--policy", *(policies or ["infinigen"]), "--no-select-all-control",
               "--scoring", "eval-prefill", "--eval-dense-prefix", str(args.eval_dense_prefix),
               "--max-model-len", str(args.max_model_len),
               "--kv-cache-bytes", str(args.kv_cache_bytes),
               "--batch-size", str(batch_size), "--out", str(work / f"mc_tasks_b{batch_size}")]
    progress(f"[ours, batch {batch_size}] {shlex.join(command)}")
    start = time.perf_counter()
    with open(work / f"mc_tasks_b{batch_size}.log", "w") as out:
        subprocess.run(command, env=env, check=True, stdout=out, cwd=paths.REPO)
    seconds = time.perf_counter() - start
    progress(f"[ours, batch {batch_size}] done in {seconds:.0f} s")
    written = json.loads((work / f"mc_tasks_b{batch_size}.json").read_text())
    return written["results"], {"command": shlex.join(command), "seconds": seconds,
                                "batch_size": batch_size, "inputs": written["settings"]["inputs"]}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def comparison(configs: Sequence[ServeConfig], lm_eval: dict[str, dict], ours: Sequence[dict],
               prompts: dict[str, list], batched: Sequence[dict] = ()) -> list[dict[str, Any]]:
    """One row per (task, configuration): lm-eval's numbers beside ours.

    ``batched``: our results at a larger offline batch, compared as ``batched_*``.
    """
    by_mode = {(r["kv_manager"], r["task"]): r for r in ours}
    batched_by_mode = {(r["kv_manager"], r["task"]): r for r in batched}
    rows = []
    for config in configs:
        for name, task_out in lm_eval[config.label].items():
            row = {"task": name, "config": config.label,
                   **compare_task(task_out, by_mode[(config.mode, name)], prompts.get(name))}
            if (config.mode, name) in batched_by_mode:
                other = compare_task(task_out, batched_by_mode[(config.mode, name)])
                row.update({f"batched_{key}": other.get(key)
                            for key in ("acc_equal", "same_choice", "max_abs_dll")})
            rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict]) -> str:
    def pair(row: dict, metric: str) -> str:
        theirs, mine = row[f"lm_eval_{metric}"], row[f"ours_{metric}"]
        if theirs is None:
            return ""
        return f"{theirs:.3f} / {mine:.3f}" + ("" if theirs == mine else " **differ**")

    batched = any("batched_max_abs_dll" in r for r in rows)
    return report.markdown_table(
        ["task", "configuration", "docs", "acc: lm-eval / ours", "acc_norm: lm-eval / ours",
         "same prompts", "same choice", "max abs dLL (nats)",
         *(["batched: same choice", "batched: max abs dLL"] if batched else [])],
        [[r["task"], r["config"], report.cell(r.get("docs_compared")), pair(r, "acc"),
          pair(r, "acc_norm"),
          report.cell(r.get("same_prompts")), report.cell(r.get("same_choice")),
          report.cell(r.get("max_abs_dll"), ".1e"),
          *([report.cell(r.get("batched_same_choice")),
             report.cell(r.get("batched_max_abs_dll"), ".1e")] if batched else [])]
         for r in rows])


def mean_table(rows: Sequence[dict]) -> str:
    """Mean acc over the tasks per configuration, lm-eval and ours."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        group = [r for r in rows if r["config"] == config]
        theirs = sum(r["lm_eval_acc"] for r in group) / len(group)
        mine = sum(r["ours_acc"] for r in group) / len(group)
        out.append([config, str(len(group)), f"{theirs:.3f}", f"{mine:.3f}",
                    "yes" if all(r["acc_equal"] for r in group) else "no"])
    return report.markdown_table(
        ["configuration", "tasks", "mean acc, lm-eval", "mean acc, ours",
         "every task equal (acc, acc_norm)"], out)


DENSE_PREFIX_NOTE = """\
A server holds one `--infinigen-eval-dense-prefix` for every request, and the
contexts here average {shortest:.0f} to {longest:.0f} tokens per task, so N cannot be each
request's context length (which would put only the continuation under the
selection, as `mc_tasks.py`'s decode scoring does). N = {n} puts nearly every
prompt row, the few-shot examples included, under the selection, as the
InfiniGen artifact's lm-eval simulation does (`accuracy/src/modeling_*_ours.py`:
every row past int(budget x sequence length) attends over its top-k, k capped at
budget x sequence length). The evaluation mode gives a row at position p what a
decode step at context p gets (at most floor(budget x p) tokens) and keeps only
the first N rows dense. It is a harsher test than decode-time scoring: the
context's own representations are computed under the selection."""


def batching_note(rows: Sequence[dict], batch_size: int) -> str:
    """What the per-document comparison shows about batching."""
    text = f"Ours scored {batch_size} request(s) per engine call; lm-eval sends one at a time."
    batched = [r for r in rows if r.get("batched_max_abs_dll") is not None]
    if batched:
        worst = {dense: max((r["batched_max_abs_dll"] for r in batched
                             if (r["config"] == "dense") == dense), default=None)
                 for dense in (True, False)}
        changed = sum(r["docs_compared"] - r["batched_same_choice"] for r in batched)
        text += (" Scored again with many requests per engine call (the 'batched' columns), "
                 f"dense vLLM stays within {report.cell(worst[True], '.1e')} nats of lm-eval "
                 "(its attention runs per sequence); the sparse configurations move by up to "
                 f"{report.cell(worst[False], '.1e')} nats on a summed log-likelihood: float32 "
                 "rounding in the sparse path depends on which requests share an engine step "
                 f"(one request per step is bit-identical). Answers changed: {changed}.")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=mc_tasks.DEFAULT_MODEL)
    parser.add_argument("--data-dir", type=Path, default=mc_tasks.DEFAULT_DATA)
    parser.add_argument("--tasks", nargs="+", default=list(mc_prompts.TASKS),
                        choices=list(mc_prompts.TASKS))
    parser.add_argument("--limit", type=int, default=20, help="first N documents per task")
    parser.add_argument("--num-fewshot", type=int, default=mc_prompts.NUM_FEWSHOT)
    parser.add_argument("--policy", nargs="+", default=["infinigen"],
                        choices=["infinigen", "streaming", "quest"],
                        help="policies served in evaluation mode (H2O has none)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--eval-dense-prefix", type=int, default=16)
    parser.add_argument("--no-dense", dest="dense", action="store_false",
                        help="skip the stock dense vLLM configuration")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the server's and lm-eval's max_length (left truncation)")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--lm-eval-batch-size", type=int, default=1,
                        help="prompts per /v1/completions request")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="requests per offline engine call (mc_tasks.py); 1, as lm-eval "
                             "sends them, gives bit-identical log-likelihoods")
    parser.add_argument("--also-batch-size", type=int, default=None,
                        help="score ours once more at this batch size and compare it too")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep task YAMLs, logs and lm-eval outputs here (default: a "
                             "temporary directory, removed)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        parser.error("--budget must be in (0, 1]")
    if args.limit < 1 or args.eval_dense_prefix < 1:
        parser.error("--limit and --eval-dense-prefix must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (args.model, args.data_dir):
        if not path.exists():
            progress(f"skipped: {path} is absent")
            return 0
    try:
        import aiohttp  # noqa: F401  (lm-eval's API models need its [api] extra)
        import lm_eval  # noqa: F401
        import tenacity  # noqa: F401
    except ImportError as e:
        progress(f"skipped: {e.name} is absent (pip install 'lm_eval[api]==0.4.13')")
        return 0
    configs = ([ServeConfig()] if args.dense else []) + [
        ServeConfig(policy, args.budget) for policy in args.policy]
    with tempfile.TemporaryDirectory(prefix="lm_eval_serve_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        yamls = write_task_yamls(work / "tasks", args.data_dir, args.tasks)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(work / "hf_datasets")}
        lm_eval_out, runs = {}, {}
        for index, config in enumerate(configs, 1):
            progress(f"=== configuration {index}/{len(configs)}: {config.label}")
            lm_eval_out[config.label], runs[config.label] = run_lm_eval(config, args, work, env)
        ours, first_run = run_ours(configs, args, work, env, args.batch_size)
        ours_runs, batched = [first_run], []
        if args.also_batch_size:
            batched, run = run_ours(configs, args, work, env, args.also_batch_size)
            ours_runs.append(run)
    prompts = {name: our_prompts(name, args.data_dir, args.limit, args.num_fewshot)
               for name in args.tasks}
    rows = comparison(configs, lm_eval_out, ours, prompts, batched)
    means = [task["mean_context_tokens"] for task in ours_runs[0]["inputs"].values()]
    context = {"shortest": min(means), "longest": max(means)}

    meta = report.run_metadata(model=str(args.model), lm_eval=version("lm_eval"),
                               datasets=version("datasets"))
    settings = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "runs": runs, "ours": ours_runs, "task_yamls": yamls}
    sections = [
        f"Model `{args.model.name}`, {args.num_fewshot}-shot, first {args.limit} documents "
        f"per task. lm-eval {meta['lm_eval']} (`local-completions`, token-id requests "
        f"with BOS, one request at a time) against `vllm serve`; ours: `mc_tasks.py "
        f"--scoring eval-prefill` on an offline engine. InfiniGen configurations run in the "
        f"evaluation mode with `--infinigen-eval-dense-prefix {args.eval_dense_prefix}`: "
        "every prompt row from that position on, context and continuation, attends over "
        "the selection as a decode row at that position would.",
        "## lm-eval against ours, per task", comparison_table(rows),
        "'same prompts': documents whose (context, continuation) strings lm-eval logged "
        "equal ours; 'same choice': documents where both pick the same answer; 'max abs "
        "dLL': the largest difference of one choice's summed log-likelihood.",
        "## Mean over tasks", mean_table(rows),
        "## The dense prefix", DENSE_PREFIX_NOTE.format(n=args.eval_dense_prefix, **context),
        "## Batching", batching_note(rows, args.batch_size),
        "## Commands", "\n".join(
            [f"- {label}: `vllm serve MODEL --served-model-name {SERVED_NAME} "
             f"{run['serve_args']}` (up in {run['server_start_seconds']:.0f} s), then "
             f"lm-eval ({run['lm_eval_seconds']:.0f} s):\n\n      {run['lm_eval_command']}\n"
             for label, run in runs.items()]
            + [f"- ours, batch {run['batch_size']} ({run['seconds']:.0f} s):\n\n"
               f"      {run['command']}\n" for run in ours_runs]),
        "## Task YAMLs (written to the lm-eval include path)",
        "\n\n".join(f"```yaml\n{text}```" for text in yamls.values()),
    ]
    report.write_results(args.out, meta, "lm-evaluation-harness against vllm serve "
                         "(evaluation mode) vs mc_tasks.py", settings, rows, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0 if all(r["acc_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
