# SPDX-License-Identifier: Apache-2.0
"""A prompt chunk's attention over a capped pool, in one sparse layer: vLLM's own CPU
kernel (``platforms/cpu/prefill.attend_capped``, each KV head over the entries it holds)
against ATen's flash attention (``kernels.attend_prefill``, what ran before), timed in
alternation, round by round (this machine's speed drifts 20-40 % over minutes).

One request: the last ``--rows`` prompt rows of a ``--context``-token prompt (a later
chunk of a chunked prefill; ``--rows`` = ``--context``: a whole prompt), ``--kv-heads``
KV heads of ``--group`` query heads of ``--head-size`` (the decode benchmarks'
``gqa128`` shape by default), in a capped pool whose rows sit at random places, with
``--evict`` of the earlier entries evicted, differently in each head (the step's own
are held, as the write admits them).

Example: ``python -m benchmarks.perf.prefill_micro --dtypes float32 bfloat16``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import paths, report

BLOCK = 128  # vLLM's CPU block size


def case(context: int, rows: int, kv_heads: int, group: int, head_size: int, evict: float,
         dtype: torch.dtype, seed: int = 0) -> dict:
    """The arguments both paths take, for one request."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    pool_rows = blocks * BLOCK * 2  # room for twice the context: rows scattered
    kv_pool = torch.randn((pool_rows // BLOCK, kv_heads, BLOCK, 2 * head_size),
                          generator=gen).to(dtype)
    row_map = torch.stack([torch.randperm(pool_rows, generator=gen)[:blocks * BLOCK]
                           for _ in range(kv_heads)], dim=1).view(blocks, BLOCK, kv_heads)
    row_map = row_map.transpose(1, 2).contiguous().to(torch.int32)  # [blocks, H_kv, B]
    positions = torch.arange(blocks * BLOCK)
    earlier = (positions < context - rows)[:, None].expand(-1, kv_heads)
    evicted = (torch.rand((blocks * BLOCK, kv_heads), generator=gen) < evict) & earlier
    flat = row_map.transpose(1, 2).reshape(-1, kv_heads).masked_fill(evicted, -1)
    row_map = flat.view(blocks, BLOCK, kv_heads).transpose(1, 2).contiguous()
    query = torch.randn((rows, kv_heads * group, head_size), generator=gen).to(dtype)
    return {"query": query, "kv_pool": kv_pool, "row_map": row_map,
            "block_table": torch.arange(blocks, dtype=torch.int32)[None],
            "query_start": torch.tensor([0, rows]), "seq_lens": torch.tensor([context]),
            "requests": torch.tensor([0]), "scale": head_size ** -0.5}


def paths_of(args_case: dict) -> dict:
    """name -> a call of one path over ``args_case`` into a fresh output."""
    from vllm_infinigen.platforms.cpu import kernels, prefill

    c = args_case
    common = (c["block_table"], c["query_start"], c["seq_lens"], c["requests"])

    def vllm_kernel():
        out = torch.empty_like(c["query"])
        prefill.attend_capped(c["query"], out, c["kv_pool"], c["row_map"], *common,
                              scale=c["scale"])
        return out

    def flash_attention():
        out = torch.empty_like(c["query"])
        kernels.attend_prefill(c["query"], out, c["kv_pool"], *common, scale=c["scale"],
                               row_map=c["row_map"])
        return out

    return {"vLLM's kernel (attend_capped)": vllm_kernel,
            "ATen flash attention (attend_prefill)": flash_attention}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--evict", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "prefill_micro")
    args = parser.parse_args(argv)
    rows, table = [], []
    for dtype_name in args.dtypes:
        for evict in args.evict:
            c = case(args.context, args.rows, args.kv_heads, args.group, args.head_size, evict,
                     getattr(torch, dtype_name))
            calls = paths_of(c)
            outputs = [call() for call in calls.values()]  # (warm-up; and they agree)
            difference = float((outputs[0].float() - outputs[1].float()).abs().max())
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
            new, old = medians.values()
            ratios = [a / b for a, b in zip(*times.values())]
            rows.append({"dtype": dtype_name, "evict": evict, "ms": medians,
                         "max_abs_difference": difference, "round_ratios": ratios})
            table.append([dtype_name, f"{evict:.2f}", f"{old:.1f}", f"{new:.1f}",
                          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-"
                          f"{max(ratios):.2f})", f"{difference:.1e}"])
            print(table[-1], flush=True)
    report.write_results(
        args.out, report.run_metadata(), "Prompt rows over a capped pool: vLLM's kernel "
        "against ATen's flash attention", vars(args) | {"out": str(args.out)}, rows,
        [f"One sparse layer's attention of the last {args.rows} rows of a {args.context}-token "
         f"prompt, {args.kv_heads} KV heads x {args.group} query heads of {args.head_size}, "
         f"capped pool (rows at random places, blocks in order; `evict`: the share of the earlier entries "
         f"evicted, per head); torch threads: {torch.get_num_threads()}; median of "
         f"{args.rounds} rounds, the two paths in alternation.",
         report.markdown_table(["dtype", "evict", "ATen flash attention ms",
                                "vLLM's kernel ms", "new / old, per round (range)",
                                "max abs difference"], table)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
