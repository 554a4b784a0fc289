# SPDX-License-Identifier: Apache-2.0
"""lm-evaluation-harness's side of lm_eval_serve.py: the task YAMLs, its command line, its output.

The YAMLs reproduce lm-eval's own ``copa``, ``openbookqa``, ``piqa``,
``winogrande`` and ``rte`` prompts, choices, targets and metrics over the
local files of ``mc_prompts.TASKS``, with the evaluated split as the few-shot
split; ``lm_eval run`` sends token-id requests with BOS to a server's
``/v1/completions``; ``read_lm_eval_output`` reads its results and, per
document, the log-likelihoods and prompts it logged (``--log_samples``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.accuracy import mc_prompts
from benchmarks.harness.servers import SERVED_NAME

TASK_PREFIX = "local_"
# lm-eval's prompt fields per task over the local files' columns (mc_prompts.TASKS
# names the file and the metrics lm-eval reports).
TASK_FIELDS: dict[str, dict[str, Any]] = {
    # super_glue/copa: premise without its period + " because"/" therefore" (the
    # file's query); choices " " + choice, first letter lower-cased (in the file).
    "copa": {"doc_to_text": "query", "doc_to_target": "gold",
             "doc_to_choice": "{{ choices | map('regex_replace', '^', ' ') | list }}"},
    "openbookqa": {"doc_to_text": "query", "doc_to_target": "gold", "doc_to_choice": "choices"},
    # piqa: "Question: {{goal}}\nAnswer:"; the file's query is "Question: {goal}\n".
    "piqa": {"doc_to_text": "{{query}}Answer:", "doc_to_target": "gold",
             "doc_to_choice": "choices"},
    # winogrande: an int doc_to_text (the gold option) makes the options contexts.
    "winogrande": {"doc_to_text": "gold", "doc_to_target": "continuation",
                   "doc_to_choice": "context_options"},
    "rte": {"doc_to_text": "{{sentence1}}\nQuestion: {{sentence2}} True or False?\nAnswer:",
            "doc_to_target": "label", "doc_to_choice": ["True", "False"]},
}


def task_config(name: str, data_dir: Path) -> dict[str, Any]:
    """The lm-eval task config of one local file (``local_<name>``)."""
    task = mc_prompts.TASKS[name]
    path = str((Path(data_dir) / task.file).resolve())
    if path.endswith(".tsv"):  # GLUE's TSV, read as mc_prompts.load_docs reads it
        dataset = {"dataset_path": "csv", "dataset_kwargs": {
            "data_files": {"test": path}, "sep": "\t", "quoting": 3,
            "keep_default_na": False}}
    else:
        dataset = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": path}}}
    return {
        "task": TASK_PREFIX + name, **dataset,
        "test_split": "test", "fewshot_split": "test", "output_type": "multiple_choice",
        **TASK_FIELDS[name],
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                        for m in task.lm_eval_metrics],
        "metadata": {"version": 1.0},
    }


def write_task_yamls(out_dir: Path, data_dir: Path, tasks: Sequence[str]) -> dict[str, str]:
    """Writes ``local_<task>.yaml`` per task into ``out_dir``; returns the YAML texts."""
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {}
    for name in tasks:
        texts[name] = yaml.safe_dump(task_config(name, data_dir), sort_keys=False,
                                     allow_unicode=True)
        (out_dir / f"{TASK_PREFIX}{name}.yaml").write_text(texts[name], encoding="utf-8")
    return texts


def lm_eval_command(base_url: str, model: Path, tasks: Sequence[str], *, limit: int,
                    num_fewshot: int, max_length: int, batch_size: int,
                    include_path: Path, output_path: Path) -> list[str]:
    """``lm_eval run`` against a server's ``/v1/completions``, token-id requests with BOS."""
    model_args = ",".join([
        f"base_url={base_url}/v1/completions", f"model={SERVED_NAME}", f"tokenizer={model}",
        "tokenizer_backend=huggingface", "tokenized_requests=True", "add_bos_token=True",
        f"max_length={max_length}", "num_concurrent=1", "max_retries=1"])
    lm_eval = Path(sys.executable).parent / "lm_eval"
    return [str(lm_eval), "run", "--model", "local-completions", "--model_args", model_args,
            "--tasks", ",".join(TASK_PREFIX + t for t in tasks),
            "--num_fewshot", str(num_fewshot), "--limit", str(limit),
            "--batch_size", str(batch_size), "--include_path", str(include_path),
            "--output_path", str(output_path), "--log_samples"]


def _value(metrics: dict, name: str) -> float | None:
    value = metrics.get(f"{name},none")
    return None if value is None else float(value)


def read_lm_eval_output(output_path: Path) -> dict[str, dict[str, Any]]:
    """Per task: lm-eval's acc / acc_norm and, per document, its choices' lls and prompts.

    Reads the newest ``results_*.json`` under ``output_path`` and the
    ``samples_local_<task>_*.jsonl`` beside it (``--log_samples``).
    """
    results_files = sorted(Path(output_path).rglob("results_*.json"))
    if not results_files:
        raise FileNotFoundError(f"no lm-eval results_*.json under {output_path}")
    results = json.loads(results_files[-1].read_text())["results"]
    out = {}
    for task_name, metrics in results.items():
        docs = []
        for path in sorted(results_files[-1].parent.glob(f"samples_{task_name}_*.jsonl"))[-1:]:
            lines = path.read_text(encoding="utf-8").splitlines()
            for sample in sorted(map(json.loads, filter(str.strip, lines)),
                                 key=lambda sample: sample["doc_id"]):
                # lm-eval 0.4 logs {"gen_args_0": {"arg_0": context, "arg_1": continuation}}
                docs.append({
                    "doc_id": sample["doc_id"],
                    "loglikelihoods": [float(resp[0]) for resp in sample["filtered_resps"]],
                    "requests": [(arg["arg_0"], arg["arg_1"])
                                 for arg in sample["arguments"].values()]})
        out[task_name.removeprefix(TASK_PREFIX)] = {
            "acc": _value(metrics, "acc"), "acc_norm": _value(metrics, "acc_norm"), "docs": docs}
    return out
