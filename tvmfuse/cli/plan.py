"""``tvmfuse plan MODEL.onnx``: the fused kernels a planner makes, their HBM bytes, and the fusions not taken."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import JsonOpt, VerboseOpt, emit_json, fmt_bytes, handle_errors, out, table


def plan_command(
    model: Path = typer.Argument(..., help="The ONNX model."),
    target: str = typer.Option("auto", "--target", help="auto | llvm | cuda | a TVM target JSON object."),
    planner: Optional[str] = typer.Option(None, "--planner", help="tvmfuse (default) or fuseops (TVM's FuseOps)."),
    input_shape: Optional[List[str]] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 (repeatable)."),
    precision: str = typer.Option("model", "--precision",
                                  help="model | fp32 | fp32-strict | tf32 | fp16, as given to tune."),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Show the fusion plan: groups (pattern, ops), kernels and HBM bytes before/after, rejected fusions."""
    with handle_errors(verbose):
        from tvmfuse.frontend import parse_input_shapes
        from tvmfuse.frontend.precision import check_precision
        from tvmfuse.plan.partition import DEFAULT_PLANNER, plan_model

        _, plan = plan_model(model, target=target, planner=planner or DEFAULT_PLANNER,
                             input_shapes=parse_input_shapes(input_shape), precision=check_precision(precision))
        if as_json:
            emit_json(plan.to_json())
            return
        rows = [[g.name, g.pattern, " ".join(g.ops), f"{g.kernels_unfused} -> 1", fmt_bytes(g.bytes_unfused),
                 fmt_bytes(g.bytes_fused), "; ".join(g.notes)] for g in plan.groups]
        out.print(table(f"fusion plan ({plan.planner}) for {model.name}",
                        ["group", "pattern", "ops", "kernels", "HBM before", "HBM after", "notes"], rows))
        t = plan.totals
        saved = 1 - t["bytes_fused"] / t["bytes_unfused"] if t["bytes_unfused"] else 0.0
        out.print(table("totals", ["kernels before", "kernels after", "HBM before", "HBM after", "saved"],
                        [[t["kernels_unfused"], t["kernels_fused"], fmt_bytes(t["bytes_unfused"]),
                          fmt_bytes(t["bytes_fused"]), f"{saved:.0%}"]]))
        if plan.rewrites:
            out.print(table("rewrites", ["what"], [[r] for r in plan.rewrites]))
        if plan.rejected:
            out.print(table("fusions not taken", ["ops", "reason"],
                            [[" + ".join(r.ops), r.reason] for r in plan.rejected]))
