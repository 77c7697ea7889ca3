"""``tvmfuse``: the command line. Each command parses its arguments and makes one library call."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import (FlagGroup, JsonOpt, VerboseOpt, emit_json, err, fmt_ms, handle_errors, out,
                                table)

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


TargetOpt = typer.Option("auto", "--target", help="auto | llvm | cuda | a TVM target JSON object.")
DbOpt = typer.Option(Path("tuning_logs/tvmfuse.db"), "--db", help="Tuning database.")
InputShapeOpt = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 for inputs with dynamic dims (repeatable).")
PrecisionOpt = typer.Option("model", "--precision", help="model (the types it is stored in) | fp32 | fp16 (fp32 "
                             "accumulation and statistics; inputs and outputs keep their types).")
CudaGraphOpt = typer.Option(True, "--cuda-graph/--no-cuda-graph",
                            help="On a GPU, replay the model's kernels as one CUDA graph (static shapes).")


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
                  precision: str = "model"):
    from tvmfuse.api import ModelConfig
    from tvmfuse.frontend import parse_input_shapes
    from tvmfuse.frontend.precision import check_precision

    return ModelConfig(model=model, target=target, db=db, planner=planner or _planner_default(),
                       input_shapes=parse_input_shapes(input_shape), precision=check_precision(precision))


class _RichProgress:
    """Kernels done/total, trials, best latency so far (stderr, so --json keeps stdout clean)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._progress = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=err)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def on_start(self, kernels, budgets):
        self.kernels, self.budgets = kernels, budgets
        if self._progress:
            self._k = self._progress.add_task("kernels", total=len(kernels), detail="")
            self._t = self._progress.add_task("trials", total=max(1, sum(budgets)), detail="")
            self._done_trials = 0

    def on_batch(self, index, trials_done, best_s):
        if self._progress:
            self._progress.update(self._t, completed=self._done_trials + trials_done,
                                  detail=f"{self.kernels[index].name[:40]}  best {fmt_ms(best_s)}")

    def on_kernel_done(self, index, result):
        if self._progress:
            self._done_trials += result.trials_run
            self._progress.update(self._t, completed=self._done_trials)
            self._progress.update(self._k, advance=1, detail=f"{result.name[:40]}: {result.status}")


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
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Tune every fused kernel of MODEL with MetaSchedule into the database (resumable).

    Ctrl-C (or SIGTERM) stops after the trials in flight and prints the command that resumes; a second one
    aborts at once.
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
            from tvmfuse.tune import TuneConfig

            cfg = _model_config(model, target, db, planner, input_shape, precision)
            tcfg = TuneConfig(trials=trials, trials_per_kernel=trials_per_kernel, retune=retune,
                              time_budget_s=time_budget, cost_model=cost_model)
            with _RichProgress(enabled=not json_out) as progress:
                report = api.tune(cfg, tcfg, progress=progress, stop=stop)
        interrupted = stop()
        if interrupted:
            report["interrupted"] = True
            report["resume"] = resume
        if json_out:
            emit_json(report)
            if interrupted:
                _print_interrupted(report, resume)
                raise typer.Exit(exit_code(stop.signum))
            if report["failed"] and not keep_going:
                raise typer.Exit(1)
            return
        rows = [[k["name"][:48], k["status"], k["trials_before"], k["trials_run"],
                 fmt_ms(None if k["baseline_ms"] is None else k["baseline_ms"] / 1e3),
                 fmt_ms(None if k["best_ms"] is None else k["best_ms"] / 1e3),
                 "-" if not k["speedup_vs_default"] else f"{k['speedup_vs_default']:.2f}x",
                 _check_cell(k["check"])] for k in report["kernels"]]
        out.print(table(f"tuned {Path(report['model']).name} on {report['device']} ({report['seconds']} s)",
                        ["kernel", "status", "trials before", "trials run", "default", "best", "vs default",
                         "check"], rows))
        out.print(f"database: {report['db']}; cost model: {report['cost_model']} (one for the run)")
        for k in report["kernels"]:
            if k["status"] == "failed" or "default schedule" in (k.get("message") or ""):
                err.print(f"{k['name']}: {k['status']}: {k['message']}")
        if interrupted:
            _print_interrupted(report, resume)
            raise typer.Exit(exit_code(stop.signum))
        if report["failed"] and not keep_going:
            raise typer.Exit(1)


