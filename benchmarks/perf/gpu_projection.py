# SPDX-License-Identifier: Apache-2.0
"""GPU projection: InfiniGen's decode step on an H100, from bytes per step and external timings.

python -m benchmarks.perf.gpu_projection [--fractions 0.05 0.1 0.2] [--out PATH]

This repository has no GPU data path and its machine no GPU. Every rate and
time in ``H100`` and ``H100_STEPS`` is an external measurement: one NVIDIA H100
80GB HBM3 on PCIe Gen5 x16, measured outside this repository by the scripts in
``../shared/prototypes/gpu-data-path/`` and written up in
``../shared/docs/GPU_DATA_PATH.md`` (Llama-3.1-8B attention shapes, bf16,
random data, 20 % of the K/V kept). Nothing here re-measures them. What this
module adds is the bytes each decode step moves (the formulas the CPU harness
checks against the engine's counters) and what follows from them:

- check: the doc's "PCIe bound" column is the kept bytes over the measured
  55.1 GB/s pinned copy; each measured InfiniGen step against that bound;
- measured speed-ups: InfiniGen (token-granular gather, overlapped one layer
  ahead) over full offloading (overlapped) and over dense attention with the
  K/V in GPU memory;
- this plugin's layout on that GPU: the first ``dense_layers`` layers in vLLM's
  device KV cache, the sparse layers' K/V in the host pool, the partial keys
  (r/2 of K+V) on the device. Per selected fraction f: bytes over PCIe per
  step, the step as the larger of that transfer (at the end-to-end rate of the
  measured InfiniGen step) and the compute (GEMMs: the measured dense step
  minus its measured attention; per sparse layer the measured score, top-k and
  attend at 32K), device memory needed, and the fraction at which the transfer
  alone takes as long as the measured dense step;
- the paper's OPT-13B setting (batch 20, 1,920 + 128 tokens) in bytes over
  PCIe per step, full offloading against InfiniGen, at the measured rates.

Torch-free; writes ``benchmarks/results/gpu_projection.{json,md}``. The
reasoning is in ``benchmarks/GPU_PROJECTION.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report

SOURCE = ("external measurements on one NVIDIA H100 80GB HBM3, PCIe Gen5 x16, made outside "
          "this repository by the scripts in ../shared/prototypes/gpu-data-path/ "
          "(../shared/docs/GPU_DATA_PATH.md)")


@dataclass(frozen=True)
class Setting:
    """A model and workload: the paper's OPT-13B speed experiment by default."""

    name: str
    layers: int
    hidden: int
    params: float  # parameters, for the weight bytes
    dtype_bytes: int
    batch: int
    prompt: int
    generated: int
    dense_layers: int = 2
    partial_ratio: float = 0.2
    kv_width: int | None = None  # K (or V) channels per token and layer; None: hidden (MHA)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * (self.kv_width or self.hidden) * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def mean_context(self) -> float:
        """Context of the average decode step: the prompt plus half the generated tokens."""
        return self.prompt + self.generated / 2


@dataclass(frozen=True)
class Gpu:
    """Measured transfer rates of one GPU (bytes/s) and its memory."""

    name: str
    memory_bytes: float
    copy_bytes_per_s: float  # pinned host -> device, one 1 GiB copy
    gather_bytes_per_s: tuple[float, float]  # zero-copy gather kernel, rows >= 2 KiB
    kept_fraction: float  # fraction of the K/V the measured sparse steps moved


@dataclass(frozen=True)
class MeasuredStep:
    """One row of GPU_DATA_PATH.md's 32-layer table, ms per decode step.

    ``dense_ms`` is None where the K/V does not fit in GPU memory; the doc's
    dense figure is the sum of measured attention and GEMM parts.
    """

    batch: int
    context: int
    dense_ms: float | None
    full_offload_ms: float  # copy each layer's K/V, overlapped with the previous layer
    token_ms: float  # InfiniGen, token-granular gather, overlapped
    block_ms: float  # InfiniGen, 16-token blocks, overlapped
    pcie_bound_ms: float  # kept bytes / pinned copy rate, as the doc prints it


# OPT-13B: 40 layers, hidden 5120, 40 heads x 128, 12.85e9 parameters (fp16).
PAPER_SETTING = Setting(name="OPT-13B, batch 20, 1920 + 128 tokens", layers=40, hidden=5120,
                        params=12.85e9, dtype_bytes=2, batch=20, prompt=1920, generated=128)
