"""``tvmfuse inspect``: what tuning did, per fused kernel and per model (a thin wrapper of tvmfuse.inspect)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import JsonOpt, VerboseOpt, emit_json, fmt_bytes, fmt_ms, handle_errors, out, table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def inspect_command(
    db: Path = typer.Argument(..., help="Tuning database (SQLite file)."),
    model: Optional[str] = typer.Option(None, "--model", help="ONNX model (re-planned: patterns, calls, plan bytes) or a model label in the database."),
    target: Optional[str] = typer.Option(None, "--target", help="auto | llvm | cuda | a target JSON (default: the file's only target)."),
    kernel: Optional[str] = typer.Option(None, "--kernel", help="Only kernels whose name contains this (or this workload id)."),
    artifact: Optional[Path] = typer.Option(None, "--artifact", help="Artifact folder to run for the end-to-end time."),
    e2e_ms: Optional[float] = typer.Option(None, "--e2e-ms", help="A measured end-to-end time (ms) to compare with."),
    bandwidth_gbs: Optional[float] = typer.Option(None, "--bandwidth-gbs", help="Memory bandwidth ceiling (GB/s) to use instead of the known/measured one."),
    planner: Optional[str] = typer.Option(None, "--planner", help="Planner used by tune (to re-plan --model)."),
    input_shape: Optional[List[str]] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224, as given to tune (repeatable)."),
    precision: str = typer.Option("model", "--precision", help="model | fp32 | fp32-strict | tf32 | fp16, as given "
                                  "to tune (to re-plan --model)."),
    trust_unsigned: bool = typer.Option(False, "--trust-unsigned", help="Run an --artifact whose manifest is unsigned "
                                        "or signed with another key (its library's code runs)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Per fused kernel: pattern, shapes, trials, first and best latency, bandwidth; per model: kernel sum vs end to end."""
    with handle_errors(verbose):
        from tvmfuse.frontend import parse_input_shapes
        from tvmfuse.frontend.precision import check_precision
        from tvmfuse.inspect import InspectConfig, inspect_database

        report = inspect_database(InspectConfig(
            db=db, target=target, model=model, kernel=kernel, artifact=artifact, e2e_ms=e2e_ms,
            bandwidth_gbs=bandwidth_gbs, planner=planner, input_shapes=parse_input_shapes(input_shape),
            precision=check_precision(precision), trust_unsigned=trust_unsigned))
        if json_out:
            emit_json(report)
            return
        _print(report)


def _shapes(k: dict) -> str:
    ins = ",".join("x".join(map(str, b["shape"])) for b in k["inputs"])
    outs = ",".join("x".join(map(str, b["shape"])) for b in k["outputs"])
    return f"{ins} -> {outs}"


def _is_cpu(r: dict) -> bool:
    try:
        return json.loads(r["target"]).get("kind") == "llvm"
    except (TypeError, ValueError, AttributeError):
        return False


def _print(r: dict) -> None:
    c = r["ceilings"]
    cpu = _is_cpu(r)
    memory = c.get("memory") or ("DRAM" if cpu else None)
    bw = "unknown" if c["bandwidth_gbs"] is None else f"{c['bandwidth_gbs']:.1f} GB/s"
    out.print(f"{r['db']}: {r['summary']['kernels']} kernels, {r['summary']['trials']} trials "
              f"({r['summary']['failed']} failed) on {r['device']}; {memory + ' ' if memory else ''}bandwidth "
              f"ceiling {bw} ({c['bandwidth_source']})", highlight=False)
    rows = [[k["workload_id"], k["name"], k["pattern"] + ("" if k["pattern_source"] == "plan" else "*"), _shapes(k)]
            for k in r["kernels"]]
    out.print(table("fused kernels", ["id", "kernel", "pattern", "shapes (in -> out)"], rows))
    # A CPU kernel is timed on inputs that stay in its caches from one run to the next: its GB/s can pass the DRAM
    # ceiling many times over, and a share of that ceiling would read as a measurement error. Its bytes are what
    # it reads and writes, wherever they come from.
    rows = [[k["workload_id"], k["trials"], k["failed"], fmt_ms(None if k["first_ms"] is None else k["first_ms"] / 1e3),
             fmt_ms(None if k["best_ms"] is None else k["best_ms"] / 1e3),
             "-" if not k["speedup"] else f"{k['speedup']:.2f}x", fmt_bytes(k["hbm_bytes"]),
             _num(k["achieved_gbs"], ".2f"), *([] if cpu else [_pct(k["bandwidth_share"])]),
             _num(None if not k.get("achieved_flops_per_s") else k["achieved_flops_per_s"] / 1e12, ".2f"),
             k["calls"]] for k in r["kernels"]]
    columns = ["id", "trials", "failed", "first", "best", "speedup",
               "bytes read+written" if cpu else f"{memory or 'memory'} bytes", "GB/s",
               *([] if cpu else [f"of {memory} BW" if memory else "of BW"]), "TFLOP/s", "calls"]
    out.print(table("tuning", columns, rows))
    if cpu:
        out.print("GB/s: bytes read and written over the best time; the kernels' data can stay in the CPU's caches "
                  "between timed runs, so no share of the DRAM ceiling is shown", highlight=False)
    if any(k["pattern_source"] == "name" for k in r["kernels"]):
        out.print("* pattern read from the kernel's name; give --model MODEL.onnx for the planner's own")
    from tvmfuse.kernels import registry

    for k in r["kernels"]:
        for t in registry():
            if t.config_field and k.get(t.config_field):
                out.print(f"{k['name']} (id {k['workload_id']}) runs "
                          + t.config_words.format(config=k[t.config_field], name=t.name))
    errs = [(k["name"], kind, n) for k in r["kernels"] for kind, n in k["errors"].items()]
    if errs:
        out.print(table("failed trials", ["kernel", "error", "trials"], [[a[:44], b, n] for a, b, n in errs]))
    m = r["model"]
    e2e = m.get("e2e_ms")
    line = f"model {m['name'] or '(all kernels)'}: kernel sum {fmt_ms(m['kernel_sum_ms'] / 1e3)} over {m['kernel_calls']} calls"
    if e2e is not None:
        line += f"; end to end {fmt_ms(e2e / 1e3)} ({m['source']}); kernels are {_pct(m['kernel_share'])} of it"
    out.print(line)
    for reason in m["why"]:
        out.print(f"  - {reason}")
