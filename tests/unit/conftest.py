# SPDX-License-Identifier: Apache-2.0
"""The Triton interpreter's checks start with the unit tests and run beside them.

``test_cuda_kernels.py`` checks the Triton kernels against their torch
references in a subprocess (``triton_interpreter_checks.py`` under
``TRITON_INTERPRET=1``, which Triton reads when first imported): ~3 minutes of
one core, mostly Python. Started at the first unit test when that test is
selected, it overlaps the other unit tests; the test, moved to the end of the
session, waits for its result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.paths import REPO

INTERPRETER_TEST = "test_triton_kernels_equal_the_references_in_the_interpreter"
CHECKS = Path(__file__).with_name("triton_interpreter_checks.py")
_SELECTED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: item.name == INTERPRETER_TEST)  # stable: the rest keep order


def pytest_collection_finish(session) -> None:
    session.config.stash[_SELECTED] = any(item.name == INTERPRETER_TEST
                                          for item in session.items)


class InterpreterRun:
    """``pytest triton_interpreter_checks.py`` in a subprocess, its output in a file."""

    def __init__(self, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "TRITON_INTERPRET": "1"})

    def result(self, timeout: float = 1800) -> tuple[int, str]:
        """The exit code and the output, once the run has ended."""
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def triton_interpreter_run(request, tmp_path_factory):
    """The run, started with the first unit test (None when its test is not selected)."""
    if not request.config.stash.get(_SELECTED, False):
        yield None
        return
    run = InterpreterRun(tmp_path_factory.mktemp("triton-interpreter") / "pytest.log")
    try:
        yield run
    finally:
        run.stop()
