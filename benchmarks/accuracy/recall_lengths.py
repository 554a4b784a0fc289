# SPDX-License-Identifier: Apache-2.0
"""Dense accuracy of a recall model by prompt length and needle depth (torch, no vLLM).

Held-out prompts of the multi-query recall task at each ``--lengths L:PAIRS``, made by
the task's own generator (``shared/prototypes/recall-training/recall12.py``,
``make_eval_set`` seeded ``11 + L`` as its training script seeds its held-out sets), or
read from ``--data L=PATH`` (the ``recall-4k.jsonl`` format); the greedy next token of
each in float32. ``--rope-linear-factor F`` reads the model with its RoPE positions
divided by F (linear position interpolation: F x the trained length maps onto it), the
lead for training past the length a model reached. How a training run's checkpoint is
measured on this machine (the README of ``benchmarks/models/recall-llama-12l-toward-16k``
quotes it).

    python -m benchmarks.accuracy.recall_lengths --model DIR --lengths 4096:96 6144:144 \\
        [--data 4096=PATH] [--prompts 150] --out benchmarks/results/NAME

``--save-prompts DIR`` writes the generated prompts as ``DIR/recall-L.jsonl.gz``, which
the frontier (``--recall-prompts``) and ``retrieval`` (``--data``) read; with
``--prompts-only`` nothing is measured (how ``benchmarks/data/recall-8192.jsonl.gz``
was made: ``--lengths 8192:190 --prompts 150 --save-prompts benchmarks/data
--prompts-only``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report

GENERATOR = "prototypes/recall-training"
BUCKETS = ("first_quarter", "middle", "last_quarter", "all")


def recall_task():
    """The task's module (``recall12``) from ``../shared``; a clear error without it."""
    where = paths.find_shared(GENERATOR)
    if where is None:
        raise SystemExit(f"the recall task's generator is missing: {paths.shared_path(GENERATOR)}"
                         " (set VLLM_INFINIGEN_SHARED to the directory holding it)")
    sys.path.insert(0, str(where))
    import recall12  # noqa: PLC0415 (the shared prototype, run as it is)

    return recall12


def linear_rope(rope_parameters: dict | None, factor: float) -> dict:
    """A config's ``rope_parameters`` with its positions divided by ``factor``
    (transformers' and vLLM's ``"linear"`` type), its RoPE theta kept."""
    theta = (rope_parameters or {}).get("rope_theta", 10000.0)
    return {"rope_type": "linear", "factor": factor, "rope_theta": theta}


def model_config(model_dir: str | Path, rope_linear_factor: float | None = None):
    """The model's transformers config, its RoPE positions interpolated linearly by
    ``rope_linear_factor`` where given (``linear_rope``): how every harness reads a model
    with ``--rope-linear-factor``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    if rope_linear_factor is not None:
        config.rope_parameters = linear_rope(config.rope_parameters, rope_linear_factor)
    return config


def prompts_at(task, length: int, pairs: int, count: int, data: Path | None) -> list[dict]:
    if data is not None:
        return paths.read_jsonl(data)[:count]
    return task.make_eval_set(count, seed=11 + length, L=length, N=pairs)


def save_prompts(items: list[dict], directory: Path, length: int) -> Path:
    """``items`` as ``recall-4k.jsonl``'s lines, gzipped, in ``directory/recall-LENGTH.jsonl.gz``
    (``paths.read_jsonl`` reads them): the held-out prompts other harnesses measure on."""
    path = directory / f"recall-{length}.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(item) + "\n" for item in items)
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    return path


def measure(model_dir: Path, lengths: list[tuple[int, int]], count: int,
            data: dict[int, Path], batch: int = 2,
            rope_linear_factor: float | None = None,
            save_to: Path | None = None) -> dict[str, Any]:
    """Accuracy per bucket at each length, with the prompts' source and the seconds."""
    import torch
    from transformers import LlamaForCausalLM

    task = recall_task()
    config = model_config(model_dir, rope_linear_factor)
    model = LlamaForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                             attn_implementation="sdpa")
    out = {}
    for length, pairs in lengths:
        began = time.perf_counter()
        items = prompts_at(task, length, pairs, count, data.get(length))
        assert all(len(it["prompt_token_ids"]) == length for it in items), length
        if save_to is not None and length not in data:
            save_prompts(items, save_to, length)
        acc = task.eval_prompts(model, items, torch.device("cpu"), bf16=False, bs=batch)
        source = data.get(length) or f"recall12.make_eval_set seed {11 + length}"
        out[str(length)] = {"pairs": pairs, "source": str(source),
                            "accuracy": {b: acc[b][0] for b in BUCKETS},
                            "prompts": {b: acc[b][1] for b in BUCKETS},
                            "seconds": round(time.perf_counter() - began, 1)}
        print(length, out[str(length)]["accuracy"], flush=True)
    return out


def markdown(results: dict[str, Any]) -> str:
    rows = [[f"{int(length):,} ({r['pairs']} pairs, n={r['prompts']['all']})",
             *(f"{r['accuracy'][b]:.3f}" for b in BUCKETS), r["source"]]
            for length, r in results.items()]
    return ("## Dense accuracy by prompt length and needle depth (float32, greedy, one token)\n\n"
            + report.markdown_table(["prompt length", "first quarter", "middle", "last quarter",
                                     "all", "prompts"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="required but with --prompts-only")
    parser.add_argument("--lengths", nargs="+", required=True, help="LENGTH:PAIRS ...")
    parser.add_argument("--data", nargs="*", default=[], help="LENGTH=PATH: prompts from a file")
    parser.add_argument("--prompts", type=int, default=150)
    parser.add_argument("--rope-linear-factor", type=float, default=None,
                        help="read the model with linear RoPE interpolation by this factor")
    parser.add_argument("--save-prompts", type=Path, default=None, metavar="DIR",
                        help="also write the generated prompts to DIR/recall-LENGTH.jsonl.gz")
    parser.add_argument("--prompts-only", action="store_true",
                        help="with --save-prompts: write them, measure nothing (no --out)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.prompts_only != (args.out is None) or (args.prompts_only and not args.save_prompts):
        parser.error("give --out, or --prompts-only with --save-prompts")
    if args.model is None and not args.prompts_only:
        parser.error("--model is required (but with --prompts-only)")
    lengths = [tuple(int(v) for v in x.split(":")) for x in args.lengths]
    if args.prompts_only:
        task = recall_task()
        for length, pairs in lengths:
            path = save_prompts(prompts_at(task, length, pairs, args.prompts, None),
                                args.save_prompts, length)
            print(f"{path}: {args.prompts} prompts of {length} tokens, {pairs} pairs, "
                  f"recall12.make_eval_set seed {11 + length}")
        return 0
    data = {int(k): Path(v) for k, v in (x.split("=", 1) for x in args.data)}
    results = measure(args.model, lengths, args.prompts, data,
                      rope_linear_factor=args.rope_linear_factor, save_to=args.save_prompts)
    import torch
    import transformers

    meta = report.source_metadata(torch=torch.__version__, transformers=transformers.__version__,
                                  model=str(args.model))
    factor = args.rope_linear_factor
    title = f"Dense retrieval of {args.model.name} by length" + (
        f", RoPE positions interpolated linearly by {factor:g}" if factor else "")
    report.write_results(args.out, meta, title,
                         {"lengths": args.lengths, "prompts": args.prompts, "data": args.data,
                          "rope_linear_factor": factor}, results, [markdown(results)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
