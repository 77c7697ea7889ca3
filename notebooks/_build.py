"""Write the notebooks of this folder from the cells below (keeps them diff-able and output-free).

Usage: python notebooks/_build.py
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import json
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
from tvmfuse.db import open_store
from tvmfuse.inspect import InspectConfig, curves_frame, inspect_database, kernels_frame

store = open_store(DB)
try:
    TARGETS, LABELS = store.targets(), {m["model"] for m in store.models()}
finally:
    store.close()
# the ONNX file that was tuned gives the planner's patterns, calls per kernel and plan bytes; unset, the embedded
# example where the database tuned it (the sample did), else none: patterns from kernel names, one call each
EXAMPLE = Path(tvmfuse.__file__).parent / "data" / "example.onnx"
MODEL = os.environ.get("TVMFUSE_MODEL") or (str(EXAMPLE) if EXAMPLE.stem in LABELS else None)
ARTIFACT = os.environ.get("TVMFUSE_ARTIFACT") or (DB.parent / "example.artifact")
ARTIFACT = Path(ARTIFACT) if Path(ARTIFACT).exists() else None  # run for the end-to-end time
TARGET = os.environ.get("TVMFUSE_TARGET")  # needed only when the database holds several targets
PLOTS = Path(os.environ.get("TVMFUSE_PLOTS", ROOT / "notebooks" / "plots"))
PLOTS.mkdir(parents=True, exist_ok=True)
print("database:", DB, "| model:", MODEL, "| artifact:", ARTIFACT, "| plots ->", PLOTS)
"""

LOAD = """\
def listed(df, n=4):
    # up to n kernel names of df, for the sentences that say what a plot leaves out
    names = [str(x) for x in df["name"]]
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# a database only created so far has nothing to inspect: every cell below then says so instead of plotting
report = inspect_database(InspectConfig(db=DB, target=TARGET, model=MODEL, artifact=ARTIFACT)) if TARGETS else None
kernels = kernels_frame(report or {"kernels": []})
GPU = report is not None and json.loads(report["target"])["kind"] == "cuda"
device = report["device"] if report else "no device"
MEMORY = "HBM" if GPU else "memory"  # a GPU kernel's traffic is to HBM; a CPU's may stay in its caches
tuned = kernels[kernels["best_us"].notna()]
failed_only = kernels[(kernels["trials"] > 0) & kernels["best_us"].isna()]
no_trials = kernels[kernels["trials"] == 0]
if report is None:
    print(f"{DB.name} holds no workloads or records yet: nothing to inspect (tune a model into it first).")
else:
    untuned = report["model"]["untuned"]
    print(f"{len(kernels)} kernel(s) on {device}: {len(tuned)} with a valid record, {len(failed_only)} whose every "
          f"trial failed, {len(no_trials)} without any trial"
          + (f"; {len(untuned)} kernel(s) of the model have no valid record" if untuned else ""))
kernels[["name", "pattern", "trials", "failed", "first_us", "best_us", "speedup", "hbm_bytes", "achieved_gbs",
         "calls"]].rename(columns={"hbm_bytes": f"{MEMORY.lower()}_bytes"})
"""


def short(cell: str) -> str:
    return cell


