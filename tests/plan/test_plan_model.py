"""The embedded example end to end: tvmfuse vs FuseOps (kernels, bytes, numerics), MetaSchedule tasks, CUDA build,
the plan's JSON and the ``tvmfuse plan`` command."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import build_and_run, ort_run, rel_err
from tvmfuse._tvm import dlight, ms, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.plan.partition import DEFAULT_PLANNER
from tvmfuse.target import resolve_target

EXAMPLE = Path(__file__).resolve().parents[2] / "tvmfuse" / "data" / "example.onnx"


@pytest.fixture(scope="module")
def example_mod():
    return import_model(load_model(EXAMPLE))


@pytest.fixture(scope="module")
def planned(example_mod, llvm):
    return {p: partition(example_mod, target=llvm, planner=p) for p in ("tvmfuse", "fuseops")}


def test_default_planner_is_tvmfuse():
    assert DEFAULT_PLANNER == "tvmfuse"


def test_example_fewer_kernels_and_bytes_than_fuseops_same_outputs(planned, example_mod, llvm):
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    # in the model's own layout, as FuseOps keeps it: a CPU plan otherwise adds the channels-last layout changes
    cost = CostModel.for_target(llvm, conv_layout=None)
    (mine, plan), (base_mod, base) = plan_tvmfuse(example_mod, llvm, config=PlannerConfig(cost_model=cost)), \
        planned["fuseops"]
    assert plan.totals["kernels_unfused"] == base.totals["kernels_unfused"]
    assert plan.totals["bytes_unfused"] == base.totals["bytes_unfused"]
    assert plan.totals["kernels_fused"] < base.totals["kernels_fused"]
    assert plan.totals["bytes_fused"] < base.totals["bytes_fused"]
    x = np.random.default_rng(0).standard_normal((1, 8, 16, 16)).astype("float32")
    ref = ort_run(onnx.load(str(EXAMPLE)), [x])[0]
    a, b = build_and_run(mine, llvm, [x])[0], build_and_run(base_mod, llvm, [x])[0]
    assert rel_err(a, ref) < 1e-5 and rel_err(a, b) < 1e-5


def test_fuseops_plan_counts_real_unfused_bytes(planned):
    _, base = planned["fuseops"]
    fused_groups = [g for g in base.groups if len(g.ops) > 1]
    assert fused_groups and all(g.bytes_unfused > g.bytes_fused for g in fused_groups)


def test_plan_json_shape(planned):
    doc = json.loads(json.dumps(planned["tvmfuse"][1].to_json()))
    assert set(doc) >= {"groups", "totals", "rejected"}
    assert set(doc["totals"]) == {"kernels_unfused", "kernels_fused", "bytes_unfused", "bytes_fused"}
    for g in doc["groups"]:
        assert set(g) >= {"name", "pattern", "ops", "bytes_unfused", "bytes_fused"}
    for r in doc["rejected"]:
        assert set(r) == {"ops", "reason"} and r["reason"]


def test_metaschedule_extracts_every_fused_kernel(planned, llvm):
    fused, plan = planned["tvmfuse"]
    tasks = ms.relax_integration.extract_tasks(fused, llvm.target)
    assert {t.task_name for t in tasks} == {g.kernel for g in plan.groups}


def test_cuda_code_builds_for_fused_groups_with_dlight(example_mod):
    cuda = resolve_target("cuda")
    fused, plan = partition(example_mod, target=cuda, planner="tvmfuse")
    for pattern in ("gemm_epilogue",):
        name = plan.by_pattern(pattern)[0].kernel
        mod = tvm.IRModule({"main": fused[name].with_attr("global_symbol", "main")})
        with cuda.target:
            mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                              dlight.gpu.GeneralReduction(), dlight.gpu.Fallback())(mod)
        exe = tvm.compile(mod, cuda.target)
        assert "__global__" in exe.mod.imports[0].inspect_source()


def test_plan_command_json_and_table():
    from typer.testing import CliRunner
    import typer

    from tvmfuse.cli.plan import plan_command

    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("noop")(lambda: None)
    runner = CliRunner()
    res = runner.invoke(app, ["plan", str(EXAMPLE), "--target", "llvm", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["planner"] == "tvmfuse" and doc["totals"]["kernels_fused"] < doc["totals"]["kernels_unfused"]
    res = runner.invoke(app, ["plan", str(EXAMPLE), "--target", "llvm", "--planner", "fuseops"])
    assert res.exit_code == 0 and "fusion plan (fuseops)" in res.stdout
    res = runner.invoke(app, ["plan", "missing.onnx", "--target", "llvm"])
    assert res.exit_code == 2
