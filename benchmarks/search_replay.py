"""The tuner's search against random search, replayed on measured tables of whole config spaces: issue 20's
convergence figures for a fraction of the device time a live search takes.

``measure`` (GPU): per class (``--classes``: gemm, conv, rows, attention), ``--shapes-per-class`` shapes drawn as
``benchmarks/bench_convergence.py`` draws them (the same ``--seed``: the same shapes and kernels). Every config of the
kernel's template space (the candidates its sketch samples among) is built by the tuner's builder (``--workers``
processes, CUDA compiled there) and timed by the tuner's runner; the fastest are checked against the kernel's
reference on random inputs (``tvmfuse.tune.check``) until three pass, as the tuner checks its best record, and the
default too (the rest are marked unchecked). Writes ``--table`` (JSON); the same command continues it (shapes
already there are kept) and stops before ``--time-limit-s``. A space's size sets the cost: on the CPU here a build
took about 1.5 s a core; the spaces of drawn shapes held 4 (a softmax row) to about 440 configs (a GEMM).

``replay`` (CPU, no GPU): for each shape of the table the tuner itself runs (``tune_kernels``: its search strategy,
cost model and template features, mutators, and its default chosen from the database's records) with a builder that
builds nothing and a runner that answers each candidate with its config's time in the table (a config that failed
there fails here). Two arms, each over ``--seeds`` seeds: ``random`` (MetaSchedule's ReplayTrace, a random model) and
``tvmfuse`` (evolutionary search, one XGBoost model and one database shared over the arm's shapes in the table's
order, so each shape starts from what the ones before it taught). Per class, medians over shapes and seeds:
``default / best of the space`` where the default is below 95% of that best (the issue's shapes), ``default /
tvmfuse's best after --trials``, and the trials tvmfuse's search needs to reach random search's best of 32 (the
default counts as trial 0). The replay knows nothing of a measurement's noise: it ranks configs as the table does.

    python benchmarks/search_replay.py measure --classes gemm,conv,rows --shapes-per-class 30 --table t.json
    python benchmarks/search_replay.py replay --table t.json --trials 32 --seeds 3
    python benchmarks/search_replay.py warm --table t.json --trials 32 --seeds 3

``warm`` (CPU): issue 20's warm start, replayed. Each shape is tuned by tvmfuse's search cold (a fresh database and
cost model) and warm (a database holding the cold runs' records of the other shapes of its class, the model
warm-started from them as ``tune`` does). Per class: the trials each needed to reach 90% of the cold search's final
speed, and how often warm needed at most a quarter of cold's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_convergence import draw_shapes, kernel_of, record_times, shape_name, trials_to  # noqa: E402
from tvmfuse._tvm import derived_object, ensure_tensor_intrinsics, ms  # noqa: E402

CHECKED = 3   # the fastest configs of a shape checked against its reference (the tuner checks its best)
STOCK = "stock"   # the table's name for dlight's schedule, where the untuned build runs it


# ------------------------------------------------------------------------------------------------ the space
def template_space(mod, target) -> tuple[str, dict] | None:
    """(the template whose configs ``mod``'s space samples, config name -> its schedule in the sketch's order), or
    None."""
    from tvmfuse.kernels import registry
    from tvmfuse.tune.defaults import config_schedules

    for t in registry():
        if t.candidates_key is not None and (schedules := config_schedules(mod, target, t.name)):
            return t.name, schedules
    return None


def config_key(mod) -> str | None:
    """``template:config`` of the config a candidate schedule of the space selects, or None."""
    from tvmfuse.kernels import registry

    func = mod["main"]
    for t in registry():
        name = t.config_of(func)
        if name is not None:
            return f"{t.name}:{name}"
    return None


# ------------------------------------------------------------------------------------------------ measure
def measure_shape(cls: str, shape: dict, target, *, builder, runner) -> dict:
    """Every config of one shape's kernel built, timed and checked: its table entry."""
    from tvmfuse.kernels import get
    from tvmfuse.tune.check import build_references, check_kernel

    kernel = kernel_of(cls, shape, target)
    found = None if kernel is None else template_space(kernel.mod, target.target)
    if found is None:
        return {"class": cls, "shape": shape, "error": "no template space takes the kernel"}
    tname, schedules = found
    default = get(tname).default_config(kernel.mod["main"], target.target)
    default_name = default and default.name
    if default is None:
        # the template takes the kernel but an untuned build runs dlight's rules (a ragged LayerNorm): the stock
        # schedule is timed as the config STOCK, the default the search starts from
        from tvmfuse._gpu_rules import default_schedule
        from tvmfuse.target import device_figures

        stock = default_schedule(kernel.mod, target.target, is_gpu=True, sm_count=device_figures(target).sm_count)
        if stock is not None:
            schedules, default_name = {**schedules, STOCK: stock}, STOCK
    configs: dict[str, dict] = {}
    built = builder.build([ms.builder.BuilderInput(s.mod, target.target) for s in schedules.values()])
    runs = []
    for (name, sch), b in zip(schedules.items(), built):
        if b.error_msg is not None:
            configs[name] = {"ms": None, "ok": False, "error": "build: " + b.error_msg.strip().splitlines()[-1][:200]}
            continue
        args = ms.arg_info.ArgInfo.from_entry_func(sch.mod, True)
        runs.append((name, sch, runner.run([ms.runner.RunnerInput(b.artifact_path, "cuda", args)])[0]))
    timed = []
    for name, sch, future in runs:
        res = future.result()
        if res.error_msg is not None or not res.run_secs:
            configs[name] = {"ms": None, "ok": False, "error": "run: " + str(res.error_msg or "no time")[-200:]}
            continue
        secs = [float(s) for s in res.run_secs]
        configs[name] = {"ms": sum(secs) / len(secs) * 1e3, "ok": True, "error": None, "checked": False}
        timed.append((configs[name]["ms"], name, sch))
    # checked as the tuner checks its best record: the fastest first, until CHECKED pass (a config that fails is
    # out of the table's space, as the tuner rejects it), and the default
    refs, passed = build_references(kernel.mod, target), 0
    for _, name, sch in sorted(timed, key=lambda t: t[0]):
        if passed >= CHECKED and name != default_name:
            continue
        check = check_kernel(kernel.mod, sch.mod, target, refs=refs)
        configs[name].update(ok=bool(check.ok), checked=True, rel_error=check.rel_error,
                             error=None if check.ok else f"check: {check.rel_error:.2e}")
        passed += bool(check.ok)
    return {"class": cls, "shape": shape, "template": tname, "default": default_name, "configs": configs}


