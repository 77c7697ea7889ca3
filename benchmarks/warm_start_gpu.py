#!/usr/bin/env python3
"""Whole-model warm start (issue 20): how soon a model tunes to 90% of its final speed with a database that another
model filled, against a fresh database.

Three ``tvmfuse tune`` runs of full-size ``scripts/model_zoo.py`` exports, each for ``--budget`` seconds:
1. ``first`` (default ResNet-50) into ``warm.db``;
2. ``cold``: ``then`` (default ResNet-34) into a fresh ``cold.db``;
3. ``warm``: ``then`` into a copy of ``warm.db`` (its records of ``first`` train the cost model before the first
   trial, choose the templates' defaults, and answer the kernels both models share).

Each run's speed over its wall-clock time is read from its database: the model's estimated time at ``t`` is the sum
over its kernels (tune's report: workload and calls) of calls x the fastest record created by ``t``; a kernel with
no record yet leaves the model without an estimate (infinite), since nothing says how fast it will run until its
first schedule has been measured; records older than the run count from its start. "Final" is the cold run's
estimate at its end. Reported per run: seconds to reach 90% and 95% of the final speed (and 90% of the run's own
final estimate: the same schedule measured in another run differs by a few percent), the estimate at the end,
and the kernels that had records before the run; and warm's seconds to 90% as a share of the cold run's whole
tuning time (the issue's goal: at most 25%). The estimate sums kernels as tuned, not the compiled model's
measured time (launch gaps and caches aside).

Resumable across calls of at most 10 minutes: ``$OUT/warm_start.json`` (carried back in with ``--results``) and
the databases beside it (``--state DIR``, carried in) keep the runs already made; a run that would not end before
``--deadline-s`` is left for the next call.

    python benchmarks/warm_start_gpu.py --first resnet50 --then resnet34 --budget 240 --precision fp16
    python benchmarks/warm_start_gpu.py --state carried/ --results carried/warm_start.json   # the next call
    python benchmarks/warm_start_gpu.py --target llvm --size small --budget 60   # this machine's CPU (a smoke test)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_gpu import _cli, _export  # noqa: E402 - the zoo's export and the CLI in its own session

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="warm_start-"))
RUNS = ("first", "cold", "warm")


def _workload_ids(db: Path, hashes: list[str]) -> dict[str, list[int]]:
    """Tune's report names a kernel by its workload's structural hash (hex); the database keeps it in decimal."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        rows = c.execute("SELECT id, shash FROM workloads").fetchall()
    by_hash: dict[int, list[int]] = {}
    for wid, shash in rows:
        by_hash.setdefault(int(shash) % (1 << 64), []).append(wid)
    return {h: by_hash.get(int(h, 16) % (1 << 64), []) for h in hashes}


def record_events(db: Path, kernels: list[dict], start: float, end: float) -> list[list[tuple[float, float]]]:
    """Per kernel (tune's report entries: ``workload_hash``), its records' [(seconds since ``start``, ms)]."""
    ids = _workload_ids(db, [k["workload_hash"] for k in kernels])
    events: list[list[tuple[float, float]]] = []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        for k in kernels:
            events.append(sorted((max(created - start, 0.0), secs * 1e3) for wid in ids[k["workload_hash"]]
                                 for created, secs in c.execute(
                                     "SELECT created, mean_secs FROM records WHERE workload_id=? AND failed=0 AND "
                                     "mean_secs IS NOT NULL AND created<=?", (wid, end))))
    return events


def speed_curve(kernels: list[dict], events: list[list[tuple[float, float]]],
                keep: set[str] | None = None) -> list[tuple[float, float]]:
    """[(seconds, the model's estimated ms)] at each record that lowers the estimate, from the moment every kernel
    (of ``keep``'s workload hashes, when given) has one."""
    picked = [i for i, k in enumerate(kernels) if keep is None or k["workload_hash"] in keep]
    best = {i: math.inf for i in picked}
    curve: list[tuple[float, float]] = []
    for t, i, ms in sorted((t, i, ms) for i in picked for t, ms in events[i]):
        if ms < best[i]:
            best[i] = ms
            total = sum(kernels[j]["weight"] * b for j, b in best.items())
            if math.isfinite(total):
                if curve and curve[-1][0] == t:
                    curve[-1] = (t, total)
                else:
                    curve.append((t, total))
    return curve


def reach(curve: list[tuple[float, float]], target_ms: float) -> float | None:
    """The first moment the estimate is at most ``target_ms`` (None: never)."""
    return next((t for t, ms in curve if ms <= target_ms * (1 + 1e-9)), None)


def run(name: str, model: str, db: Path, args, deadline: float, work: Path) -> dict:
    onnx_path, shapes = _export(model, args.size, args.batch, args.seq, work)
    bound = [a for s in shapes for a in ("--input-shape", s)]
    start = time.time()
    rc, rep, err = _cli("tune", onnx_path, *bound, "--target", args.target, "--db", str(db), "--time-budget",
                        str(args.budget), "--precision", args.precision, "--keep-going",
                        timeout=max(min(args.budget + 240, deadline - time.time()), 1))
    end = time.time()
    row = {"run": name, "model": model, "rc": rc, "tune_s": end - start, "start": start, "end": end}
    if rep is None:
        return {**row, "error": err}
    kernels = [{"name": k["name"], "workload_hash": k["workload_hash"], "weight": k["weight"],
                "status": k["status"], "had_records": k.get("best_before_ms") is not None}
               for k in rep.get("kernels", [])]
    return {**row, "kernels": kernels, "cost_model": rep.get("cost_model"),
            "status": {s: sum(1 for k in kernels if k["status"] == s) for s in {k["status"] for k in kernels}},
            "events": record_events(db, kernels, start, end)}