CURVES = [
    new_markdown_cell("# Tuning curves\n\nBest latency found so far against the number of trials, one line per "
                      "fused kernel, read from the tuning database through `tvmfuse.inspect`. A curve that is "
                      "still falling at its last trial says more trials would pay; a flat one says they would not. "
                      "Kernels without a successfully measured trial have no curve; the cells say which.\n\n"
                      "Set `TVMFUSE_DB` to inspect your own database (default: the sample made by "
                      "`scripts/make_sample_db.py`); `TVMFUSE_PLOTS` chooses where the PNGs go."),
    new_code_cell(SETUP),
    new_code_cell(LOAD),
    new_code_cell("""\
curves = curves_frame(report or {"kernels": []})
# a kernel whose trials all failed (or that has none) has no latency to draw on a log scale
curves = curves[curves["workload_id"].isin(tuned["workload_id"])]
if curves.empty:
    print("Nothing to plot: no kernel has a successfully measured trial yet"
          + (f" ({len(failed_only)} kernel(s) with only failed trials: {listed(failed_only)})" if len(failed_only)
             else "") + ".")
else:
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
    if len(failed_only) or len(no_trials):
        print(f"Not plotted: {len(failed_only)} kernel(s) whose every trial failed"
              + (f" ({listed(failed_only)})" if len(failed_only) else "")
              + f", {len(no_trials)} without any trial" + (f" ({listed(no_trials)})" if len(no_trials) else "") + ".")
"""),
    new_code_cell("""\
df = tuned.dropna(subset=["first_us", "best_us"]).sort_values("speedup")
if df.empty:
    print("Nothing to plot: no kernel has a valid record, so there is no first candidate or best to compare.")
else:
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(df) + 1.5))
    y = range(len(df))
    ax.barh([i + 0.2 for i in y], df["first_us"], height=0.4, label="first candidate", color="#bbbbbb")
    ax.barh([i - 0.2 for i in y], df["best_us"], height=0.4, label="best after tuning", color="#1f77b4")
    for i, (b, s, t) in enumerate(zip(df["best_us"], df["speedup"], df["trials"])):
        ax.text(b, i - 0.2, f" {s:.2f}x in {t} trials", va="center", fontsize=8)
    ax.set_yticks(list(y))
    ax.set_yticklabels(df["name"], fontsize=8)
    ax.set_xlabel("latency (µs)")
    left_out = len(kernels) - len(df)
    ax.set_title(f"First candidate vs best record per fused kernel ({device})"
                 + (f"\\n{left_out} kernel(s) without a valid record left out" if left_out else ""))
    ax.set_xlim(0, max(df["first_us"].max(), df["best_us"].max()) * 1.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "speedup.png", dpi=110)
"""),
]

