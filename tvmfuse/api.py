"""The library calls behind the CLI: ``tune``, ``compile``, ``run``. A notebook calls these directly.

Each takes keyword arguments, returns a JSON-ready report dict, and raises ``TvmfuseError`` subclasses for
anything a user can fix.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from tvmfuse import verify
from tvmfuse.db import open_database
from tvmfuse.errors import ArtifactError, ModelError, TvmfuseError, VerificationError
from tvmfuse.frontend import import_model, load_model
from tvmfuse.frontend.precision import TOLERANCE as PRECISION_TOLERANCE
from tvmfuse.frontend.precision import hint as precision_hint
from tvmfuse.plan import partition
from tvmfuse.plan.partition import DEFAULT_PLANNER
from tvmfuse.runtime.loaded import check_digest, manifest_digest
from tvmfuse.target import resolve_target
from tvmfuse.threads import apply_threads
from tvmfuse.tune import TuneConfig, TuneProgress, extract_kernels, tune_kernels
from tvmfuse.tune.retime import finalists_for
from tvmfuse.tune.samples import cpu_trials
from tvmfuse.tune.tuner import make_cost_model
from tvmfuse.tune.warm_start import warm_start

DEFAULT_DB = Path("tuning_logs") / "tvmfuse.db"
EXAMPLE_MODEL = Path(__file__).parent / "data" / "example.onnx"


@dataclass(frozen=True)
class ModelConfig:
    """What every model command shares: the model, its input shapes, the target, the planner, the database."""

    model: Path
    target: str = "auto"
    db: Path = DEFAULT_DB
    planner: str = DEFAULT_PLANNER
    input_shapes: dict = field(default_factory=dict)
    precision: str = "model"  # model | fp32 | fp32-strict | tf32 | fp16 (tvmfuse.frontend.precision)
    threads: int | None = None  # CPU threads of TVM's runtime (None: the physical cores; tvmfuse.threads)


def _resolve(cfg: ModelConfig, rpc=None):
    """The target, and with ``rpc`` (a ``tvmfuse.rpc.RPCOptions``) the remote device and servers it describes:
    ``--target auto|llvm|cuda`` then resolve against the servers' device, and records are keyed by its identity
    (``tvmfuse.rpc.device``). The tracker is asked before the model is read: a wrong address costs no time."""
    if rpc is None:
        return resolve_target(cfg.target), None, []
    from tvmfuse.rpc.device import probe, remote_target

    device, servers = probe(rpc)
    return remote_target(cfg.target, device), device, servers


def _prepare(cfg: ModelConfig, target=None):
    target = target if target is not None else resolve_target(cfg.target)
    loaded = load_model(cfg.model, input_shapes=cfg.input_shapes, precision=cfg.precision)
    mod = import_model(loaded)
    fused, plan = partition(mod, target=target, planner=cfg.planner, precision=cfg.precision)
    return target, loaded, fused, plan


def tune(cfg: ModelConfig, tune_cfg: TuneConfig, *, progress: TuneProgress | None = None,
         stop: Callable[[], bool] | None = None) -> dict:
    """Partition the model, extract one task per fused kernel, tune within the budget into ``cfg.db``.

    ``stop``: polled during tuning; once it returns True the run ends after the trials in flight (see
    :func:`tvmfuse.tune.tune_kernels`) and the report has ``interrupted`` set and the kernels ``left``.

    ``tune_cfg.rpc`` (a :class:`tvmfuse.rpc.RPCOptions`): candidates are built here and measured on the RPC servers
    registered under its key (``rpc.workers`` at a time; default: one per server), and the records are keyed by
    their device (see :func:`_resolve`). A tracker that cannot be reached or no server under the key within
    ``rpc.connect_timeout_s`` raises ``RPCError`` (exit 2). A server that dies mid-run costs only its trials in
    flight: the report's ``rpc`` says which server measured what and which trials were lost, and ``rpc.stopped``
    why the run stopped early when no server was left.
    """
    t0 = time.perf_counter()
    threads = apply_threads(cfg.threads)   # before any TVM run here and before the runner's workers start
    rpc = tune_cfg.rpc
    target, device, servers = _resolve(cfg, rpc)
    target, loaded, fused, plan = _prepare(cfg, target)
    kernels = extract_kernels(fused, target=target)
    # auto resolved once, for the runner and the report alike
    trials = None if target.is_gpu or rpc is not None else cpu_trials(kernels, tune_cfg.cpu_trials)
    if trials is not None:
        tune_cfg = replace(tune_cfg, cpu_trials=trials[0])
    cost_model = make_cost_model(tune_cfg.cost_model)   # before the database: a model that cannot load is exit 2
    runner = ledger = None
    check_note = None
    if rpc is not None:
        from tvmfuse.rpc.runner import make_runner

        rpc = replace(rpc, workers=rpc.workers or len(servers))
        tune_cfg = replace(tune_cfg, rpc=rpc)
        if tune_cfg.check and not target.runs_here():
            # the check runs the best schedule here against its reference: code for the servers' device does not
            # run on this machine (another CPU, or no such GPU)
            tune_cfg = replace(tune_cfg, check=False)
            check_note = (f"best schedules not checked against their reference: they run on {target.device}, "
                          "which this machine is not")
    db = open_database(cfg.db, target=target, spaces_dir=tune_cfg.spaces_dir)   # records keyed by these spaces
    try:
        if rpc is not None:
            runner, ledger = make_runner(rpc, workers=rpc.workers)
        # the run's one model first learns what the database already measured (other shapes, other models)
        warm = warm_start(cost_model, db, target) if tune_cfg.cost_model == "xgb" else 0
        results = tune_kernels(kernels, target=target, database=db, config=tune_cfg, progress=progress,
                               model=loaded.name, stop=stop, cost_model=cost_model, runner=runner, ledger=ledger)
        end_to_end = None
        if (tune_cfg.end_to_end_check and not target.is_gpu and rpc is None and target.runs_here()
                and not (stop is not None and stop()) and any(r.trials_run for r in results)):
            from tvmfuse.compile.model_check import check_model

            if hasattr(progress, "on_end_to_end"):
                progress.on_end_to_end()
            end_to_end = check_model(fused, target=target, database=db)
    finally:
        db.close()
        if runner is not None:
            getattr(runner, "_inst", runner).shutdown()  # the Python object behind MetaSchedule's wrapper
    report = {
        "model": str(cfg.model), "target": target.canonical, "device": target.device, "db": str(cfg.db),
        "planner": plan.planner, "precision": cfg.precision,
        "precision_hint": precision_hint(loaded.proto, cfg.precision, target.is_gpu), "cost_model": tune_cfg.cost_model,
        "threads": threads, "warm_start_records": warm,
        "kernels": [r.to_json() for r in results],
        "trials_run": sum(r.trials_run for r in results),
        "default_schedules_measured": sum(r.baseline_s is not None for r in results),
        "retime_finalists": finalists_for(tune_cfg, target),
        "cpu_trials": None if trials is None else {"mode": trials[0], "why": trials[1]},
        "retimed": sum(bool(r.retimed and "best_ms" in r.retimed) for r in results),
        "retimed_best_changed": sum(bool(r.retimed and r.retimed.get("best_changed")) for r in results),
        "failed": [r.name for r in results if r.status == "failed"],
        "interrupted": bool(stop is not None and stop()),
        "left": [r.name for r in results if r.status in ("interrupted", "skipped-interrupt", "lost")],
        "end_to_end": end_to_end,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if check_note:
        report["check_note"] = check_note
    if rpc is not None:
        report["rpc"] = _rpc_report(rpc, device, servers, ledger)
    return report


def _rpc_report(rpc, device, servers: list[str], ledger) -> dict:
    """Where a remote run measured: per server the trials measured, failed (the kernel's fault) and lost (the
    server's), the losses grouped by server and reason, and why the run stopped early if it did."""
    from collections import Counter

    grouped = Counter((loss.server or "no server", loss.reason) for loss in ledger.losses)
    return {
        "tracker": rpc.tracker, "key": rpc.key, "workers": rpc.workers, "registered": servers,
        "device": device.summary, "described_by": device.described_by,
        "servers": ledger.servers(), "lost_trials": ledger.lost_total(),
        "losses": [{"server": s, "reason": r, "trials": n} for (s, r), n in grouped.most_common()],
        "stopped": ledger.gone or None,
    }


def compile(cfg: ModelConfig, *, out: Path, untuned: bool = False, cuda_graph: bool = True,  # noqa: A001
            rpc=None) -> dict:
    """Apply the best records for the target and export an artifact folder to ``out`` (``cuda_graph``: on a GPU,
    the model replays as one CUDA graph; see ``tvmfuse.compile.build``).

    A target for another machine (``aarch64``, or a JSON with another ``mtriple``) is linked with zig
    (``tvmfuse.compile.cross``); the manifest's ``machine`` names the machine it runs on. ``rpc``: take the target
    and the records' device from the RPC servers under ``rpc.key``, as ``tune`` with the same options did."""
    from tvmfuse.compile import export_artifact
    from tvmfuse.compile.cross import export_options
    from tvmfuse.compile.model_check import build_checked

    t0 = time.perf_counter()
    threads = apply_threads(cfg.threads)
    out = Path(out)
    _check_artifact_folder(out)  # before the build: a bad -o costs no compile time
    target, _device, _servers = _resolve(cfg, rpc)
    export_options(target)  # a cross build without its linker is refused before the build, too
    target, loaded, fused, plan = _prepare(cfg, target)
    use_db = not untuned and Path(cfg.db).exists()
    db = open_database(cfg.db, target=target, create=False) if use_db else None
    try:
        result, end_to_end = build_checked(fused, target=target, database=db, cuda_graph=cuda_graph)
    finally:
        if db is not None:
            db.close()
    try:
        export_artifact(result, out, target=target, inputs=loaded.inputs, outputs=loaded.outputs,
                        model_path=cfg.model, planner=plan.planner,
                        extra={"cuda_graph": result.cuda_graph, "precision": cfg.precision,
                               "threads": threads, "tir_pipeline": result.tir_pipeline,
                               "end_to_end_check": end_to_end})
    except OSError as e:  # a full disk, a folder made read-only since the check
        raise ArtifactError(f"cannot write the artifact folder {out}: {e.strerror or e}") from None
    return {
        "artifact": str(out), "target": target.canonical, "device": target.device, "planner": plan.planner,
        "precision": cfg.precision, "precision_hint": precision_hint(loaded.proto, cfg.precision, target.is_gpu),
        "threads": threads, "kernels": [k.to_json() for k in result.kernels],
        "db": str(cfg.db) if use_db else None, "untuned": result.untuned, "cuda_graph": result.cuda_graph,
        "end_to_end_check": end_to_end,
        "tir_pipeline": result.tir_pipeline, "machine": target.machine(),
        "manifest_digest": manifest_digest(out), "seconds": round(time.perf_counter() - t0, 2),
    }


def _check_artifact_folder(out: Path) -> None:
    """``compile -o``: a folder that holds an artifact or nothing, or can be created."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"-o {out} is a file, not a folder: give a folder for the artifact")
    if out.is_dir():
        from tvmfuse.runtime.loaded import MANIFEST_NAME

        if any(out.iterdir()) and not (out / MANIFEST_NAME).exists():
            raise ArtifactError(f"refusing to overwrite {out}: it exists and is not a tvmfuse artifact")
    # the nearest folder that exists must be a writable folder (the artifact is written beside it, then renamed)
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"cannot create the artifact folder {out}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot create the artifact folder {out}: {parent} is not writable")


def run(artifact: Path, *, inputs: Path | None = None, verify_against: Path | None = None,
        compare_to: Path | None = None, outputs: Path | None = None, repeat: int = 20, warmup: int = 3,
        duration_s: float | None = None, seed: int = 0, profile: bool = False, profile_runs: int = 1,
        trace: Path | None = None, trust_unsigned: bool = False, expect_digest: str | None = None,
        threads: int | None = None) -> dict:
    """Run an artifact: latency (median, p90) and, with ``verify_against``, relative error vs onnxruntime, or with
    ``compare_to``, vs outputs saved in an ``.npz`` (keyed by output name, as ``outputs`` writes them).

    Timing: ``warmup`` untimed runs, then ``repeat`` timed runs, continued until ``duration_s`` seconds have passed
    when that is given.

    ``profile`` (or ``trace``): after ``warmup`` untimed runs, ``profile_runs`` runs with each kernel timed on the
    host (``tvmfuse.runtime.profile``); the report's ``profile`` gives each kernel's calls, time and share, with
    its schedule from the manifest, and ``trace`` is written as a Chrome trace (Trace Event Format JSON).

    ``threads``: TVM's runtime threads (default: the manifest's ``threads``, what it was compiled and tuned
    for, else the physical cores); set before the artifact first runs.

    ``trust_unsigned``: load an artifact whose manifest is unsigned or signed with another key (see
    :func:`tvmfuse.runtime.load_artifact`); the report's ``warnings`` then say so.

    Raises :class:`VerificationError` (exit 1) when any output is beyond its dtype's tolerance.
    """
    import warnings

    from tvmfuse.runtime import load_artifact
    from tvmfuse.runtime.signing import UntrustedArtifactWarning

    if verify_against is not None and compare_to is not None:
        raise TvmfuseError("give --verify-against or --compare-to, not both")
    if outputs is not None:
        _check_writable_file(Path(outputs), "--outputs")
    if trace is not None:
        _check_writable_file(Path(trace), "--trace")
        profile = True
    if profile and profile_runs < 1:
        raise TvmfuseError(f"--profile-runs must be at least 1, not {profile_runs}")
    if expect_digest is not None:   # the deployer's own pin, checked before anything of the artifact is read
        check_digest(artifact, expect_digest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntrustedArtifactWarning)
        art = load_artifact(artifact, trust_unsigned=trust_unsigned)
    notes = [str(w.message) for w in caught if issubclass(w.category, UntrustedArtifactWarning)]
    threads = apply_threads(threads if threads is not None else art.manifest.get("threads"))
    if verify_against is not None:
        _check_model_matches(Path(verify_against), art)
    refs = _load_reference(Path(compare_to), art.output_specs) if compare_to is not None else None
    feeds = verify.load_inputs(inputs, art.input_specs) if inputs else verify.random_inputs(art.input_specs, seed=seed)
    results = art.run(feeds)
    names = [s["name"] for s in art.output_specs]
    report: dict = {"artifact": str(artifact), "device": art.manifest.get("device"), "threads": threads,
                    "signature": {k: v for k, v in art.signature.items() if k != "warning"},
                    "outputs": [{"name": n, "shape": list(o.shape), "dtype": str(o.dtype)}
                                for n, o in zip(names, results)]}
    if notes:
        report["warnings"] = notes
    if outputs is not None:
        save_outputs(Path(outputs), dict(zip(names, results)))
        report["outputs_file"] = str(outputs)
    if repeat > 0 or duration_s:
        t0 = time.perf_counter()
        times = np.array(art.benchmark(feeds, repeat=repeat, warmup=warmup, min_seconds=duration_s or 0.0)) * 1e3
        report["latency_ms"] = {"median": float(np.median(times)), "p90": float(np.percentile(times, 90)),
                                "min": float(times.min()), "mean": float(times.mean()), "repeat": int(times.size),
                                "warmup": warmup, "seconds": round(time.perf_counter() - t0, 3),
                                "duration_s": duration_s}
    if profile:
        prof = art.profile(feeds, runs=profile_runs, warmup=warmup)
        report["profile"] = prof.summary()
        report["profile"]["cuda_graph"] = bool(art.manifest.get("cuda_graph"))
        if trace is not None:
            import json

            try:
                Path(trace).write_text(json.dumps(prof.chrome_trace(label=f"tvmfuse run {Path(artifact).name}")))
            except OSError as e:
                raise TvmfuseError(f"cannot write --trace {trace}: {e.strerror or e}") from None
            report["profile"]["trace"] = str(trace)
    # an artifact compiled below its model's precision (--precision fp16) is held to that precision's tolerance
    loose = PRECISION_TOLERANCE.get(art.manifest.get("precision", "model"), 0.0)
    if verify_against is not None:
        model = load_model(verify_against, input_shapes={s["name"]: tuple(s["shape"]) for s in art.input_specs})
        ort_refs = verify.run_onnxruntime(model.path, feeds)
        floor = verify.quantization_floor(model.path, feeds, ort_refs) if verify.is_quantized(model.proto) else None
        extra = {}
        if floor is not None:
            loose = max(loose, verify.QUANTIZED_SLACK * floor)
            extra = {"quantization_floor": floor, "degenerate_scales": verify.degenerate_scales(model.proto)}
        checks = verify.compare(results, ort_refs, names, min_tolerance=loose)
        if art.manifest.get("precision") == "tf32" and not all(c.ok for c in checks):
            # a deep model's own TF32 error may pass the tolerance: held to the same graph's with TF32 operands
            try:
                tf32 = verify.tf32_floor(model.proto, feeds, ort_refs)
            except ModelError as err:   # no floor: the check keeps the tolerance, and the report says why
                extra.update(tf32_floor=None, tf32_floor_reason=str(err))
            else:
                checks = verify.compare(results, ort_refs, names,
                                        min_tolerance=max(loose, verify.TF32_SLACK * tf32))
                extra.update(tf32_floor=tf32, tf32_slack=verify.TF32_SLACK)
        _verify(report, checks, "onnxruntime", "onnxruntime", extra)
    elif refs is not None:
        for name, out in zip(names, results):
            ref = refs[name]
            if ref.shape != out.shape or ref.dtype != out.dtype:
                error = VerificationError(f"output '{name}' is {out.dtype}{list(out.shape)}, the reference in "
                                          f"{Path(compare_to).name} is {ref.dtype}{list(ref.shape)}")
                report["verification"] = {"reference": str(compare_to), "outputs": [], "ok": False,
                                          "error": str(error)}
                error.report = report
                raise error
        checks = verify.compare(results, [refs[n] for n in names], names, min_tolerance=loose)
        _verify(report, checks, str(compare_to), Path(compare_to).name)
    return report


def _verify(report: dict, checks, reference: str, shown: str, extra: dict | None = None) -> None:
    report["verification"] = {"reference": reference, "outputs": [c.to_json() for c in checks],
                              "ok": all(c.ok for c in checks), **(extra or {})}
    if not report["verification"]["ok"]:
        worst = max(checks, key=lambda c: c.rel_error / max(c.tolerance, 1e-30))
        error = VerificationError(f"output '{worst.name}' differs from {shown}: relative error "
                                  f"{worst.rel_error:.3g} > {worst.tolerance:g}")
        error.report = report
        raise error


def _check_writable_file(path: Path, what: str) -> None:
    """Fail before any work when ``path`` cannot be written as a file: a folder, or a missing or read-only folder."""
    if path.is_dir():
        raise TvmfuseError(f"{what} {path} is a folder; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise TvmfuseError(f"{what} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TvmfuseError(f"{what} {path} cannot be written (permission denied)")


def save_outputs(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an ``.npz`` keyed by output name, at exactly ``path`` (``np.savez`` would add a suffix,
    and its keyword arguments cannot carry an output named ``file``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asanyarray(arr), allow_pickle=False)
    except OSError as e:
        raise TvmfuseError(f"cannot write --outputs {path}: {e.strerror or e}") from None


def _load_reference(path: Path, specs: list[dict]) -> dict[str, np.ndarray]:
    """The saved outputs of ``--compare-to``, one per artifact output, keyed by output name."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise TvmfuseError(f"--compare-to file not found: {path}") from None
    except IsADirectoryError:
        raise TvmfuseError(f"--compare-to {path} is a folder, not an .npz file") from None
    except Exception as e:  # noqa: BLE001 - zipfile/pickle/ValueError: not an npz numpy can read
        raise TvmfuseError(f"--compare-to {path} is not a readable .npz file ({type(e).__name__})") from None
    if not isinstance(data, dict) or not data:
        raise TvmfuseError(f"--compare-to {path} holds no arrays")
    for s in specs:
        if s["name"] not in data:
            raise TvmfuseError(f"--compare-to {path.name} has no output '{s['name']}'",
                               hint="its keys are " + ", ".join(sorted(data)))
    return data


