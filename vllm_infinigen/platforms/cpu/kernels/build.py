# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's kernel library: compiled on first use for this machine, cached.

``csrc/ops.cpp`` declares every op's schema (``torch.ops.vllm_infinigen_C.*``);
the rest of ``csrc/`` holds their CPU implementations and registers them under
the CPU dispatch key. They are compiled for the instruction set ATen itself
dispatches to on this machine (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2 or DEFAULT; ``ATEN_CPU_CAPABILITY`` overrides it), with ATen's
portable vector types, so the same source serves every x86 machine; nothing
is built with ``-march=native``. The build is cached in
``~/.cache/vllm_infinigen/kernels`` (``VLLM_INFINIGEN_CACHE``, or
``VLLM_INFINIGEN_KERNELS_DIR`` for this directory alone), one directory per
version of the sources, flags and torch (``build_key``), and reused until
those change. ``make setup`` builds it ahead of time
(``python -m vllm_infinigen.platforms.cpu.kernels``). The CUDA platform's kernels are
Triton's, in ``platforms/cuda/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from vllm_infinigen.logs import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# The schemas, then the CPU implementations and their registration.
SOURCES = ("ops.cpp", "register.cpp", "write.cpp", "select.cpp", "int_keys.cpp", "bounds.cpp",
           "attend.cpp", "prefill.cpp", "uses.cpp", "short.cpp",
           "query.cpp")
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
            "(VLLM_INFINIGEN_CACHE) with `python -m vllm_infinigen.platforms.cpu.kernels`"
        )


def build_key(isa: str) -> str:
    """Digest of what the build depends on: where the C++ sources are (the
    build files name them by path), their contents, the flags and torch's
    version. Each version gets its own build directory, so that two installs
    (or checkouts) never rebuild over each other, and a changed source is
    compiled with the log line saying so."""
    digest = hashlib.sha256(str(CSRC).encode() + b"\0")
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(ISA_FLAGS[isa]).encode() + torch.__version__.encode())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def exclusive_build(build_dir: Path):
    """Holds the build of ``build_dir`` for this process, across processes.

    torch's extension loader guards a build with a ``lock`` file that it
    deletes when done; a build killed midway leaves it behind, and every later
    load would wait on it forever. This lock is an ``flock`` that the kernel
    drops when its holder exits, so whoever holds it knows that no build is
    running, and removes the orphaned file (with its half-built outputs'
    state left to ninja, which rebuilds what is stale).
    """
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("InfiniGen: waiting for another process compiling the kernels in %s",
                        build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        orphan = build_dir / "lock"
        if orphan.exists():
            logger.warning("InfiniGen: removing %s, left by a kernel build that did not finish",
                           orphan)
            orphan.unlink()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
        with exclusive_build(build_dir):
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