def measure(args) -> int:
    from tvmfuse.target import resolve_target
    from tvmfuse.tune.builder import close_builder, make_builder
    from tvmfuse.tune.samples import KeptSamplesRunner, local_runner

    target = resolve_target(args.target)
    if not target.is_gpu or not target.runs_here():
        print("search_replay: measure needs the GPU here (--target cuda on a machine with one)", file=sys.stderr)
        return 2
    ensure_tensor_intrinsics(target.kind)   # the GEMM sketch tensorizes: without them its space falls back
    table = json.loads(args.table.read_text()) if args.table.exists() else {"target": args.target, "shapes": {}}
    builder = make_builder(workers=args.workers, timeout_s=120.0, precompile=True)
    runner = KeptSamplesRunner(local_runner(30.0, gpu=True))
    start = time.time()
    try:
        for cls in args.classes.split(","):
            for shape in draw_shapes(cls, args.shapes_per_class, args.seed, False):
                key = shape_name(cls, shape)
                if table["shapes"].get(key, {}).get("configs"):
                    continue   # (an entry without configs, as a template fixed since, is measured again)
                if time.time() - start > args.time_limit_s:
                    print(f"[search_replay] stopping before {key}: --time-limit-s reached; run again to go on")
                    return 0
                t0 = time.time()
                table["shapes"][key] = entry = measure_shape(cls, shape, target, builder=builder, runner=runner)
                args.table.write_text(json.dumps(table, indent=1))
                ok = [c["ms"] for c in entry.get("configs", {}).values() if c["ok"]]
                print(f"[search_replay {time.time() - start:5.0f}s] {key}: {len(entry.get('configs', {}))} configs, "
                      f"{len(ok)} ok, best {min(ok) if ok else float('nan'):.4f} ms ({time.time() - t0:.0f}s)",
                      flush=True)
    finally:
        close_builder(builder)
    return 0