# The paper's cap: at most 400 KV entries per head (--max-num-kv 400).
PAPER_MAX_KV = 400
# Llama-3.1-8B's attention as measured: 8 KV heads x 128 (K+V 4 KiB per token and
# layer in bf16); 8.03e9 parameters (published), 2 of 32 layers dense as in the plugin.
H100_SHAPE = Setting(name="Llama-3.1-8B attention (32 layers, 8 KV heads x 128, bf16)",
                     layers=32, hidden=4096, kv_width=8 * 128, params=8.03e9, dtype_bytes=2,
                     batch=1, prompt=32768, generated=0)
H100 = Gpu(name="H100 80GB HBM3, PCIe Gen5 x16", memory_bytes=80e9, copy_bytes_per_s=55.1e9,
           gather_bytes_per_s=(47e9, 51e9), kept_fraction=0.2)
H100_STEPS = (
    MeasuredStep(1, 32768, 7.8, 78.1, 17.8, 18.9, 15.6),
    MeasuredStep(1, 131072, 11.9, 311.4, 67.6, 70.1, 62.3),
    MeasuredStep(8, 32768, 17.6, 623.7, 136.0, 140.4, 124.8),
    MeasuredStep(8, 131072, None, 2492.9, 541.0, 547.0, 498.6),
)
# One attention layer at 32K, ms, per batch: dense (SDPA, K/V in GPU memory) and
# the token-granular sparse layer's compute with 20 % kept (score, top-k, attend).
H100_DENSE_LAYER_MS_32K = {1: 0.064, 8: 0.364}
H100_SPARSE_LAYER_MS_32K = {1: {"score": 0.031, "topk": 0.076, "attend": 0.034},
                            8: {"score": 0.071, "topk": 0.091, "attend": 0.103}}


def kv_bytes(setting: Setting, context: float, layers: int | None = None) -> float:
    """K/V bytes of the whole batch at ``context`` tokens, over ``layers`` (default all)."""
    layers = setting.layers if layers is None else layers
    return setting.batch * context * layers * setting.kv_bytes_per_token_layer


def infinigen_step_bytes(setting: Setting, context: float,
                         selected_fraction: float) -> dict[str, float]:
    """Bytes one InfiniGen decode step touches, by place.

    - ``pcie``: selected K/V of the sparse layers, host pool -> device;
    - ``dense_layers``: the dense layers' full K/V (vLLM's device KV cache here;
      over PCIe too if they were kept in the pool);
    - ``hbm_partial``: partial keys, r of K = r/2 of K+V, of every sparse layer
      and context token, read on the device to speculate.
    """
    sparse_full = kv_bytes(setting, context, setting.layers - setting.dense_layers)
    return {"pcie": selected_fraction * sparse_full,
            "dense_layers": kv_bytes(setting, context, setting.dense_layers),
            "hbm_partial": setting.partial_ratio / 2 * sparse_full}


def transfer_seconds(num_bytes: float, bytes_per_s: float) -> float:
    return num_bytes / bytes_per_s


def gemm_ms(batch: int, setting: Setting = H100_SHAPE) -> float:
    """The measured dense step at 32K minus its measured attention: the GEMMs alone."""
    step = next(s for s in H100_STEPS if (s.batch, s.context) == (batch, 32768))
    return step.dense_ms - setting.layers * H100_DENSE_LAYER_MS_32K[batch]


def compute_ms(batch: int, setting: Setting = H100_SHAPE) -> float:
    """An InfiniGen step's compute from the 32K timings: GEMMs, dense layers'
    attention, each sparse layer's score, top-k and attend (at least that at
    longer contexts, where scoring and the dense layers grow)."""
    sparse = setting.layers - setting.dense_layers
    return (gemm_ms(batch, setting) + setting.dense_layers * H100_DENSE_LAYER_MS_32K[batch]
            + sparse * sum(H100_SPARSE_LAYER_MS_32K[batch].values()))


def measured_rows(gpu: Gpu = H100, setting: Setting = H100_SHAPE) -> list[dict[str, Any]]:
    """Per measured step: the bound recomputed from bytes, and the measured ratios."""
    rows = []
    for step in H100_STEPS:
        full = kv_bytes(dataclasses.replace(setting, batch=step.batch), step.context)
        kept = gpu.kept_fraction * full
        rows.append({
            "batch": step.batch, "context": step.context, "kv_gb": full / 1e9,
            "kept_gb": kept / 1e9,
            "pcie_bound_ms": 1000 * transfer_seconds(kept, gpu.copy_bytes_per_s),
            "doc_pcie_bound_ms": step.pcie_bound_ms,
            **{f"measured_{k}": v for k, v in asdict(step).items()
               if k not in ("batch", "context", "pcie_bound_ms")},
            "token_over_bound": step.token_ms / step.pcie_bound_ms,
            "token_end_to_end_gb_s": kept / (step.token_ms / 1000) / 1e9,
            "token_speedup_vs_full_offload": step.full_offload_ms / step.token_ms,
            "token_speed_vs_dense": None if step.dense_ms is None
            else step.dense_ms / step.token_ms,
            "dense_fits": step.dense_ms is not None,
        })
    return rows


