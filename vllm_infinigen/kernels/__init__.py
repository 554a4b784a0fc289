# SPDX-License-Identifier: Apache-2.0
"""Worker side: InfiniGen's compiled CPU kernels, built on first use and cached.

The C++ sources in ``csrc/`` register ``torch.ops.vllm_infinigen_C.*``. They
are compiled for the instruction set ATen itself dispatches to on this
machine (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or
DEFAULT; ``ATEN_CPU_CAPABILITY`` overrides it), with ATen's portable vector
types, so the same source serves every x86 machine; nothing is built with
``-march=native``. The build is cached in
``~/.cache/vllm_infinigen/kernels`` (``VLLM_INFINIGEN_CACHE``, or
``VLLM_INFINIGEN_KERNELS_DIR`` for this directory alone), one directory per
version of the sources, flags and torch (``build_key``), and reused until
those change. ``make setup`` builds it ahead of time
(``python -m vllm_infinigen.kernels``).

The thin wrappers below document shapes; ``reference.py`` holds the
pure-torch definitions the unit tests hold the kernels to.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "write.cpp", "select.cpp", "attend.cpp", "prefill.cpp", "uses.cpp")
# ATen's CPU capability -> compiler flags and the vector implementation macros.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}
_lock = threading.Lock()
_loaded: str | None = None


def cache_dir() -> Path:
    """``VLLM_INFINIGEN_KERNELS_DIR``, else ``kernels`` in InfiniGen's cache."""
    if os.environ.get("VLLM_INFINIGEN_KERNELS_DIR"):
        return Path(os.environ["VLLM_INFINIGEN_KERNELS_DIR"])
    root = os.environ.get("VLLM_INFINIGEN_CACHE",
                          str(Path.home() / ".cache" / "vllm_infinigen"))
    return Path(root) / "kernels"


def target_isa() -> str:
    """The instruction set the kernels are built for: ATen's own choice here."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return capability if capability in ISA_FLAGS else "DEFAULT"


def _check_toolchain() -> None:
    """Raises RuntimeError naming what a build needs and does not find."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    missing = []
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ('{compiler}'; Debian/Ubuntu: apt-get install g++)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja, or apt-get install ninja-build)")
    if missing:
        raise RuntimeError(
            "InfiniGen's CPU kernels are compiled on first use and need "
            + " and ".join(missing) + f"; or build them once elsewhere into {cache_dir()} "
            "(VLLM_INFINIGEN_CACHE) with `python -m vllm_infinigen.kernels`"
        )


def build_key(isa: str) -> str:
    """Digest of what the build depends on: where the C++ sources are (the
    build files name them by path), their contents, the flags and torch's
    version. Each version gets its own build directory, so that two installs
    (or checkouts) never rebuild over each other, and a changed source is
    compiled with the log line saying so."""
    digest = hashlib.sha256(str(CSRC).encode() + b"\0")
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(ISA_FLAGS[isa]).encode() + torch.__version__.encode())
    return digest.hexdigest()[:12]


