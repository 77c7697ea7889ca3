"""Write the notebooks of this folder from the cells below (keeps them diff-able and output-free).

Usage: python notebooks/_build.py
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
import os
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
DB = Path(os.environ.get("TVMFUSE_DB", ROOT / "tuning_logs" / "sample" / "tvmfuse.db"))
if not DB.exists():
    raise FileNotFoundError(f"no tuning database at {DB}: run `python scripts/make_sample_db.py` "
                            "or set TVMFUSE_DB")

import matplotlib
matplotlib.use("Agg")  # files, not windows: the plots are saved as PNG
import matplotlib.pyplot as plt
import pandas as pd

import tvmfuse
from tvmfuse.inspect import InspectConfig, curves_frame, inspect_database, kernels_frame

# the ONNX file that was tuned: gives the planner's patterns, calls per kernel and plan bytes
MODEL = os.environ.get("TVMFUSE_MODEL", str(Path(tvmfuse.__file__).parent / "data" / "example.onnx"))
ARTIFACT = os.environ.get("TVMFUSE_ARTIFACT") or (DB.parent / "example.artifact")
ARTIFACT = Path(ARTIFACT) if Path(ARTIFACT).exists() else None  # run for the end-to-end time
PLOTS = Path(os.environ.get("TVMFUSE_PLOTS", ROOT / "notebooks" / "plots"))
PLOTS.mkdir(parents=True, exist_ok=True)
print("database:", DB, "| model:", MODEL, "| artifact:", ARTIFACT, "| plots ->", PLOTS)
'''

LOAD = '''\
report = inspect_database(InspectConfig(db=DB, model=MODEL, artifact=ARTIFACT))
kernels = kernels_frame(report)
device = report["device"]
kernels[["name", "pattern", "trials", "failed", "first_us", "best_us", "speedup", "hbm_bytes", "achieved_gbs",
         "calls"]]
'''


def short(cell: str) -> str:
    return cell


CURVES = [
    new_markdown_cell("# Tuning curves\n\nBest latency found so far against the number of trials, one line per "
                      "fused kernel, read from the tuning database through `tvmfuse.inspect`. A curve that is "
                      "still falling at its last trial says more trials would pay; a flat one says they would not.\n\n"
                      "Set `TVMFUSE_DB` to inspect your own database (default: the sample made by "
                      "`scripts/make_sample_db.py`); `TVMFUSE_PLOTS` chooses where the PNGs go."),
    new_code_cell(SETUP),
    new_code_cell(LOAD),
    new_code_cell('''\
curves = curves_frame(report)
fig, ax = plt.subplots(figsize=(9, 5))
for (wid, name), g in curves.groupby(["workload_id", "name"], sort=False):
    line, = ax.plot(g["trial"], g["best_us"], marker="o", label=f"{name} (#{wid})")
    ok = g[~g["failed"]]
    ax.scatter(ok["trial"], ok["latency_us"], color=line.get_color(), marker="x", alpha=0.5)
    bad = g[g["failed"]]
    if len(bad):
        ax.scatter(bad["trial"], [g["best_us"].max()] * len(bad), color="red", marker="v")
ax.set_yscale("log")
ax.set_xlabel("trial (in commit order)")
ax.set_ylabel("latency (µs, log scale)")
ax.set_title(f"Tuning curves: best latency so far per fused kernel\\n{DB.name} on {device}")
ax.xaxis.get_major_locator().set_params(integer=True)
handles, labels = ax.get_legend_handles_labels()
from matplotlib.lines import Line2D
handles += [Line2D([], [], color="grey", marker="x", linestyle="", label="one trial's latency"),
            Line2D([], [], color="red", marker="v", linestyle="", label="failed trial")]
ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
fig.savefig(PLOTS / "tuning_curves.png", dpi=110)
'''),
    new_code_cell('''\
df = kernels.sort_values("speedup")
fig, ax = plt.subplots(figsize=(9, 0.5 * len(df) + 1.5))
y = range(len(df))
ax.barh([i + 0.2 for i in y], df["first_us"], height=0.4, label="first candidate", color="#bbbbbb")
ax.barh([i - 0.2 for i in y], df["best_us"], height=0.4, label="best after tuning", color="#1f77b4")
for i, (b, s, t) in enumerate(zip(df["best_us"], df["speedup"], df["trials"])):
    ax.text(b, i - 0.2, f" {s:.2f}x in {t} trials", va="center", fontsize=8)
ax.set_yticks(list(y))
ax.set_yticklabels(df["name"], fontsize=8)
ax.set_xlabel("latency (µs)")
ax.set_title(f"First candidate vs best record per fused kernel ({device})")
ax.set_xlim(0, max(df["first_us"].max(), df["best_us"].max()) * 1.3)
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
fig.tight_layout()
fig.savefig(PLOTS / "speedup.png", dpi=110)
'''),
]

WHERE = [
    new_markdown_cell("# Where the time goes\n\nA roofline per fused kernel (achieved FLOP/s against arithmetic "
                      "intensity, under the device's bandwidth and compute ceilings), time by fusion pattern against "
                      "the measured end-to-end time, and the HBM bytes each kernel moves fused vs unfused (from the "
                      "planner). The ceilings come from `tvmfuse.inspect.ceilings_for`: measured anchors for the "
                      "H200, a numpy measurement of this machine for a CPU.\n\nEnvironment: `TVMFUSE_DB`, "
                      "`TVMFUSE_MODEL` (the ONNX file that was tuned), `TVMFUSE_ARTIFACT`, `TVMFUSE_PLOTS`."),
    new_code_cell(SETUP),
    new_code_cell(LOAD),
    new_code_cell('''\
import numpy as np

ceil = report["ceilings"]
df = kernels.dropna(subset=["flops_per_byte", "achieved_flops_per_s"])
fig, (ax, key_ax) = plt.subplots(1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [2.6, 1]})
lo = min(df["flops_per_byte"].min(), 0.1) / 2 if len(df) else 0.05
hi = max(df["flops_per_byte"].max(), 10) * 4 if len(df) else 100
xs = np.logspace(np.log10(lo), np.log10(hi), 200)
if ceil["bandwidth_gbs"]:
    bw_line = xs * ceil["bandwidth_gbs"] * 1e9
    roof = np.minimum(bw_line, ceil["flops_per_s"]) if ceil["flops_per_s"] else bw_line
    ax.plot(xs, roof / 1e9, color="black", label=f"roofline: {ceil['bandwidth_gbs']:.1f} GB/s"
            + (f", {ceil['flops_per_s'] / 1e9:.0f} GFLOP/s" if ceil["flops_per_s"] else ""))
for pattern, g in df.groupby("pattern"):
    ax.scatter(g["flops_per_byte"], g["achieved_flops_per_s"] / 1e9, s=60, label=pattern)
    for _, r in g.iterrows():
        ax.annotate(f"#{r['workload_id']}", (r["flops_per_byte"], r["achieved_flops_per_s"] / 1e9), fontsize=8,
                    xytext=(5, 3), textcoords="offset points")
ax.set_xscale("log"); ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
ax.set_ylabel("achieved GFLOP/s (best record)")
ax.set_title(f"Roofline of the fused kernels on {device}")
ax.legend(fontsize=8, loc="upper left")
ax.grid(True, which="both", alpha=0.3)
key = "\\n".join(f"#{r.workload_id} {r.name[:28]}: {r.achieved_gbs:.2f} GB/s, {r.best_us:.0f} µs"
                for r in df.itertuples())
key_ax.axis("off")
key_ax.text(0.0, 1.0, "kernel: achieved bandwidth, best latency\\n" + key, transform=key_ax.transAxes,
            fontsize=7, va="top", family="monospace")
fig.text(0.01, 0.01, "traffic = inputs read once + outputs written once; "
         f"bandwidth ceiling: {ceil['bandwidth_source']}\\ncompute ceiling: {ceil['flops_source']}", fontsize=7)
fig.tight_layout(rect=(0, 0.05, 1, 1))
fig.savefig(PLOTS / "roofline.png", dpi=110)
'''),
    new_code_cell('''\
by_pattern = kernels.groupby("pattern")["total_us"].sum().sort_values()
model = report["model"]
fig, ax = plt.subplots(figsize=(9, 4.5))
bars = ax.barh(by_pattern.index, by_pattern.values, color="#1f77b4", label="tuned kernel time (best × calls)")
ax.bar_label(bars, fmt="%.0f µs", fontsize=8, padding=2)
if model.get("e2e_ms") is not None:
    ax.axvline(model["e2e_ms"] * 1e3, color="red", linestyle="--",
               label=f"measured end to end: {model['e2e_ms'] * 1e3:.0f} µs")
ax.axvline(model["kernel_sum_ms"] * 1e3, color="grey", linestyle=":",
           label=f"sum of all kernels: {model['kernel_sum_ms'] * 1e3:.0f} µs")
ax.set_xlabel("time per inference (µs)")
ax.set_ylabel("fusion pattern")
ax.set_title(f"Time by fusion pattern: {model['name'] or 'all kernels'} on {device}")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(PLOTS / "time_by_pattern.png", dpi=110)
for reason in model["why"]:
    print("-", reason)
'''),
    new_code_cell('''\
plan = kernels.dropna(subset=["bytes_unfused", "bytes_fused"]).sort_values("bytes_unfused")
fig, ax = plt.subplots(figsize=(9, 0.5 * max(len(plan), 1) + 1.8))
y = np.arange(len(plan))
ax.barh(y + 0.2, plan["bytes_unfused"] / 1024, height=0.4, color="#bbbbbb", label="unfused (one kernel per operator)")
ax.barh(y - 0.2, plan["bytes_fused"] / 1024, height=0.4, color="#2ca02c", label="fused (this plan)")
for i, (u, f) in enumerate(zip(plan["bytes_unfused"], plan["bytes_fused"])):
    ratio = u / max(f, 1)
    ax.text(u / 1024, i + 0.2, f" {ratio:.1f}x less traffic" if ratio > 1.05 else " nothing fused", va="center",
            fontsize=7)
ax.set_yticks(y)
ax.set_yticklabels(plan["name"], fontsize=8)
ax.set_xlabel("memory traffic per call (KiB; each operator's inputs read and outputs written once)")
totals = report["model"].get("plan") or {}
ax.set_title("Memory traffic, fused vs unfused, per fused kernel"
             + (f"\\nwhole model: {totals.get('bytes_unfused', 0) / 1024:.0f} KiB -> "
                f"{totals.get('bytes_fused', 0) / 1024:.0f} KiB, {totals.get('kernels_unfused')} -> "
                f"{totals.get('kernels_fused')} kernels" if totals else ""))
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(PLOTS / "fused_vs_unfused_bytes.png", dpi=110)
'''),
]


def write(name: str, cells) -> None:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}})
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("tuning_curves.ipynb", CURVES)
    write("where_time_goes.ipynb", WHERE)
