"""``tvmfuse``: the command line. Each command parses its arguments and makes one library call."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import (FlagGroup, JsonOpt, ThreadsOpt, VerboseOpt, emit_json, err, fmt_duration, fmt_ms,
                                handle_errors, out, table)
from tvmfuse.cli.progress import RichProgress, trials_text

app = typer.Typer(
    name="tvmfuse",
    help="Memory-bound fusion search on Apache TVM: ONNX -> fused, tuned kernels -> a deployable artifact.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=FlagGroup,
)


def versions() -> dict:
    """tvmfuse's, TVM's and apache-tvm-ffi's versions, read from the installed distributions (importing TVM
    takes seconds); a source build of TVM that is not a distribution is asked directly."""
    from importlib import metadata

    import tvmfuse

    found = {"tvmfuse": tvmfuse.__version__}
    for label, dist, module in (("tvm", "apache-tvm", "tvm"), ("apache-tvm-ffi", "apache-tvm-ffi", "tvm_ffi")):
        try:
            found[label] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            try:
                found[label] = str(__import__(module).__version__)
            except Exception:  # noqa: BLE001 - not installed, or broken: say so rather than fail
                found[label] = None
    return found


def _print_version(value: bool) -> None:
    if value:
        v = versions()
        out.print(f"tvmfuse {v['tvmfuse']}\nTVM {v['tvm'] or 'not installed'}\n"
                  f"apache-tvm-ffi {v['apache-tvm-ffi'] or 'not installed'}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the versions of tvmfuse, TVM and apache-tvm-ffi and exit.")):
    """Memory-bound fusion search on Apache TVM: ONNX -> fused, tuned kernels -> a deployable artifact."""


TargetOpt = typer.Option("auto", "--target",
                         help="auto | llvm | cuda | aarch64 (cross build) | a TVM target JSON object.")
DbOpt = typer.Option(Path("tuning_logs/tvmfuse.db"), "--db", help="Tuning database.")
InputShapeOpt = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 for inputs with dynamic dims (repeatable).")
PrecisionOpt = typer.Option("model", "--precision", help="model (the types it is stored in) | fp32 (on Hopper: "
                             "GEMMs, convs and attention in three TF32 products, fp32's accuracy class) | "
                             "fp32-strict (every kernel on the CUDA cores) | tf32 (fp32 GEMMs, convs and attention "
                             "on a GPU's tensor cores in TF32) | fp16 (fp32 accumulation and statistics; inputs "
                             "and outputs keep their types).")
CudaGraphOpt = typer.Option(True, "--cuda-graph/--no-cuda-graph",
                            help="On a GPU, replay the model's kernels as one CUDA graph (static shapes).")
RpcTrackerOpt = typer.Option(None, "--rpc-tracker", help="Measure on the RPC servers of this tracker (HOST:PORT, "
                             "`tvmfuse rpc tracker`); with --rpc-key. Records are keyed by the servers' device.")
RpcKeyOpt = typer.Option(None, "--rpc-key", help="The key the servers registered under (`tvmfuse rpc server --key`).")


def _planner_default() -> str:
    from tvmfuse.plan.partition import DEFAULT_PLANNER

    return DEFAULT_PLANNER


PlannerOpt = typer.Option(None, "--planner", help="Fusion planner: tvmfuse (default) or fuseops (TVM's stock FuseOps, for comparison).")


def _check_cell(check: dict | None) -> str:
    """The tune table's cell for a kernel's check of its best schedule against the reference."""
    if not check:
        return "-"
    rejected = f", {check['rejected']} rejected" if check.get("rejected") else ""
    if check.get("ok") is None:
        return "not run" + rejected
    return ("ok" if check["ok"] else "WRONG") + rejected


def _model_config(model: Path, target: str, db: Path, planner: Optional[str], input_shape: Optional[List[str]],
                  precision: str = "model", threads: Optional[str] = None):
    from tvmfuse.api import ModelConfig
    from tvmfuse.frontend import parse_input_shapes
    from tvmfuse.frontend.precision import check_precision

    return ModelConfig(model=model, target=target, db=db, planner=planner or _planner_default(),
                       input_shapes=parse_input_shapes(input_shape), precision=check_precision(precision),
                       threads=_threads(threads))


def _threads(value: Optional[str]) -> Optional[int]:
    """``--threads``: a count, checked (one line and exit 2 when bad), or None for the default."""
    from tvmfuse.threads import check_threads

    return None if value is None else check_threads(value)


def _command_line(ctx: typer.Context) -> str:
    """The command as the user gave it (what they typed, as parsed; defaults left out), to run again."""
    import shlex

    args, opts = [], []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if source is None or source.name == "DEFAULT" or source.name == "DEFAULT_MAP":
            continue
        value = ctx.params.get(p.name)
        if p.param_type_name == "argument":
            args.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
            continue
        name = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        if getattr(p, "is_flag", False):
            if value:
                opts.append(name)
            elif p.secondary_opts:
                opts.append(p.secondary_opts[0])
            continue
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            opts += [name, str(v)]
    return shlex.join(["tvmfuse", ctx.info_name or "tune", *args, *opts])


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@app.command("tune")
def tune_command(
    ctx: typer.Context,
    model: Path = typer.Argument(..., help="ONNX model file."),
    target: str = TargetOpt, db: Path = DbOpt,
    trials: int = typer.Option(64, "--trials", min=0, help="New trials this run may spend over all kernels."),
    trials_per_kernel: int = typer.Option(16, "--trials-per-kernel", min=1, help="Budget per fused kernel; kernels whose records reach it are skipped."),
    retune: bool = typer.Option(False, "--retune", help="Spend the budget again on kernels already tuned."),
    time_budget: Optional[float] = typer.Option(
        None, "--time-budget", min=0, help="Wall seconds for the run: every kernel gets its first trials (heaviest "
        "first) before the heaviest get the rest; those not started in time keep their default schedule (resume "
        "later to tune them)."),
    planner: Optional[str] = PlannerOpt, input_shape: Optional[List[str]] = InputShapeOpt,
    precision: str = PrecisionOpt,
    cost_model: str = typer.Option("xgb", "--cost-model", help="xgb (MetaSchedule's XGBoost model, one for the whole "
                                   "run) or random; a model that cannot load stops the run (exit 2)."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Exit 0 even when a kernel failed (no schedule of "
                                    "it built and ran); the failures are still reported."),
    retime: Optional[int] = typer.Option(None, "--retime", min=0, help="After each kernel's search, its N fastest "
                                         "schedules and its default are timed again in interleaved rounds and "
                                         "ranked by those times (default: 4 on CPUs, 0 on GPUs; 0: off)."),
    end_to_end: bool = typer.Option(True, "--e2e-check/--no-e2e-check", help="On a CPU, after tuning: time the "
                                    "whole model's tuned build against its untuned one side by side; compile and "
                                    "bench ship the untuned one where the tuned one was slower."),
    cpu_trials: str = typer.Option("auto", "--cpu-trials", help="cold (each trial's weights flushed from the "
                                   "caches), warm, or auto: cold where the model's weights outgrow half the "
                                   "last-level cache, as a model at batch 1 then reads them from DRAM."),
    rpc_tracker: Optional[str] = RpcTrackerOpt, rpc_key: Optional[str] = RpcKeyOpt,
    rpc_workers: Optional[int] = typer.Option(None, "--rpc-workers", help="Trials measured at once on the RPC "
                                              "servers (default: one per server under the key)."),
    rpc_timeout: Optional[float] = typer.Option(None, "--rpc-timeout", min=1, help="Seconds one trial's RPC session "
                                                "may take (upload, link, timing; default 30): past it the server "
                                                "ends it and the trial fails."),
    threads: Optional[str] = ThreadsOpt,
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Tune every fused kernel of MODEL with MetaSchedule into the database (resumable).

    Ctrl-C (or SIGTERM) stops after the trials in flight and prints the command that resumes; a second one
    aborts at once. With --rpc-tracker and --rpc-key, candidates are built here and measured on the servers
    registered under the key; a server that dies costs only its trials in flight (reported as lost).
    """
    with handle_errors(verbose):
        from tvmfuse.cli.interrupt import abort, exit_code, stop_on_signal

        resume = _command_line(ctx)

        def on_first(signum: int) -> None:
            err.print(f"{_signal_name(signum)}: stopping after the trials in flight; every finished trial is kept "
                      "(press Ctrl-C again to abort now)", highlight=False, markup=False)

        def on_abort(signum: int) -> None:
            abort(signum, f"error: {_signal_name(signum)} again: aborted; the trials committed before it are in "
                          f"{db}; resume with: {resume}")

        # before TVM is imported and any worker started: they inherit the blocked signals (see the module)
        with stop_on_signal(on_first, on_abort) as stop:
            from tvmfuse import api
            from tvmfuse.rpc import rpc_options
            from tvmfuse.tune import TuneConfig

            cfg = _model_config(model, target, db, planner, input_shape, precision, threads)
            rpc = rpc_options(rpc_tracker, rpc_key, workers=rpc_workers, session_timeout_s=rpc_timeout)
            tcfg = TuneConfig(trials=trials, trials_per_kernel=trials_per_kernel, retune=retune,
                              time_budget_s=time_budget, cost_model=cost_model, rpc=rpc, retime_finalists=retime,
                              cpu_trials=cpu_trials, end_to_end_check=end_to_end)
            with RichProgress(enabled=not json_out, time_budget_s=time_budget) as progress:
                report = api.tune(cfg, tcfg, progress=progress, stop=stop)
        interrupted = stop()
        if interrupted:
            report["interrupted"] = True
            report["resume"] = resume
        out_of_time = [k["name"] for k in report["kernels"] if k["status"] == "skipped-time"]
        if out_of_time and not interrupted:
            report["left_untuned"] = out_of_time
            report["resume"] = resume
        remote = report.get("rpc")
        gone = bool(remote and remote["stopped"]) and not interrupted
        if gone or (remote and remote["lost_trials"]):
            report["resume"] = resume  # lost trials are not stored: the same command measures them again
        if json_out:
            emit_json(report)
        else:
            kernels = _table_order(report["kernels"])
            rows = [[k["name"][:48], k["weight"], k["status"], k["trials_before"], k["trials_run"],
                     fmt_ms(None if k["baseline_ms"] is None else k["baseline_ms"] / 1e3),
                     fmt_ms(None if k["best_ms"] is None else k["best_ms"] / 1e3),
                     "-" if not k["speedup_vs_default"] else f"{k['speedup_vs_default']:.2f}x",
                     _check_cell(k["check"])] for k in kernels]
            out.print(table(f"tuned {Path(report['model']).name} on {report['device']} ({report['seconds']} s)",
                            ["kernel", "calls", "status", "trials before", "trials run", "default", "best",
                             "vs default", "check"], rows, caption=TABLE_ORDER))
            out.print(f"database: {report['db']}; cost model: {report['cost_model']} (one for the run, "
                      f"warm-started with {report['warm_start_records']} records of the database)")
            if report.get("precision_hint"):
                err.print(f"note: {report['precision_hint']}", highlight=False)
            if report.get("cpu_trials"):
                out.print(f"CPU trials: {report['cpu_trials']['mode']} ({report['cpu_trials']['why']})")
            if report["retime_finalists"]:
                out.print(f"retimed: {report['retimed']} kernels' {report['retime_finalists']} fastest schedules and "
                          f"default, side by side; another schedule came first for {report['retimed_best_changed']}")
            if report.get("end_to_end"):
                e2e = report["end_to_end"]
                out.print(f"end to end ({e2e['rounds']} interleaved rounds): tuned {e2e['tuned_ms']:.3f} ms, untuned "
                          f"{e2e['untuned_ms']:.3f} ms; compile ships the {e2e['ships']} build")
            chosen = [f"{k['name'][:32]}: {k['default']}" for k in kernels
                      if (k.get("default") or "").startswith("model")]
            if chosen:   # a template default the cost model picked, not the hand rule
                out.print("default: " + "; ".join(chosen) + "; the others' default: rule")
            for k in kernels:
                if k["status"] == "failed" or "default schedule" in (k.get("message") or ""):
                    err.print(f"{k['name']}: {k['status']}: {k['message']}")
            if remote:
                _print_remote(remote, report.get("check_note"))
        if gone:
            left = report.get("left") or []
            err.print(f"error: {remote['stopped']}: the run stopped with {len(left)} of {len(report['kernels'])} "
                      f"kernels left; resume with: {resume}", highlight=False, markup=False)
            raise typer.Exit(2)
        if interrupted:
            _print_interrupted(report, resume)
            raise typer.Exit(exit_code(stop.signum))
        if out_of_time:
            _print_out_of_time(report, time_budget, resume)
        if report["failed"] and not keep_going:
            raise typer.Exit(1)


