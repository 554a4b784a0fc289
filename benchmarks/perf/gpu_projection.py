# SPDX-License-Identifier: Apache-2.0
"""A projection on paper: InfiniGen's decode step on a GPU, from bytes moved per step.

python -m benchmarks.perf.gpu_projection [--fractions 0.118 0.2] [--out PATH]

The paper's speed setting (OPT-13B, fp16, batch 20, 1,920-token prompts + 128
generated, RTX A6000 with PCIe 3.0 x16) is turned into bytes per decode step
for four ways to run it, and bytes into time with published bandwidths:

- dense in HBM: weights and every layer's K/V read from device memory (does
  not fit at batch 20 in 48 GB; shown as the lower bound);
- full offloading (FlexGen with the cache on the CPU, as the artifact's
  ``--percent 100 0 0 100 100 0``): all K/V crosses PCIe every step;
- InfiniGen offloaded: the dense layers' K/V and the selected fraction of the
  sparse layers' K/V cross PCIe; the partial keys (r of the key channels,
  r/2 of K+V) stay in device memory and are read every step;
- InfiniGen in HBM: the same selection with the K/V resident (no offloading):
  sparse attention only.

Step time = weights / HBM bandwidth (decode GEMMs at batch <= 20 are
memory-bound) + bytes over PCIe / PCIe bandwidth + other device reads / HBM
bandwidth, either summed (no overlap; the artifact runs ``--overlap false``)
or as the larger of transfer and device time (perfect overlap). Selected
fractions come from our measurements (``--fractions``, and the
``selected_fraction`` of InfiniGen rows in ``benchmarks/results/decode_latency*.json``).
Writes ``benchmarks/results/gpu_projection.{json,md}``; the reasoning is in
``benchmarks/GPU_PROJECTION.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import paths, report


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

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.hidden * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def mean_context(self) -> float:
        """Context of the average decode step: the prompt plus half the generated tokens."""
        return self.prompt + self.generated / 2


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float  # device memory bandwidth (peak, as published)
    pcie_bytes_per_s: float  # host -> device, effective
    memory_bytes: float


# OPT-13B: 40 layers, hidden 5120, 40 heads x 128, 12.85e9 parameters (fp16).
PAPER_SETTING = Setting(name="OPT-13B, batch 20, 1920 + 128 tokens", layers=40, hidden=5120,
                        params=12.85e9, dtype_bytes=2, batch=20, prompt=1920, generated=128)
HARDWARE = {
    "A6000 + PCIe 3.0 x16": Hardware("A6000 + PCIe 3.0 x16", 768e9, 12.5e9, 48e9),
    "A6000 + PCIe 4.0 x16": Hardware("A6000 + PCIe 4.0 x16", 768e9, 25e9, 48e9),
    "A100-80GB + PCIe 4.0 x16": Hardware("A100-80GB + PCIe 4.0 x16", 2.0e12, 25e9, 80e9),
    "H100-SXM + PCIe 5.0 x16": Hardware("H100-SXM + PCIe 5.0 x16", 3.35e12, 50e9, 80e9),
}
# The paper's cap: at most 400 KV entries per head (--max-num-kv 400).
PAPER_MAX_KV = 400


def kv_bytes(setting: Setting, context: float, layers: int | None = None) -> float:
    """K/V bytes of the whole batch at ``context`` tokens, over ``layers`` (default all)."""
    layers = setting.layers if layers is None else layers
    return setting.batch * context * layers * setting.kv_bytes_per_token_layer


def infinigen_step_bytes(setting: Setting, context: float,
                         selected_fraction: float) -> dict[str, float]:
    """Bytes one InfiniGen decode step moves, by path.

    - ``pcie``: selected K/V of the sparse layers, host pool -> device;
    - ``pcie_dense_layers``: the dense layers' full K/V (kept in the pool too);
    - ``hbm_partial``: partial keys, r of K = r/2 of K+V, of every sparse layer
      and context token, read on the device to speculate;
    - ``hbm_fetched``: the transferred K/V, read again by the attention.
    """
    sparse = setting.layers - setting.dense_layers
    sparse_full = kv_bytes(setting, context, sparse)
    pcie = selected_fraction * sparse_full
    dense = kv_bytes(setting, context, setting.dense_layers)
    return {"pcie": pcie, "pcie_dense_layers": dense,
            "hbm_partial": setting.partial_ratio / 2 * sparse_full,
            "hbm_fetched": pcie + dense}


def transfer_seconds(num_bytes: float, bytes_per_s: float) -> float:
    return num_bytes / bytes_per_s


def step_times(setting: Setting, hw: Hardware, selected_fraction: float,
               context: float | None = None) -> dict[str, float]:
    """Seconds per decode step of each scheme (no overlap and perfect overlap)."""
    context = setting.mean_context if context is None else context
    weights = transfer_seconds(setting.weight_bytes, hw.hbm_bytes_per_s)
    full = kv_bytes(setting, context)
    parts = infinigen_step_bytes(setting, context, selected_fraction)
    sparse_full = kv_bytes(setting, context, setting.layers - setting.dense_layers)
    dense_layers = parts["pcie_dense_layers"]
    pcie_inf = transfer_seconds(parts["pcie"] + dense_layers, hw.pcie_bytes_per_s)
    device_inf = weights + transfer_seconds(parts["hbm_partial"] + parts["hbm_fetched"],
                                            hw.hbm_bytes_per_s)
    pcie_full = transfer_seconds(full, hw.pcie_bytes_per_s)
    device_full = weights + transfer_seconds(full, hw.hbm_bytes_per_s)
    in_hbm_sparse = (dense_layers + (setting.partial_ratio / 2 + selected_fraction)
                     * sparse_full)
    return {
        "dense_in_hbm": device_full,
        "full_offload": pcie_full + device_full,
        "full_offload_overlap": max(pcie_full, device_full),
        "infinigen_offload": pcie_inf + device_inf,
        "infinigen_offload_overlap": max(pcie_inf, device_inf),
        "infinigen_in_hbm": weights + transfer_seconds(in_hbm_sparse, hw.hbm_bytes_per_s),
    }


def max_dense_batch(setting: Setting, hw: Hardware, reserve_bytes: float = 2e9) -> int:
    """Largest batch whose weights + full K/V (prompt + generated) fit in device memory."""
    per_request = (setting.prompt + setting.generated) * setting.layers \
        * setting.kv_bytes_per_token_layer
    return max(0, int((hw.memory_bytes - setting.weight_bytes - reserve_bytes) // per_request))


def dense_throughput_at_max_batch(setting: Setting, hw: Hardware) -> float:
    """Tokens/s of dense attention in HBM at the largest batch that fits (0 if none)."""
    batch = min(setting.batch, max_dense_batch(setting, hw))
    if batch == 0:
        return 0.0
    smaller = dataclasses.replace(setting, batch=batch)
    return batch / step_times(smaller, hw, selected_fraction=1.0)["dense_in_hbm"]


def measured_fractions(results: Path = paths.RESULTS) -> dict[str, float]:
    """Mean selected fraction of InfiniGen rows in our decode-latency results, per file."""
    out = {}
    for path in sorted(results.glob("decode_latency*.json")):
        data = json.loads(path.read_text())
        rows = data.get("results") or data.get("rows") or []
        values = [row["selected_fraction"] for row in rows
                  if row.get("policy", "infinigen") == "infinigen"
                  and row.get("selected_fraction") is not None
                  and row.get("config", "").startswith("infinigen")]
        if values:
            out[path.stem] = statistics.fmean(values)
    return out


def projection(fractions: dict[str, float], setting: Setting = PAPER_SETTING) -> list[dict]:
    rows = []
    for hw in HARDWARE.values():
        for label, fraction in fractions.items():
            times = step_times(setting, hw, fraction)
            rows.append({
                "hardware": hw.name, "fraction_source": label, "selected_fraction": fraction,
                **{f"{k}_ms": 1000 * v for k, v in times.items()},
                "speedup_vs_full_offload": times["full_offload"] / times["infinigen_offload"],
                "speedup_vs_full_offload_overlap":
                    times["full_offload_overlap"] / times["infinigen_offload_overlap"],
                "speedup_vs_dense_in_hbm": times["dense_in_hbm"] / times["infinigen_offload"],
                "in_hbm_speedup_vs_dense_in_hbm":
                    times["dense_in_hbm"] / times["infinigen_in_hbm"],
                "max_dense_batch": max_dense_batch(setting, hw),
                "infinigen_offload_tokens_per_s": setting.batch / times["infinigen_offload"],
                "dense_in_hbm_max_batch_tokens_per_s": dense_throughput_at_max_batch(setting, hw),
            })
    return rows


def sections(rows: list[dict], setting: Setting) -> list[str]:
    table = [[r["hardware"], r["fraction_source"], f"{r['selected_fraction']:.3f}",
              f"{r['dense_in_hbm_ms']:.0f}", f"{r['full_offload_ms']:.0f}",
              f"{r['infinigen_offload_ms']:.0f}", f"{r['speedup_vs_full_offload']:.2f}",
              f"{r['speedup_vs_full_offload_overlap']:.2f}",
              f"{r['speedup_vs_dense_in_hbm']:.2f}", f"{r['infinigen_in_hbm_ms']:.0f}",
              f"{r['in_hbm_speedup_vs_dense_in_hbm']:.2f}", str(r["max_dense_batch"]),
              f"{r['dense_in_hbm_max_batch_tokens_per_s']:.0f}",
              f"{r['infinigen_offload_tokens_per_s']:.0f}"]
             for r in rows]
    full = kv_bytes(setting, setting.mean_context)
    return [
        f"Setting: {setting.name}; {setting.layers} layers, hidden {setting.hidden}, "
        f"fp16 K/V = {setting.kv_bytes_per_token_layer} B per token and layer; mean "
        f"decode context {setting.mean_context:.0f}; full K/V of the batch "
        f"{full / 1e9:.1f} GB; weights {setting.weight_bytes / 1e9:.1f} GB; "
        f"{setting.dense_layers} dense layers, r = {setting.partial_ratio}.",
        "## Decode step (ms) and speed-ups\n\n" + report.markdown_table(
            ["hardware", "selected fraction from", "f", "dense in HBM", "full offload",
             "InfiniGen offload", "vs full offload", "vs full offload (overlap)",
             "vs dense in HBM", "InfiniGen in HBM", "in-HBM vs dense in HBM",
             "max dense batch in memory", "dense tok/s at that batch",
             f"InfiniGen offload tok/s at batch {setting.batch}"], table),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="*", default=[],
                        help="extra selected fractions to project")
    parser.add_argument("--out", type=Path, default=paths.RESULTS / "gpu_projection")
    args = parser.parse_args(argv)
    setting = PAPER_SETTING
    fractions = {"paper cap 400 tokens": PAPER_MAX_KV / setting.mean_context}
    fractions.update({f"measured: {k}": v for k, v in measured_fractions().items()})
    fractions.update({f"given {f}": f for f in args.fractions})
    rows = projection(fractions, setting)
    meta: dict[str, Any] = report.run_metadata(
        setting=asdict(setting), hardware={k: asdict(v) for k, v in HARDWARE.items()})
    report.write_results(args.out, meta, "GPU projection (on paper)", {"fractions": fractions},
                         rows, sections(rows, setting))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
