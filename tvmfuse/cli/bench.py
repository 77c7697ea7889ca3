"""``tvmfuse bench MODEL.onnx``: the tuned build side by side with onnxruntime, stock TVM and PyTorch."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import JsonOpt, ThreadsOpt, VerboseOpt, emit_json, handle_errors, out, table


def bench_command(
    model: Path = typer.Argument(..., help="The ONNX model."),
    target: str = typer.Option("auto", "--target", help="auto | llvm | cuda | a TVM target JSON object."),
    db: Path = typer.Option(Path("tuning_logs/tvmfuse.db"), "--db", help="Tuning database (its records are applied; "
                            "a missing file means an untuned build)."),
    against: str = typer.Option("onnxruntime,tvm-default,torch", "--against",
                                help="Comma-separated baselines: onnxruntime, tvm-default, torch (= torch-eager + "
                                     "torch-compile), torch-all (also torch-compile-ro: mode reduce-overhead, CUDA "
                                     "graphs; torch-compile-max: max-autotune-no-cudagraphs), or any of those names; "
                                     "empty for none."),
    repeat: int = typer.Option(30, "--repeat", min=1, help="Timed samples per backend."),
    number: int = typer.Option(5, "--number", min=1, help="Back-to-back calls per sample (every backend)."),
    planner: Optional[str] = typer.Option(None, "--planner", help="tvmfuse (default) or fuseops."),
    input_shape: Optional[List[str]] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    precision: str = typer.Option("model", "--precision", help="model | fp32 | fp32-strict | tf32 | fp16: every "
                                  "backend runs the converted graph; the check is against onnxruntime on the model "
                                  "as stored."),
    cuda_graph: bool = typer.Option(True, "--cuda-graph/--no-cuda-graph",
                                    help="On a GPU, tvmfuse's build replays as one CUDA graph (static shapes)."),
    torch_tf32: str = typer.Option("auto", "--torch-tf32", help="auto | on | off: PyTorch's fp32 GEMMs and convs "
                                   "on a GPU in TF32 (auto: on for tf32, off for fp32-strict, else PyTorch's "
                                   "defaults: convs on, matmuls off). off: fp32's accuracy, as an fp32 tvmfuse "
                                   "build keeps it."),
    threads: Optional[str] = ThreadsOpt,
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Time the tuned build and the baselines on the same inputs; check every output against onnxruntime."""
    with handle_errors(verbose):
        from tvmfuse.bench import BenchConfig, run_bench
        from tvmfuse.frontend import parse_input_shapes
        from tvmfuse.threads import check_threads

        cfg = BenchConfig(model=model, target=target, db=db, against=tuple(against.split(",")) if against else (),
                          planner=planner, input_shapes=parse_input_shapes(input_shape), repeat=repeat,
                          number=number, seed=seed, cuda_graph=cuda_graph,
                          precision=precision, threads=None if threads is None else check_threads(threads),
                          torch_tf32=torch_tf32)
        report = run_bench(cfg)
        if as_json:
            emit_json(report)
        else:
            _print_table(model, report, precision)
        # the report says which backends ran; a tvmfuse build that did not run is the command's failure
        ours = next((r for r in report["results"] if r["backend"] == "tvmfuse"), {})
        if ours.get("available") is False:
            print(f"error: tvmfuse's build did not run: {ours.get('reason', '')}", file=sys.stderr)
            raise typer.Exit(3)


def _print_table(model: Path, report: dict, precision: str) -> None:
    """The bench report as a table: each backend's times, its ratio to the fastest and its check."""
    fast = min((r["median_ms"] for r in report["results"] if r.get("median_ms")), default=None)
    rows = []
    for r in report["results"]:
        if r.get("median_ms") is None:
            rows.append([r["backend"], "-", "-", "-", "-", "not available: " + r.get("reason", "")])
            continue
        check = "-" if "ok" not in r else ("ok" if r["ok"] else "WRONG") + f" ({r['rel_error']:.1e})"
        if r.get("floor"):   # past the dtype's tolerance, within the plain same-precision run's own error
            floor = report["verification"]["floor"]
            check += f", {floor['backend']}'s {precision} error {floor['rel_error']:.1e}"
        note = r.get("provider", "")
        if r["backend"] == "tvmfuse":
            note = f"{r['untuned_kernels']} untuned kernel(s)" + (", CUDA graph" if r.get("cuda_graph") else "")
            e2e = (report.get("tvmfuse_build") or {}).get("end_to_end_check")
            if e2e and e2e["ships"] == "untuned":
                note += " (the end-to-end check found the tuned build slower)"
        rows.append([r["backend"], f"{r['median_ms']:.3f}", f"{r['p90_ms']:.3f}",
                     f"{r['median_ms'] / fast:.2f}x" if fast else "-", check, note])
    out.print(table(f"{model.name} on {report['device']}, {report['threads']} thread(s)",
                    ["backend", "median ms", "p90 ms", "vs fastest", "vs onnxruntime", "note"], rows))
    quantized = (report.get("verification") or {}).get("quantization_floor")
    if quantized is not None:
        out.print(f"quantized graph: checked against onnxruntime's basic run within "
                  f"{(report['verification']['slack'])}x the graph's own drift ({quantized:.1e}: onnxruntime's "
                  "optimised run, or its run on inputs moved by 1e-6)")
        bad = report["verification"].get("degenerate_scales") or []
        if bad:
            out.print(f"warning: {len(bad)} quantization scale(s) not finite or above 1e30 (first: {bad[0]}): "
                      "dequantizing through them gives inf and NaN in onnxruntime's reference too, so no backend's "
                      "check means much (a calibration that saw a mask's -3.4e38?)")