def _print_interrupted(report: dict, resume: str) -> None:
    left = report.get("left") or []
    if left:
        names = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        what = f"{len(left)} of {len(report['kernels'])} kernels left to tune ({names})"
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
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Apply the best records and export an artifact folder (library, params, manifest)."""
    with handle_errors(verbose):
        from tvmfuse import api

        report = api.compile(_model_config(model, target, db, planner, input_shape, precision), out=output, untuned=untuned,
                             cuda_graph=cuda_graph)
        if json_out:
            emit_json(report)
            return
        rows = [[k["name"][:56], k["schedule"], fmt_ms(None if k["best_ms"] is None else k["best_ms"] / 1e3)]
                for k in report["kernels"]]
        out.print(table(f"artifact {report['artifact']} ({report['seconds']} s)", ["kernel", "schedule", "tuned latency"], rows))
        if report["db"] is None and not untuned:
            err.print(f"note: no tuning database at {db}: every kernel keeps TVM's default schedule (run `tvmfuse tune` first)")
        n_untuned = len(report["untuned"])
        out.print(f"{len(rows) - n_untuned}/{len(rows)} kernels run a tuned schedule"
                  + (f"; untuned: {', '.join(report['untuned'][:5])}{' ...' if n_untuned > 5 else ''}" if n_untuned else ""))


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
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Run an artifact: latency (median, p90) and, with --verify-against or --compare-to, the error against a reference."""
    from tvmfuse.errors import VerificationError

    with handle_errors(verbose):
        from tvmfuse import api

        try:
            report = api.run(artifact, inputs=inputs, verify_against=verify_against, compare_to=compare_to,
                             outputs=outputs, repeat=repeat, warmup=warmup, duration_s=duration)
        except VerificationError as e:
            if json_out:
                emit_json(getattr(e, "report", {}))
            raise
        if json_out:
            emit_json(report)
            return
        _print_run(report)


def _print_run(report: dict) -> None:
    lat = report.get("latency_ms")
    if lat:
        out.print(f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms ({lat['repeat']} runs in "
                  f"{lat['seconds']:.2f} s, after {lat['warmup']} warm-up) on {report['device']}", highlight=False)
    if report.get("outputs_file"):
        out.print(f"outputs saved to {report['outputs_file']}", highlight=False)
    ver = report.get("verification")
    if ver:
        rows = [[o["name"], o["dtype"], f"{o['rel_error']:.2e}", f"{o['tolerance']:g}", "ok" if o["ok"] else "FAIL"]
                for o in ver["outputs"]]
        shown = ver["reference"] if ver["reference"] == "onnxruntime" else Path(ver["reference"]).name
        out.print(table(f"against {shown}", ["output", "dtype", "relative error", "tolerance", ""], rows))


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
        with _RichProgress(enabled=not json_out) as progress:
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
        _print_run(ran)


@app.command("version")
def version_command(json_out: bool = JsonOpt):
    """The versions of tvmfuse, TVM and apache-tvm-ffi."""
    if json_out:
        emit_json(versions())
        return
    _print_version(True)


def _register_subcommands() -> None:
    """Commands owned by other stages (plan, db, inspect, bench) register here when present."""
    import importlib

    for module, name, kind in (("tvmfuse.cli.plan", "plan", "command"), ("tvmfuse.cli.db", "db", "typer"),
                               ("tvmfuse.cli.inspect", "inspect", "command"), ("tvmfuse.cli.bench", "bench", "command")):
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
    app()


if __name__ == "__main__":
    main()
