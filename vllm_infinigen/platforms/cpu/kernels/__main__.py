# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_infinigen.platforms.cpu.kernels``: builds (or finds) the CPU kernels and says where."""

from __future__ import annotations

import time

from vllm_infinigen.platforms.cpu.kernels.build import cache_dir, load

if __name__ == "__main__":
    start = time.monotonic()
    isa = load()
    print(f"InfiniGen CPU kernels ready for {isa} in {time.monotonic() - start:.1f} s "
          f"({cache_dir()})")
