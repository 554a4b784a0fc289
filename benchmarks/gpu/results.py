# SPDX-License-Identifier: Apache-2.0
"""Result files of the GPU benchmarks: ``benchmarks.harness.report``'s format
(JSON + Markdown with command, commit, machine and date), without vLLM."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import report
from benchmarks.harness.paths import REPO


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
    """Command, commit, machine, device, versions and date of this run."""
    import torch

    return {
        "command": shlex.join(report.command_line()),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # A lent GPU machine gets a copy of the working tree whose .git may be
        # missing or stale: the caller names the commit there
        # (INFINIGEN_COMMIT=$(git rev-parse HEAD), a clean tree).
        **({"repo_commit": os.environ["INFINIGEN_COMMIT"], "uncommitted_changes": False}
           if os.environ.get("INFINIGEN_COMMIT") else
           {"repo_commit": report._git("rev-parse", "HEAD", cwd=REPO),
            "uncommitted_changes": bool(report._git("status", "--porcelain",
                                                    "--untracked-files=no", cwd=REPO))}),
        **device_description(),
        **extra,
    }


def metadata_markdown(meta: Mapping[str, Any]) -> str:
    dirty = " + uncommitted changes" if meta.get("uncommitted_changes") else ""
    return "\n".join([
        f"- command: `{meta.get('command')}`",
        (f"- device: {meta.get('device')}; machine: {meta.get('machine')}, "
         f"{meta.get('cpus')} CPUs; python {meta.get('python')}, torch {meta.get('torch')}"),
        f"- repository commit: {meta.get('repo_commit')}{dirty}",
        f"- date (UTC): {meta.get('date_utc')}",
    ])


def write_gpu_results(out: Path, meta: Mapping[str, Any], title: str,
                      settings: Mapping[str, Any], results: Any,
                      sections: Sequence[str]) -> tuple[Path, Path]:
    """``out.json`` and ``out.md``, as ``report.write_results`` writes them."""
    json_path, md_path = report.write_results(out, meta, title, settings, results, [])
    body = [f"# {title}", metadata_markdown(meta), *sections]
    md_path.write_text("\n\n".join(part.strip("\n") for part in body if part) + "\n")
    return json_path, md_path