# ------------------------------------------------------------------------------------------------ replay
@derived_object
class TableBuilder(ms.builder.PyBuilder):
    """A builder that builds nothing: each candidate's artifact is an empty folder (MetaSchedule removes it once
    measured) that ``names`` maps to the candidate's config in the table."""

    def __init__(self, configs: dict, names: dict):
        super().__init__()
        self.configs, self.names, self.asked = configs, names, False

    def build(self, build_inputs):
        out = []
        for b in build_inputs:
            key = config_key(b.mod)
            name = None if key is None else key.split(":", 1)[1]
            if key is None and not self.asked and STOCK in self.configs:
                name = STOCK   # the tuner measures the untuned build's schedule first: dlight's, where it is STOCK
            self.asked = True
            if name not in self.configs:
                out.append(ms.builder.BuilderResult(None, f"not a config of the table ({key})"))
                continue
            path = str(Path(tempfile.mkdtemp(prefix="replay-")) / "candidate")
            self.names[path] = name
            out.append(ms.builder.BuilderResult(path, None))
        return out


@derived_object
class _Answer(ms.runner.PyRunnerFuture):
    def __init__(self, result):
        super().__init__()
        self.answer = result

    def done(self) -> bool:
        return True

    def result(self):
        return self.answer


@derived_object
class TableRunner(ms.runner.PyRunner):
    """A runner that answers each candidate with its config's time in the table (seconds), or its failure."""

    def __init__(self, configs: dict, names: dict):
        super().__init__()
        self.configs, self.names = configs, names
        self.asked: list[str] = []

    def run(self, runner_inputs):
        out = []
        for r in runner_inputs:
            name = self.names.pop(str(r.artifact_path))
            self.asked.append(name)
            c = self.configs[name]
            out.append(_Answer(ms.runner.RunnerResult([c["ms"] / 1e3], None) if c["ok"] else
                               ms.runner.RunnerResult(None, c["error"] or "failed in the table")))
        return out


def replay_arm(arm: str, entries: list[tuple[str, dict]], target, *, trials: int, seed: int,
               db_path: Path | None = None, warm: bool = False) -> dict:
    """One arm over ``entries`` (table key, entry), in order, with one database and one cost model: each shape's
    record times in order (the default first), seconds. ``db_path``: that database (kept) instead of a temporary
    one; ``warm``: the cost model warm-started from its records first (``tvmfuse.tune.warm_start``, as ``tune``
    does)."""
    from tvmfuse.db import open_database
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.cost_model import make_cost_model
    from tvmfuse.tune.tuner import TuneConfig
    from tvmfuse.tune.warm_start import warm_start

    config = TuneConfig(trials=trials, trials_per_kernel=trials + 1, trials_per_round=8, population=64, seed=seed,
                        cost_model="xgb" if arm == "tvmfuse" else "random", check=False, retime_finalists=0,
                        strategy="evolutionary" if arm == "tvmfuse" else "random", nvcc_cache="off")
    cost_model = make_cost_model(config.cost_model)
    out, statuses = {}, {}
    with tempfile.TemporaryDirectory() as work:
        db = open_database(db_path or Path(work) / "replay.db", target=target)
        if warm:
            warm_start(cost_model, db, target)
        for key, entry in entries:
            kernel = kernel_of(entry["class"], entry["shape"], target)
            names: dict[str, str] = {}
            builder, runner = TableBuilder(entry["configs"], names), TableRunner(entry["configs"], names)
            (result,) = tune_kernels([kernel], target=target, database=db, config=config, cost_model=cost_model,
                                     builder=builder, runner=runner)
            out[key], statuses[key] = record_times(db, kernel.mod), result.status
        db.close()
    if any(s not in ("tuned", "exhausted") for s in statuses.values()):
        raise RuntimeError(f"the {arm} arm's search did not finish: {statuses}")
    return out


