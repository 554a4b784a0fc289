# SPDX-License-Identifier: Apache-2.0
"""Decode time per token and KV bytes per step versus context: dense vs InfiniGen.

python benchmarks/perf/decode_latency.py [--model DIR] [--contexts 256 512 1024 1920]
    [--batch-sizes 1 4] [--budget 0.2] [--out benchmarks/results/decode_latency]

Each configuration (stock vLLM, InfiniGen with the in-place transfer, InfiniGen
with the copy transfer) gets one engine, prefix caching off; for every
(context, batch) it generates 1+N tokens per request and reads the engine's own
timestamps: decode time per token = (last token - first token) / N, averaged
over the batch. KV bytes read per decode step are
computed from the model shape (dense) and from InfiniGen's counters (selected
K/V + partial keys of every context token + the dense layers' full KV).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "gutenberg-llama-2k"
CONFIGS = {
    "dense": {},
    "infinigen-in-place": {"kv_manager": "infinigen", "infinigen_transfer": "in-place"},
    "infinigen-copy": {"kv_manager": "infinigen", "infinigen_transfer": "copy"},
}


def model_shape(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "layers": config["num_hidden_layers"],
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


def timed_generate(llm, prompts, max_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token), from the engine's timestamps."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = [out.metrics for out in outputs]
    prefill = max(s.first_token_ts for s in stats) - min(s.scheduled_ts for s in stats)
    decode = sum((s.last_token_ts - s.first_token_ts) / (max_tokens - 1) for s in stats)
    return prefill, decode / len(stats)


def run_config(name: str, model: Path, args) -> list[dict]:
    import vllm_infinigen  # noqa: F401
    from vllm import LLM

    from vllm_infinigen.metrics import summarize

    shape = model_shape(model)
    extra = dict(CONFIGS[name])
    if extra:
        extra["infinigen_budget"] = args.budget
    llm = LLM(model=str(model), dtype="float32", max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_bytes, seed=0,
              enable_prefix_caching=False, disable_log_stats=False, **extra)
    rng = random.Random(0)
    rows = []
    try:
        timed_generate(llm, [{"prompt_token_ids": [1, 5, 6]}], 8)  # warm-up
        for context in args.contexts:
            for batch in args.batch_sizes:
                prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(context)]}
                           for _ in range(batch)]
                before = summarize(llm.get_metrics())
                prefill, decode = timed_generate(llm, prompts, 1 + args.decode_tokens)
                after = summarize(llm.get_metrics())
                counters = {key: sum(after.get(key, {}).values())
                            - sum(before.get(key, {}).values())
                            for key in ("selected_tokens", "candidate_tokens", "swap_bytes")}
                rows.append(measure_row(name, context, batch, prefill, decode, counters,
                                        shape, args))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return rows


def measure_row(name, context, batch, prefill, decode, counters, shape, args) -> dict:
    steps = args.decode_tokens * batch  # decode rows
    kv_token_layer = 2 * shape["kv_heads"] * shape["head_dim"] * 4  # fp32 K+V
    dense_bytes = kv_token_layer * shape["layers"] * (context + args.decode_tokens / 2)
    row = {"config": name, "context": context, "batch": batch,
           "decode_ms_per_token": 1000 * decode,
           "prefill_s": prefill, "dense_kv_bytes_per_row": dense_bytes}
    if counters["candidate_tokens"]:
        sparse_layers = shape["layers"] - 2
        rank = max(1, int(shape["head_dim"] * 0.2))
        partial = counters["candidate_tokens"] * shape["kv_heads"] * rank * 4
        dense_part = 2 * kv_token_layer * (context + args.decode_tokens / 2) * steps
        row["kv_bytes_per_row"] = (counters["swap_bytes"] + partial + dense_part) / steps
        row["selected_fraction"] = counters["selected_tokens"] / counters["candidate_tokens"]
        row["ideal_fraction_of_dense"] = (
            2 + sparse_layers * (0.2 / 2 + args.budget)) / shape["layers"]
    else:
        row["kv_bytes_per_row"] = dense_bytes
    row["kv_read_vs_dense"] = row["kv_bytes_per_row"] / dense_bytes
    return row


def write_results(rows: list[dict], args, out: Path) -> None:
    import torch
    import vllm

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "machine": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "vllm": vllm.__version__,
            "model": str(args.model), "budget": args.budget}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Decode latency ({meta['machine']}, {meta['cpus']} CPUs, vLLM {meta['vllm']})",
             "", f"`{meta['command']}`", "",
             "| config | context | batch | decode ms/token | KV read vs dense | selected |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['context']} | {row['batch']} | "
                     f"{row['decode_ms_per_token']:.1f} | {row['kv_read_vs_dense']:.3f} | "
                     f"{row.get('selected_fraction', 1.0):.3f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 1920])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/decode_latency")
    args = parser.parse_args()
    if not args.model.is_dir():
        print(f"skipped: model directory {args.model} is absent (pass --model)")
        return 0
    rows = [row for name in args.configs for row in run_config(name, args.model, args)]
    write_results(rows, args, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
