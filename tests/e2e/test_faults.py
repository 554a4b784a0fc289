# SPDX-License-Identifier: Apache-2.0
"""A fault inside InfiniGen's selection fails requests loudly; it never hangs them.

The fault is injected by ``tests/e2e/fault_inject.py`` (a test-only vLLM
plugin that makes ``InfiniGenRuntime.speculate`` raise "injected swap fault"
on its Nth call in the worker). What vLLM 0.32 does with an exception from the
worker's ``execute_model``:

- engine core in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
  uni-process executor raises it from ``EngineCore.step``, so
  ``LLM.generate`` raises the worker's own exception;
- engine core in its own process (``LLM`` default, ``vllm serve``): the worker
  logs the traceback and answers FAILURE, the engine core logs "EngineCore
  encountered a fatal error" and exits, callers get ``EngineDeadError``, and
  the API server answers every in-flight request with an error, then shuts
  itself down (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` unset).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL, REPO
from benchmarks.harness.servers import SERVED_NAME, alive, kill_tree, process_tree, start_server
from tests.e2e.fault_inject import MESSAGE, fault_env

pytestmark = pytest.mark.slow
FAULT_AT = 30  # the 10th decode step of stories260K (3 speculating layers)


def run_engine(tmp_path, scenario: str, *flags: str,
               env: dict[str, str] | None = None) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.engine_faults", scenario, str(BUNDLED_MODEL),
         str(out), *flags],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"engine_faults exited with {proc.returncode}:\n{log[-4000:]}")
    return json.loads(out.read_text()), log


def test_fault_in_process_raises_from_generate(tmp_path):
    report, _ = run_engine(tmp_path, "speculate", "--in-process",
                           env=fault_env(tmp_path / "dist", FAULT_AT))
    assert report["error_type"] == "builtins.RuntimeError"
    assert report["error"].startswith(f"{MESSAGE} (speculation call {FAULT_AT}")
    assert report["seconds"] < 60


def test_fault_in_engine_process_is_engine_dead_with_cause_logged(tmp_path):
    report, log = run_engine(tmp_path, "speculate", env=fault_env(tmp_path / "dist", FAULT_AT))
    assert report["error_type"] == "vllm.v1.engine.exceptions.EngineDeadError"
    assert report["seconds"] < 60
    assert "EngineCore encountered a fatal error" in log
    assert f"RuntimeError: {MESSAGE}" in log  # the worker's traceback


async def _request(base_url: str, stream: bool) -> dict:
    """Sends one completion; returns how it ended (never raises)."""
    from openai import APIError, APIStatusError, AsyncOpenAI

    seen: dict = {"stream": stream, "chunks": 0}
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120,
                           max_retries=0) as client:
        kwargs = dict(model=SERVED_NAME, prompt="Once upon a time, there was a " * 8,
                      max_tokens=64, temperature=0.0, extra_body={"ignore_eos": True})
        try:
            if stream:
                async for _ in await client.completions.create(stream=True, **kwargs):
                    seen["chunks"] += 1
            else:
                await client.completions.create(**kwargs)
            seen["ended"] = "completed"
        except APIStatusError as exc:
            seen.update(ended="http_error", status=exc.status_code, message=exc.message)
        except APIError as exc:  # an error chunk in a stream, or a dropped connection
            seen.update(ended="error", message=exc.message)
    return seen


async def _burst(base_url: str) -> list[dict]:
    jobs = [_request(base_url, stream) for stream in (True, False, True, False)]
    return list(await asyncio.wait_for(asyncio.gather(*jobs), timeout=180))


def test_fault_in_server_fails_requests_and_stops_server(tmp_path):
    server = start_server(tmp_path / "serve.log", "--kv-manager", "infinigen",
                          env=fault_env(tmp_path / "dist", FAULT_AT))
    tree = process_tree(server.proc.pid)
    try:
        results = asyncio.run(_burst(server.base_url))
        try:
            code = server.proc.wait(timeout=60)  # vLLM shuts the server down
        except subprocess.TimeoutExpired:
            code = None
    finally:
        kill_tree(server.proc.pid)
    log = server.log.read_text(errors="replace")
    assert [r["ended"] for r in results] == ["error", "http_error"] * 2, results
    assert all(r["status"] == 500 for r in results if not r["stream"]), results
    assert "EngineCore encountered a fatal error" in log
    assert f"RuntimeError: {MESSAGE}" in log
    assert code is not None, "vllm serve kept running after its engine died"
    deadline = time.monotonic() + 30
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(tree) == []
