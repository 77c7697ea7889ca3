"""Check real models on the GPU kernel by kernel: which fused kernel first computes something wrong.

    python scripts/gpu_model_check.py MODEL.onnx [MODEL.onnx ...] [--tune-seconds 0] [--db PATH] [--out DIR]

For each model: partition for the GPU, build it untuned (and, with ``--tune-seconds``, tuned into ``--db``),
run it on the model's ``<stem>.inputs.npz`` (random inputs where there is none) and compare with
onnxruntime. Then the same partitioned module is built for llvm (TVM's plain lowering of every kernel, the
reference semantics of each fused kernel) and both builds run under a VM instrument that keeps every kernel
call's outputs: each CUDA kernel call is compared with the llvm call of the same kernel and occurrence, so the
first kernel that goes wrong, its schedule source and its error are named. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _inputs(model_path: Path, specs) -> dict:
    from tvmfuse import verify

    npz = model_path.with_name(model_path.name.split(".")[0] + ".inputs.npz")
    return verify.load_inputs(npz, specs) if npz.exists() else verify.random_inputs(specs, seed=0)


def _trace(executable, dev, args) -> tuple[list, list]:
    """Run ``main`` keeping each kernel call's last argument (its output, destination-passing) as numpy."""
    from tvmfuse._tvm import relax, tvm

    vm = relax.VirtualMachine(executable, dev)
    calls: list = []

    def instrument(func, name, before_run, ret, *call_args):
        if not before_run and call_args and name not in ("vm.builtin.alloc_storage",):
            last = call_args[-1]
            if isinstance(last, tvm.runtime.Tensor):
                calls.append((str(name), last.numpy().copy()))
        return 0

    vm.set_instrument(instrument)
    out = vm["main"](*args)
    outs = [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]
    return calls, outs


def _time_ms(executable, dev, args) -> float:
    """Median ms of one call: 10 samples, each the mean of 20 back-to-back calls (METHOD: TVM's time_evaluator)."""
    from tvmfuse.bench import time_vm
    from tvmfuse._tvm import relax

    vm = relax.VirtualMachine(executable, dev)
    return float(np.median(time_vm(vm, args, dev, repeat=10, number=20))) * 1e3


def _profile(executable, dev, args, top: int = 5) -> list:
    """The ``top`` kernels by time in one call: each kernel call timed on the host between device syncs (so a
    figure includes one launch, a few microseconds); TVM 0.27's Relax VM has no profiler of its own."""
    import time as _time

    from tvmfuse._tvm import relax

    vm = relax.VirtualMachine(executable, dev)
    per: dict = {}
    start: list = [0.0]

    def instrument(func, name, before_run, ret, *call_args):
        if str(name).startswith("vm.builtin"):
            return 0
        dev.sync()
        if before_run:
            start[0] = _time.perf_counter()
        else:
            per[str(name)] = per.get(str(name), 0.0) + (_time.perf_counter() - start[0]) * 1e6
        return 0

    vm["main"](*args)
    vm.set_instrument(instrument)
    vm["main"](*args)
    return sorted(([n, round(t, 1)] for n, t in per.items()), key=lambda x: -x[1])[:top]


_WEIGHTS: dict = {}   # id(build) -> its weights on the device, made once


def _args(built, loaded, feeds, dev):
    """Fresh input tensors and the build's weights, the same tensors every call: a CUDA graph captures the
    weights' addresses (the parameters after ``num_input``), so weights copied anew for each call would be read
    from freed memory on the next replay (as the runtime's LoadedArtifact does, keep them)."""
    from tvmfuse._tvm import tvm

    ins = [tvm.runtime.tensor(np.ascontiguousarray(feeds[s.name].astype(s.dtype)), dev) for s in loaded.inputs]
    key = (id(built), str(dev))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = (built, [tvm.runtime.tensor(p.numpy(), dev) for p in built.lifted_params])
    return ins + _WEIGHTS[key][1]


