# SPDX-License-Identifier: Apache-2.0
"""The rehearsal of a lent GPU's calls (benchmarks/gpu/rehearse.py): it rehearses the
commands the GPU README documents, and a failing step is reported as failed."""

from __future__ import annotations

import sys

import pytest

from benchmarks.gpu import rehearse


def test_call_1_is_read_from_the_readme_and_run_in_its_smoke_form(tmp_path):
    tests, training = rehearse.documented_training_call()
    command = rehearse.training_as_smoke(training, tmp_path / "scripts", tmp_path / "out",
                                         tmp_path / "work")
    assert command[:3] == [sys.executable, "-m", "benchmarks.gpu.continue_recall"]
    assert command[-3:] == ["--smoke", "--device", "cpu"]
    after = command[command.index("--") + 1:]
    # the training's own arguments as documented, before the smoke flags
    assert "--train-seconds" in after and "--stages" in after
    for flag, value in (("--scripts", "scripts"), ("--pack-to", "out"), ("--work", "work")):
        assert command[command.index(flag) + 1] == str(tmp_path / value)
    assert "$OUT" not in " ".join(command)
    collection = rehearse.gpu_tests_as_collection(tests)
    assert collection[:3] == [sys.executable, "-m", "pytest"] and "tests/gpu" in collection
    assert not any(">" in word or "&" in word for word in collection)


def test_a_readme_without_call_1s_block_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("## The next lent GPU\n\nnothing to run\n")
    with pytest.raises(ValueError, match="no command block"):
        rehearse.documented_training_call(readme)
    readme.write_text("## The next lent GPU\n\n```\necho hello\n```\n")
    with pytest.raises(ValueError, match="no pytest or continue_recall"):
        rehearse.documented_training_call(readme)


@pytest.mark.parametrize(("output", "rc", "passed"), [
    ("..\n192 passed, 23 warnings in 120.53s", 0, True),
    ("..\n191 passed, 1 failed in 120.53s", 1, False),
    ("..\n191 passed, 1 skipped in 120.53s", 0, False),
    ("test_the_error_path PASSED\n3 passed in 1s", 0, True),  # a name is not the summary
    ("3 passed in 1s", 2, False),
    ("", 0, False),
])
def test_a_pytest_step_passes_on_its_summary_alone(output, rc, passed):
    step = rehearse.Step("Triton", ["pytest"], [r"\d+ passed"], ["failed", "error", "skipped"],
                         summary=True)
    assert rehearse.judge(output, rc, step) is passed


def test_a_self_test_fails_on_any_failed_check():
    step = rehearse.Step("self-test", ["x"], [r"'passed': True"], [r"'passed': False"])
    assert rehearse.judge("{'a': {'passed': True}, 'passed': True}", 0, step)
    assert not rehearse.judge("{'a': {'passed': False}, 'passed': True}", 0, step)


def test_the_stack_must_be_the_gpus(tmp_path):
    assert rehearse.stack_mismatch({"python": "3.12.1", "torch": "2.11.0+cu130",
                                    "triton": "3.6.0", "transformers": "5.17.0",
                                    "numpy": "2.5.2"}) == []
    wrong = rehearse.stack_mismatch({"python": "3.11.7", "torch": "2.13.0+cpu",
                                     "triton": None, "transformers": "5.19.0"})
    assert [line.split()[0] for line in wrong] == ["python", "torch", "triton", "transformers",
                                                   "numpy"]
    assert rehearse.pack_comes_back(tmp_path) == f"no recall.tgz.part* in {tmp_path}"


def test_the_training_step_reads_back_the_pack_its_command_writes(tmp_path):
    packing = [step for step in rehearse.steps(tmp_path, tmp_path / "scripts", None)
               if step.pack is not None]
    assert [step.name for step in packing] == [
        "issue 48's training call (call 1), smoke form on the CPU"]
    command = packing[0].command
    assert command[command.index("--pack-to") + 1] == str(packing[0].pack)
