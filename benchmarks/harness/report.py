# SPDX-License-Identifier: Apache-2.0
"""Result files of the benchmarks: JSON + Markdown (+ PNG) under benchmarks/results/.

Every result records how it was made (command, date, machine, versions, where the
``vllm_infinigen`` runtime was imported from, the repository's commit and whether
tracked files differed from it)::

    meta = run_metadata(model=args.model)
    write_results(out, meta, title, settings, results, sections)  # out.json, out.md
    plot_quality_vs_budget(out.with_suffix(".png"), panels)        # needs matplotlib

matplotlib is optional: without it ``plot_quality_vs_budget`` raises
``PlotUnavailable`` with the install command, and the benchmarks skip the plot.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import REPO


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def git(*args: str, cwd: Path) -> str | None:
    """``git ARGS`` in ``cwd``: its output, or None outside a git tree."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                             check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def runtime_source() -> dict[str, Any]:
    """Where ``vllm_infinigen`` is imported from, with its commit if in a git tree."""
    import importlib.util

    spec = importlib.util.find_spec("vllm_infinigen")
    if spec is None or spec.origin is None:
        return {"path": None}
    package = Path(spec.origin).resolve().parent
    top = git("rev-parse", "--show-toplevel", cwd=package)
    if top is None:
        return {"path": str(package)}
    status = git("status", "--porcelain", "--", str(package), cwd=package)
    return {"path": str(package), "commit": git("rev-parse", "HEAD", cwd=package),
            "uncommitted_changes": bool(status)}


def repository_state() -> dict[str, Any]:
    """This checkout's commit and whether tracked files other than the results differ
    from it (a run that rewrites its own results files is still of a clean tree). A lent
    GPU machine gets a copy of the working tree whose .git may be missing or
    stale: there the caller names the commit of a clean tree
    (``INFINIGEN_COMMIT=$(git rev-parse HEAD)``)."""
    if os.environ.get("INFINIGEN_COMMIT"):
        return {"repo_commit": os.environ["INFINIGEN_COMMIT"], "repo_uncommitted_changes": False}
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)benchmarks/results", cwd=REPO)
    return {"repo_commit": git("rev-parse", "HEAD", cwd=REPO),
            "repo_uncommitted_changes": None if changes is None else bool(changes)}


# /proc/cpuinfo flags -> the widest x86 vector set they name (the CPU kernels are
# built for ATen's choice, which follows the same flags).
VECTOR_SETS = (("avx512f", "AVX-512"), ("avx2", "AVX2"))


