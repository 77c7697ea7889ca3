"""``inspect``: what tuning did, per fused kernel and per model, read from the tuning database.

Per kernel: pattern, shapes, trials, first-candidate and best latency, speedup, HBM bytes and achieved
bandwidth against the device's ceiling, FLOPs, failed trials. Per model: the sum of kernel times (best ×
calls) against a measured end-to-end time, and the reasons they differ.

Where the pattern comes from: with the ONNX model the model is re-planned (same planner as ``tune``) and
each tuned workload is matched by structure to the kernel the planner made, which gives the planner's
own pattern, its operators, unfused/fused bytes and the number of calls. Without the model the pattern
is read from the kernel's name (``pattern_from_name``) and every kernel counts as called once.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tvmfuse.db import open_database, open_store
from tvmfuse.errors import DatabaseError, TvmfuseError
from tvmfuse.inspect.ceilings import Ceilings, ceilings_for
from tvmfuse.inspect.workload import buffers, flops, hbm_bytes, pattern_from_name
from tvmfuse.target import TargetInfo


@dataclass(frozen=True)
class InspectConfig:
    """What to inspect.

    Attributes
    ----------
    db : the tuning database (SQLite file)
    target : None (the file's only target, or this machine's), "auto", "llvm", "cuda" or a target JSON
    model : an ONNX file (re-planned: patterns, calls, plan bytes) or a model label the tuner recorded
    kernel : keep kernels whose name contains this text (or whose workload id it is)
    artifact : an artifact folder to run for the end-to-end time
    e2e_ms : a measured end-to-end time (ms) to compare with, when no artifact is given
    bandwidth_gbs, flops_per_s : ceilings to use instead of the known/measured ones
    planner, input_shapes, precision : as for ``tune`` (must match it for workloads to match)
    repeat : timed runs of the artifact
    trust_unsigned : load an artifact whose manifest is unsigned or signed with another key (see tvmfuse.runtime)
    """

    db: Path
    target: str | None = None
    model: str | None = None
    kernel: str | None = None
    artifact: Path | None = None
    e2e_ms: float | None = None
    bandwidth_gbs: float | None = None
    flops_per_s: float | None = None
    planner: str | None = None
    input_shapes: dict = field(default_factory=dict)
    precision: str = "model"
    repeat: int = 20
    trust_unsigned: bool = False


def _bind_target(path: Path, spec: str | None) -> TargetInfo:
    """The (target, device) of the file to read; records are keyed by both."""
    from tvmfuse._tvm import Target
    from tvmfuse.target import resolve_target

    store = open_store(path, create=False)
    try:
        pairs = [(t["target"], t["device"]) for t in store.targets()]
    finally:
        store.close()
    if not pairs:
        raise DatabaseError(f"tuning database {path} holds no workloads or records")
    listed = "; ".join(f"{t} on {d}" for t, d in pairs)
    if spec is None:
        if len(pairs) > 1:
            here = resolve_target("auto")
            mine = [p for p in pairs if p == (here.canonical, here.device)]
            if not mine:
                raise DatabaseError(f"tuning database {path} holds several targets: {listed}",
                                    hint="choose one with --target")
            pairs = mine
        canonical, device = pairs[0]
    else:
        want = resolve_target(spec)
        same = [p for p in pairs if p[0] == want.canonical]
        exact = [p for p in same if p[1] == want.device]
        if not same:
            raise DatabaseError(f"tuning database {path} has no records for target {want.canonical}",
                                hint=f"it holds: {listed}")
        canonical, device = (exact or same)[0]
    spec_dict = json.loads(canonical)
    return TargetInfo(target=Target(spec_dict), kind=str(spec_dict["kind"]), canonical=canonical, device=device)


def _plan_model(model: Path, target: TargetInfo, planner: str | None, input_shapes: dict, precision: str = "model"):
    """Re-plan the model as ``tune`` did: (model label, plan, kernels from ``extract_kernels``)."""
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.plan.partition import DEFAULT_PLANNER
    from tvmfuse.tune import extract_kernels

    loaded = load_model(model, input_shapes=input_shapes, precision=precision)
    fused, plan = partition(import_model(loaded), target=target, planner=planner or DEFAULT_PLANNER,
                            precision=precision)
    return loaded.name, plan, extract_kernels(fused, target=target)


def _curve_stats(trial_secs: list[float | None]) -> dict:
    """Trial of the best record and trials until within 10% of it (MetaSchedule's cost of getting there)."""
    best = min((s for s in trial_secs if s is not None), default=None)
    if best is None:
        return {"best_trial": None, "trials_to_90pct": None}
    best_trial = next(i for i, s in enumerate(trial_secs) if s == best) + 1
    to90 = next(i for i, s in enumerate(trial_secs) if s is not None and best / s >= 0.9) + 1
    return {"best_trial": best_trial, "trials_to_90pct": to90}


def _error_kinds(db, workload_id: int, rows) -> dict:
    """Failed trials by cause: the builder's or runner's message where the tuner kept it ("build: ..." /
    "run: ..."), else (older files, rejected records) by what the record holds."""
    kinds: dict[str, int] = {f"{kind}: {msg}": n for (kind, msg), n in db.trial_errors(workload_id).items()}
    unexplained = sum(1 for r in rows if r.failed) - sum(kinds.values())
    if unexplained > 0:
        kinds["no message kept (rejected by the check, or tuned before messages were kept)"] = unexplained
    return kinds


def _selected(db, mod, workload_id: int, template) -> str | None:
    """The config of ``template`` (a kernel template written whole from configs) that the best valid record of a
    kernel of its classes selects: read only where the record's trace carries the template's candidates (other
    traces may tensorize, and replaying them would need the tensor intrinsics registered, a 40 s import)."""
    from tvmfuse.tune.spaces import classify

    best = db.best_record(workload_id) if classify(mod["main"]) in template.kernel_classes else None
    if best is None or template.candidates_key not in db.record_json(best):
        return None
    return template.config_of(db.schedule_of(best, mod)["main"])


def _template_configs(db, mod, workload_id: int) -> dict:
    """``<template>_config`` per template written from configs (flash, wgmma, the row program): the config the
    kernel's best record selects, or None."""
    from tvmfuse.kernels import registry

    return {t.config_field: _selected(db, mod, workload_id, t) for t in registry() if t.config_field}


def _kernel_view(db, w, ceil: Ceilings, planned: dict | None, calls: int | None) -> dict:
    mod = db.workload_mod(w.workload_id)
    bufs = buffers(mod)
    nbytes = hbm_bytes(bufs)
    fl = flops(mod)
    rows = db.records(w.workload_id)
    trial_secs = [None if r.failed else r.mean_secs for r in rows]
    name = w.task_name or (planned or {}).get("kernel") or f"workload_{w.workload_id}"
    best, first = w.best_secs, w.first_secs
    gbs = nbytes / best / 1e9 if best else None
    flops_s = fl / best if (best and fl) else None
    intensity = fl / nbytes if (fl and nbytes) else None
    ridge = ceil.ridge_flops_per_byte
    view = {
        "workload_id": w.workload_id, "name": name, "model": w.model, "shash": w.shash,
        "pattern": planned["pattern"] if planned else pattern_from_name(name),
        "pattern_source": "plan" if planned else "name",
        "ops": planned["ops"] if planned else None,
        "inputs": [b.to_json() for b in bufs if b.role == "input"],
        "outputs": [b.to_json() for b in bufs if b.role == "output"],
        "trials": w.trials, "failed": w.failed, "errors": _error_kinds(db, w.workload_id, rows),
        "first_ms": None if first is None else first * 1e3, "best_ms": None if best is None else best * 1e3,
        "speedup": (first / best) if (first and best) else None,
        **_curve_stats(trial_secs),
        "trial_ms": [None if s is None else s * 1e3 for s in trial_secs],
        "hbm_bytes": nbytes, "achieved_gbs": gbs,
        "bandwidth_share": (gbs / ceil.bandwidth_gbs) if (gbs and ceil.bandwidth_gbs) else None,
        "flops": fl, "achieved_flops_per_s": flops_s,
        "flops_share": (flops_s / ceil.flops_per_s) if (flops_s and ceil.flops_per_s) else None,
        "flops_per_byte": intensity,
        "bound": None if (intensity is None or ridge is None) else ("memory" if intensity < ridge else "compute"),
        "bytes_unfused": planned["bytes_unfused"] if planned else None,
        "bytes_fused": planned["bytes_fused"] if planned else None,
        "calls": calls if calls is not None else 1, "calls_source": "model" if calls is not None else "assumed",
        **_template_configs(db, mod, w.workload_id),
    }
    view["total_ms"] = None if best is None else best * 1e3 * view["calls"]
    return view


def _planned_by_kernel(plan) -> dict[str, dict]:
    """Plan groups by the PrimFunc they call (one kernel may serve several groups)."""
    out: dict[str, dict] = {}
    for g in plan.groups:
        key = g.kernel or g.name
        d = out.setdefault(key, {"kernel": key, "pattern": g.pattern, "ops": list(g.ops), "bytes_unfused": 0,
                                 "bytes_fused": 0, "groups": 0})
        d["bytes_unfused"] += g.bytes_unfused
        d["bytes_fused"] += g.bytes_fused
        d["groups"] += 1
    return out


def _measure_artifact(path: Path, repeat: int, trust_unsigned: bool = False) -> dict:
    from tvmfuse import verify
    from tvmfuse.runtime import load_artifact

    art = load_artifact(path, trust_unsigned=trust_unsigned)
    feeds = verify.random_inputs(art.input_specs, seed=0)
    times = sorted(art.benchmark(feeds, repeat=max(1, repeat)))
    kernels = art.manifest.get("kernels", [])
    return {"e2e_ms": statistics.median(times) * 1e3, "source": f"artifact {path} (median of {len(times)} runs)",
            "device": art.manifest.get("device"),
            "artifact_untuned": [k["name"] for k in kernels if k.get("schedule") not in (None, "tuned")],
            "artifact_kernels": len(kernels)}


def _explain(model: dict, kernels: list[dict], untuned: list[str]) -> list[str]:
    """Why the sum of kernel times differs from the end-to-end time, with the figures at hand."""
    why = []
    calls = sum(k["calls"] for k in kernels)
    e2e, total = model.get("e2e_ms"), model["kernel_sum_ms"]
    if untuned:
        why.append(f"{len(untuned)} kernel(s) of the model have no valid record and are not in the sum "
                   f"(they run a default schedule): {', '.join(untuned[:5])}")
    if any(k["calls_source"] == "assumed" for k in kernels):
        why.append("calls per kernel are unknown without the ONNX model: each kernel is counted once")
    if e2e is None:
        why.append("no end-to-end time: give an artifact (--artifact) or a measured figure (--e2e-ms)")
        return why
    gap = e2e - total
    if gap > 0:
        why.append(f"launch and VM overhead: {calls} kernel call(s) plus the Relax VM's dispatch, output "
                   f"allocation and copies between kernels; the gap is {gap * 1e3 / max(calls, 1):.1f} µs per call")
        why.append("kernels were timed in isolation, repeated on the same buffers (warm caches); in the model "
                   "each reads what the previous kernel wrote")
    else:
        why.append(f"the model ran {-gap * 1e3:.1f} µs faster than the kernel sum: the kernel times are tuning-time "
                   "measurements (MetaSchedule's runner in its own process, a few repeats, while builder workers "
                   "compiled the next candidates on the same cores); the end-to-end time was taken later in one "
                   "process. Small kernels also keep their data in cache from one call to the next in the model")
    if model.get("artifact_untuned"):
        why.append(f"the artifact built {len(model['artifact_untuned'])} kernel(s) without a tuned record: "
                   f"{', '.join(model['artifact_untuned'][:5])}")
    return why


def inspect_database(config: InspectConfig) -> dict:
    """Read the tuning database and report what tuning did (a JSON-ready dict).

    Returns
    -------
    dict
        ``{"db", "target", "device", "ceilings", "model", "kernels": [...], "summary": {...}}``; each kernel as
        described in :func:`_kernel_view`'s keys (times in ms, bytes, GB/s, shares of the ceiling as 0..1).

    Raises
    ------
    DatabaseError
        The file is missing or damaged, has no records for the target, or several targets and none chosen.
    TvmfuseError
        ``--model`` names neither an ONNX file nor a model in the database; ``--kernel`` matches nothing.
    """
    path = Path(config.db)
    if not path.exists():
        raise DatabaseError(f"tuning database {path} does not exist")
    target = _bind_target(path, config.target)
    ceil = ceilings_for(kind=target.kind, device=target.device, bandwidth_gbs=config.bandwidth_gbs,
                        flops_per_s=config.flops_per_s)
    db = open_database(path, target=target, create=False)
    try:
        stats = db.list_workloads()
        planned: dict[int, dict] = {}
        calls: dict[int, int] = {}
        untuned: list[str] = []
        label = None
        plan_json = None
        if config.model is not None:
            mpath = Path(config.model)
            if mpath.suffix == ".onnx" or mpath.exists():
                label, plan, kernels = _plan_model(mpath, target, config.planner, config.input_shapes,
                                                     config.precision)
                by_kernel = _planned_by_kernel(plan)
                plan_json = {"planner": plan.planner, **plan.totals}
                for k in kernels:
                    wid = db.workload_id(k.mod)
                    if wid is None or db.best_run_secs(k.mod) is None:
                        untuned.append(k.name)
                    if wid is not None:
                        calls[wid] = k.weight
                        if k.name in by_kernel:
                            planned[wid] = by_kernel[k.name]
                stats = [w for w in stats if w.workload_id in calls]
            else:
                label = config.model
                models = sorted({w.model for w in stats if w.model})
                stats = [w for w in stats if w.model == label]
                if not stats:
                    raise TvmfuseError(f"no ONNX file or tuned model named '{label}'",
                                       hint=f"models in the database: {', '.join(models) or 'none'}")
        if config.kernel:
            needle = config.kernel.lower()
            kept = [w for w in stats if needle in (w.task_name or "").lower() or needle == str(w.workload_id)]
            if not kept:
                names = ", ".join(w.task_name or str(w.workload_id) for w in stats[:8])
                raise TvmfuseError(f"no kernel matches '{config.kernel}'", hint=f"kernels: {names}")
            stats = kept
        views = [_kernel_view(db, w, ceil, planned.get(w.workload_id), calls.get(w.workload_id)
                              if calls else None) for w in stats]
    finally:
        db.close()

    model: dict = {"name": label, "plan": plan_json,
                   "kernel_sum_ms": sum(k["total_ms"] for k in views if k["total_ms"] is not None),
                   "kernel_calls": sum(k["calls"] for k in views), "untuned": untuned}
    if config.artifact is not None:
        model.update(_measure_artifact(Path(config.artifact), config.repeat, config.trust_unsigned))
    elif config.e2e_ms is not None:
        model.update({"e2e_ms": float(config.e2e_ms), "source": "given"})
    else:
        model.update({"e2e_ms": None, "source": None})
    e2e = model["e2e_ms"]
    model["gap_ms"] = None if e2e is None else e2e - model["kernel_sum_ms"]
    model["kernel_share"] = None if not e2e else model["kernel_sum_ms"] / e2e
    model["why"] = _explain(model, views, untuned) if not config.kernel else []
    return {
        "db": str(path), "target": target.canonical, "device": target.device, "ceilings": ceil.to_json(),
        "model": model, "kernels": views,
        "summary": {"kernels": len(views), "trials": sum(k["trials"] for k in views),
                    "failed": sum(k["failed"] for k in views),
                    "tuned": sum(1 for k in views if k["best_ms"] is not None)},
    }
