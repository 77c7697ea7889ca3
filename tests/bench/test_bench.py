"""tvmfuse bench: the tuned build beside the baselines on one set of inputs, checked against onnxruntime;
and the kernel check: fresh inputs, outputs poisoned, an unwritten output fails."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from tvmfuse._tvm import tvm
from tvmfuse.bench import BenchConfig, run_bench
from tvmfuse.bench.torch_onnx import Unsupported, check_supported


@pytest.fixture(scope="module")
def bench_report(example_model):
    return run_bench(BenchConfig(model=example_model, target="llvm", db=None, repeat=3, number=1,
                                 against=("onnxruntime", "tvm-default", "torch")))


def test_bench_reports_every_backend_with_latency_and_a_check(bench_report):
    results = {r["backend"]: r for r in bench_report["results"]}
    assert list(results) == ["tvmfuse", "tvm-default", "onnxruntime", "torch-eager", "torch-compile"]
    for name in ("tvmfuse", "tvm-default", "onnxruntime"):
        r = results[name]
        assert 0 < r["median_ms"] <= r["p90_ms"], r
        assert r["ok"] and r["rel_error"] < 1e-4, r  # same inputs, checked against onnxruntime
    assert results["tvmfuse"]["untuned_kernels"] == len(bench_report["tvmfuse_build"]["untuned"])
    for name in ("torch-eager", "torch-compile"):
        r = results[name]
        try:
            import torch  # noqa: F401
        except ImportError:
            assert r["available"] is False and "torch" in r["reason"] and r["median_ms"] is None
        else:
            assert r.get("median_ms") is not None or r.get("available") is False


def test_bench_cli_json(example_model, tmp_path):
    from tvmfuse.cli.main import app

    res = CliRunner().invoke(app, ["bench", str(example_model), "--target", "llvm", "--db", str(tmp_path / "none.db"),
                                   "--against", "onnxruntime", "--repeat", "2", "--number", "3", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["backend"] for r in doc["results"]] == ["tvmfuse", "onnxruntime"]
    assert doc["calls_per_sample"] == 3   # every backend's sample: the mean of 3 back-to-back calls
    for r in doc["results"]:
        assert {"backend", "median_ms", "p90_ms"} <= set(r) and r["samples"] == 2


def test_bench_samples_the_backends_in_turn(example_model, monkeypatch):
    """One sample of each backend a round, after all are built: a load that comes and goes mid-run slows them alike
    (taken one backend after another, a shared CPU ran onnxruntime's ResNet-50 at 8 ms, then at 17)."""
    import tvmfuse.bench as bench

    order: list[str] = []

    def spy(name, make):
        def wrapped(*args, **kwargs):
            outs, sample, *rest = make(*args, **kwargs)
            return (outs, lambda: order.append(name) or sample(), *rest)
        return wrapped

    monkeypatch.setattr(bench, "_tvm_run", spy("tvm", bench._tvm_run))
    monkeypatch.setattr(bench, "_ort", spy("onnxruntime", bench._ort))
    monkeypatch.setattr(bench, "QUIET_S", 0.0)   # no gap: every sampler call is a kept sample
    report = run_bench(BenchConfig(model=example_model, target="llvm", db=None, repeat=3, number=1,
                                   against=("onnxruntime", "tvm-default")))
    assert order == ["tvm", "tvm", "onnxruntime"] * 3
    assert all(r["samples"] == 3 and r["ok"] for r in report["results"]), report["results"]
    # on the CPU each sample comes after a quiet gap and untimed calls of its own backend (the other runtime's
    # threads stop spinning first): still one kept sample of each backend a round, in turn
    order.clear()
    monkeypatch.setattr(bench, "QUIET_S", 0.01)
    monkeypatch.setattr(bench, "WARM_S", 0.005)
    report = run_bench(BenchConfig(model=example_model, target="llvm", db=None, repeat=3, number=1,
                                   against=("onnxruntime", "tvm-default")))
    groups = [[order[0], 1]]
    for name in order[1:]:
        if name == groups[-1][0]:
            groups[-1][1] += 1
        else:
            groups.append([name, 1])
    # tvmfuse's and tvm-default's calls run together (both "tvm"): at least a warm-up and a sample each
    assert [g[0] for g in groups] == ["tvm", "onnxruntime"] * 3, groups
    assert all(n >= (4 if name == "tvm" else 2) for name, n in groups), groups
    assert all(r["samples"] == 3 and r["ok"] for r in report["results"]), report["results"]


def test_a_build_that_does_not_run_is_its_row_and_the_commands_failure(example_model, tmp_path, monkeypatch):
    """A tvmfuse build whose first call fails (a kernel the GPU refused to launch) is reported in its row with the
    lines that name the kernel, the baselines are still timed and checked, and the command exits 3 after printing
    the report. (The failure is injected: no kernel fails to launch on this CPU.)"""
    import tvmfuse.bench as bench
    from tvmfuse.cli.main import app

    def refused(*args, **kwargs):
        raise RuntimeError("CUDALaunch Error: CUDA_ERROR_INVALID_VALUE\n grid=(512,1,1),  block=(128,1,1)\n"
                           "// func_name=fused_rotary_kernel\n// CUDA Source\n#include <cuda_fp16.h>\n")

    monkeypatch.setattr(bench, "_tvm_run", refused)
    res = CliRunner().invoke(app, ["bench", str(example_model), "--target", "llvm", "--db", str(tmp_path / "none.db"),
                                   "--against", "onnxruntime", "--repeat", "2", "--number", "1", "--json"])
    assert res.exit_code == 3, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    ours, ort = doc["results"]
    assert ours["backend"] == "tvmfuse" and ours["available"] is False and "func_name=fused_rotary_kernel" in ours[
        "reason"] and "CUDA Source" not in ours["reason"]
    assert ort["backend"] == "onnxruntime" and ort["samples"] == 2 and ort["ok"]
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert "did not run" in line and "grid=(512,1,1)" in line
    table = CliRunner().invoke(app, ["bench", str(example_model), "--target", "llvm", "--db", str(tmp_path / "x.db"),
                                     "--against", "onnxruntime", "--repeat", "2", "--number", "1"])
    assert table.exit_code == 3 and "onnxruntime" in table.stdout and "did not run" in table.stderr


def test_bench_cli_refuses_an_unknown_backend(example_model):
    from tvmfuse.cli.main import app

    res = CliRunner().invoke(app, ["bench", str(example_model), "--target", "llvm", "--against", "tensorrt"])
    assert res.exit_code == 2
    assert "unknown backend 'tensorrt'" in res.output


def test_torch_interpreter_refuses_ops_it_lacks():
    g = onnx.helper.make_graph([onnx.helper.make_node("Resize", ["x"], ["y"])], "g",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    with pytest.raises(Unsupported, match="Resize"):
        check_supported(onnx.helper.make_model(g))


def _scale_kernel(rows_written: int):
    """y = x * 2 over 8x16, but only the first ``rows_written`` rows are written."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((8, 16), "float32"), y: T.Buffer((8, 16), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i, j in T.grid(rows_written, 16):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)

    return tvm.IRModule({"main": main})


def test_kernel_check_catches_unwritten_outputs(llvm_target):
    from tvmfuse.tune.check import check_kernel

    ref = _scale_kernel(8)
    good = check_kernel(ref, _scale_kernel(8), llvm_target, seed=np.random.randint(1 << 30))
    assert good.ok and good.unwritten == 0 and good.rel_error == 0.0
    bad = check_kernel(ref, _scale_kernel(4), llvm_target, seed=1)
    assert not bad.ok and bad.unwritten == 4 * 16


@pytest.mark.slow
def test_bench_times_torch_compile_with_cuda_graphs_mode(example_model):
    pytest.importorskip("torch")
    report = run_bench(BenchConfig(model=example_model, target="llvm", db=None, repeat=2, number=1,
                                   against=("torch-compile-ro",)))
    results = {r["backend"]: r for r in report["results"]}
    assert list(results) == ["tvmfuse", "torch-compile-ro"]
    r = results["torch-compile-ro"]
    assert r["median_ms"] > 0 and r["ok"] and r["rel_error"] < 1e-4, r


def test_precision_floor_holds_a_reduced_precision_build_to_the_plain_same_precision_error():
    from tvmfuse.bench import FLOOR_SLACK, precision_floor

    # a random-weight CNN in fp16: every backend ~6.6e-2 off the fp32 reference, past fp16's 1e-2
    results = [{"backend": "tvmfuse", "rel_error": 0.068, "ok": False},
               {"backend": "torch-compile", "rel_error": 0.070, "ok": False},
               {"backend": "torch-eager", "rel_error": 0.066, "ok": False},
               {"backend": "tvm-default", "rel_error": 0.066 * FLOOR_SLACK * 1.01, "ok": False}]
    doc = precision_floor(results)
    assert doc["floor"] == {"backend": "torch-eager", "rel_error": 0.066, "slack": FLOOR_SLACK}
    by = {r["backend"]: r for r in results}
    assert by["tvmfuse"]["ok"] and by["tvmfuse"]["floor"] and by["torch-compile"]["ok"]
    assert by["tvm-default"]["ok"] is False and "floor" not in by["tvm-default"]   # past the slack: still wrong
    assert by["torch-eager"]["ok"] is False and "floor" not in by["torch-eager"]  # the floor does not pass itself
    # no plain same-precision implementation ran: nothing is excused
    alone = [{"backend": "tvmfuse", "rel_error": 0.068, "ok": False}]
    assert precision_floor(alone)["floor"] is None and alone[0]["ok"] is False


def test_bench_fp16_reports_its_precision_floor(example_model):
    report = run_bench(BenchConfig(model=example_model, target="llvm", db=None, repeat=1, number=1,
                                   against=("onnxruntime",), precision="fp16"))
    floor = report["verification"]["floor"]
    ort = next(r for r in report["results"] if r["backend"] == "onnxruntime")
    assert floor["backend"] == "onnxruntime" and floor["rel_error"] == ort["rel_error"]
    assert all(r["ok"] for r in report["results"]), report["results"]


def test_the_quiet_gap_lasts_until_the_process_threads_stop_spinning():
    """A thread of this process that spins for 0.3 s (a runtime's pool after its last call) holds the gap open
    until it stops; an idle process waits QUIET_S alone."""
    import threading

    from tvmfuse import bench

    assert bench.quiet() < bench.QUIET_S + 3 * bench.QUIET_STEP_S + 0.05

    def spin(until):
        while time.perf_counter() < until:
            pass

    t0 = time.perf_counter()
    worker = threading.Thread(target=spin, args=(t0 + 0.3,))
    worker.start()
    waited = bench.quiet()
    worker.join()
    assert 0.3 <= waited + 0.01 and waited < bench.QUIET_MAX_S


def test_pytorch_runs_tf32_as_the_precision_says_unless_told():
    """PyTorch's convs default to TF32 (ResNet-50 fp32: 2.1e-2 against onnxruntime, 100x fp32's 1e-4); tf32 turns
    its GEMMs and convs to TF32 and fp32-strict off, and ``--torch-tf32`` sets it either way for any precision (an
    fp32 tvmfuse build on Hopper keeps fp32's accuracy, which ``off`` times PyTorch at)."""
    from tvmfuse.bench import torch_tf32

    want = {"model": None, "fp32": None, "fp16": None, "tf32": True, "fp32-strict": False}
    for precision, tf32 in want.items():
        assert torch_tf32(BenchConfig(model=Path("m.onnx"), precision=precision)) is tf32
        for told, value in (("on", True), ("off", False)):
            assert torch_tf32(BenchConfig(model=Path("m.onnx"), precision=precision, torch_tf32=told)) is value