# the tune table's rows: what needs a look first (failed), then what this run tuned, then what it left alone;
# within each group the kernels that take the most of the model's time first
_STATUS_GROUP = {"failed": 0, "tuned": 1, "resumed": 1, "interrupted": 1, "lost": 1}
TABLE_ORDER = ("order: failed, then tuned (resumed, interrupted, lost), then skipped or exhausted; within each, the "
               "most model time first (calls x best time)")


def _print_remote(remote: dict, check_note: str | None) -> None:
    """Where a remote run measured, and what it lost (lost trials are no verdict on a kernel and are not stored)."""
    measured = [f"{name} ({trials_text(n['measured'] + n['failed'])})" for name, n in remote["servers"].items()
                if n["measured"] + n["failed"]]
    out.print(f"measured on {remote['device']} through {remote['tracker']} (key '{remote['key']}', "
              f"{remote['workers']} at a time): " + (", ".join(measured) or "nothing measured"), highlight=False)
    if remote["lost_trials"]:
        where = "; ".join(f"{x['trials']} on {x['server']}: {x['reason']}" for x in remote["losses"][:4])
        more = f"; and {len(remote['losses']) - 4} more" if len(remote["losses"]) > 4 else ""
        err.print(f"lost {trials_text(remote['lost_trials'])} ({where}{more}): a lost trial is not stored, and the same "
                  "command measures it again", highlight=False, markup=False)
    if check_note:
        out.print(f"note: {check_note}", highlight=False)


