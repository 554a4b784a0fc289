# SPDX-License-Identifier: Apache-2.0
"""The one way a test asks for ``../shared`` (models and data too large for the
repository): ``require_shared``. Without the directory a clone's tests skip,
naming what is missing; under CI, which has it, such a test fails instead, so
that a green CI run shows that none of them skipped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks.harness import paths


def running_in_ci() -> bool:
    """``CI`` set, and not to "0" or "false" (CI services set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def require_shared(relative: str) -> Path:
    """``../shared/<relative>``; skips the calling test (or module) when it is
    absent, and fails it under CI (``CI=true``)."""
    found = paths.find_shared(relative)
    if found is not None:
        return found
    caller = sys._getframe(1)
    where = f"{os.path.relpath(caller.f_code.co_filename, paths.REPO)}:{caller.f_lineno}"
    reason = (f"{where} needs {relative} from the shared models and data, absent: "
              f"{paths.shared_path(relative)} (set VLLM_INFINIGEN_SHARED to the "
              f"directory holding them; default ../shared beside the checkout)")
    if running_in_ci():
        pytest.fail(f"{reason}; CI={os.environ['CI']}: a test needing shared data "
                    f"must run in CI, not skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