def cold_and_warm(entries: list[tuple[str, dict]], target, *, trials: int, seed: int, work: Path) -> dict:
    """Each shape tuned by tvmfuse's search ``cold`` (a fresh database and cost model) and ``warm``: from a database
    holding the cold runs' records of the other shapes of its class (what tuning other models leaves), the cost
    model warm-started from them, as ``tune`` starts. {"cold" | "warm": {key: record times}}."""
    from tvmfuse.db.ops import merge

    dbs = {key: work / f"cold{i}.db" for i, (key, _) in enumerate(entries)}
    runs = {"cold": {}, "warm": {}}
    for key, entry in entries:
        runs["cold"].update(replay_arm("tvmfuse", [(key, entry)], target, trials=trials, seed=seed,
                                       db_path=dbs[key]))
    for i, (key, entry) in enumerate(entries):
        dest = work / f"warm{i}.db"
        merge(sources=[dbs[k] for k, e in entries if k != key and e["class"] == entry["class"]], dest=dest)
        runs["warm"].update(replay_arm("tvmfuse", [(key, entry)], target, trials=trials, seed=seed, db_path=dest,
                                       warm=True))
    return runs


def summarize_warm(table: dict, runs: dict, trials: int, fraction: float = 0.9) -> list[dict]:
    """Per class, over the shapes whose default is below 95% of its space's best and the seeds where the cold search
    needed a trial to reach ``fraction`` of its final speed: the trials cold and warm needed (medians), the median
    of warm's over cold's, and how often warm needed at most a quarter of cold's (issue 20's warm-start goal); the
    warm search's final best over the cold one's."""
    rows = []
    for cls in dict.fromkeys(e["class"] for e in table["shapes"].values()):
        keys = [k for k, e in table["shapes"].items() if e["class"] == cls and e.get("configs")]
        cold_n, warm_n, ratio, quarter, final, pairs, at_default = [], [], [], 0, [], 0, 0
        for key in keys:
            entry = table["shapes"][key]
            ok = [c["ms"] for c in entry["configs"].values() if c["ok"]]
            d = entry["configs"].get(entry.get("default") or "", {})
            if not ok or not d.get("ok") or d["ms"] * 0.95 <= min(ok):
                continue
            for seed_runs in runs.values():
                cold, warm = seed_runs["cold"].get(key), seed_runs["warm"].get(key)
                if not cold or not warm:
                    continue
                best = min(cold[:trials + 1])
                tc, tw = trials_to(cold[:trials + 1], best, fraction), trials_to(warm[:trials + 1], best, fraction)
                tw = tw if tw is not None else float("inf")
                final.append(min(warm[:trials + 1]) / best)
                if tc == 0:
                    at_default += 1
                    continue
                pairs += 1
                cold_n.append(tc)
                warm_n.append(tw)
                ratio.append(tw / tc)
                quarter += tw <= tc / 4
        med = (lambda xs: statistics.median(xs) if xs else None)  # noqa: E731
        rows.append({"class": cls, "shapes": len(keys), "runs": pairs, "default_within_fraction": at_default,
                     "cold_trials": med(cold_n), "warm_trials": med(warm_n), "warm_over_cold": med(ratio),
                     "warm_within_quarter": quarter, "warm_final_over_cold": med(final)})
    return rows


def summarize(table: dict, runs: dict, trials: int) -> list[dict]:
    """Per class: medians over shapes (and seeds) of the figures the module docstring names."""
    rows = []
    for cls in dict.fromkeys(e["class"] for e in table["shapes"].values()):
        keys = [k for k, e in table["shapes"].items() if e["class"] == cls and e.get("configs")]
        gap, tuned, reach, room = [], [], [], 0
        for key in keys:
            entry = table["shapes"][key]
            ok = [c["ms"] for c in entry["configs"].values() if c["ok"]]
            d = entry["configs"].get(entry.get("default") or "", {})
            if not ok or not d.get("ok"):
                continue
            best = min(ok)
            if d["ms"] * 0.95 <= best:
                continue   # the default within 95% of the space's best: not one of the shapes
            room += 1
            gap.append(d["ms"] / best)
            for seed_runs in runs.values():
                rand, ours = seed_runs["random"].get(key), seed_runs["tvmfuse"].get(key)
                if not rand or not ours:
                    continue
                tuned.append(d["ms"] / 1e3 / min(ours[:trials + 1]))
                target_s = min(rand[:33])   # the default and 32 trials
                hit = trials_to(ours, target_s, 1.0)
                reach.append(hit if hit is not None else float("inf"))
        med = (lambda xs: statistics.median(xs) if xs else None)  # noqa: E731
        rows.append({"class": cls, "shapes": len(keys), "default_below_95pct": room,
                     "default_over_space_best": med(gap), "default_over_tuned": med(tuned),
                     "trials_to_random32": med(reach), "runs": len(tuned)})
    return rows