def summary(rows: dict) -> dict:
    cold, warm = rows.get("cold"), rows.get("warm")
    if not (cold and warm and cold.get("events") is not None and warm.get("events") is not None):
        return {}
    # a kernel that one of the two runs never reached (its time budget spent first) runs its untuned default there;
    # no record says how fast that is, so the estimate compares the kernels both runs measured and names the rest
    def measured(r):
        return {k["workload_hash"] for k, ev in zip(r["kernels"], r["events"]) if ev}
    both = measured(cold) & measured(warm)
    curves = {r["run"]: speed_curve(r["kernels"], r["events"], both) for r in (cold, warm)}
    if not curves["cold"] or not curves["warm"]:
        return {}
    final = curves["cold"][-1][1]
    out = {"final_ms": final, "kernels_compared": len(both),
           "left_out": sorted({k["name"] for r in (cold, warm) for k in r["kernels"]
                               if k["workload_hash"] not in both})}
    for r in (cold, warm):
        curve = curves[r["run"]]
        end = curve[-1][1]
        out[r["run"]] = {"t90_s": reach(curve, final / 0.9), "t95_s": reach(curve, final / 0.95),
                         "t90_own_s": reach(curve, end / 0.9), "end_ms": end, "tune_s": r["tune_s"],
                         "kernels": len(r["kernels"]), "had_records": sum(k["had_records"] for k in r["kernels"]),
                         "curve": curve}
    t90 = out["warm"]["t90_s"]
    out["warm_t90_over_cold_tune"] = None if t90 is None else t90 / cold["tune_s"]
    # (against its own end: a schedule measured again in another run differs by a few percent)
    own = out["warm"]["t90_own_s"]
    out["warm_t90_own_over_cold_tune"] = None if own is None else own / cold["tune_s"]
    return out


def _fmt(v, spec: str = ".1f") -> str:
    return "never" if v is None else format(v, spec)


def _save(args, done: dict) -> dict:
    """``$OUT/warm_start.json`` with the runs so far and their summary (returned)."""
    res = summary(done)
    (OUT / "warm_start.json").write_text(json.dumps({"args": vars(args) | {"state": None, "results": None},
                                                     "runs": done, "summary": res}, indent=1, default=str))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first", default="resnet50")
    ap.add_argument("--then", default="resnet34")
    ap.add_argument("--size", default="full", choices=("small", "full"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--budget", type=float, default=240.0, help="each run's --time-budget, seconds")
    ap.add_argument("--state", type=Path, default=None, help="a folder carried in: its warm.db / cold.db")
    ap.add_argument("--results", type=Path, default=None, help="an earlier warm_start.json carried in")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.deadline_s
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ("warm.db", "cold.db"):
        if args.state and (args.state / name).exists() and not (OUT / name).exists():
            shutil.copy(args.state / name, OUT / name)
    done = json.loads(args.results.read_text()).get("runs", {}) if args.results and args.results.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="warm_start-onnx-"))
    for name in RUNS:
        if name in done and "error" not in done[name]:
            continue
        if time.time() + args.budget + 120 > deadline:
            print(f"[warm_start] {name}: left for the next call (would end past the deadline)", flush=True)
            break
        db = OUT / ("cold.db" if name == "cold" else "warm.db")
        if name == "warm":   # a copy: warm.db keeps only the first model's records for a rerun
            shutil.copy(OUT / "warm.db", OUT / "warm-then.db")
            db = OUT / "warm-then.db"
        model = args.first if name == "first" else args.then
        print(f"[warm_start] {name}: tuning {model} for {args.budget:.0f} s", flush=True)
        done[name] = run(name, model, db, args, deadline, work)
        _save(args, done)
    res = _save(args, done)
    print(f"{'run':<6} {'model':<14} {'tune s':>7} {'kernels':>8} {'had records':>12} {'t90 s':>7} {'t95 s':>7} "
          f"{'t90 own':>8} {'end ms':>9}")
    for name in RUNS:
        r = done.get(name)
        if not r:
            continue
        s = res.get(name)   # (none for the first model's run, or before both runs of the second: no reference)
        t90, t95, own = (_fmt(s[k]) for k in ("t90_s", "t95_s", "t90_own_s")) if s else ("-",) * 3
        print(f"{name:<6} {r['model']:<14} {r['tune_s']:>7.0f} {len(r.get('kernels', [])):>8} "
              f"{s['had_records'] if s else '-':>12} {t90:>7} {t95:>7} {own:>8} "
              f"{_fmt(s['end_ms'] if s else None, '.3f'):>9}" + (f"  {r['error']}" if r.get("error") else ""))
    if res:
        print(f"kernels compared: {res['kernels_compared']}; left out (a run never reached them): "
              f"{', '.join(res['left_out']) or 'none'}")
        print(f"warm's time to 90% of the cold final ({res['final_ms']:.3f} ms) / cold's tuning time: "
              f"{_fmt(res['warm_t90_over_cold_tune'], '.2f')}; to 90% of its own final: "
              f"{_fmt(res['warm_t90_own_over_cold_tune'], '.2f')} (goal <= 0.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
