# SPDX-License-Identifier: Apache-2.0
"""The requests lm-eval itself builds from our task YAMLs, recorded for tests without lm-eval.

``lm_eval_requests.json`` holds, per task, the (context, continuation) pairs
of each document that lm-eval's own ``TaskManager`` built from
``lm_eval_tasks.write_task_yamls`` over the hand-written documents below
(``write_task_files``), with the versions that built them. The unit tests
hold ``lm_eval_serve.our_prompts`` to it everywhere, and to lm-eval itself
where the ``bench`` extra is installed. Re-record after changing the
documents, the YAMLs or the lm-eval pin (``pip install 'vllm-infinigen[bench]'``)::

    python -m tests.reference.lm_eval_requests
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

from benchmarks.accuracy import lm_eval_tasks, mc_prompts

RECORDED = Path(__file__).with_name("lm_eval_requests.json")
LIMIT = 5
NUM_FEWSHOT = 2

COPA = {"query": "The man turned on the faucet, therefore", "gold": 1,
        "choices": ["the toilet filled with water.", "water flowed from the spout."]}
OBQA = {"query": "Predators eat", "choices": ["lions", "humans", "bunnies", "grass"], "gold": 2}
PIQA = {"query": "Question: How do I open a jar?\n", "gold": 0,
        "choices": ["Twist the lid.", "Bake the lid."]}
WINO = {"context_options": ["Sarah was a better surgeon than Maria so Sarah",
                            "Sarah was a better surgeon than Maria so Maria"],
        "continuation": "always got the harder cases.", "gold": 0}
RTE = {"sentence1": "Bacteria mutate fast.", "sentence2": "Bacteria are winning.",
       "label": "1", "idx": "7"}


def write_task_files(data_dir: Path, num_docs: int = 7) -> None:
    """num_docs copies per task of the hand-written documents, each made distinct."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, doc in [("copa", COPA), ("openbookqa", OBQA), ("piqa", PIQA), ("winogrande", WINO)]:
        rows = []
        for index in range(num_docs):
            row = json.loads(json.dumps(doc))
            key = {"winogrande": "continuation"}.get(name, "query")
            row[key] = row[key].replace(" ", f" {index} ", 1)
            row["gold"] = index % 2
            rows.append(json.dumps(row))
        (data_dir / mc_prompts.TASKS[name].file).write_text("\n".join(rows) + "\n")
    lines = ["sentence1\tsentence2\tlabel\tidx"] + [
        f'He said "hi {index}.\t{RTE["sentence2"]}\t{index % 2}\t{index}'
        for index in range(num_docs)]
    (data_dir / "rte_dev.tsv").write_text("\n".join(lines) + "\n")


def lm_eval_requests(work_dir: Path) -> dict[str, list[list[tuple[str, str]]]]:
    """Per task (our name), per document: the requests lm-eval's own TaskManager
    builds from our YAMLs over ``write_task_files``'s documents (needs lm-eval).

    The caller keeps the Hugging Face datasets cache inside ``work_dir`` and
    sets ``HF_DATASETS_OFFLINE=1``.
    """
    from lm_eval.tasks import TaskManager

    write_task_files(work_dir / "data")
    lm_eval_tasks.write_task_yamls(work_dir / "tasks", work_dir / "data", list(mc_prompts.TASKS))
    manager = TaskManager(include_path=str(work_dir / "tasks"), include_defaults=False)
    tasks = manager.load([f"local_{name}" for name in mc_prompts.TASKS])["tasks"]
    out = {}
    for task_name, task in sorted(tasks.items()):
        task.set_config(key="num_fewshot", value=NUM_FEWSHOT)
        task.set_fewshot_seed(seed=mc_prompts.FEWSHOT_SEED)
        task.build_all_requests(limit=LIMIT, rank=0, world_size=1)
        by_doc: dict[int, list[tuple[str, str]]] = {}
        for instance in task.instances:
            by_doc.setdefault(instance.doc_id, []).append(tuple(instance.arguments))
        out[task_name.removeprefix("local_")] = [by_doc[index] for index in sorted(by_doc)]
    return out


def load_recorded() -> dict:
    """The recorded file: ``{"provenance": {...}, "requests": {task: [[[ctx, cont], ...], ...]}}``."""
    return json.loads(RECORDED.read_text(encoding="utf-8"))


def as_lists(requests: dict[str, list[list[tuple]]]) -> dict[str, list[list[list[str]]]]:
    """Tuples as JSON stores them (lists), for comparing with ``load_recorded()``."""
    return {task: [[list(pair) for pair in doc] for doc in docs]
            for task, docs in requests.items()}


def main() -> int:
    import os
    from importlib.metadata import version

    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        datasets.config.HF_DATASETS_CACHE = str(Path(tmp) / "cache")
        requests = lm_eval_requests(Path(tmp))
    record = {
        "provenance": {
            "built_by": "lm_eval.tasks.TaskManager(include_path=<write_task_yamls>)"
                        ".load(...); task.build_all_requests(limit, rank=0, world_size=1)",
            "command": "python -m tests.reference.lm_eval_requests",
            "lm_eval": version("lm_eval"),
            "datasets": version("datasets"),
            "python": platform.python_version(),
            "limit": LIMIT,
            "num_fewshot": NUM_FEWSHOT,
            "fewshot_seed": mc_prompts.FEWSHOT_SEED,
        },
        "requests": as_lists(requests),
    }
    RECORDED.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    sys.stdout.write(f"wrote {RECORDED} ({sum(map(len, requests.values()))} documents)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