def processor(cpuinfo: str | None = None) -> dict[str, Any]:
    """The host processor's name and widest vector set (``cpu_model``, ``cpu_vectors``):
    the same code runs at about twice the speed on this project's AVX-512 hosts as on
    its AVX2 ones, so a results file names which. None where /proc/cpuinfo is missing."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"cpu_model": platform.processor() or None, "cpu_vectors": None}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    vectors = next((name for flag, name in VECTOR_SETS if flag in flags), None)
    return {"cpu_model": fields.get("model name") or platform.processor() or None,
            "cpu_vectors": vectors}


def command_line() -> list[str]:
    """How this process was started, to run it again: ``python -m MODULE ARGS`` for a
    module run (``sys.argv[0]`` then holds the module's file, not its name)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return [Path(sys.executable).name, *argv]


def run_metadata(**extra: Any) -> dict[str, Any]:
    """Command, machine, versions and source of this run, plus ``extra``."""
    import torch
    import transformers
    import vllm

    return source_metadata(torch=torch.__version__, vllm=vllm.__version__,
                           transformers=transformers.__version__, **extra)


def source_metadata(**extra: Any) -> dict[str, Any]:
    """``run_metadata`` without the library versions, for scripts that import no torch."""
    meta = {
        "command": shlex.join(command_line()),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        **processor(),
        "python": platform.python_version(),
    }
    versions = {key: extra.pop(key) for key in ("torch", "vllm", "transformers") if key in extra}
    return {**meta, **versions, **repository_state(), "runtime": runtime_source(), **extra}


def cell(value: Any, spec: str = "") -> str:
    """A Markdown table cell: blank for None, ``format(value, spec)`` otherwise."""
    if value is None:
        return ""
    return format(value, spec) if spec else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table of preformatted cells."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def metadata_markdown(meta: Mapping[str, Any]) -> str:
    """The run's provenance as a short Markdown block."""
    runtime = meta.get("runtime") or {}
    source = runtime.get("path")
    # (GPU results written before the one writer: "uncommitted_changes")
    repo_dirty = meta.get("repo_uncommitted_changes", meta.get("uncommitted_changes"))
    if runtime.get("commit"):
        dirty = " + uncommitted changes" if runtime.get("uncommitted_changes") else ""
        source = f"{source} (commit {runtime['commit'][:10]}{dirty})"
    versions = [f"python {meta.get('python')}"] + [
        f"{label} {meta[key]}" for key, label in
        (("torch", "torch"), ("vllm", "vLLM"), ("transformers", "transformers")) if key in meta]
    lines = [
        f"- command: `{meta.get('command')}`",
        *([f"- device: {device_line(meta)}"] if meta.get("device") else []),
        f"- machine: {meta.get('machine')}, {meta.get('cpus')} CPUs{cpu_text(meta)}; "
        + ", ".join(versions),
        f"- repository commit: {meta.get('repo_commit')}"
        f"{' + uncommitted changes' if repo_dirty else ''}"
        + (f"; vllm_infinigen from {source}" if source else ""),
        f"- date (UTC): {meta.get('date_utc')}",
    ]
    return "\n".join(lines)


def cpu_text(meta: Mapping[str, Any]) -> str:
    """The processor as `` (AMD EPYC, AVX2)`` from ``processor``'s fields; empty for
    results written before them."""
    known = [meta[key] for key in ("cpu_model", "cpu_vectors") if meta.get(key)]
    return f" ({', '.join(known)})" if known else ""


def device_line(meta: Mapping[str, Any]) -> str:
    """The accelerator of a run (``benchmarks.gpu.results.device_description``)."""
    details = [f"{meta[key]} {label}" for key, label in
               (("sm_count", "SMs"), ("memory_GiB", "GiB")) if meta.get(key)]
    details += [f"{label} {meta[key]}" for key, label in
                (("torch_cuda", "CUDA"), ("triton", "Triton")) if meta.get(key)]
    return f"{meta['device']}" + (f" ({', '.join(details)})" if details else "")


def read_results(out: Path) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(meta, settings, results) of ``out.json``, as ``write_results`` wrote them."""
    saved = json.loads(Path(out).with_suffix(".json").read_text())
    return saved["meta"], saved["settings"], saved["results"]


def write_results(
    out: Path,
    meta: Mapping[str, Any],
    title: str,
    settings: Mapping[str, Any],
    results: Any,
    sections: Sequence[str],
) -> tuple[Path, Path]:
    """Writes ``out.json`` (meta, settings, results) and ``out.md`` (title, provenance, sections).

    Returns:
        The two paths.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    json_path.write_text(json.dumps(
        {"meta": dict(meta), "settings": dict(settings), "results": results},
        indent=1, default=str) + "\n")
    body = [f"# {title}", metadata_markdown(meta), *sections]
    md_path.write_text("\n\n".join(part.strip("\n") for part in body if part) + "\n")
    return json_path, md_path


@dataclass
class Panel:
    """One subplot: a quality metric against the budget, one line per policy.

    ``series`` maps a policy label to (x, value) points, x being the budget
    unless ``xlabel`` says otherwise; ``references`` maps a label to an
    x-independent value (dense attention, a control), drawn as a horizontal
    line.
    """

    title: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    references: dict[str, float] = field(default_factory=dict)
    xlabel: str = "budget (fraction of context)"
    xscale: str = "log"


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(
            "plots need matplotlib: `pip install matplotlib` "
            "(results are written without the PNG)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(panels: Sequence[Panel]) -> dict[str, str]:
    """One colour per label over every panel, so that one legend serves all."""
    labels: list[str] = []
    for panel in panels:
        for label in [*panel.series, *panel.references]:
            if label not in labels:
                labels.append(label)
    return {label: f"C{index % 10}" for index, label in enumerate(labels)}


def plot_quality_vs_budget(path: Path, panels: Sequence[Panel], suptitle: str = "") -> Path:
    """Draws the panels side by side into a PNG at ``path``, one legend below.

    Raises:
        PlotUnavailable: If matplotlib is absent.
        ValueError: If there is nothing to plot.
    """
    if not panels or not any(p.series or p.references for p in panels):
        raise ValueError("nothing to plot")
    plt = _pyplot()
    colors = _colors(panels)
    columns = 2 if len(panels) == 4 else min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows + 0.9),
                             squeeze=False)
    handles: dict[str, Any] = {}
    for axis, panel in zip(axes.flat, panels):
        for label, points in panel.series.items():
            points = sorted(points)
            (line,) = axis.plot([x for x, _ in points], [v for _, v in points], marker="o",
                                color=colors[label], label=label)
            handles.setdefault(label, line)
        for label, value in panel.references.items():
            line = axis.axhline(value, linestyle="--", color=colors[label], label=label)
            handles.setdefault(label, line)
        axis.set_xscale(panel.xscale)
        xs = sorted({x for points in panel.series.values() for x, _ in points})
        if panel.xscale == "log" and xs:  # label the measured budgets, not powers of 10
            axis.set_xticks(xs, [format(x, "g") for x in xs])
            axis.minorticks_off()
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel(panel.ylabel)
        axis.set_title(panel.title, fontsize=10)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="lower center",
               ncol=min(3, len(handles)), fontsize=8, frameon=False)
    legend_rows = -(-len(handles) // min(3, len(handles)))
    fig.tight_layout(rect=(0, min(0.45, 0.035 * legend_rows + 0.02), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def try_plot(path: Path, panels: Sequence[Panel], suptitle: str = "") -> Path | None:
    """``plot_quality_vs_budget``, or None with a message on stderr if matplotlib is absent."""
    try:
        return plot_quality_vs_budget(path, panels, suptitle)
    except PlotUnavailable as e:
        print(f"no plot: {e}", file=sys.stderr)
        return None
