# SPDX-License-Identifier: Apache-2.0
"""Records InfiniGen's block selections on a trained model, and how much consecutive steps reuse.

python -m benchmarks.gpu.record_selections [--models gutenberg-llama-2k ...]
    [--budgets 0.1 0.2] [--token-caps 256 512] [--keys bounds|int|partial] [--alpha A]
    [--trace-model recall-llama-12l-4k|none] [--trace-dir DIR]

HF transformers + torch on the CPU, no vLLM. One request: ``--context``
tokens of prefill, then ``--steps`` decode steps teacher-forced with the
text that follows (book text for gutenberg-llama-2k: Frankenstein, held out
from its training; a recall prompt's own tokens for recall-llama-12l). At
every step, for every sparse layer (``--dense-layers`` first layers dense),
the selection is the one InfiniGen on a GPU would make
(``vllm_infinigen.platforms.cuda.kernels.block_rule``): the query of layer l
from layer l-1's attention input (layer l's q_proj, RoPE), scored against
layer l's speculation keys, best over the query heads of each KV head and
over each block's tokens; the budget (``--budgets``, each token cap of
``--token-caps`` at the largest budget), or with ``--alpha`` the paper's
count capped by it, rounded up to blocks, plus the sink block and the own
block. Keys (``--keys``): ``bounds``, the product's default (each unit of
16 tokens: every channel's max and min key in 8 bits, the unit scores its
upper bound of q . k, ``block_rule.bound_unit_scores``), ``int`` (every
channel in 4 bits, one scale per channel and 16 tokens, as a float32 cache
holds them), or ``partial`` (r = 0.2 of the skewed channels, the skew from
``compute_skew_tables`` on the bundled calibration text for gutenberg, on
other recall prompts for the recall models). The window is the product's
(``--recent-tokens``, default 16: the block before the row's own is kept too).

Writes ``--trace-model``'s selections, one trace per budget and cap, under
benchmarks/gpu/traces/ (a few KiB each, with provenance: the GPU benchmarks
replay the one recorded at the fraction of the context they select,
``selection_trace.trace_for``), and benchmarks/results/selection_reuse.{json,md}:
step-to-step reuse and the device block cache's hit rate on the recorded
selections for each eviction rule and cache size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu import selection_trace
from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.harness import paths, report
from vllm_infinigen.layout import BOUND_BITS, BOUND_UNIT
from vllm_infinigen.platforms.cuda.block_cache import EVICTION_RULES, DeviceBlockCache
from vllm_infinigen.platforms.cuda.kernels import block_rule as rule
from vllm_infinigen.platforms.cuda.kernels.reference import bound_key_codes
from vllm_infinigen.platforms.cuda.kernels.widths import window_blocks

MODELS = {
    "gutenberg-llama-2k": ("text", "data/text/gutenberg-frankenstein.txt"),
    "recall-llama-12l": ("recall", "data/recall/recall-1k.jsonl"),
    "recall-llama-12l-4k": ("recall", "data/recall/recall-4k.jsonl"),
}
CACHE_FACTORS = (1.0, 1.5, 2.0, 3.0)
DEFAULT_OUT = paths.RESULTS / "selection_reuse"


def _inputs(kind: str, source: Path, tokenizer, count: int) -> tuple[list[int], list[str]]:
    """(token ids of the request, calibration texts)."""
    if kind == "text":
        text = source.read_text(encoding="utf-8")
        return tokenizer(text[: 16 * count], verbose=False).input_ids[:count], []
    prompts = [row["prompt_token_ids"] for row in paths.read_jsonl(source)]
    calibration = [" ".join(tokenizer.convert_ids_to_tokens(p[1:])) for p in prompts[1:3]]
    return prompts[0][:count], calibration


class _Capture:
    """Each layer's attention input and rotary tables (pre-hook) and its keys
    after RoPE, cache included (attention function), for the latest forward."""

    name = "infinigen_trace"  # the attention implementation to load the model with

    def __init__(self) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface

        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}

        def attend(module, query, key, value, attention_mask, **kwargs):
            self.keys[module.layer_idx] = key[0].detach()  # [H_kv, T, D]
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self.name, attend)
        AttentionMaskInterface.register(self.name, sdpa_mask)

    def attach(self, model) -> None:
        for idx, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._hook(idx), with_kwargs=True)

    def _hook(self, idx: int):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            self.inputs[idx] = (hidden[0, -1].detach(), cos[0, -1], sin[0, -1])
        return hook


def _partial_query(model, target: int, captured, skew: torch.Tensor) -> torch.Tensor:
    """[1, H_kv, G, R] layer ``target``'s skewed partial query from layer target-1's input."""
    from transformers.models.llama.modeling_llama import rotate_half

    hidden, cos, sin = captured
    attention = model.model.layers[target].self_attn
    num_kv_heads, head_dim, _ = skew.shape
    query = attention.q_proj(hidden).view(-1, head_dim)  # [H_q, D]
    query = query * cos + rotate_half(query) * sin
    grouped = query.view(num_kv_heads, -1, head_dim)
    return torch.einsum("hgd,hdr->hgr", grouped.float(), skew)[None]


def _block_scores(model, target: int, capture: _Capture, keys_kind: str,
                  skew: torch.Tensor | None, context: int,
                  block_size: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token scores [1, H_kv, NB * bs] or None for the bounds, block scores [1, H_kv, NB])
    of ``target`` at this step: ``keys_kind`` bounds (each complete unit's bound from its
    8-bit codes, the row's open unit unscored: the rule keeps it as recent), int (4-bit
    codes per channel and 16 tokens, the row's open block with its full keys) or partial
    (``skew``)."""
    keys = capture.keys[target][:, :context].float()  # [H_kv, ctx, D]
    num_kv_heads, _, head_dim = keys.shape
    num_blocks = context // block_size + 1
    table = torch.arange(num_blocks)[None]
    lens = torch.tensor([context])
    if keys_kind == "bounds":
        query = _partial_query(model, target, capture.inputs[target - 1],
                               torch.eye(head_dim).expand(num_kv_heads, head_dim, head_dim))
        return None, bound_block_scores(query, keys, block_size)
    if skew is None:
        from benchmarks.accuracy.key_forms import quantize_blocks

        skew = torch.eye(head_dim).expand(num_kv_heads, head_dim, head_dim)
        closed = context // 16 * 16
        keys = torch.cat([torch.stack([quantize_blocks(k[:closed], 4, False) for k in keys]),
                          keys[:, closed:]], dim=1)
    query = _partial_query(model, target, capture.inputs[target - 1], skew)
    partial = torch.einsum("htd,hdr->htr", keys, skew)  # [H_kv, ctx, R]
    padded = torch.zeros(partial.shape[0], num_blocks * block_size, partial.shape[2])
    padded[:, :context] = partial
    # today's layout: [num_blocks, H_kv, R, block_size]
    partial_keys = padded.view(partial.shape[0], num_blocks, block_size, -1).permute(1, 0, 3, 2)
    scale = 1.0 / math.sqrt(skew.shape[1])
    tokens = rule.partial_token_scores(query, partial_keys.contiguous(), table, scale=scale)
    return tokens, rule.block_scores(tokens, lens, block_size)


