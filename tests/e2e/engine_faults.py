# SPDX-License-Identifier: Apache-2.0
"""Runs an offline InfiniGen engine into a fault and reports what the caller saw.

Usage: python -m tests.e2e.engine_faults SCENARIO MODEL OUT.json
    [--in-process]

Scenarios:
    speculate   generate() while ``tests.e2e.fault_inject`` makes the
                speculation raise (set ``INFINIGEN_TEST_FAULT_AT`` and
                ``PYTHONPATH`` with ``fault_inject.fault_env``).

``--in-process`` keeps the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni-process executor); otherwise
the engine core and the worker run in their own processes, as by default.
Writes {"error_type", "error", "seconds", "outputs"}; tests/e2e/test_faults.py
asserts on it.
"""

from __future__ import annotations

import argparse
import json
import time


def run(scenario: str, model: str, in_process: bool) -> dict:
    from vllm import SamplingParams

    from tests.e2e.engines import engine, random_prompts

    assert scenario == "speculate"
    prompts = random_prompts([40, 120, 300, 64], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    report: dict = {"error_type": None, "error": None, "outputs": None}
    with engine(model, processes=not in_process, kv_manager="infinigen",
                infinigen_budget=0.2) as llm:
        start = time.monotonic()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            report["outputs"] = [list(out.outputs[0].token_ids) for out in outputs]
        except Exception as exc:  # what the caller of generate() gets
            report["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
            report["error"] = str(exc)
        report["seconds"] = time.monotonic() - start
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["speculate"])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args()
    report = run(args.scenario, args.model, args.in_process)
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
