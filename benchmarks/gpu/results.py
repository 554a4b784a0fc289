# SPDX-License-Identifier: Apache-2.0
"""Provenance of the GPU benchmarks: ``benchmarks.harness.report``'s (command,
commit, machine, date), plus the accelerator, without vLLM. Their results are
written by ``report.write_results`` like every other benchmark's."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import report


def device_description() -> dict[str, Any]:
    """The accelerator this process sees (or that there is none)."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu (no CUDA device)"}
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"device": props.name, "sm_count": props.multi_processor_count,
                            "memory_GiB": round(props.total_memory / 2**30, 1),
                            "torch_cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def gpu_run_metadata(**extra: Any) -> dict[str, Any]:
    """Command, commit, machine, device, versions and date of this run (no vLLM:
    ``report.source_metadata`` with torch's version and the device)."""
    import torch

    return report.source_metadata(torch=torch.__version__, **device_description(), **extra)
