# SPDX-License-Identifier: Apache-2.0
"""`vllm bench throughput|latency` accept and use the InfiniGen flags."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks.harness import models
from benchmarks.harness.paths import BUNDLED_MODEL
from benchmarks.harness.servers import SERVE_FLAGS, VLLM

pytestmark = pytest.mark.slow
FLAGS = ["--kv-manager", "infinigen", "--infinigen-budget", "0.2", *SERVE_FLAGS]


def _run(args: list[str]) -> str:
    # The engine core in the command's own process: what is tested is the CLI and
    # its flags, not vLLM's processes (one process fewer importing torch and vLLM).
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([VLLM, "bench", *args], capture_output=True, text=True, timeout=600,
                          env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "InfiniGen: 4 layers" in output or "InfiniGen: 5 layers" in output, output[-4000:]
    return output


def test_bench_throughput():
    output = _run(["throughput", "--model", str(BUNDLED_MODEL), "--dataset-name", "random",
                   "--random-input-len", "200", "--random-output-len", "16",
                   "--num-prompts", "4", *FLAGS])
    assert "Throughput:" in output


def test_bench_latency(tmp_path):
    # A random tokenizer reads no English: the int keys need no calibration text.
    model = models.build_wide_vocab_llama(tmp_path / "wide")
    output = _run(["latency", "--model", str(model), "--input-len", "200",
                   "--output-len", "8", "--batch-size", "2", "--num-iters-warmup", "1",
                   "--num-iters", "2", "--infinigen-speculation-keys", "int", *FLAGS])
    assert "Avg latency:" in output
