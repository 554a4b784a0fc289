# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny models built once per session."""

from __future__ import annotations

import pytest

from benchmarks.harness import models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama-mha": str(models.build_tiny_llama(root / "llama-mha", num_kv_heads=4)),
        "llama-gqa": str(models.build_tiny_llama(root / "llama-gqa", num_kv_heads=2)),
        "opt": str(models.build_tiny_opt(root / "opt")),
    }


@pytest.fixture(scope="session", autouse=True)
def skew_cache(tmp_path_factory, request):
    """Computed skew files go to a per-session cache, not the user's home."""
    import os

    from vllm_infinigen import kernels

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
