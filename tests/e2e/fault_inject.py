# SPDX-License-Identifier: Apache-2.0
"""Test-only fault injection: InfiniGen's speculation raises on its Nth call.

``write_distribution(dir)`` puts a tiny distribution in ``dir`` whose
``vllm.general_plugins`` entry point is ``register`` below. With ``dir`` and the
repository on ``PYTHONPATH``, every vLLM process (API server, engine core,
workers) runs ``register`` at start-up; it patches
``InfiniGenRuntime.speculate`` only where ``INFINIGEN_TEST_FAULT_AT`` is set, so
the worker that runs the model fails the way a real fault in the selection or
the swap would, with no change to the package.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

FAULT_AT_ENV = "INFINIGEN_TEST_FAULT_AT"
MESSAGE = "injected swap fault"
DIST_NAME = "infinigen_test_faults"


def register() -> None:
    """The entry point: patches the speculation if ``INFINIGEN_TEST_FAULT_AT`` is set."""
    at = os.environ.get(FAULT_AT_ENV)
    if at:
        patch_speculate(int(at))


def patch_speculate(at: int) -> None:
    """Makes the ``at``-th call of ``InfiniGenRuntime.speculate`` in this process raise."""
    from vllm_infinigen.worker.runtime import InfiniGenRuntime

    original = InfiniGenRuntime.speculate
    if getattr(original, "fault_injected", False):
        return
    calls = itertools.count(1)

    def speculate(self, state, plan):
        call = next(calls)
        if call == at:
            raise RuntimeError(f"{MESSAGE} (speculation call {call}, layer {state.layer_idx})")
        return original(self, state, plan)

    speculate.fault_injected = True
    InfiniGenRuntime.speculate = speculate


def write_distribution(root: Path) -> Path:
    """Writes the entry point's distribution metadata under ``root``; returns ``root``."""
    dist = root / f"{DIST_NAME}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{DIST_NAME} = tests.e2e.fault_inject:register\n"
    )
    return root


def fault_env(root: Path, at: int) -> dict[str, str]:
    """Environment for a process whose vLLM should fail at speculation call ``at``."""
    from benchmarks.harness.paths import REPO

    paths = [str(write_distribution(root)), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {FAULT_AT_ENV: str(at), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
