# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --kv-manager infinigen` stops cleanly on SIGINT and SIGTERM.

After serving a request, the signal must stop the API server, the engine core
and the worker within a minute, with exit code 0 and none of the /dev/shm
entries (vLLM's shared-memory message queues) left behind.

With vLLM's default ``--shutdown-timeout 0`` ("abort") the API server sends
the engine core SIGTERM and kills its process tree at once
(``vllm/v1/utils.py``, ``shutdown``); Python's resource tracker then unlinks
the shared memory the killed processes held. With a timeout ("drain") the
engine core and the worker exit on their own: nothing is killed and nothing is
left for the resource tracker. In both modes the API server's output handler
may log an ``EngineDeadError`` traceback as the engine core goes away
(``vllm/v1/engine/async_llm.py``), so the log is not checked for tracebacks.
"""

from __future__ import annotations

import signal
import time

import pytest
import requests

from benchmarks.harness.servers import (
    SERVED_NAME,
    alive,
    kill_tree,
    process_tree,
    shm_entries,
    shm_in_use,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow


# Each signal once, each mode once (a server start is ~50 s of make test): SIGINT
# (Ctrl-C) with the default abort, SIGTERM (what a supervisor sends) draining.
@pytest.mark.parametrize(("sig", "shutdown_timeout"), [
    (signal.SIGINT, 0), (signal.SIGTERM, 20),
], ids=["SIGINT", "SIGTERM-drain"])
def test_signal_stops_every_process_and_frees_shared_memory(tmp_path, sig, shutdown_timeout):
    shm_before = shm_entries()
    server = start_server(tmp_path / "serve.log", "--kv-manager", "infinigen",
                          "--shutdown-timeout", str(shutdown_timeout))
    try:
        response = requests.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 16,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        tree = process_tree(server.proc.pid)
        names = [proc.name() for proc in tree]
        assert any("EngineCore" in name for name in names), names
        assert any("Worker" in name for name in names), names
        ours = (shm_entries() - shm_before) & shm_in_use()
        start = time.monotonic()
        code = stop_server(server, sig, timeout=60)
        seconds = time.monotonic() - start
    finally:
        kill_tree(server.proc.pid)
    assert code == 0, f"exit code {code} after {sig.name}:\n{server.log_tail()}"
    assert seconds < 60
    deadline = time.monotonic() + 15
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(tree) == [], [proc.name() for proc in alive(tree)]
    # Entries it created: gone, unless another live process uses them.
    assert ours, "the server mapped no /dev/shm entry (nothing to check)"
    left = (shm_entries() - shm_before) - shm_in_use()
    assert left == set(), left
    if shutdown_timeout:
        log = server.log.read_text(errors="replace")
        for sign in ("force killing", "leaked shared_memory", "leaked semaphore"):
            assert sign not in log, f"{sign!r} in the log:\n{server.log_tail()}"