WHERE = [
    new_markdown_cell("# Where the time goes\n\nA roofline per fused kernel (achieved FLOP/s against arithmetic "
                      "intensity, under the device's bandwidth and compute ceilings where they are known), time by "
                      "fusion pattern against the measured end-to-end time, and the memory traffic (HBM on a GPU) "
                      "each kernel moves fused vs unfused (from the planner). The ceilings come from "
                      "`tvmfuse.inspect.ceilings_for`: measured anchors for the H200, a numpy measurement of this "
                      "machine for records measured on this machine's CPU, none otherwise. Kernels without a valid "
                      "record have no time to plot; the cells say which.\n\nEnvironment: `TVMFUSE_DB`, "
                      "`TVMFUSE_MODEL` (the ONNX file that was tuned), `TVMFUSE_ARTIFACT`, `TVMFUSE_TARGET` (when "
                      "the database holds several), `TVMFUSE_PLOTS`."),
    new_code_cell(SETUP),
    new_code_cell(LOAD),
    new_code_cell("""\
import numpy as np

ceil = report["ceilings"] if report else {}
df = kernels.dropna(subset=["flops_per_byte", "achieved_flops_per_s"])
if df.empty:
    print("Nothing to plot: no kernel has both a valid record and a FLOP count"
          + (f" ({len(kernels)} kernel(s), {len(tuned)} with a valid record)" if len(kernels) else "") + ".")
else:
    fig, (ax, key_ax) = plt.subplots(1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [2.6, 1]})
    lo = min(df["flops_per_byte"].min(), 0.1) / 2
    hi = max(df["flops_per_byte"].max(), 10) * 4
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    bw, peak = ceil.get("bandwidth_gbs"), ceil.get("flops_per_s")
    if bw:
        bw_line = xs * bw * 1e9
        roof = np.minimum(bw_line, peak) if peak else bw_line
        ax.plot(xs, roof / 1e9, color="black", label=f"roofline: {bw:.1f} GB/s"
                + (f", {peak / 1e9:.0f} GFLOP/s" if peak else ""))
    elif peak:
        ax.axhline(peak / 1e9, color="black", label=f"compute ceiling: {peak / 1e9:.0f} GFLOP/s")
    for pattern, g in df.groupby("pattern"):
        ax.scatter(g["flops_per_byte"], g["achieved_flops_per_s"] / 1e9, s=60, label=pattern)
        for _, r in g.iterrows():
            ax.annotate(f"#{r['workload_id']}", (r["flops_per_byte"], r["achieved_flops_per_s"] / 1e9), fontsize=8,
                        xytext=(5, 3), textcoords="offset points")
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel(f"arithmetic intensity (FLOP per byte of traffic to {MEMORY})")
    ax.set_ylabel("achieved GFLOP/s (best record)")
    ax.set_title(f"Roofline of the fused kernels on {device}")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    key = "\\n".join(f"#{r.workload_id} {r.name[:28]}: {r.achieved_gbs:.2f} GB/s, {r.best_us:.0f} µs"
                    for r in df.itertuples())
    key_ax.axis("off")
    key_ax.text(0.0, 1.0, "kernel: achieved bandwidth, best latency\\n" + key, transform=key_ax.transAxes,
                fontsize=7, va="top", family="monospace")
    fig.text(0.01, 0.01, f"traffic to {MEMORY} = inputs read once + outputs written once; "
             f"bandwidth ceiling: {ceil.get('bandwidth_source')}\\ncompute ceiling: {ceil.get('flops_source')}",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(PLOTS / "roofline.png", dpi=110)
    if not bw and not peak:
        print(f"No ceiling is known for {device}: the kernels are plotted without a roofline.")
    if len(kernels) > len(df):
        print(f"Not plotted: {len(kernels) - len(df)} kernel(s) without a valid record or a FLOP count"
              f" ({listed(kernels.drop(df.index))}).")
"""),
    new_code_cell("""\
model = report["model"] if report else {}
timed = kernels.dropna(subset=["total_us"])
if timed.empty:
    print("Nothing to plot: no kernel has a valid record, so there is no kernel time to add up"
          + (f" (the model ran end to end in {model['e2e_ms'] * 1e3:.0f} µs)" if model.get("e2e_ms") is not None
             else "") + ".")
else:
    by_pattern = timed.groupby("pattern")["total_us"].sum().sort_values()
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
for reason in model.get("why", []):
    print("-", reason)
"""),
    new_code_cell("""\
plan = kernels.dropna(subset=["bytes_unfused", "bytes_fused"]).sort_values("bytes_unfused")
totals = (report["model"].get("plan") if report else None) or {}
if plan.empty:
    print("Nothing to plot: "
          + ("no kernel in the database matches a kernel of the model's plan" if totals else
             "the fused and unfused bytes come from the planner: set TVMFUSE_MODEL to the ONNX file that was tuned")
          + (f" (whole model: {totals.get('bytes_unfused', 0) / 1024:.0f} KiB unfused -> "
             f"{totals.get('bytes_fused', 0) / 1024:.0f} KiB fused)" if totals else "") + ".")
else:
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(plan) + 1.8))
    y = np.arange(len(plan))
    ax.barh(y + 0.2, plan["bytes_unfused"] / 1024, height=0.4, color="#bbbbbb",
            label="unfused (one kernel per operator)")
    ax.barh(y - 0.2, plan["bytes_fused"] / 1024, height=0.4, color="#2ca02c", label="fused (this plan)")
    for i, (u, f) in enumerate(zip(plan["bytes_unfused"], plan["bytes_fused"])):
        ratio = u / max(f, 1)
        ax.text(u / 1024, i + 0.2, f" {ratio:.1f}x less traffic" if ratio > 1.05 else " nothing fused",
                va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(plan["name"], fontsize=8)
    ax.set_xlabel(f"traffic to {MEMORY} per call (KiB; each operator's inputs read and outputs written once)")
    ax.set_title(f"Traffic to {MEMORY}, fused vs unfused, per fused kernel"
                 + (f"\\nwhole model: {totals.get('bytes_unfused', 0) / 1024:.0f} KiB -> "
                    f"{totals.get('bytes_fused', 0) / 1024:.0f} KiB, {totals.get('kernels_unfused')} -> "
                    f"{totals.get('kernels_fused')} kernels" if totals else ""))
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(PLOTS / "fused_vs_unfused_bytes.png", dpi=110)
"""),
]


def write(name: str, cells) -> None:
    for i, cell in enumerate(cells):
        cell["id"] = f"{Path(name).stem}-{i}"  # nbformat draws random ids: fixed ones keep a rebuild's diff empty
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}})
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("tuning_curves.ipynb", CURVES)
    write("where_time_goes.ipynb", WHERE)
