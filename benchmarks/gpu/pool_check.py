# SPDX-License-Identifier: Apache-2.0
"""The pinned host pool on this GPU machine, size by size: how it was pinned, how
long that took, and whether a GPU kernel reads it (the product's pool and the
benchmarks' depend on the last).

python -m benchmarks.gpu.pool_check [--gib 1 16 32 40] [--out DIR/pool_check]

For each size: ``cudaHostRegister`` on huge-page memory (``host_pool._registered_pool``)
and, where asked (``--pin-memory``), torch's ``pin_memory``, each probed by a
kernel reading the first and last bytes (``host_pool.unreadable_by_kernels``);
then ``allocate_host_pool`` as the product calls it. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.harness import paths, report


def _probe(pin: str, num_bytes: int) -> dict[str, Any]:
    from vllm_infinigen.platforms.cuda import host_pool

    row: dict[str, Any] = {"GiB": num_bytes / 2**30, "pin": pin}
    start = time.perf_counter()
    try:
        if pin == "cudaHostRegister":
            owner = host_pool._registered_pool((num_bytes,), torch.uint8, num_bytes)
            tensor = owner.tensor
        elif pin == "pin_memory":
            owner = None
            tensor = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            owner = host_pool.allocate_host_pool(num_bytes // 4096, 1, 16, 64, torch.float16)
            tensor = owner.tensor
            row["pinned_by"] = owner.pinned_by
    except (RuntimeError, OSError, ValueError) as error:
        row.update(seconds=time.perf_counter() - start, error=str(error)[:300])
        return row
    row["seconds"] = time.perf_counter() - start
    row["unreadable"] = host_pool.unreadable_by_kernels(tensor)
    del tensor
    if owner is not None:
        owner.close()
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1, 16, 32, 40])
    parser.add_argument("--pin-memory", action="store_true",
                        help="also torch's pin_memory at each size (slow: seconds per GiB)")
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "gpu_pool_check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = []
    for gib in args.gib:
        num_bytes = int(gib * 2**30)
        pins = ["cudaHostRegister", *(["pin_memory"] if args.pin_memory else []), "product"]
        for pin in pins:
            rows.append(_probe(pin, num_bytes))
            print(rows[-1], flush=True)
    lines = ["| GiB | pinned by | seconds | a kernel reads it |", "|---:|---|---:|---|"]
    for row in rows:
        pin = row["pin"] if row["pin"] != "product" else f"product: {row.get('pinned_by')}"
        readable = ("error: " + row["error"] if "error" in row
                    else "yes" if row["unreadable"] is None else "no: " + row["unreadable"])
        lines.append(f"| {row['GiB']:g} | {pin} | {row['seconds']:.2f} | {readable} |")
    report.write_results(args.out, gpu_run_metadata(), "The pinned host pool on this GPU machine",
                         vars(args) | {"out": str(args.out)}, rows, ["\n".join(lines)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
