# SPDX-License-Identifier: Apache-2.0
"""Starting, watching and stopping `vllm serve` processes (tests and benchmarks)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks.harness.paths import BUNDLED_MODEL

VLLM = str(Path(sys.executable).parent / "vllm")
SERVED_NAME = "tiny"
# The tests' server: small and float32, eager (no compile time at start-up).
SERVE_FLAGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    "--kv-cache-memory-bytes", str(32 << 20),
]
SHM = Path("/dev/shm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_server(log: Path, *extra: str, model: str | Path = BUNDLED_MODEL,
                 env: dict[str, str] | None = None, timeout: float = 300) -> Server:
    """Starts ``vllm serve`` on a free loopback port and waits for /health.

    Raises:
        RuntimeError: If the server exits or is not healthy within ``timeout``
            (the log's tail is in the message).
    """
    if "infinigen" in extra and "--infinigen-min-context" not in extra:
        # Select at every context length (engines.with_selection_everywhere).
        extra = (*extra, "--infinigen-min-context", "0")
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [VLLM, "serve", str(model), "--served-model-name", SERVED_NAME,
             "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS, *extra],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            if requests.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(1)
    kill_tree(proc.pid)
    raise RuntimeError(f"vllm serve did not become healthy:\n{server.log_tail()}")


def stop_server(server: Server, sig: int = signal.SIGINT, timeout: float = 60) -> int | None:
    """Signals the server and waits; returns its exit code (None: it had to be killed)."""
    if server.proc.poll() is not None:
        return server.proc.returncode
    server.proc.send_signal(sig)
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(server.proc.pid)
        server.proc.wait(timeout=30)
        return None


def process_tree(pid: int) -> list:
    """The process and all its descendants (psutil.Process objects)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    import psutil

    for proc in reversed(process_tree(pid)):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def alive(procs: list) -> list:
    """Those of ``procs`` still running (zombies count as gone)."""
    import psutil

    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def shm_entries() -> set[str]:
    return {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()


def shm_in_use() -> set[str]:
    """/dev/shm entries that some live process maps or holds open."""
    used: set[str] = set()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for line in (pid_dir / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    used.add(path[len("/dev/shm/"):].removesuffix(" (deleted)"))
            for fd in (pid_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
        except OSError:
            continue
    return used


def metrics(base_url: str) -> str:
    return requests.get(f"{base_url}/metrics", timeout=10).text


def metric_total(text: str, name: str) -> float | None:
    """Sum of every sample of ``name`` (any labels); None if it is absent."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+|NaN)$"
    values = [float(v) for v in re.findall(pattern, text, re.M)]
    return sum(values) if values else None
