# SPDX-License-Identifier: Apache-2.0
"""Markdown of the GPU decode-step benchmark's results (``decode_step.py``)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.report import cell, markdown_table

HEADERS = ["context", "batch", "variant (mode)", "ms / step", "host enqueue ms",
           "launches / step", "host syncs / step", "MB over PCIe / step", "GB/s", "PCIe bound ms",
           "hit rate", "cache slots / head (x widest step)", "note"]


def _context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _row(config: dict[str, Any], name: str, result: dict[str, Any]) -> list[str]:
    note = result.get("skipped") or result.get("error", "")
    slots = result.get("cache_slots_per_head")
    return [_context(config["context"]), str(config["batch"]), name,
            cell(result.get("ms_per_step"), ".2f"), cell(result.get("host_enqueue_ms"), ".2f"),
            cell(result.get("launches_per_step"), ".0f"), cell(result.get("syncs_per_step"), ".1f"),
            cell(result["pcie_bytes_per_step"] / 1e6 if "pcie_bytes_per_step" in result else None,
                 ".4g"),
            cell(result.get("GBps"), ".1f"), cell(result.get("pcie_bound_ms"), ".2f"),
            cell(result.get("hit_rate"), ".3f"),
            f"{slots} (x{result['cache_factor']})" if slots else "", note[:120]]


def markdown_sections(results: dict[str, Any], *, self_test: bool) -> list[str]:
    rows = [_row(config, name, result) for config in results["configs"]
            for name, result in config["variants"].items()]
    replay = [f"{_context(c['context'])} x {c['batch']}: kept {c['replay']['kept_fraction']:.3f} "
              f"of the blocks ({c['replay']['trace']})" for c in results["configs"]]
    sections = []
    if self_test:
        checks = results["checks"]
        sections.append(
            "CPU self-test: tiny shapes (4 layers, 2 dense), float32, the kernels' torch "
            "references, no streams. Timings here say nothing about a GPU. "
            f"**Checks passed: {checks['passed']}** -- select-all (budget 1) against dense, "
            f"relative L2 of the logits, {checks['select_all']['keys']} keys (the default): "
            f"{checks['select_all']['relative_l2_vs_dense']}; int keys: "
            f"{checks.get('select_all_int_keys', {}).get('relative_l2_vs_dense')}; "
            f"partial keys: "
            f"{checks['select_all_partial_keys']['relative_l2_vs_dense']}; "
            "trace replayed: the product's logits with 1x and 2x the widest step's cache "
            f"slots are the same (max abs {checks['replay']['cache_sizes_same_logits_max_abs']:.2e})"
            f" and differ from dense ({checks['replay']['sparse_differs_from_dense_max_abs']:.2e}),"
            f" the larger cache fetching fewer units ({checks['replay']['fetched_units_x2']} "
            f"against {checks['replay']['fetched_units_x1']}). GPU numbers: measured only by "
            "`python -m benchmarks.gpu.decode_step` on a CUDA machine.")
    else:
        limits, check = results["h2d_limits"], results["select_all"]
        sections.append(
            f"H2D limits measured in this run: one 1 GiB pinned copy {limits['copy_GBps']:.1f} "
            f"GB/s; the gather kernel ({limits['gather_ctas']} CTAs, 8192 random units) "
            f"{limits['gather_GBps']:.1f} GB/s. Select-all (budget 1) against dense at "
            f"{check['context']} x {check['batch']} ({check['keys']} keys): relative L2 of "
            "the logits "
            f"{check['relative_l2_vs_dense']} (at most {check['tolerance']:g}); against "
            "dense_units, InfiniGen's attention kernel over every block "
            f"{check.get('relative_l2_vs_dense_units')} (at most "
            f"{check.get('same_kernel_tolerance')}); passed: {check['passed']}. "
            + (f"A captured step against the eager one (InfiniGen's trace replayed): relative "
               f"L2 {results['graph_vs_eager']['relative_l2_graph_vs_eager']} (passed: "
               f"{results['graph_vs_eager']['passed']}). "
               if results.get("graph_vs_eager") else "") +
            "InfiniGen: the product's runtime and CUDA data path; its selections computed "
            "(their cost is in the time), then replaced by the recorded trace scaled to the "
            "context (benchmarks/gpu/selection_trace.py). graph: the whole step captured in "
            "one CUDA graph and replayed. PCIe bound: bytes over PCIe / the copy limit.")
    sections.append(markdown_table(HEADERS, rows))
    resident = resident_lines(results["configs"])
    if resident:
        sections.append("While memory allows (`--infinigen-residency device-first` before the "
                        "move: dense attention plus the product's write-through), ms per step "
                        "over dense's (issue 35's target at 32K x 1: at most 1.05x): "
                        + "; ".join(resident) + ".")
    breakdown = kernel_breakdown(results["configs"])
    if breakdown:
        sections.append(breakdown)
    for limits in results.get("kernel_limits") or []:
        from benchmarks.gpu.kernel_limits import markdown

        sections.append(markdown(limits))
    sections.append("Replayed selections: " + "; ".join(replay) + ".")
    return sections


def streams_text(streams: list[dict[str, Any]]) -> str:
    """Each profiled stream's busy and idle ms per step, the gather's marked."""
    return "; ".join(f"stream {s['stream']}{' (gather)' if s['gather'] else ''} busy "
                     f"{s['busy_ms_per_step']:.2f} ms, idle {s['idle_ms_per_step']:.2f} ms"
                     for s in streams)


def kernel_breakdown(configs: list[dict[str, Any]]) -> str:
    """Where each InfiniGen step's device time goes (``--profile``): the kernels
    that took most, ms and calls per step, per (context, batch, mode)."""
    parts = []
    for config in configs:
        for key, result in config["variants"].items():
            if not key.startswith("infinigen (") or not result.get("top_kernels"):
                continue
            rows = [[k["kernel"], f"{k['ms_per_step']:.3f}", f"{k['calls_per_step']:g}"]
                    for k in result["top_kernels"]]
            parts.append(f"{_context(config['context'])} x {config['batch']}, {key}: "
                         f"{result['device_ms_per_step']:.2f} ms of kernels per step "
                         f"({result.get('ms_per_step', float('nan')):.2f} ms per step)\n\n"
                         + markdown_table(["kernel", "ms / step", "calls / step"], rows)
                         + (f"\n\nStreams per step: {streams_text(result['streams'])}."
                            if result.get("streams") else ""))
    if not parts:
        return ""
    return ("Device time per step by kernel (torch profiler, 3 steps; the kernels that "
            "took most):\n\n" + "\n\n".join(parts))


def resident_lines(configs: list[dict[str, Any]]) -> list[str]:
    """"<context> x <batch> <mode>: <ratio>x" of infinigen_resident over dense,
    where both were measured in the same run."""
    lines = []
    for config in configs:
        variants = config["variants"]
        for key, result in variants.items():
            if not key.startswith("infinigen_resident ("):
                continue
            mode = key[len("infinigen_resident ("):-1]
            dense = variants.get(f"dense ({mode})", {}).get("ms_per_step")
            ms = result.get("ms_per_step")
            if dense and ms:
                lines.append(f"{_context(config['context'])} x {config['batch']} {mode}: "
                             f"{ms / dense:.3f}x")
    return lines
