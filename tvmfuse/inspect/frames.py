"""The inspect report as pandas DataFrames, for notebooks (pandas is imported only here, on use)."""
from __future__ import annotations


def kernels_frame(report: dict):
    """One row per fused kernel: name, pattern, trials, first/best latency (µs), bytes, GB/s, FLOP/s, calls."""
    import pandas as pd

    cols = ["workload_id", "name", "pattern", "pattern_source", "trials", "failed", "first_ms", "best_ms",
            "speedup", "best_trial", "trials_to_90pct", "hbm_bytes", "achieved_gbs", "bandwidth_share", "flops",
            "achieved_flops_per_s", "flops_share", "flops_per_byte", "bound", "bytes_unfused", "bytes_fused",
            "calls", "total_ms"]
    df = pd.DataFrame([{c: k.get(c) for c in cols} for k in report["kernels"]], columns=cols)
    df["first_us"] = df["first_ms"] * 1e3
    df["best_us"] = df["best_ms"] * 1e3
    df["total_us"] = df["total_ms"] * 1e3
    return df


def curves_frame(report: dict):
    """One row per trial: kernel, trial number (1-based, commit order), latency (µs, NaN if failed), best so far."""
    import numpy as np
    import pandas as pd

    rows = []
    for k in report["kernels"]:
        best = np.inf
        for i, ms in enumerate(k["trial_ms"], start=1):
            us = np.nan if ms is None else ms * 1e3
            if not np.isnan(us):
                best = min(best, us)
            rows.append({"workload_id": k["workload_id"], "name": k["name"], "pattern": k["pattern"], "trial": i,
                         "latency_us": us, "failed": ms is None, "best_us": np.nan if np.isinf(best) else best})
    return pd.DataFrame(rows, columns=["workload_id", "name", "pattern", "trial", "latency_us", "failed", "best_us"])