def plugin_rows(fractions: dict[str, float], gpu: Gpu = H100,
                setting: Setting = H100_SHAPE) -> list[dict[str, Any]]:
    """This plugin's layout at each measured (batch, context) and selected fraction."""
    rows = []
    for measured in measured_rows(gpu, setting):
        batch, context = measured["batch"], measured["context"]
        shaped = dataclasses.replace(setting, batch=batch)
        rate = measured["token_end_to_end_gb_s"] * 1e9
        sparse_full = kv_bytes(shaped, context, setting.layers - setting.dense_layers)
        dense_ms = measured["measured_dense_ms"]
        floor_ms = compute_ms(batch, setting)
        for label, fraction in fractions.items():
            parts = infinigen_step_bytes(shaped, context, fraction)
            transfer_ms = 1000 * transfer_seconds(parts["pcie"], rate)
            step_ms = max(transfer_ms, floor_ms)
            # Device: weights, dense layers' K/V, partial keys, two layers' selected rows.
            device = (setting.weight_bytes + parts["dense_layers"] + parts["hbm_partial"]
                      + 2 * parts["pcie"] / (setting.layers - setting.dense_layers))
            rows.append({
                "batch": batch, "context": context, "fraction_source": label,
                "selected_fraction": fraction, "pcie_gb": parts["pcie"] / 1e9,
                "transfer_ms": transfer_ms, "compute_ms": floor_ms, "step_ms": step_ms,
                "dense_ms": dense_ms,
                "speed_vs_dense": None if dense_ms is None else dense_ms / step_ms,
                "speedup_vs_full_offload": measured["measured_full_offload_ms"] / step_ms,
                "device_gb": device / 1e9,
                "dense_device_gb": (setting.weight_bytes + kv_bytes(shaped, context)) / 1e9,
                "break_even_fraction": None if dense_ms is None
                else dense_ms / 1000 * rate / sparse_full,
            })
    return rows


def paper_rows(fractions: dict[str, float], gpu: Gpu = H100,
               setting: Setting = PAPER_SETTING) -> list[dict[str, Any]]:
    """The paper's setting in bytes over PCIe per step, at the measured rates."""
    full = kv_bytes(setting, setting.mean_context)
    full_ms = 1000 * transfer_seconds(full, gpu.copy_bytes_per_s)
    rows = []
    for label, fraction in fractions.items():
        pcie = infinigen_step_bytes(setting, setting.mean_context, fraction)["pcie"]
        slow, fast = (1000 * transfer_seconds(pcie, rate) for rate in gpu.gather_bytes_per_s)
        rows.append({"fraction_source": label, "selected_fraction": fraction,
                     "full_offload_gb": full / 1e9, "full_offload_ms": full_ms,
                     "infinigen_gb": pcie / 1e9, "infinigen_ms": [fast, slow],
                     "bytes_ratio": full / pcie,
                     "speedup_vs_full_offload": [full_ms / slow, full_ms / fast]})
    return rows


