"""``tvmfuse``: the command line. Each command parses its arguments and makes one library call."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import (JsonOpt, VerboseOpt, emit_json, err, fmt_ms, handle_errors, out, table)

app = typer.Typer(
    name="tvmfuse",
    help="Memory-bound fusion search on Apache TVM: ONNX -> fused, tuned kernels -> a deployable artifact.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

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


@app.command("tune")
def tune_command(
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
    keep_going: bool = typer.Option(False, "--keep-going", help="Exit 0 even when a kernel failed (no schedule of "
                                    "it built and ran); the failures are still reported."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Tune every fused kernel of MODEL with MetaSchedule into the database (resumable)."""
    with handle_errors(verbose):
        from tvmfuse import api
        from tvmfuse.tune import TuneConfig

        cfg = _model_config(model, target, db, planner, input_shape, precision)
        tcfg = TuneConfig(trials=trials, trials_per_kernel=trials_per_kernel, retune=retune, time_budget_s=time_budget)
        with _RichProgress(enabled=not json_out) as progress:
            report = api.tune(cfg, tcfg, progress=progress)
        if json_out:
            emit_json(report)
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
        out.print(f"database: {report['db']}")
        for k in report["kernels"]:
            if k["status"] == "failed" or "default schedule" in (k.get("message") or ""):
                err.print(f"{k['name']}: {k['status']}: {k['message']}")
        if report["failed"] and not keep_going:
            raise typer.Exit(1)


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
    repeat: int = typer.Option(20, "--repeat", min=0, help="Timed runs (0: no timing)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Run an artifact: latency (median, p90) and, with --verify-against, the error against onnxruntime."""
    from tvmfuse.errors import VerificationError

    with handle_errors(verbose):
        from tvmfuse import api

        try:
            report = api.run(artifact, inputs=inputs, verify_against=verify_against, repeat=repeat)
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
        out.print(f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms ({lat['repeat']} runs) on {report['device']}")
    ver = report.get("verification")
    if ver:
        rows = [[o["name"], o["dtype"], f"{o['rel_error']:.2e}", f"{o['tolerance']:g}", "ok" if o["ok"] else "FAIL"]
                for o in ver["outputs"]]
        out.print(table("against onnxruntime", ["output", "dtype", "relative error", "tolerance", ""], rows))


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
