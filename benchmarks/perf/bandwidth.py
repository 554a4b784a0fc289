# SPDX-License-Identifier: Apache-2.0
"""Streaming memory bandwidth of this machine (torch, CPU): the physical limit of a decode step.

``measure_bandwidth`` times ``x.sum()`` (read) and ``y.copy_(x)`` (read +
write, counted as 2 x the tensor's bytes as STREAM's copy does) over a float32
tensor much larger than the caches, on one thread and on all of torch's
threads, and keeps the best of ``reps`` repetitions of each. The decode
benchmark divides the KV bytes a step reads by its time and compares the
result with these numbers.
"""

from __future__ import annotations

import time
from typing import Any


def _best_seconds(fn, reps: int) -> float:
    fn()  # touch the pages / warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(mib: int = 256, reps: int = 5, threads: int | None = None) -> dict[str, Any]:
    """Read and copy GB/s (1e9 bytes per second) on 1 thread and on ``threads``.

    Args:
        mib: Size of the source tensor (the copy allocates a second one).
        reps: Timed repetitions per measurement (the fastest is kept).
        threads: "All threads" (default: ``torch.get_num_threads()``, at least 2
            when the machine has 2 CPUs or more).

    Returns:
        ``read_gb_s_1_thread``, ``read_gb_s_all_threads``, ``copy_gb_s_1_thread``,
        ``copy_gb_s_all_threads``, and ``threads``, ``mib``, ``reps``.
    """
    import os

    import torch

    if mib < 1 or reps < 1:
        raise ValueError(f"need mib >= 1 and reps >= 1 (mib {mib}, reps {reps})")
    saved = torch.get_num_threads()
    if threads is None:
        threads = max(saved, min(2, os.cpu_count() or 1))
    nbytes = mib * 2**20
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {}
    try:
        for label, count in (("1_thread", 1), ("all_threads", threads)):
            torch.set_num_threads(count)
            read = _best_seconds(src.sum, reps)
            copy = _best_seconds(lambda: dst.copy_(src), reps)
            out[f"read_gb_s_{label}"] = nbytes / read / 1e9
            out[f"copy_gb_s_{label}"] = 2 * nbytes / copy / 1e9
    finally:
        torch.set_num_threads(saved)
        del src, dst
    return {**out, "threads": threads, "mib": mib, "reps": reps}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(measure_bandwidth(*(int(a) for a in sys.argv[1:3])), indent=1))