def check_model(path: Path, *, tune_seconds: float, db_path: Path | None, precision: str = "model",
                profile: bool = False) -> list[dict]:
    from tvmfuse import verify
    from tvmfuse._tvm import relax, tvm
    from tvmfuse.compile import build
    from tvmfuse.db import open_database
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.frontend.precision import TOLERANCE as PRECISION_TOLERANCE
    from tvmfuse.plan.partition import DEFAULT_PLANNER, partition
    from tvmfuse.target import resolve_target
    from tvmfuse.tune import TuneConfig, extract_kernels, tune_kernels

    loaded = load_model(path, precision=precision)
    feeds = _inputs(path, loaded.inputs)
    feeds = {s.name: np.ascontiguousarray(feeds[s.name].astype(s.dtype)) for s in loaded.inputs}
    refs = verify.run_onnxruntime(loaded.path, feeds)
    target = resolve_target("cuda")
    mod = import_model(loaded)
    fused, _plan = partition(mod, target=target, planner=DEFAULT_PLANNER)
    cpu = resolve_target("llvm")
    ref_build = build(fused, target=cpu, database=None)
    ref_calls, ref_outs = _trace(ref_build.executable, tvm.cpu(0), _args(ref_build, loaded, feeds, tvm.cpu(0)))
    rows = []
    stages = [("untuned", None)]
    if tune_seconds > 0:
        stages.append(("tuned", db_path))
    for stage, dbp in stages:
        row = {"model": path.name + ("" if precision == "model" else f" ({precision})"), "build": stage}
        t0 = time.perf_counter()
        db = None
        if dbp is not None:
            db = open_database(dbp, target=target)
            kernels = extract_kernels(fused, target=target)
            res = tune_kernels(kernels, target=target, database=db, model=loaded.name,
                               config=TuneConfig(trials=10_000, trials_per_kernel=8, time_budget_s=tune_seconds))
            row["tune"] = {s: sum(x.status == s for x in res) for s in {x.status for x in res}}
            row["failed"] = {r.name: (r.message or "")[:200] for r in res if r.status == "failed"}
        built = build(fused, target=target, database=db, cuda_graph=False)   # traced kernel by kernel
        row["build_s"] = round(time.perf_counter() - t0, 1)
        sources = {k.name: k.schedule for k in built.kernels}
        dev = tvm.cuda(0)
        calls, outs = _trace(built.executable, dev, _args(built, loaded, feeds, dev))
        row["rel_err_no_graph"] = max(verify.relative_error(o, r) for o, r in zip(outs, refs))
        row["rel_err_llvm_vs_ort"] = max(verify.relative_error(o, r) for o, r in zip(ref_outs, refs))
        tol = max(verify.tolerance(str(refs[0].dtype)), PRECISION_TOLERANCE.get(precision, 0.0))
        bad = []
        by_name_ref: dict = {}
        for name, arr in ref_calls:
            by_name_ref.setdefault(name, []).append(arr)
        seen: dict = {}
        for name, arr in calls:
            k = seen.get(name, 0)
            seen[name] = k + 1
            ref_list = by_name_ref.get(name, [])
            if k >= len(ref_list) or ref_list[k].shape != arr.shape:
                continue
            err = verify.relative_error(arr, ref_list[k]) if arr.dtype.kind == "f" else float(
                0.0 if np.array_equal(arr, ref_list[k]) else float("inf"))
            if err > tol:
                bad.append({"kernel": name, "call": k, "rel_err": err, "schedule": sources.get(name, "?"),
                            "nonfinite": int((~np.isfinite(arr)).sum()) if arr.dtype.kind == "f" else 0,
                            "ref_nonfinite": int((~np.isfinite(ref_list[k])).sum()) if arr.dtype.kind == "f" else 0})
        row["kernel_calls"] = len(calls)
        row["bad_kernels"] = bad[:8]
        row["schedules"] = {s: sum(v == s for v in sources.values()) for s in set(sources.values())}
        # the default build (CUDA graph on): timed, then checked on a replay of the captured graph
        graph = build(fused, target=target, database=db, cuda_graph=True)
        graph_args = _args(graph, loaded, feeds, dev)
        row["graph_ms"] = _time_ms(graph.executable, dev, graph_args)
        row["no_graph_ms"] = _time_ms(built.executable, dev, _args(built, loaded, feeds, dev))
        if profile:
            row["top_kernels_us"] = _profile(built.executable, dev, _args(built, loaded, feeds, dev))
        # replays with other inputs in other buffers: a graph that kept the first call's input would repeat it
        other = {k: np.ascontiguousarray(np.roll(v, 1)) for k, v in feeds.items()}
        other_refs = verify.run_onnxruntime(loaded.path, other)
        vm = relax.VirtualMachine(graph.executable, dev)
        errs = []
        for f, r in ((feeds, refs), (other, other_refs), (feeds, refs)):
            out = vm["main"](*_args(graph, loaded, f, dev))
            got = [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]
            errs.append(max(verify.relative_error(o, x) for o, x in zip(got, r)))
        row["rel_err_vs_ort"] = max(errs)
        row["ok"] = row["rel_err_vs_ort"] <= tol
        if db is not None:
            db.close()
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    _WEIGHTS.clear()   # (this model's builds are done: their weights leave the device)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--tune-seconds", type=float, default=0.0)
    ap.add_argument("--db", type=Path, default=Path("tuning_logs") / "gpu_model_check.db")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--precision", default="model", help="model | fp32 | fp16 (tvmfuse.frontend.precision)")
    ap.add_argument("--profile", action="store_true", help="the 5 heaviest kernels of each build (Relax VM profiler)")
    a = ap.parse_args()
    rows = []
    for m in a.models:
        try:
            rows += check_model(m, tune_seconds=a.tune_seconds, db_path=a.db, precision=a.precision, profile=a.profile)
        except Exception as err:  # noqa: BLE001 - report, go on with the next model
            rows.append({"model": m.name, "build": "-", "error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1, default=str))
    nan = float("nan")
    print(f"\n{'model':32} {'build':8} {'rel_err':>9} {'llvm':>9} {'graph ms':>9} {'plain ms':>9}  first bad kernel")
    for r in rows:
        first = r.get("bad_kernels", [{}])[0] if r.get("bad_kernels") else {}
        print(f"{r['model']:32} {r['build']:8} {r.get('rel_err_vs_ort', nan):9.2e} "
              f"{r.get('rel_err_llvm_vs_ort', nan):9.2e} {r.get('graph_ms', nan):9.3f} {r.get('no_graph_ms', nan):9.3f}  "
              f"{first.get('kernel', r.get('error', '-'))} {first.get('schedule', '')} {first.get('rel_err', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