def _table_order(kernels: list[dict]) -> list[dict]:
    def model_ms(k: dict) -> float:
        ms = k["best_ms"] if k["best_ms"] is not None else k["baseline_ms"]
        return (ms or 0.0) * max(1, k["weight"])

    return sorted(kernels, key=lambda k: (_STATUS_GROUP.get(k["status"], 2), -model_ms(k), -k["weight"], k["name"]))


def _names(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _print_out_of_time(report: dict, time_budget: float | None, resume: str) -> None:
    left = report["left_untuned"]
    budget = f" ({fmt_duration(time_budget)})" if time_budget is not None else ""
    err.print(f"time budget{budget} spent: {len(left)} of {len(report['kernels'])} kernels left untuned "
              f"({_names(left)}); they keep their default schedule until tuned", highlight=False, markup=False)
    err.print(f"continue with: {resume}", highlight=False, markup=False)


def _print_interrupted(report: dict, resume: str) -> None:
    left = report.get("left") or []
    if left:
        what = f"{len(left)} of {len(report['kernels'])} kernels left to tune ({_names(left)})"
    else:
        what = "no kernel left to tune"
    err.print(f"interrupted: {what}; every finished trial is in {report['db']}", highlight=False, markup=False)
    err.print(f"resume with: {resume}", highlight=False, markup=False)


@app.command("compile")
def compile_command(
    model: Path = typer.Argument(..., help="ONNX model file."),
    output: Path = typer.Option(..., "-o", "--output", help="Artifact folder to write."),
    target: str = TargetOpt, db: Path = DbOpt, planner: Optional[str] = PlannerOpt,
    input_shape: Optional[List[str]] = InputShapeOpt,
    untuned: bool = typer.Option(False, "--untuned", help="Ignore the database (a baseline build)."),
    cuda_graph: bool = CudaGraphOpt, precision: str = PrecisionOpt,
    rpc_tracker: Optional[str] = RpcTrackerOpt, rpc_key: Optional[str] = RpcKeyOpt,
    threads: Optional[str] = typer.Option(None, "--threads", help="CPU threads of TVM's runtime, recorded in the "
                                          "manifest for `run` (default: the physical cores)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Apply the best records and export an artifact folder (library, params, manifest).

    --target aarch64 (or a JSON with another "mtriple") builds for another machine, linked with zig
    (pip install 'tvmfuse[cross]'); with --rpc-tracker and --rpc-key the target and records are the RPC servers'
    device, as `tune` with the same options measured them."""
    with handle_errors(verbose):
        from tvmfuse import api
        from tvmfuse.rpc import rpc_options

        rpc = rpc_options(rpc_tracker, rpc_key)
        report = api.compile(_model_config(model, target, db, planner, input_shape, precision, threads), out=output,
                             untuned=untuned,
                             cuda_graph=cuda_graph, rpc=rpc)
        if json_out:
            emit_json(report)
            return
        rows = [[k["name"][:56], k["schedule"], fmt_ms(None if k["best_ms"] is None else k["best_ms"] / 1e3)]
                for k in report["kernels"]]
        out.print(table(f"artifact {report['artifact']} ({report['seconds']} s)", ["kernel", "schedule", "tuned latency"], rows))
        if report["db"] is None and not untuned:
            err.print(f"note: no tuning database at {db}: every kernel runs its untuned default, named in the schedule column (run `tvmfuse tune` first)")
        if report.get("precision_hint"):
            err.print(f"note: {report['precision_hint']}", highlight=False)
        n_untuned = len(report["untuned"])
        _print_end_to_end(report.get("end_to_end_check"))
        machine = report.get("machine") or {}
        if machine.get("arch") and machine["arch"] != _host_arch():
            out.print(f"built for {machine['triple']} (another machine: `tvmfuse run` it there)", highlight=False)
        out.print(f"manifest digest: {report['manifest_digest']} (pin it: tvmfuse run --expect-digest)")
        n_pre = sum(k["schedule"] == "prescheduled" for k in report["kernels"])
        out.print(f"{len(rows) - n_untuned - n_pre}/{len(rows)} kernels run a tuned schedule"
                  + (f"; {n_pre} run topi's own schedule (sorts, scans: prescheduled)" if n_pre else "")
                  + (f"; untuned: {', '.join(report['untuned'][:5])}{' ...' if n_untuned > 5 else ''}" if n_untuned else ""))


def _print_end_to_end(check: dict | None) -> None:
    """The database's end-to-end check of the model, where there is one, and which build it made ship."""
    if not check:
        return
    times = f"tuned {check['tuned_ms']:.3f} ms, untuned {check['untuned_ms']:.3f} ms"
    if check["ships"] == "untuned":
        err.print(f"note: every kernel runs its untuned default: tune's end-to-end check timed the tuned build "
                  f"slower ({times}); `tvmfuse tune --no-e2e-check` keeps the records' schedules", highlight=False)
    elif not check["current"]:
        out.print(f"end-to-end check ({times}) predates the newest records: not applied", highlight=False)
    else:
        out.print(f"end-to-end check: {times}", highlight=False)


@app.command("run")
def run_command(
    artifact: Path = typer.Argument(..., help="Artifact folder from `tvmfuse compile`."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help=".npz keyed by input name (default: random inputs)."),
    verify_against: Optional[Path] = typer.Option(None, "--verify-against", help="ONNX model to compare with under onnxruntime."),
    compare_to: Optional[Path] = typer.Option(None, "--compare-to", help="Outputs saved by --outputs (.npz keyed by "
                                              "output name) to compare with, at --verify-against's tolerances."),
    outputs: Optional[Path] = typer.Option(None, "--outputs", help="Save the outputs to this .npz, keyed by output name."),
    repeat: int = typer.Option(20, "--repeat", min=0, help="Timed runs, at least (0: no timing)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed runs before the timed ones."),
    duration: Optional[float] = typer.Option(None, "--duration", min=0, help="Keep timing until this many seconds "
                                             "have passed (and --repeat runs are done)."),
    profile: bool = typer.Option(False, "--profile", help="Time each kernel of the artifact's own run (host-timed, "
                                 "launch included), after --warmup runs; joined with the manifest's schedules."),
    profile_runs: int = typer.Option(1, "--profile-runs", min=1, help="Profiled runs, averaged."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="With --profile (implied): write the kernels' "
                                         "timeline as a Chrome trace (JSON for chrome://tracing or Perfetto)."),
    trust_unsigned: bool = typer.Option(False, "--trust-unsigned", help="Load an artifact whose manifest is "
                                        "unsigned or signed with another key (a warning says so)."),
    expect_digest: Optional[str] = typer.Option(None, "--expect-digest", help="Refuse the artifact unless its "
                                                "manifest's digest is this one (`compile` prints it: sha256:HEX)."),
    threads: Optional[str] = typer.Option(None, "--threads", help="CPU threads of TVM's runtime (default: the "
                                          "manifest's, else the physical cores)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Run an artifact: latency (median, p90) and, with --verify-against or --compare-to, the error against a reference.

    The manifest's signature is checked with this machine's signing key before anything is loaded (README:
    deploying to another machine).
    """
    from tvmfuse.errors import VerificationError

    with handle_errors(verbose):
        from tvmfuse import api

        try:
            report = api.run(artifact, inputs=inputs, verify_against=verify_against, compare_to=compare_to,
                             outputs=outputs, repeat=repeat, warmup=warmup, duration_s=duration, profile=profile,
                             profile_runs=profile_runs, trace=trace, trust_unsigned=trust_unsigned,
                             expect_digest=expect_digest, threads=_threads(threads))
        except VerificationError as e:
            report = getattr(e, "report", {})
            _print_warnings(report)
            if json_out:
                emit_json(report)
            raise
        _print_warnings(report)
        if json_out:
            emit_json(report)
            return
        _print_run(report)


def _host_arch() -> str:
    from tvmfuse.machine import host_arch

    return host_arch()


def _print_warnings(report: dict) -> None:
    for note in report.get("warnings") or []:
        err.print(f"warning: {note}", highlight=False, markup=False)


def _print_run(report: dict) -> None:
    lat = report.get("latency_ms")
    if lat:
        out.print(f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms ({lat['repeat']} runs in "
                  f"{lat['seconds']:.2f} s, after {lat['warmup']} warm-up) on {report['device']}, "
                  f"{report.get('threads')} thread(s)", highlight=False)
    if report.get("outputs_file"):
        out.print(f"outputs saved to {report['outputs_file']}", highlight=False)
    ver = report.get("verification")
    if ver:
        rows = [[o["name"], o["dtype"], f"{o['rel_error']:.2e}", f"{o['tolerance']:g}", "ok" if o["ok"] else "FAIL"]
                for o in ver["outputs"]]
        shown = ver["reference"] if ver["reference"] == "onnxruntime" else Path(ver["reference"]).name
        out.print(table(f"against {shown}", ["output", "dtype", "relative error", "tolerance", ""], rows))
    if report.get("profile"):
        _print_profile(report["profile"])


def _print_profile(prof: dict) -> None:
    rows = [[k["name"][:56], k["schedule"] or "-", k["calls"], fmt_ms(k["total_ms"] / 1e3),
             fmt_ms(None if k["mean_ms"] is None else k["mean_ms"] / 1e3), f"{100 * k['share']:.1f}%",
             fmt_ms(None if k["tuned_ms"] is None else k["tuned_ms"] / 1e3)] for k in prof["kernels"]]
    runs = f"{prof['runs']} run{'s' if prof['runs'] != 1 else ''}"
    out.print(table(f"kernels of one run (mean of {runs}, after {prof['warmup']} warm-up): "
                    f"{fmt_ms(prof['kernels_ms'] / 1e3)} in kernels of {fmt_ms(prof['run_ms'] / 1e3)}",
                    ["kernel", "schedule", "calls", "time", "per call", "share", "tuned latency"], rows,
                    caption="share: of the kernels' time; heaviest first"))
    out.print(f"note: {prof['note']}", highlight=False)
    if prof.get("cuda_graph"):
        out.print("note: the artifact replays its kernels as one CUDA graph, timed as [cuda graph]; compile with "
                  "--no-cuda-graph to time them one by one", highlight=False)
    if prof.get("trace"):
        out.print(f"trace: {prof['trace']} (open in chrome://tracing or https://ui.perfetto.dev)", highlight=False)


@app.command("example")
def example_command(
    workdir: Path = typer.Option(Path("tuning_logs"), "--workdir", help="Where the database and the artifact go."),
    trials: int = typer.Option(64, "--trials", min=0), target: str = TargetOpt,
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """The embedded example end to end: tune, compile, run and verify against onnxruntime."""
    from tvmfuse.errors import VerificationError

    with handle_errors(verbose):
        from tvmfuse import api
        from tvmfuse.tune import TuneConfig

        cfg = _model_config(api.EXAMPLE_MODEL, target, workdir / "tvmfuse.db", None, None)
        with RichProgress(enabled=not json_out) as progress:
            tuned = api.tune(cfg, TuneConfig(trials=trials), progress=progress)
        built = api.compile(cfg, out=workdir / "example.artifact")
        try:
            ran = api.run(workdir / "example.artifact", verify_against=api.EXAMPLE_MODEL, repeat=50)
        except VerificationError as e:
            ran = getattr(e, "report", {})
            if json_out:
                emit_json({"tune": tuned, "compile": built, "run": ran})
            raise
        if json_out:
            emit_json({"tune": tuned, "compile": built, "run": ran})
            return
        n = len(built["kernels"])
        out.print(f"tuned {n} fused kernels ({tuned['trials_run']} new trials, "
                  f"{tuned['default_schedules_measured']} of them default schedules, {tuned['seconds']} s); "
                  f"{n - len(built['untuned'])}/{n} run a tuned schedule; artifact: {built['artifact']}")
        _print_end_to_end(built.get("end_to_end_check"))
        _print_run(ran)


@app.command("version")
def version_command(json_out: bool = JsonOpt):
    """The versions of tvmfuse, TVM and apache-tvm-ffi."""
    if json_out:
        emit_json(versions())
        return
    _print_version(True)


def _register_subcommands() -> None:
    """Commands owned by other stages (plan, db, inspect, bench, rpc) register here when present."""
    import importlib

    for module, name, kind in (("tvmfuse.cli.plan", "plan", "command"), ("tvmfuse.cli.db", "db", "typer"),
                               ("tvmfuse.cli.inspect", "inspect", "command"), ("tvmfuse.cli.bench", "bench", "command"),
                               ("tvmfuse.cli.rpc", "rpc", "typer")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        if kind == "typer":
            app.add_typer(mod.app, name=name)
        else:
            app.command(name)(getattr(mod, f"{name}_command"))


_register_subcommands()


def main() -> None:
    """The console entry point. A usage error (an unknown flag, a missing argument, a bad value) is one line and
    exit 2, as every other bad input is, instead of click's boxed usage text."""
    import os
    import sys

    usage_error, abort = _click_exceptions()
    try:
        code = app(standalone_mode=False)
    except usage_error as e:
        where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        print(f"error: {e.format_message()}{where}", file=sys.stderr)
        sys.exit(2)
    except abort:  # Ctrl-C outside the commands that handle it themselves
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`tvmfuse ... | head`): nothing more to say to it
        # stdout's buffer would raise again at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    sys.exit(code if isinstance(code, int) else 0)


def _click_exceptions() -> tuple[type, type]:
    """click's UsageError and Abort as the installed typer raises them. Typer vendors its own click
    (``typer._click``) from 0.25 on, and from 0.29 its Abort lives in ``typer.exceptions``; an ``except`` naming a
    class that is not there turns every exception it meets into an AttributeError traceback."""
    try:
        from typer._click import exceptions as errors
    except ImportError:
        from click import exceptions as errors
    abort = getattr(errors, "Abort", None)
    if abort is None:
        from typer.exceptions import Abort as abort
    return errors.UsageError, abort


if __name__ == "__main__":
    main()
