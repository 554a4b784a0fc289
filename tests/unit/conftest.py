# SPDX-License-Identifier: Apache-2.0
"""Three unit tests run their work in subprocesses that start with the unit tests
and run beside them, on the machine's second core:

- ``test_cuda_kernels.py``'s interpreter test: the Triton kernels against
  their torch references (``triton_interpreter_checks.py`` under
  ``TRITON_INTERPRET=1``, which Triton reads when first imported), ~3 minutes
  of one core, mostly Python;
- its test of the lent GPUs' Triton (``make setup`` installs it into the
  venv's ``gpu-triton/``, outside its site-packages): the same interpreter
  checks, then every kernel compiled for sm_90 (``test_triton_compile.py``),
  with that Triton first on ``PYTHONPATH``, ~3 minutes of one core;
- ``test_kernels.py``'s ``test_other_instruction_sets_build_and_agree``: the
  CPU kernels built for each instruction set below this machine's (ATen's
  DEFAULT, and AVX2 on an AVX-512 host) and its kernel tests run on that
  build, ~3.5 minutes in a clean clone (the build; cached builds take seconds).

Each starts at the first unit test when its test is selected; the test,
moved to the end of the session, waits for its result. The builds use one
compile job (``MAX_JOBS=1``) so that the tests beside them keep a core.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.paths import REPO

UNIT = Path(__file__).parent
INTERPRETER_TEST = "test_triton_kernels_equal_the_references_in_the_interpreter"
GPU_TRITON_TEST = "test_triton_kernels_compile_and_agree_with_the_lent_gpus_triton"
INSTRUCTION_SET_TEST = "test_other_instruction_sets_build_and_agree"
BACKGROUND_TESTS = (INTERPRETER_TEST, GPU_TRITON_TEST, INSTRUCTION_SET_TEST)
# Where `make setup` puts the lent GPUs' Triton (pip's --target folder, in the venv).
GPU_TRITON = Path(sys.prefix) / "gpu-triton"
_SELECTED = pytest.StashKey[set]()


def _base_name(item) -> str:
    return item.name.partition("[")[0]


def pytest_collection_modifyitems(items) -> None:
    # stable: the rest keep their order, the background tests go last
    items.sort(key=lambda item: _base_name(item) in BACKGROUND_TESTS)


def pytest_collection_finish(session) -> None:
    session.config.stash[_SELECTED] = {item.name for item in session.items
                                       if _base_name(item) in BACKGROUND_TESTS}


def interpreter_command() -> tuple[list[str], dict[str, str]]:
    return ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             str(UNIT / "triton_interpreter_checks.py")], {"TRITON_INTERPRET": "1"})


def gpu_triton_command() -> tuple[list[str], dict[str, str]]:
    """Under the lent GPUs' Triton, one after another: the Triton imported (its version
    and file, which the test checks), the interpreter checks, the sm_90 compile tests
    (Triton's cache keys its entries by its version, so the two Tritons share one)."""
    interpreter, interpret_env = interpreter_command()
    python = [sys.executable, "-c", "import triton; print('triton', triton.__version__, "
              "triton.__file__)"]
    compile_tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                     str(UNIT / "test_triton_compile.py")]
    env_of = " ".join(f"{key}={value}" for key, value in interpret_env.items())
    script = " && ".join([shlex.join(python), f"env {env_of} {shlex.join(interpreter)}",
                          shlex.join(compile_tests)])
    path = os.pathsep.join(filter(None, [str(GPU_TRITON), os.environ.get("PYTHONPATH")]))
    return ["bash", "-c", script], {"PYTHONPATH": path}


def instruction_set_command(capability: str) -> tuple[list[str], dict[str, str]]:
    """``test_kernels.py``, ``test_int_keys.py`` (whose code unpacking has a SIMD
    path and a portable one) and ``test_kernels_fp8.py`` (whose widening has both
    too), on the kernels built for ``capability``."""
    from vllm_infinigen.platforms.cpu import kernels

    tests = [str(UNIT / name) for name in ("test_kernels.py", "test_int_keys.py",
                                           "test_kernels_fp8.py")]
    return ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
             "-k", "not other_instruction_sets and not instruction_set"],
            {"ATEN_CPU_CAPABILITY": capability.lower(), "MAX_JOBS": "1",
             "VLLM_INFINIGEN_KERNELS_DIR": str(kernels.cache_dir())})


class BackgroundRun:
    """A command in a subprocess, its output in a file."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=REPO, env={**os.environ, **env})

    def result(self, timeout: float = 1800) -> tuple[int, str]:
        """The exit code and the output, once the run has ended."""
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory):
    """{test name: its run}, started with the first unit test, for the selected
    background tests."""
    selected = request.config.stash.get(_SELECTED, set())
    runs: dict[str, BackgroundRun] = {}
    try:
        for name in sorted(selected):
            if name == INTERPRETER_TEST:
                command, env = interpreter_command()
            elif name == GPU_TRITON_TEST:
                if not GPU_TRITON.is_dir():
                    continue  # the test says so (make setup)
                command, env = gpu_triton_command()
            else:  # test_other_instruction_sets_build_and_agree[<capability>]
                command, env = instruction_set_command(name.partition("[")[2].rstrip("]"))
            folder = tmp_path_factory.mktemp("background")
            runs[name] = BackgroundRun(command, env, folder / "pytest.log")
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.fixture
def background_result(request, background_runs):
    """The exit code and output of this test's background run."""
    return background_runs[request.node.name].result()
