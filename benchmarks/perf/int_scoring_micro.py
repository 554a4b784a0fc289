# SPDX-License-Identifier: Apache-2.0
"""The int keys' CPU scoring: the product's float form against an int8 VNNI form.

    python -m benchmarks.perf.int_scoring_micro [--groups 28672]

Builds ``csrc/int_scoring_micro.cpp`` with g++ (AVX-512 F/BW/VL/DQ + VNNI;
the product's ``int_keys_avx512.h`` for the float form) and runs it: ns per
16-token group of one KV head (4 query heads, head 128), weights included,
over ``--groups`` groups (28,672: 14 layers x 2 KV heads x 1,024 groups, a
16K step), 4- and 2-bit codes, median of 9 interleaved rounds, one thread.
Not product code: it measured whether integer arithmetic would speed the
scoring up on this host (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRODUCT_CSRC = HERE.parents[1] / "vllm_infinigen" / "platforms" / "cpu" / "kernels" / "csrc"
FLAGS = ["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-mfma", "-mf16c"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=28672)
    args = parser.parse_args(argv)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512_vnni" not in flags:
        print("this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo): nothing to measure")
        return 1
    compiler = shutil.which("g++")
    if compiler is None:
        print("needs g++")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "int_scoring_micro"
        subprocess.run([compiler, *FLAGS, f"-I{PRODUCT_CSRC}", str(HERE / "csrc" /
                        "int_scoring_micro.cpp"), "-o", str(binary)], check=True)
        return subprocess.run([str(binary), str(args.groups)]).returncode


if __name__ == "__main__":
    sys.exit(main())
