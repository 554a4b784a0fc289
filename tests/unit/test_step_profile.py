# SPDX-License-Identifier: Apache-2.0
"""The step profile's clock and arithmetic (the engine runs are benchmarks, not tests)."""

from __future__ import annotations

import time

import pytest

from benchmarks.perf import step_profile


def test_nested_entry_points_count_once_and_components_add_up():
    clock = step_profile.Clock()
    kernel = clock.timed("attend", lambda: time.sleep(0.01))

    def inner():
        kernel()

    inner_entry = clock.timed("plugin", inner, entry=True)
    outer = clock.timed("plugin", lambda: (inner_entry(), time.sleep(0.01)), entry=True)
    outer()
    seconds = clock.take()
    assert seconds["attend"] == pytest.approx(0.01, abs=0.008)
    # The outer entry point's time only: the inner one is inside it.
    assert 0.02 <= seconds["plugin"] < 0.04
    assert clock.take() == {}
    ms = step_profile.breakdown({**seconds, "capture": 0.002}, step_s=0.05, steps=1)
    assert ms["attend"] == pytest.approx(1000 * seconds["attend"])
    assert ms["plugin Python"] == pytest.approx(1000 * (seconds["plugin"] - seconds["attend"]))
    assert ms["rest of the step"] == pytest.approx(50 - 1000 * seconds["plugin"] - 2)
    total = sum(ms.values())
    assert total == pytest.approx(50)  # every millisecond of the step in one component


def test_instrumented_wraps_the_plugin_and_restores_it():
    from vllm_infinigen.platforms.cpu import kernels
    from vllm_infinigen.worker import attention
    from vllm_infinigen.worker.runtime import InfiniGenRuntime

    originals = (kernels.attend_decode, InfiniGenRuntime.begin_layer, attention.capture_pre_hook)
    with step_profile.instrumented(step_profile.Clock()):
        assert kernels.attend_decode is not originals[0]
        assert kernels.attend_decode.__wrapped__ is originals[0]
        assert InfiniGenRuntime.begin_layer is not originals[1]
        assert attention.capture_pre_hook is not originals[2]
    assert (kernels.attend_decode, InfiniGenRuntime.begin_layer,
            attention.capture_pre_hook) == originals


def test_default_alpha_goes_first():
    assert step_profile.parse_args([]).alphas == ["default", "5"]
    with pytest.raises(SystemExit):
        step_profile.parse_args(["--alphas", "10000", "default"])
