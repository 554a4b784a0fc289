# SPDX-License-Identifier: Apache-2.0
"""A benchmark's measurement in a fresh process (an engine per setup, nothing shared):
``python -m MODULE --child ARGS...`` prints one ``RESULT <json>`` line, which
``run_child`` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.harness import paths

RESULT = "RESULT "


def print_result(result: dict[str, Any]) -> None:
    """The child's side: its result, as the one line ``run_child`` reads."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(module: str, args: list[Any], what: str,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``module --child args`` with ``env`` added to this process's environment.

    Raises:
        RuntimeError: When it fails or prints no result, naming ``what`` and its stderr.
    """
    command = [sys.executable, "-m", module, "--child", *(str(arg) for arg in args)]
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, cwd=paths.REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))
