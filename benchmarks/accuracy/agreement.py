# SPDX-License-Identifier: Apache-2.0
"""Agreement with dense attention during free generation: per-token KL and top-1 agreement.

1. Dense vLLM generates G tokens greedily after each prompt, returning the
   top-k raw logprobs of every step.
2. An InfiniGen engine teacher-forces that same dense continuation, also with
   top-k logprobs, once per budget and ``--policy`` (InfiniGen or the
   runtime's baselines; switched on the running engine).
3. Per position, the two next-token distributions are compared.

Step 0 is predicted by the (dense) prefill in both engines and is left out:
positions 1..G-1 are decode steps.

KL estimate (the approximation): vLLM returns only the top-k tokens of each
distribution (plus the forced token). With K the tokens known in both, the
vocabulary is coarse-grained into the tokens of K and one "rest" bucket, and

    KL_K = sum_{t in K} p(t) log(p(t) / q(t)) + p(R) log(p(R) / q(R)),
    R = vocabulary \\ K, p(R) = 1 - sum_K p, q(R) = 1 - sum_K q

(p dense, q InfiniGen). By the data-processing inequality KL_K <= KL(p || q);
it is exact when k covers the vocabulary (``--top-logprobs`` = vocabulary
size). ``covered_mass`` reports sum_K p, how much of p the estimate resolves.
Top-1 agreement: InfiniGen's most likely token is the dense greedy token.
Example::

    flock /tmp/engine.lock python -m benchmarks.accuracy.agreement --budget 0.05 0.1 0.2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import report
from benchmarks.accuracy import sweeps
from benchmarks.harness import paths
from benchmarks.accuracy.perplexity import cut_windows, tokenize_text

DEFAULT_MODEL = paths.shared_path("models/gutenberg-llama-2k")
DEFAULT_TEXT = paths.shared_path("data/text/gutenberg-frankenstein.txt")
DEFAULT_OUT = paths.RESULTS / "agreement"
# Floor for q(R) when the known tokens already hold all of q's mass (rounding).
MIN_REST = 1e-12


def logprob_map(step: Mapping[int, Any]) -> dict[int, float]:
    """``{token: logprob}`` of a vLLM step (``Logprob`` objects or floats)."""
    return {token: float(getattr(value, "logprob", value)) for token, value in step.items()}


def top1_token(logprobs: Mapping[int, float]) -> int:
    """The most likely token (lowest id on ties)."""
    return min(logprobs, key=lambda token: (-logprobs[token], token))


def kl_lower_bound(p: Mapping[int, float], q: Mapping[int, float]) -> tuple[float, float]:
    """(KL_K, covered mass): coarse-grained KL(p || q) over the tokens known in both.

    Args:
        p: Reference logprobs (dense), a subset of the vocabulary.
        q: Compared logprobs (InfiniGen), a subset of the vocabulary.

    Returns:
        KL_K as in the module docstring (a lower bound on KL(p || q), exact
        when both cover the vocabulary) and sum over the known tokens of p.
    """
    known = p.keys() & q.keys()
    kl = 0.0
    p_known = q_known = 0.0
    for token in known:
        p_t = math.exp(p[token])
        kl += p_t * (p[token] - q[token])
        p_known += p_t
        q_known += math.exp(q[token])
    p_rest = 1.0 - p_known
    if p_rest > 0:
        q_rest = max(1.0 - q_known, MIN_REST)
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), min(p_known, 1.0)


def compare_steps(dense: Sequence[Mapping[int, float]], sparse: Sequence[Mapping[int, float]],
                  skip: int = 1) -> list[dict[str, float]]:
    """Per position (from ``skip`` on): KL_K, covered mass and top-1 agreement."""
    if len(dense) != len(sparse):
        raise ValueError(f"{len(dense)} dense steps but {len(sparse)} sparse steps")
    out = []
    for p, q in list(zip(dense, sparse))[skip:]:
        kl, covered = kl_lower_bound(p, q)
        out.append({"kl": kl, "covered_mass": covered,
                    "top1_agree": float(top1_token(p) == top1_token(q))})
    return out


def summarize_positions(positions: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean / median / 95th percentile KL, mean covered mass, top-1 agreement."""
    if not positions:
        raise ValueError("no positions to summarize")
    kls = sorted(p["kl"] for p in positions)
    return {
        "num_positions": len(positions),
        "mean_kl": sum(kls) / len(kls),
        "median_kl": statistics.median(kls),
        "p95_kl": kls[min(len(kls) - 1, math.ceil(0.95 * len(kls)) - 1)],
        "top1_agreement": sum(p["top1_agree"] for p in positions) / len(positions),
        "mean_covered_mass": sum(p["covered_mass"] for p in positions) / len(positions),
    }