def _model_io(path: Path):
    """({input: (dims or None, dtype or None)}, [output names]) as the ONNX file declares them, without its
    weights; None when it cannot be read here (``load_model`` then says why, in its words)."""
    import onnx

    try:
        m = onnx.load(str(path), load_external_data=False)
        inits = {i.name for i in m.graph.initializer}
        ins = {}
        for vi in m.graph.input:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type
            dims = ([d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]
                    if tt.HasField("shape") else None)
            try:
                dtype = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)))
            except Exception:  # noqa: BLE001 - unknown element types: load_model reports them
                dtype = None
            ins[vi.name] = (dims, dtype)
        return ins, [o.name for o in m.graph.output]
    except Exception:  # noqa: BLE001 - missing, truncated, not ONNX: load_model's errors say it better
        return None


def _check_model_matches(path: Path, art) -> None:
    """``--verify-against``: the model must take the artifact's inputs (names, dtypes, static dims) and give its
    outputs; otherwise say so, naming the first input or output that differs."""
    io = _model_io(path)
    if io is None:
        return
    ins, outs = io
    art_in = {s["name"]: s for s in art.input_specs}
    mismatch = f"{path.name} does not match the artifact"
    listed = f"the artifact's inputs: {', '.join(art_in)}; the model's: {', '.join(ins) or 'none'}"
    missing = [n for n in art_in if n not in ins]
    if missing:
        raise ModelError(f"{mismatch}: it has no input '{missing[0]}'", hint=listed)
    extra = [n for n in ins if n not in art_in]
    if extra:
        raise ModelError(f"{mismatch}: its input '{extra[0]}' is not an input of the artifact", hint=listed)
    for name, spec in art_in.items():
        dims, dtype = ins[name]
        if dtype is not None and dtype != spec["dtype"]:
            raise ModelError(f"{mismatch}: input '{name}' is {dtype} in the model, {spec['dtype']} in the artifact")
        shape = list(spec["shape"])
        if dims is not None and (len(dims) != len(shape) or any(d is not None and d != a for d, a in zip(dims, shape))):
            shown = "x".join("?" if d is None else str(d) for d in dims)
            raise ModelError(f"{mismatch}: input '{name}' is {shown} in the model, "
                             f"{'x'.join(map(str, shape))} in the artifact")
    art_out = [s["name"] for s in art.output_specs]
    if sorted(outs) != sorted(art_out):
        name = next((n for n in art_out if n not in outs), None) or next(n for n in outs if n not in art_out)
        raise ModelError(f"{mismatch}: output '{name}' is not in both",
                         hint=f"the artifact's outputs: {', '.join(art_out)}; the model's: {', '.join(outs)}")
