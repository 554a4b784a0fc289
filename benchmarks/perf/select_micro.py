# SPDX-License-Identifier: Apache-2.0
"""The selection kernels alone: microseconds per call of one layer's selection.

    python -m benchmarks.perf.select_micro [--context 16384] [--batch 1]
        [--threads 1] [--keys bounds int] [--calls 200]

One layer of the decode benchmark's model (``--preset gqa128``: 2 KV heads of
4 query heads, head_dim 128, blocks of 128 tokens) with ``--context`` tokens
per row in a bfloat16 pool whose speculation keys are written by the
product's write kernels; each call selects for ``--batch`` rows what a
256-token cap keeps (alpha off, 16 recent tokens) through the product's
``kernels.select_bounds`` / ``select_tokens_int``. Median and fastest of
``--calls`` calls after 20 warm-up calls, on ``--threads`` threads, the
keys' bytes read per call beside them. A 16K step calls the kernel once per
sparse layer (14 in the gqa128 model).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_infinigen.layout import BOUND_BITS, BOUND_UNIT, KEY_GROUP
from vllm_infinigen.platforms.cpu import kernels

KV_HEADS, GROUP, HEAD_SIZE, BLOCK = 2, 4, 128, 128


def keys_of(kind: str, pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layer's speculation keys of ``kind``, written from ``pool``."""
    num_blocks = pool.shape[0]
    if kind == "bounds":
        bounds = torch.zeros(num_blocks, KV_HEADS, BLOCK // BOUND_UNIT, 2,
                             HEAD_SIZE * BOUND_BITS // 8, dtype=torch.uint8)
        scales = torch.zeros(num_blocks, KV_HEADS, BLOCK // BOUND_UNIT, dtype=torch.float16)
        kernels.write_bounds(bounds, scales, pool, slots)
        return bounds, scales
    bits = 2  # a 16-bit cache's int keys
    codes = torch.zeros(num_blocks, KV_HEADS, BLOCK // KEY_GROUP, HEAD_SIZE, 2 * bits,
                        dtype=torch.uint8)
    scales = torch.zeros(num_blocks, KV_HEADS, BLOCK // KEY_GROUP, HEAD_SIZE,
                         dtype=torch.float16)
    kernels.write_int_keys(codes, scales, pool, slots)
    return codes, scales


def time_calls(kind: str, context: int, batch: int, calls: int) -> dict[str, float]:
    """Median and fastest microseconds per call, and the keys' bytes a call reads."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = context // BLOCK + 1
    num_blocks = batch * blocks_per_row
    pool = torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE, generator=gen).to(
        torch.bfloat16)
    slots = torch.arange(num_blocks * BLOCK, dtype=torch.int64)
    keys = keys_of(kind, pool, slots)
    query = torch.randn(batch, KV_HEADS, GROUP, HEAD_SIZE, generator=gen)
    table = torch.arange(num_blocks, dtype=torch.int32).reshape(batch, blocks_per_row)
    lens = torch.full((batch,), context, dtype=torch.int64)
    caps = torch.full((batch,), 256, dtype=torch.int64)
    select = kernels.select_bounds if kind == "bounds" else kernels.select_tokens_int

    def call() -> None:
        select(query, *keys, pool, table, lens, caps, scale=HEAD_SIZE ** -0.5,
               alpha=float("inf"), recent_tokens=16)

    for _ in range(20):
        call()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    used = sum(key.numel() * key.element_size() for key in keys) * context / (
        blocks_per_row * BLOCK)
    return {"median_us": 1e6 * statistics.median(seconds), "min_us": 1e6 * min(seconds),
            "key_bytes": used}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keys", nargs="+", choices=["bounds", "int"], default=["bounds", "int"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU kernels for {kernels.load()}; context {args.context} x {args.batch}, "
          f"{args.threads} thread(s)")
    for kind in args.keys:
        row = time_calls(kind, args.context, args.batch, args.calls)
        print(f"{kind}: median {row['median_us']:.0f} us, fastest {row['min_us']:.0f} us "
              f"per call; keys {row['key_bytes'] / 2**10:.0f} KiB per call")


if __name__ == "__main__":
    main()
