"""How fast tvmfuse's search converges, against random search, on shapes nobody tuned for.

Per kernel class (``--classes``: gemm, rows, pointwise, conv, attention), ``--shapes-per-class`` shapes are drawn at
random (``--seed``): GEMM M, N, K in 64..16384 (N and K mostly multiples of 64, odd multiples too, so not all of
128; one shape in five any integer), rows of width 64..65536 (softmax, LayerNorm, RMSNorm), pointwise sizes, 3x3
convs (batch, channels, spatial), attention B/H/S/D. For each shape's kernel of its class:

* ``default``: the schedule an untuned build runs (the template's hand rule, or dlight's), measured first;
* ``random``: ``--trials`` random points of the kernel's space (MetaSchedule's ReplayTrace, random cost model);
* ``tvmfuse``: ``--trials`` of tvmfuse's search: evolutionary search steered by one XGBoost model shared by the
  whole sweep (warm-started from the database's records), the template configs' knobs as features, the
  config-neighbour mutator, and a template's first-measured default chosen by that model where the database
  holds the template's records at other shapes (``default`` in the JSON: ``rule`` or ``model (N records)``).

Reported per shape and arm: every record's time in order (``times_ms``, the default first), the config-neighbour
mutator's applications during the arm (``config_mutations``), the best time, the trials each needed to reach
90% / 95% of the best any arm found
(the default counts as trial 0; None: never), and the tuner's check of the best schedule against its reference
(TVM's unscheduled kernel on random inputs, outputs poisoned). The table (printed last) gives each class's median
trials to 90% / 95% and how often each arm found the best.

Resumable: ``--db PATH`` holds the search's tvmfuse SQLite database (``PATH``), the random arm's
(``PATH.random.db``) and the finished results (``PATH.results.json``); the same command continues a sweep where it
stopped. It stops itself before ``--time-limit-s`` (default 420 s) so that a 10-minute call ends cleanly; run it
again to go on. ``--small --target llvm``: tiny shapes on this machine's CPU (a smoke test; llvm uses
MetaSchedule's stock spaces, no templates). ``--dry-run``: builds each shape's default and a few sampled
schedules for the target (CUDA with nvcc, no GPU) and runs nothing.

    python benchmarks/bench_convergence.py --shapes-per-class 3 --classes gemm,rows --trials 16 --db /tmp/conv.db
    python benchmarks/bench_convergence.py --small --target llvm --shapes-per-class 1 --trials 4
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLASSES = ("gemm", "rows", "pointwise", "conv", "attention")
KERNEL_CLASS = {"gemm": "gemm", "rows": "row_reduction", "pointwise": "pointwise", "conv": "conv",
                "attention": "attention"}
ARMS = ("random", "tvmfuse")


# -------------------------------------------------------------------------------------------- shapes
def _log_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``lo..hi``, log-uniform."""
    return lo if hi <= lo else _clamp(int(round(2 ** rng.uniform(math.log2(lo), math.log2(hi)))), lo, hi)


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def draw_shapes(cls: str, n: int, seed: int, small: bool) -> list[dict]:
    """``n`` shapes of class ``cls``, the same for the same seed (one generator per class)."""
    rng = random.Random(f"{seed}:{cls}")
    out = []
    for _ in range(n):
        if cls == "gemm":
            hi = 512 if small else 16384

            def dim():
                if rng.random() < 0.2:
                    return _clamp(_log_int(rng, 64, hi) + rng.randrange(-31, 32), 64, hi)   # any integer
                return _clamp(64 * max(1, _log_int(rng, 64, hi) // 64 + rng.randrange(0, 2)), 64, hi)

            out.append({"M": _clamp(_log_int(rng, 64, hi) + rng.randrange(0, 64), 64, hi), "N": dim(), "K": dim()})
        elif cls == "rows":
            width = 8 * max(8, _log_int(rng, 64, 2048 if small else 65536) // 8 + rng.randrange(0, 8))
            budget = (1 << 16) if small else (1 << 27)   # elements: at most 256 MB of fp16 a tensor
            rows = _clamp(_log_int(rng, 1, 8192), 1, max(1, budget // width))
            out.append({"case": rng.choice(["softmax", "layernorm", "rmsnorm"]), "M": rows, "N": width})
        elif cls == "pointwise":
            total = _log_int(rng, 1 << 10, 1 << 14) if small else _log_int(rng, 1 << 16, 1 << 27)   # elements
            width = 8 * max(1, _log_int(rng, 8, 16384) // 8)
            rows = max(1, total // width)
            out.append({"case": rng.choice(["pointwise", "swiglu"]), "M": rows, "N": width})
        elif cls == "conv":
            out.append({"B": rng.choice([1, 2] if small else [1, 4, 16, 32]),
                        "C": rng.choice([64] if small else [64, 128, 256]),
                        "H": rng.choice([8] if small else [7, 14, 28, 56])})
        elif cls == "attention":
            out.append({"B": rng.choice([1] if small else [1, 2, 4, 8]),
                        "H": rng.choice([1, 2] if small else [8, 16, 32]),
                        "S": rng.choice([64, 128] if small else [128, 256, 512, 1024, 2048, 4096]),
                        "D": rng.choice([32] if small else [64, 128])})
        else:
            raise SystemExit(f"unknown class '{cls}' (classes: {', '.join(CLASSES)})")
    return out


def shape_name(cls: str, shape: dict) -> str:
    return cls + ":" + ",".join(f"{k}={v}" for k, v in shape.items())


def _gemm_model(M, N, K):
    """y = relu(x @ w), both operands graph inputs (a 16384^2 weight as an initializer would be a 512 MB model)."""
    from onnx import TensorProto, helper

    f16 = TensorProto.FLOAT16
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
                          "gemm", [helper.make_tensor_value_info("x", f16, [M, K]),
                                   helper.make_tensor_value_info("w", f16, [K, N])],
                          [helper.make_tensor_value_info("y", f16, [M, N])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 9
    return m


def kernel_of(cls: str, shape: dict, target):
    """The planner's kernel of class ``cls`` (the heaviest, where several) for one shape's model."""
    import onnx

    from tvmfuse.bench.cases import CASES
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import extract_kernels
    from tvmfuse.tune.spaces import classify

    if cls == "gemm":
        model = _gemm_model(shape["M"], shape["N"], shape["K"])
    elif cls in ("rows", "pointwise"):
        model = CASES[shape["case"]](M=shape["M"], N=shape["N"])[0]
    elif cls == "conv":
        model = CASES["conv_bn_relu"](B=shape["B"], C=shape["C"], H=shape["H"], W=shape["H"])[0]
    else:
        model = CASES["attention"](B=shape["B"], H=shape["H"], S=shape["S"], D=shape["D"])[0]
    path = Path(tempfile.mkdtemp(prefix="conv-bench-")) / "m.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=target)
    found = [k for k in extract_kernels(fused, target=target) if classify(k.mod["main"]) == KERNEL_CLASS[cls]]
    if not found:
        return None
    return max(found, key=lambda k: k.flops)


# -------------------------------------------------------------------------------------------- measuring
def trials_to(times: list[float], best: float, fraction: float):
    """The first trial (0: the default, the first record) whose running best is within ``fraction`` of ``best``
    (time <= best / fraction), or None."""
    run = float("inf")
    for i, t in enumerate(times):
        run = min(run, t)
        if run <= best / fraction:
            return i
    return None


def record_times(db, mod) -> list[float]:
    """The kernel's records in commit order (the default first), seconds; a failed trial is inf."""
    wid = db.workload_id(mod)
    if wid is None:
        return []
    return [float("inf") if r.failed or r.mean_secs is None else float(r.mean_secs) for r in db.records(wid)]


def run_arm(arm: str, kernel, *, target, db, trials: int, cost_model, workers: int) -> dict:
    """Tune ``kernel`` for ``trials`` (resuming what ``db`` already holds) as ``arm`` says; its result."""
    from tvmfuse.kernels import mutator
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.tuner import TuneConfig

    config = TuneConfig(trials=trials, trials_per_kernel=trials + 1, trials_per_round=8, population=64,
                        cost_model="xgb" if arm == "tvmfuse" else "random",
                        strategy="evolutionary" if arm == "tvmfuse" else "random", max_workers=workers)
    applied = sum(mutator.APPLIED.values())
    (result,) = tune_kernels([kernel], target=target, database=db, config=config, cost_model=cost_model)
    return {"status": result.status, "default": result.default, "check": result.check,
            "config_mutations": sum(mutator.APPLIED.values()) - applied,   # the config-neighbour mutator's
            "default_ms": None if result.baseline_s is None else result.baseline_s * 1e3}


def dry_run(classes, args, target) -> int:
    """Build (nvcc, no GPU needed) each drawn shape's default schedule and ``--dry-run-samples`` random points of its
    space for the target: what the GPU run would build, so it cannot fail there for a reason a CPU can see."""
    from tvmfuse._gpu_rules import default_schedule
    from tvmfuse._tvm import build_context, tvm
    from tvmfuse.kernels import expand
    from tvmfuse.tune.defaults import default_template_schedule
    from tvmfuse.tune.spaces import sample_schedules, select_space

    failed = 0
    for cls in classes:
        for shape in draw_shapes(cls, args.shapes_per_class, args.seed, args.small):
            key = shape_name(cls, shape)
            kernel = kernel_of(cls, shape, target)
            if kernel is None:
                print(f"{key}: no {KERNEL_CLASS[cls]} kernel (skipped by the run)")
                continue
            choice = select_space(kernel.mod, target.target)
            sch = default_template_schedule(kernel.mod, target.target) or default_schedule(
                kernel.mod, target.target, is_gpu=target.is_gpu)
            mods = [("default", expand(sch.mod))] if sch is not None else []
            mods += [(f"sample {i}", m) for i, m in enumerate(sample_schedules(
                kernel.mod, target.target, choice, n=args.dry_run_samples, seed=args.seed))]
            for what, mod in mods:
                try:
                    with build_context():
                        tvm.compile(mod, target=target.target)
                    status = "built"
                except Exception as err:  # noqa: BLE001 - reported, counted
                    failed += 1
                    status = f"FAILED: {(str(err).strip().splitlines() or [type(err).__name__])[-1][:200]}"
                print(f"{key} ({choice.source}) {what}: {status}", flush=True)
    print(f"dry run: {failed} builds failed")
    return 1 if failed else 0


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(results: dict, classes, trials: int) -> list[list]:
    rows = []
    for cls in classes:
        done = [r for r in results.values() if r["class"] == cls and all(a in r for a in ARMS)]
        if not done:
            continue
        row = [cls, len(done)]
        for arm in ARMS:
            # never reached: counted past the budget for the median
            t90 = [r[arm]["trials_to_90"] if r[arm]["trials_to_90"] is not None else trials + 1 for r in done]
            t95 = [r[arm]["trials_to_95"] if r[arm]["trials_to_95"] is not None else trials + 1 for r in done]
            wins = sum(r[arm]["best_ms"] is not None and r[arm]["best_ms"] <= r["best_ms"] * 1.0001 for r in done)
            row += [_median(t90), _median(t95), f"{wins}/{len(done)}"]
        models = sum(str(r["tvmfuse"].get("default") or "").startswith("model") for r in done)
        default_best = sum(r["default_ms"] is not None and r["default_ms"] <= r["best_ms"] / 0.95 for r in done)
        rows += [row + [f"{default_best}/{len(done)}", f"{models}/{len(done)}"]]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", default="gemm,rows,pointwise,conv,attention")
    p.add_argument("--shapes-per-class", type=int, default=30)
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="cuda", help="cuda (the GPU here) or llvm")
    p.add_argument("--db", default=None, help="database path (default: a temporary folder; not resumable)")
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
    p.add_argument("--time-limit-s", type=float, default=420.0, help="stop before this, to resume in a next call")
    p.add_argument("--dry-run", action="store_true",
                   help="build each shape's default and a few sampled schedules (CUDA: no GPU needed); run nothing")
    p.add_argument("--dry-run-samples", type=int, default=2)
    args = p.parse_args(argv)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    bad = [c for c in classes if c not in CLASSES]
    if bad or args.shapes_per_class < 1 or args.trials < 1:
        print(f"error: unknown class {bad[0]!r} (classes: {', '.join(CLASSES)})" if bad
              else "error: --shapes-per-class and --trials must be at least 1", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    from tvmfuse.db import open_database
    from tvmfuse.target import device_figures, resolve_target
    from tvmfuse.tune.cost_model import make_cost_model
    from tvmfuse.tune.warm_start import warm_start

    target = resolve_target(args.target)
    if args.dry_run:
        return dry_run(classes, args, target)
    if target.is_gpu and not target.runs_here():
        print("error: --target cuda needs the GPU here (use --small --target llvm on a CPU)", file=sys.stderr)
        return 2
    db_path = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="conv-bench-")) / "search.db"
    db_path.parent.mkdir(parents=True, exist_ok=True)
    paths = {"tvmfuse": db_path, "random": Path(f"{db_path}.random.db")}
    results_path = Path(f"{db_path}.results.json")
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    dbs = {arm: open_database(path, target=target) for arm, path in paths.items()}
    model = make_cost_model("xgb")   # one for the sweep: each shape's records teach it for the next
    warm = warm_start(model, dbs["tvmfuse"], target)
    workers = max(1, min(16, len(os.sched_getaffinity(0))))
    stopped = False
    try:
        for cls in classes:
            for shape in draw_shapes(cls, args.shapes_per_class, args.seed, args.small):
                key = shape_name(cls, shape)
                entry = results.get(key, {"class": cls, "shape": shape})
                if all(a in entry for a in ARMS) or entry.get("skipped"):
                    continue
                if time.monotonic() - t0 > args.time_limit_s:
                    stopped = True
                    break
                kernel = kernel_of(cls, shape, target)
                if kernel is None:
                    entry["skipped"] = f"no {KERNEL_CLASS[cls]} kernel in the model"
                    results[key] = entry
                    continue
                entry["kernel"] = kernel.name
                for arm in ARMS:
                    if arm in entry:
                        continue
                    if time.monotonic() - t0 > args.time_limit_s:
                        stopped = True
                        break
                    t = time.monotonic()
                    out = run_arm(arm, kernel, target=target, db=dbs[arm], trials=args.trials,
                                  cost_model=model if arm == "tvmfuse" else None, workers=workers)
                    out["times_ms"] = [x * 1e3 if x != float("inf") else None
                                       for x in record_times(dbs[arm], kernel.mod)]
                    out["seconds"] = round(time.monotonic() - t, 1)
                    entry[arm] = out
                    results[key] = entry
                    results_path.write_text(json.dumps(results, indent=1))
                if stopped:
                    break
                times = {a: [x / 1e3 if x is not None else float("inf") for x in entry[a]["times_ms"]] for a in ARMS}
                best = min(min(ts, default=float("inf")) for ts in times.values())
                entry["best_ms"] = None if best == float("inf") else best * 1e3
                # the untuned build's default: the random arm's first record (its default is always the hand rule)
                entry["default_ms"] = (times["random"][0] * 1e3 if times["random"]
                                       and times["random"][0] != float("inf") else None)
                for a in ARMS:
                    ts = times[a]
                    entry[a]["best_ms"] = None if not ts or min(ts) == float("inf") else min(ts) * 1e3
                    entry[a]["trials_to_90"] = trials_to(ts, best, 0.90) if best != float("inf") else None
                    entry[a]["trials_to_95"] = trials_to(ts, best, 0.95) if best != float("inf") else None
                results[key] = entry
                results_path.write_text(json.dumps(results, indent=1))
            if stopped:
                break
    finally:
        for db in dbs.values():
            db.close()
    report = {"target": json.loads(target.canonical), "device": target.device, "trials": args.trials,
              "seed": args.seed, "classes": classes, "shapes_per_class": args.shapes_per_class,
              "warm_start_records": warm, "db": str(db_path), "complete": not stopped,
              "device_figures": device_figures(target).to_json() if target.is_gpu else None,
              "results": results}
    rows = summarize(results, classes, args.trials)
    report["summary"] = [dict(zip(["class", "shapes", "random_t90", "random_t95", "random_best", "tvmfuse_t90",
                                   "tvmfuse_t95", "tvmfuse_best", "default_within_95", "model_defaults"], r))
                         for r in rows]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_convergence.json").write_text(json.dumps(report, indent=1))
    for key, entry in results.items():
        if entry.get("skipped"):
            print(f"{key}: skipped ({entry['skipped']})")
        for arm in ARMS:
            check = (entry.get(arm) or {}).get("check") or {}
            if check.get("ok") is False:
                print(f"{key}: {arm}'s best schedule FAILED its check: {check}")
    if stopped:
        print(f"stopped at the time limit ({args.time_limit_s:.0f} s): run the same command to continue "
              f"(--db {db_path})")
    head = ["class", "shapes", "rand t90", "rand t95", "rand best", "tvmf t90", "tvmf t95", "tvmf best",
            "default>=95%", "model dflt"]
    print(f"convergence on {target.device}, {args.trials} trials (median trials to 90% / 95% of the best found; "
          "trial 0 is the default; budget+1: never)")
    print(" | ".join(f"{h:>11}" for h in head))
    for r in rows:
        print(" | ".join(f"{'-' if c is None else c:>11}" for c in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