def bound_block_scores(query: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """[1, H_kv, NB] each block's best unit bound for one row (the product's
    ``bound_unit_scores`` over its bound keys, ``bound_key_codes``): the
    complete units of ``keys`` [H_kv, ctx, D] scored against ``query``
    [1, H_kv, G, D]; a block without a complete unit (the row's open one) -inf."""
    num_kv_heads, context, head_dim = keys.shape
    num_blocks = context // block_size + 1
    units, per_block = context // BOUND_UNIT, block_size // BOUND_UNIT
    codes, scales = bound_key_codes(
        keys[:, : units * BOUND_UNIT].reshape(num_kv_heads, units, BOUND_UNIT, head_dim)
        .transpose(0, 1), BOUND_BITS)  # [units, H_kv, 2, D * bits / 8], [units, H_kv]
    bounds = torch.zeros(num_blocks * per_block, *codes.shape[1:], dtype=codes.dtype)
    unit_scales = torch.zeros(num_blocks * per_block, num_kv_heads, dtype=scales.dtype)
    bounds[:units], unit_scales[:units] = codes, scales
    # the layer's layout: [blocks, H_kv, units per block, ...]
    bounds = bounds.view(num_blocks, per_block, *codes.shape[1:]).transpose(1, 2)
    unit_scales = unit_scales.view(num_blocks, per_block, num_kv_heads).transpose(1, 2)
    scores = rule.bound_unit_scores(query, bounds.contiguous(), unit_scales.contiguous(),
                                    torch.arange(num_blocks)[None], torch.tensor([context]),
                                    scale=1.0 / math.sqrt(head_dim), block_size=block_size)
    return rule.unit_block_scores(scores, per_block)


def _attention_mass(model, target: int, capture: _Capture, context: int,
                    block_size: int) -> torch.Tensor:
    """[H_kv, NB] the layer's own dense attention (softmax over the context,
    the own token left out) summed over each block and over the group's query
    heads, divided by the group size: how much each block matters."""
    attention = model.model.layers[target].self_attn
    hidden, cos, sin = capture.inputs[target]
    keys = capture.keys[target][:, :context].float()  # [H_kv, ctx, D]
    num_kv_heads, _, head_dim = keys.shape
    from transformers.models.llama.modeling_llama import rotate_half

    query = attention.q_proj(hidden).view(-1, head_dim)
    query = (query * cos + rotate_half(query) * sin).view(num_kv_heads, -1, head_dim)
    probs = torch.softmax(torch.einsum("hgd,htd->hgt", query, keys) / math.sqrt(head_dim), -1)
    num_blocks = context // block_size + 1
    mass = torch.zeros(num_kv_heads, num_blocks * block_size)
    mass[:, :context] = probs.mean(dim=1)
    return mass.view(num_kv_heads, num_blocks, block_size).sum(-1)


def budget_label(budget: float, cap: int | None) -> str:
    return str(budget) if cap is None else f"{budget} cap {cap}"


def budgets_of(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    """Each budget, then each token cap at the largest."""
    return ([(b, None) for b in args.budgets]
            + [(max(args.budgets), cap) for cap in args.token_caps])


def record(model_name: str,
           args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{budget label: masks [steps, sparse layers, H_kv, max_blocks]} and provenance
    (with the layers' own attention mass the selections cover)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.accuracy.recall_lengths import model_config
    from vllm_infinigen.skewing.calibration import compute_skew_tables

    model_dir, kind, source = args.sources[model_name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, calibration = _inputs(kind, source, tokenizer, args.context + args.steps)
    tables = (compute_skew_tables(str(model_dir), 0.2, calibration or None)
              if args.keys == "partial" else None)
    torch.manual_seed(0)
    capture = _Capture()
    # only --recall-model is read interpolated (main refuses a shared model's name for it)
    factor = args.rope_linear_factor if args.recall_model is not None and (
        model_name == args.recall_model.name) else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=model_config(model_dir, factor),
                                                 dtype=torch.float32,
                                                 attn_implementation=capture.name).eval()
    capture.attach(model)
    num_layers = model.config.num_hidden_layers
    sparse = list(range(args.dense_layers, num_layers))
    bs = args.block_size
    max_blocks = (args.context + args.steps - 1) // bs + 1
    heads = model.config.num_key_value_heads
    settings = budgets_of(args)
    sink, recent = window_blocks(0, args.recent_tokens, bs)
    masks = {budget_label(*s): np.zeros((args.steps, len(sparse), heads, max_blocks), bool)
             for s in settings}
    covered = {label: [] for label in masks}
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[: args.context]]), use_cache=True)
        cache = out.past_key_values
        for step in range(args.steps):
            position = args.context + step
            token = torch.tensor([[ids[position]]])
            cache = model(input_ids=token, past_key_values=cache, use_cache=True).past_key_values
            lens = torch.tensor([position])  # context tokens before the row's own
            for index, target in enumerate(sparse):
                tokens, scores = _block_scores(
                    model, target, capture, args.keys,
                    None if tables is None else tables.skew[target], position, bs)
                mass = _attention_mass(model, target, capture, position, bs)
                for budget, cap in settings:
                    label = budget_label(budget, cap)
                    caps = torch.tensor([max(1, min(math.floor(position * budget),
                                                    cap or position))])
                    if args.alpha is not None:
                        caps = rule.alpha_token_caps(tokens, lens, args.alpha, caps)
                    chosen = rule.select_blocks(scores, lens, caps, block_size=bs,
                                                width=scores.shape[-1], sink_blocks=sink,
                                                recent_blocks=recent).logical[0]
                    for head in range(heads):
                        picked = chosen[head][chosen[head] >= 0]
                        masks[label][step, index, head, picked.numpy()] = True
                        covered[label].append(float(mass[head, picked].sum()))
    weights = sorted(model_dir.glob("*.safetensors"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in weights)).hexdigest()[:16]
    provenance = {
        "model": model_name, "weights_sha256_prefix": digest,
        "input": f"{source} ({'first prompt' if kind == 'recall' else 'from the start'})",
        "context_tokens": args.context, "decode_steps": args.steps,
        "decode": "teacher-forced with the tokens that follow the context",
        "block_size": bs, "dense_layers": args.dense_layers, "sparse_layers": sparse,
        "kv_heads": heads, "keys": args.keys,
        "rope_linear_factor": factor,
        "alpha": "off (the budget binds)" if args.alpha is None else args.alpha,
        "skew_calibration": None if args.keys != "partial" else "bundled calibration text"
        if not calibration else "recall prompts 2-3", "sink_blocks": sink,
        "recent_blocks": recent, "recent_tokens": args.recent_tokens,
        "rule": "vllm_infinigen.platforms.cuda.kernels.block_rule (speculated from layer l-1)",
        "attention_mass_covered": {b: float(np.mean(v)) for b, v in covered.items()},
    }
    return masks, provenance


def forced_blocks(num_steps: int, context: int, block_size: int, max_blocks: int,
                  recent_blocks: int = 1) -> np.ndarray:
    """[steps, max_blocks] the sink block and each step's last ``recent_blocks``
    (the own block and those before it)."""
    forced = np.zeros((num_steps, max_blocks), bool)
    forced[:, 0] = True
    for step in range(num_steps):
        own = (context + step) // block_size
        forced[step, max(0, own - recent_blocks + 1): own + 1] = True
    return forced


def simulate_cache(masks: np.ndarray, factor: float, eviction: str) -> float:
    """Hit rate of a device block cache with ``factor`` x the widest step's
    blocks per head, replaying ``masks`` (first step, cold, left out)."""
    steps, layers, heads, max_blocks = masks.shape
    width = int(masks.sum(axis=-1).max())
    cache = DeviceBlockCache(layers, heads, math.ceil(factor * width), max_blocks, "cpu",
                             eviction=eviction)
    hits = misses = 0
    for step in range(steps):
        for layer in range(layers):
            ids = torch.full((1, heads, width), -1, dtype=torch.int64)
            for head in range(heads):
                chosen = torch.from_numpy(np.flatnonzero(masks[step, layer, head]))
                ids[0, head, : chosen.numel()] = chosen
            cache.lookup(layer, ids)
        step_hits, step_misses = cache.take_counters()
        if step:
            hits, misses = hits + sum(step_hits), misses + sum(step_misses)
    return hits / max(hits + misses, 1)


def summarize(masks: dict[str, np.ndarray], args: argparse.Namespace,
              provenance: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for budget, mask in masks.items():
        forced = forced_blocks(args.steps, args.context, args.block_size, mask.shape[-1],
                               provenance["recent_blocks"])
        reuse = selection_trace.step_reuse(mask)
        free = selection_trace.step_reuse(mask, skip=forced)
        results[budget] = {
            "blocks_per_head_mean": float(mask.sum(axis=-1).mean()),
            "kept_fraction_mean": float(mask.sum(axis=-1).mean() / mask.shape[-1]),
            "attention_mass_covered": provenance["attention_mass_covered"][budget],
            "reuse_mean": float(reuse.mean()),
            "reuse_without_sink_and_own_mean": float(free.mean()),
            "reuse_by_layer": [float(v) for v in reuse.mean(axis=(0, 2))],
            "hit_rate": {rule_name: {str(f): simulate_cache(mask, f, rule_name)
                                     for f in CACHE_FACTORS} for rule_name in EVICTION_RULES},
        }
    return results


def _markdown(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = ["| budget | blocks per head | attention covered | reuse | reuse w/o sink & recent | "
            + " | ".join(f"{r} hit rate x{f}" for r in EVICTION_RULES for f in CACHE_FACTORS)
            + " |", "|" + "---|" * (5 + len(EVICTION_RULES) * len(CACHE_FACTORS))]
    for budget, r in results.items():
        cells = [budget, f"{r['blocks_per_head_mean']:.1f}",
                 f"{r['attention_mass_covered']:.3f}", f"{r['reuse_mean']:.3f}",
                 f"{r['reuse_without_sink_and_own_mean']:.3f}"]
        cells += [f"{r['hit_rate'][n][str(f)]:.3f}" for n in EVICTION_RULES for f in CACHE_FACTORS]
        rows.append("| " + " | ".join(cells) + " |")
    by_layer = ["| budget | " + " | ".join(f"layer {i}" for i in range(
        args.dense_layers, args.dense_layers + len(next(iter(results.values()))["reuse_by_layer"])))
        + " |"]
    by_layer.append("|" + "---|" * (1 + len(next(iter(results.values()))["reuse_by_layer"])))
    for budget, r in results.items():
        values = " | ".join(f"{v:.3f}" for v in r["reuse_by_layer"])
        by_layer.append(f"| {budget} | {values} |")
    return ["\n".join(rows), "Reuse by layer:", "\n".join(by_layer)]


_INTRO = (
    "Reuse: the fraction of a step's selected blocks (per sparse layer and KV head) that "
    "the previous step selected too, mean over layers, heads and steps; w/o sink & recent: "
    "the same with the always-kept sink block and recent blocks (the own block and, with "
    "the default 16 recent tokens, the one before it) left out of both steps. "
    "Attention covered: the share of the layer's own dense attention (mean over query "
    "heads) that falls in the selected blocks (the kept fraction is what a uniform choice "
    "would cover). Hit rate: the device block cache (`platforms/cuda/block_cache.py`) "
    "replaying the selections, with slots per KV head = factor x the widest step's blocks "
    "per head; the cold first step left out. Block size 16, the keys, alpha and window "
    "named under each model (the product's defaults: bound keys, alpha off so the budget "
    "binds, 1 sink block, 16 recent tokens); `python -m benchmarks.gpu.record_selections` "
    "(HF transformers on the CPU; the trace model's selections, one trace per row, are "
    "`benchmarks/gpu/traces/`, which the GPU benchmarks replay).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help="default: gutenberg-llama-2k recall-llama-12l, or none beside "
                        "--recall-model")
    parser.add_argument("--recall-model", type=Path, default=None,
                        help="a recall model's folder (one this project trained, e.g. "
                        "benchmarks/models/...), recorded beside --models under its "
                        "folder's name (also a --trace-model)")
    parser.add_argument("--recall-prompts", type=Path, default=None,
                        help="its recall prompts (jsonl; the first is the request)")
    parser.add_argument("--rope-linear-factor", type=float, default=None,
                        help="read --recall-model with its RoPE positions interpolated "
                        "linearly by this factor (benchmarks.accuracy.recall_lengths)")
    parser.add_argument("--context", type=int, default=1024,
                        help="prefill tokens (at most a recall prompt's length - --steps)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--token-caps", type=int, nargs="*", default=[],
                        help="--infinigen-budget-tokens values, each at the largest budget")
    parser.add_argument("--keys", choices=("bounds", "int", "partial"), default="bounds",
                        help="--infinigen-speculation-keys the recorded selection scores "
                        "(default: the product's, bounds)")
    parser.add_argument("--recent-tokens", type=int, default=16,
                        help="--infinigen-recent-tokens (default: the product's, 16)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="the paper's count (e.g. 5) capped by the budget (default: off, "
                        "the product's default: the budget binds)")
    parser.add_argument("--trace-model", default=selection_trace.TRACE_MODEL,
                        help="the model whose selections are written as the GPU benchmarks' "
                        "traces, one per budget and cap ('none': no trace)")
    parser.add_argument("--trace-dir", type=Path, default=selection_trace.TRACES)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.alpha is not None and args.keys == "bounds":
        parser.error("--alpha counts tokens over the int or partial keys' scores: "
                     "add --keys int (or partial)")
    if (args.recall_model is None) != (args.recall_prompts is None):
        parser.error("--recall-model and --recall-prompts go together")
    if args.rope_linear_factor is not None and args.recall_model is None:
        parser.error("--rope-linear-factor applies to --recall-model")
    if args.recall_model is not None and args.recall_model.name in MODELS:
        parser.error(f"--recall-model's folder name {args.recall_model.name!r} is a shared "
                     "model's (--models): the results and traces are keyed by it; use another "
                     "folder name")
    # name -> (model folder, kind, input): the shared models', and --recall-model's
    args.sources = {name: (paths.shared_path(f"models/{name}"), kind, paths.shared_path(source))
                    for name, (kind, source) in MODELS.items()}
    named = [] if args.recall_model else ["gutenberg-llama-2k", "recall-llama-12l"]
    args.models = list(args.models or named)
    if args.recall_model is not None:
        args.sources[args.recall_model.name] = (args.recall_model, "recall", args.recall_prompts)
        args.models.append(args.recall_model.name)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    meta = gpu_run_metadata()
    settings, results, sections = {}, {}, []
    for name in args.models:
        _, kind, source = args.sources[name]
        prompt = (len(paths.read_jsonl(source)[0]["prompt_token_ids"])
                  if kind == "recall" else None)
        model_args = argparse.Namespace(**{**vars(args), "context": min(
            args.context, prompt - args.steps) if prompt else args.context})
        masks, provenance = record(name, model_args)
        if name == args.trace_model:
            for budget, cap in budgets_of(model_args):
                path = selection_trace.save_recorded(
                    args.trace_dir, masks[budget_label(budget, cap)], provenance,
                    budget=budget, cap=cap, command=meta["command"],
                    repo_commit=meta["repo_commit"], date_utc=meta["date_utc"])
                print(f"trace: {path} ({path.stat().st_size} bytes)")
        settings[name] = provenance
        results[name] = summarize(masks, model_args, provenance)
        about = (f"Context {provenance['context_tokens']} tokens, "
                 f"{provenance['decode_steps']} decode steps ({provenance['decode']}); "
                 f"input {provenance['input']}; "
                 + {"bounds": f"bound keys ({BOUND_BITS}-bit, units of {BOUND_UNIT})",
                    "int": "int keys (no skew)"}.get(
                     provenance["keys"], f"partial keys, skew from "
                     f"{provenance['skew_calibration']}")
                 + f"; alpha {provenance['alpha']}; {provenance['sink_blocks']} sink block, "
                 f"{provenance['recent_tokens']} recent tokens ({provenance['recent_blocks']} "
                 "last blocks, the own one included).")
        sections += [f"## {name}", about,
                     *_markdown(results[name], model_args)]
    report.write_results(args.out, meta, "Step-to-step reuse of InfiniGen's block selections",
                         settings, results, [_INTRO, *sections])
    print(json.dumps({m: {b: {k: v for k, v in r.items() if k != "reuse_by_layer"}
                          for b, r in per.items()} for m, per in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