def dense_generate(args, prompts: Sequence[list[int]]) -> tuple[list[list[int]], list[list[dict]]]:
    """Greedy dense continuations and their per-step top-k logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=args.generate_tokens, ignore_eos=True,
                            logprobs=args.top_logprobs, detokenize=False)
    with sweeps.start_engine(str(args.model), "vllm", max_model_len=args.max_model_len,
                             kv_cache_memory_bytes=args.kv_cache_bytes,
                             max_logprobs=args.top_logprobs) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=True)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    steps = [[logprob_map(step) for step in out.outputs[0].logprobs] for out in outputs]
    return tokens, steps


def sparse_compare(args, prompts, dense_tokens, dense_steps) -> list[dict]:
    """Teacher-forces the dense continuations through InfiniGen, per setting."""
    from tqdm import tqdm

    from benchmarks.accuracy.teacher_forcing import force_continuations

    results = []
    with sweeps.start_engine(str(args.model), "infinigen", max_model_len=args.max_model_len,
                             infinigen={"budget": args.budget[0]},
                             kv_cache_memory_bytes=args.kv_cache_bytes,
                             max_logprobs=args.top_logprobs) as llm:
        for setting in sweeps.sweep(llm, "infinigen", sweeps.selection_grid(
                args.budget, args.policy, args.select_all_control)):
            start = time.perf_counter()
            per_prompt = []
            with sweeps.SelectionMeter(llm) as meter, tqdm(total=len(prompts), unit="prompt",
                                                            desc=f"infinigen {setting}",
                                                            file=sys.stderr) as bar:
                indices = list(range(len(prompts)))
                for chunk in sweeps.batched(indices, args.batch_size):
                    steps = force_continuations(
                        llm, [prompts[i] for i in chunk], [dense_tokens[i] for i in chunk],
                        num_logprobs=args.top_logprobs)
                    for i, sequence in zip(chunk, steps):
                        per_prompt.append(compare_steps(
                            dense_steps[i], [logprob_map(step) for step in sequence]))
                    bar.update(len(chunk))
            flat = [position for prompt in per_prompt for position in prompt]
            results.append({
                "kv_manager": "infinigen",
                "control": sweeps.is_control(setting),
                **setting, "policy": sweeps.policy_of(setting), **summarize_positions(flat),
                "selected_fraction": meter.fraction,
                "seconds": time.perf_counter() - start,
                "per_prompt_kl": [[round(p["kl"], 6) for p in prompt] for prompt in per_prompt],
                "per_prompt_top1": [[int(p["top1_agree"]) for p in prompt]
                                    for prompt in per_prompt],
            })
    return results


def results_table(results: Sequence[dict]) -> str:
    rows = [["select all (control)" if r["control"] else r["policy"],
             report.cell(r["budget"], "g"),
             report.cell(r.get("alpha"), "g"), str(r["num_positions"]),
             f"{r['mean_kl']:.4f}", f"{r['median_kl']:.4f}", f"{r['p95_kl']:.4f}",
             f"{r['top1_agreement']:.3f}", f"{r['mean_covered_mass']:.3f}",
             report.cell(r["selected_fraction"], ".3f")] for r in results]
    return report.markdown_table(
        ["policy", "budget", "alpha", "positions", "mean KL_K", "median KL_K", "p95 KL_K",
         "top-1 agreement", "covered dense mass", "selected fraction"], rows)


def plot_panels(results: Sequence[dict], top_logprobs: int) -> list[report.Panel]:
    kl = report.Panel(f"KL(dense || sparse), KL_K from the top {top_logprobs}",
                      "mean KL_K (nats/token)")
    top1 = report.Panel("top-1 agreement with dense", "fraction of positions")
    for r in results:
        if r["control"]:
            kl.references["select all (control)"] = r["mean_kl"]
            top1.references["select all (control)"] = r["top1_agreement"]
        else:
            kl.series.setdefault(r["policy"], []).append((r["budget"], r["mean_kl"]))
            top1.series.setdefault(r["policy"], []).append((r["budget"], r["top1_agreement"]))
    return [kl, top1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                        help="prompts are cut from this UTF-8 text")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--generate-tokens", type=int, default=128)
    parser.add_argument("--top-logprobs", type=int, default=20,
                        help="k: top tokens returned per step (vocabulary size: exact KL)")
    sweeps.add_selection_options(parser, [0.05, 0.1, 0.2])
    sweeps.add_run_options(parser, max_model_len=2048, kv_cache_bytes=256 << 20, batch_size=8,
                           out=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sweeps.check_budgets(parser, args.budget)
    if args.generate_tokens < 2:
        parser.error("--generate-tokens must be >= 2 (step 0 comes from the prefill)")
    if args.top_logprobs < 1:
        parser.error("--top-logprobs must be >= 1")
    if args.prompt_tokens + args.generate_tokens > args.max_model_len:
        parser.error("--prompt-tokens + --generate-tokens must be <= --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sweeps.inputs_missing(args.model, args.text):
        return 0
    token_ids = tokenize_text(str(args.model), args.text.read_text(encoding="utf-8"))
    windows = cut_windows(token_ids, args.prompt_tokens, args.generate_tokens, args.num_prompts)
    prompts = [prompt for prompt, _ in windows]
    dense_tokens, dense_steps = dense_generate(args, prompts)
    results = sparse_compare(args, prompts, dense_tokens, dense_steps)

    meta = report.run_metadata(model=str(args.model), text=str(args.text))
    sections = [
        f"{len(prompts)} prompts of {args.prompt_tokens} tokens cut from `{args.text.name}`; "
        f"dense vLLM generates {args.generate_tokens} tokens greedily, InfiniGen is "
        f"teacher-forced along them; positions 1..{args.generate_tokens - 1} (decode steps) "
        f"compared with the top {args.top_logprobs} logprobs of each side.",
        "KL_K is a lower bound on KL(dense || sparse): the vocabulary is coarse-grained "
        "into the tokens whose logprobs both sides returned plus one rest bucket (exact when "
        "k covers the vocabulary); 'covered dense mass' is the dense probability those "
        "tokens hold.",
        "## Per setting", results_table(results),
    ]
    png = report.try_plot(args.out.with_suffix(".png"), plot_panels(results, args.top_logprobs),
                          f"agreement with dense, {args.model.name}")
    if png:
        sections.append(f"![agreement vs budget]({png.name})")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report.write_results(args.out, meta, "Agreement with dense during free generation",
                         settings, results, sections)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