def _opt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def sections(measured: list[dict], plugin: list[dict], paper: list[dict],
             gpu: Gpu = H100, setting: Setting = H100_SHAPE) -> list[str]:
    """Markdown: inputs, the check against the measured steps, the plugin, the paper."""
    low, high = (rate / 1e9 for rate in gpu.gather_bytes_per_s)
    inputs = (
        f"Inputs: {SOURCE}. {setting.name}: K+V {setting.kv_bytes_per_token_layer} B per "
        f"token and layer; measured rates: pinned host -> device copy "
        f"{gpu.copy_bytes_per_s / 1e9:.1f} GB/s, zero-copy gather kernel {low:.0f}-{high:.0f}"
        f" GB/s (rows >= 2 KiB); measured steps keep {gpu.kept_fraction:.0%} of the K/V in "
        f"all {setting.layers} layers. Nothing in this file was measured on this machine.")
    check = [[str(r["batch"]), f"{r['context'] // 1024}K", f"{r['kv_gb']:.1f}",
              f"{r['pcie_bound_ms']:.1f}", f"{r['doc_pcie_bound_ms']:.1f}",
              _opt(r["measured_dense_ms"], ".1f"), f"{r['measured_full_offload_ms']:.1f}",
              f"{r['measured_token_ms']:.1f}", f"{r['measured_block_ms']:.1f}",
              f"{r['token_over_bound']:.2f}", f"{r['token_end_to_end_gb_s']:.1f}",
              f"{r['token_speedup_vs_full_offload']:.2f}",
              _opt(r["token_speed_vs_dense"], ".2f")] for r in measured]
    projected = [[str(r["batch"]), f"{r['context'] // 1024}K", r["fraction_source"],
                  f"{r['selected_fraction']:.3f}", f"{r['pcie_gb']:.2f}",
                  f"{r['transfer_ms']:.1f}", f"{r['compute_ms']:.1f}", f"{r['step_ms']:.1f}",
                  _opt(r["dense_ms"], ".1f"), _opt(r["speed_vs_dense"], ".2f"),
                  f"{r['speedup_vs_full_offload']:.1f}", f"{r['device_gb']:.1f}",
                  f"{r['dense_device_gb']:.1f}", _opt(r["break_even_fraction"], ".3f")]
                 for r in plugin]
    paper = [[r["fraction_source"], f"{r['selected_fraction']:.3f}",
              f"{r['full_offload_gb']:.1f}", f"{r['full_offload_ms']:.0f}",
              f"{r['infinigen_gb']:.2f}",
              f"{r['infinigen_ms'][0]:.0f}-{r['infinigen_ms'][1]:.0f}",
              f"{r['bytes_ratio']:.2f}",
              f"{r['speedup_vs_full_offload'][0]:.2f}-{r['speedup_vs_full_offload'][1]:.2f}"]
             for r in paper]
    return [
        inputs,
        "## Measured steps against the bytes (32 layers, 20 % kept)\n\n"
        "bound: kept bytes / pinned copy rate, recomputed here; doc: as GPU_DATA_PATH.md "
        "prints it. speed vs dense: dense ms / InfiniGen ms (< 1: slower than dense).\n\n"
        + report.markdown_table(
            ["batch", "context", "K/V GB", "bound ms", "doc bound ms", "dense ms",
             "full offload ms", "InfiniGen token ms", "InfiniGen block ms",
             "token / bound", "token end-to-end GB/s", "token vs full offload",
             "token speed vs dense"], check),
        f"## This plugin's layout on that GPU ({setting.dense_layers} dense layers on the "
        "device, partial keys on the device)\n\n"
        "transfer: selected K/V of the sparse layers at the end-to-end rate of the measured "
        "InfiniGen step of the same batch and context; compute: GEMMs (measured dense step "
        "at 32K minus its measured attention) + dense layers' attention + each sparse "
        "layer's measured score, top-k and attend, all from the 32K timings (a lower bound "
        "at 128K); step: the larger of the two (measured: the compute hides behind the "
        "transfer). device "
        "GB: weights + dense layers' K/V + partial keys + two layers' selected rows; "
        "dense needs weights + all K/V (80 GB on the card). break-even: the fraction whose "
        "transfer alone takes the measured dense step.\n\n"
        + report.markdown_table(
            ["batch", "context", "fraction from", "f", "PCIe GB", "transfer ms", "compute ms",
             "step ms", "dense ms", "speed vs dense", "vs full offload", "device GB",
             "dense device GB", "break-even f"], projected),
        f"## The paper's setting on the measured rates ({PAPER_SETTING.name})\n\n"
        "Bytes over PCIe per step at the mean context "
        f"({PAPER_SETTING.mean_context:.0f} tokens), dense layers on the device; full "
        "offloading at the pinned copy rate, InfiniGen at the gather kernel's range. "
        "Transfer only: the paper's A6000 + PCIe 3.0 times are not reproduced.\n\n"
        + report.markdown_table(
            ["fraction from", "f", "full offload GB", "full offload ms", "InfiniGen GB",
             "InfiniGen ms", "bytes ratio", "vs full offload"], paper),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.2],
                        help="selected fractions to project (the accuracy tables' budgets)")
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "gpu_projection")
    args = parser.parse_args(argv)
    fractions = {f"budget {f:g}": f for f in args.fractions}
    paper_fractions = {"paper cap 400 tokens": PAPER_MAX_KV / PAPER_SETTING.mean_context,
                       **fractions}
    measured = measured_rows()
    plugin = plugin_rows(fractions)
    paper = paper_rows(paper_fractions)
    meta = report.source_metadata(inputs=SOURCE)
    settings = {"gpu": asdict(H100), "shape": asdict(H100_SHAPE),
                "measured_steps": [asdict(step) for step in H100_STEPS],
                "dense_layer_ms_32k": H100_DENSE_LAYER_MS_32K,
                "sparse_layer_ms_32k": H100_SPARSE_LAYER_MS_32K,
                "paper_setting": asdict(PAPER_SETTING), "fractions": fractions}
    report.write_results(args.out, meta, "GPU projection from external H100 measurements",
                         settings, {"measured": measured, "plugin": plugin, "paper": paper},
                         sections(measured, plugin, paper))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