def load() -> str:
    """Builds (once per machine and source version) and loads the kernels.

    Returns:
        The instruction set they were built for.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        isa = target_isa()
        name = f"vllm_infinigen_C_{isa.lower()}"
        build_dir = cache_dir() / f"{name}-{build_key(isa)}"
        build_dir.mkdir(parents=True, exist_ok=True)
        fresh = not (build_dir / f"{name}.so").is_file()
        if fresh:
            _check_toolchain()
            logger.info("InfiniGen: compiling the CPU kernels for %s (first use; cached in %s)",
                        isa, build_dir)
        from torch.utils.cpp_extension import load as load_extension

        start = time.monotonic()
        load_extension(
            name=name,
            sources=[str(CSRC / source) for source in SOURCES],
            extra_cflags=["-O3", "-fopenmp", "-std=c++17", *ISA_FLAGS[isa]],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        if fresh:
            logger.info("InfiniGen: CPU kernels compiled in %.1f s", time.monotonic() - start)
        _loaded = isa
        return isa


def _ops():
    load()
    return torch.ops.vllm_infinigen_C


def write_kv(kv_pool: torch.Tensor, partial_keys: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, skew: torch.Tensor, slot_mapping: torch.Tensor,
             row_map: torch.Tensor | None = None) -> None:
    """Writes new K/V to the pool and their partial keys, in place.

    Args:
        kv_pool: [units, H_kv, block_size, 2 * D] one layer's pool.
        partial_keys: [num_blocks, H_kv, R, block_size] channel-major per block.
        key, value: [T, H_kv, D] new entries (last dim contiguous).
        skew: [H_kv, D, R] float32 skew columns of the layer.
        slot_mapping: [T] int64 slot ids of the dense group (< 0: padding).
        row_map: [num_blocks, H_kv, block_size] int32 rows of a capped pool.
    """
    _ops().write_kv(kv_pool, partial_keys, key, value, skew, slot_mapping, row_map)


def select_tokens(partial_query: torch.Tensor, partial_keys: torch.Tensor,
                  block_table: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                  alpha: float, budget: float, sink_tokens: int = 0, recent_tokens: int = 0,
                  row_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's rule over the partial keys (see ``selector.select_tokens``).

    Args:
        partial_query: [B, H_kv, G, R] float32 skewed partial queries.
        partial_keys: [num_blocks, H_kv, R, block_size] the target layer's.
        block_table: [B, max_blocks] int32 dense-group block ids of each row.
        context_lens: [B] int64 context tokens before each row's own.
        row_map: Capped pool rows; evicted entries are never selected.

    Returns:
        positions [B, H_kv, K] int32, ascending, -1 padded (K: the largest
        count selected), and num_selected [B] int64.
    """
    return _ops().select_tokens(partial_query, partial_keys, block_table, context_lens,
                                float(scale), float(alpha), float(budget), int(sink_tokens),
                                int(recent_tokens), row_map)


def attend_decode(query: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
                  context_lens: torch.Tensor, positions: torch.Tensor | None, *, scale: float,
                  row_map: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                  stats: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per entry of ``context_lens`` over the pool, in place.

    Each row attends over ``positions`` (or, when None, every position before
    it) plus its own position ``context_lens[b]``, whose entry must be written.

    Args:
        query: [B, H_q, D].
        positions: [B, H_kv, K] int32, -1 padded; None: dense.
        probs: [B, H_kv, K] float32, filled with the attention each selected
            position received, summed over the KV head's query group.
        stats: [2] float64, incremented by (entries attended besides the
            rows' own, summed over KV heads; context tokens of the rows).

    Returns:
        [B, H_q, D] in the query's dtype.
    """
    return _ops().attend_decode(query, kv_pool, block_table, context_lens, positions, row_map,
                                float(scale), probs, stats)


def attend_prefill(query: torch.Tensor, output: torch.Tensor, kv_pool: torch.Tensor,
                   block_table: torch.Tensor, query_start: torch.Tensor,
                   seq_lens: torch.Tensor, requests: torch.Tensor, *, scale: float,
                   row_map: torch.Tensor | None = None) -> None:
    """Causal attention of the prompt rows of ``requests``, written into ``output``.

    Args:
        query, output: [T, H_q, D] the step's rows.
        block_table: [num_reqs, max_blocks] int32 of every request of the step.
        query_start: [num_reqs + 1] int64 first row of each request.
        seq_lens: [num_reqs] int64 tokens of each request after this step.
        requests: [R] int64 the requests whose rows to compute.
    """
    _ops().attend_prefill(query, output, kv_pool, block_table, query_start, seq_lens,
                          requests, row_map, float(scale))


def record_uses(positions: torch.Tensor, block_table: torch.Tensor, row_map: torch.Tensor,
                count: torch.Tensor, last_used: torch.Tensor, tick: int) -> None:
    """A capped pool's bookkeeping of one selection, in place.

    Args:
        positions: [B, H_kv, K] int32 selected positions (-1: none).
        row_map: [num_blocks, H_kv, block_size] int32 the layer's rows.
        count, last_used: [H_kv, rows] int64 the layer's use counts and last
            uses; each selected entry the pool holds gets +1 and ``tick``.
    """
    _ops().record_uses(positions, block_table, row_map, count, last_used, int(tick))
