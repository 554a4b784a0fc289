# SPDX-License-Identifier: Apache-2.0
"""Block accounting of InfiniGen requests, read from a live scheduler at every step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.harness.paths import BUNDLED_MODEL, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("manager") / "seen.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.inspect_manager", str(BUNDLED_MODEL), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def test_sparse_layers_have_their_own_groups(seen):
    assert seen["groups"][0] == "FullAttentionSpec"
    assert set(seen["groups"][1:]) == {"InfiniGenSparseSpec"}


def test_device_blocks_within_bound_at_every_step(seen):
    assert seen["steps"] > 50
    assert seen["bound_violations"] == []


def test_pool_bytes_equal_live_requests_kv(seen):
    assert seen["pool_mismatches"] == []


def test_aborts_and_completions_leave_nothing(seen):
    assert seen["aborted"] == 200 // 3 and seen["never_aborted"] == []
    # Every other request ran to its length; none of the aborted did.
    assert seen["num_finished_length"] == 200 - 200 // 3
    assert seen["free_blocks_at_end"] == seen["total_blocks"]
    assert seen["pool_used_bytes_at_end"] == 0
    assert seen["device_blocks_at_end"] == 0
    assert seen["pool_capacity_bytes"] > 0
