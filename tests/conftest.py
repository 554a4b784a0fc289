# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny models built once per session, when first used."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness import models

# On a machine without vLLM (the GPU machines this project is lent have torch and
# Triton only) only tests/gpu/ can run: the other suites import vLLM.
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["unit", "e2e"]

# name -> builder(out_dir): random tiny checkpoints (head_dim 32, 4 layers).
TINY_MODELS: dict[str, Callable[[Path], Path]] = {
    "llama-mha": lambda out: models.build_tiny_llama(out, num_kv_heads=4),
    "llama-gqa": lambda out: models.build_tiny_llama(out, num_kv_heads=2),
    "opt": models.build_tiny_opt,
    # Llama 3.x rope scaling (rope_type llama3), as Llama 3.1 checkpoints ship it.
    "llama3-rope": lambda out: models.build_tiny_llama(
        out, num_kv_heads=2, seed=3, rope_scaling=models.LLAMA3_ROPE_SCALING),
    # Per-head q/k RMSNorm before RoPE.
    "qwen3": lambda out: models.build_tiny_qwen3(out, seed=1),
    "qwen3-moe": lambda out: models.build_tiny_qwen3(out, seed=2, moe=True),
    # 8 layers alternating a 64-token sliding window and full attention.
    "gemma3": models.build_tiny_gemma3,
}


class TinyModels(dict):
    """{name: model directory}, each model built on first lookup (a second or so)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> str:
        path = str(TINY_MODELS[name](self.root / name))
        self[name] = path
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session", autouse=True)
def skew_cache(tmp_path_factory, request):
    """Computed skew files go to a per-session cache, not the user's home."""
    import os

    from vllm_infinigen.platforms.cpu import kernels

    # The compiled kernels stay where `make setup` built them.
    os.environ.setdefault("VLLM_INFINIGEN_KERNELS_DIR", str(kernels.cache_dir()))
    path = tmp_path_factory.mktemp("skew-cache")
    previous = os.environ.get("VLLM_INFINIGEN_CACHE")
    os.environ["VLLM_INFINIGEN_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("VLLM_INFINIGEN_CACHE", None)
    else:
        os.environ["VLLM_INFINIGEN_CACHE"] = previous


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine's CPU beside the result (CI shows only the end of its output):
    a failure that depends on the instruction set names it."""
    import os

    import torch

    from benchmarks.harness.report import processor

    model = processor()["cpu_model"] or "unknown"
    extras = [name for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"),
                                       ("amx_tile", "_is_amx_tile_supported"))
              if getattr(torch.cpu, probe, lambda: False)()]
    terminalreporter.write_line(
        f"machine: {model}, {os.cpu_count()} cores, ATen CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
        + (f" ({', '.join(extras)})" if extras else ""))