def _table(args) -> tuple[dict, object, list]:
    """(the table ``--table`` names, its target, its shapes that have configs as (key, entry))."""
    from tvmfuse.target import resolve_target

    table = json.loads(args.table.read_text())
    return (table, resolve_target(table.get("target", "cuda")),
            [(k, e) for k, e in table["shapes"].items() if e.get("configs")])


def replay(args) -> int:
    table, target, entries = _table(args)
    runs = {}
    for seed in range(args.seeds):
        runs[seed] = {arm: replay_arm(arm, entries, target, trials=args.trials if arm == "tvmfuse" else
                                      max(args.trials, 32), seed=seed) for arm in ("random", "tvmfuse")}
    rows = summarize(table, runs, args.trials)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    print(f"{'class':10} {'shapes':>6} {'room':>5} {'default/best':>13} {'default/tuned':>14} {'trials to rnd32':>16}")
    for r in rows:
        f = (lambda v, p=2: "-" if v is None else f"{v:.{p}f}")  # noqa: E731
        print(f"{r['class']:10} {r['shapes']:6d} {r['default_below_95pct']:5d} {f(r['default_over_space_best']):>13} "
              f"{f(r['default_over_tuned']):>14} {f(r['trials_to_random32'], 1):>16}")
    return 0


def warm(args) -> int:
    table, target, entries = _table(args)
    runs = {}
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as work:
            runs[seed] = cold_and_warm(entries, target, trials=args.trials, seed=seed, work=Path(work))
    rows = summarize_warm(table, runs, args.trials)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    f = (lambda v, p=1: "-" if v is None else f"{v:.{p}f}")  # noqa: E731
    print(f"{'class':10} {'shapes':>6} {'runs':>5} {'at default':>10} {'cold trials':>11} {'warm trials':>11} "
          f"{'warm/cold':>9} {'<= 1/4':>6} {'warm best/cold':>14}")
    for r in rows:
        print(f"{r['class']:10} {r['shapes']:6d} {r['runs']:5d} {r['default_within_fraction']:10d} "
              f"{f(r['cold_trials']):>11} {f(r['warm_trials']):>11} {f(r['warm_over_cold'], 2):>9} "
              f"{r['warm_within_quarter']:6d} {f(r['warm_final_over_cold'], 3):>14}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time every config of each drawn shape's space (GPU)")
    m.add_argument("--classes", default="gemm,conv,rows,attention")
    m.add_argument("--shapes-per-class", type=int, default=30)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--target", default="cuda")
    m.add_argument("--workers", type=int, default=12)
    m.add_argument("--time-limit-s", type=float, default=500.0)
    m.add_argument("--table", type=Path, required=True)
    r = sub.add_parser("replay", help="the search and random search against a table (CPU)")
    r.add_argument("--table", type=Path, required=True)
    r.add_argument("--trials", type=int, default=32)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--json", type=Path, default=None)
    w = sub.add_parser("warm", help="tvmfuse's search on each shape cold and warm-started from the others (CPU)")
    w.add_argument("--table", type=Path, required=True)
    w.add_argument("--trials", type=int, default=32)
    w.add_argument("--seeds", type=int, default=3)
    w.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd in ("replay", "warm") and not args.table.exists():
        print(f"search_replay: no table at {args.table}", file=sys.stderr)
        return 2
    return {"measure": measure, "replay": replay, "warm": warm}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
