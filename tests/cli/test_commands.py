"""The CLI through typer's runner and as a real subprocess: JSON output, exit codes, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from tvmfuse.cli.main import app

runner = CliRunner()


def _one_line_error(result_stderr: str) -> str:
    lines = [l for l in result_stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, result_stderr
    assert "Traceback" not in result_stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, example_model):
    d = tmp_path_factory.mktemp("bad")
    (d / "not_onnx.onnx").write_text("this is not a protobuf\n" * 10)
    data = example_model.read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 3])
    # Celu is a standard ONNX op (opset 12) that TVM 0.27's importer does not convert
    node = helper.make_node("Celu", ["x"], ["y"], name="celu_node", alpha=1.0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, d / "unsupported.onnx")
    return d


@pytest.mark.parametrize("command", ["tune", "compile"])
@pytest.mark.parametrize("case,needle", [
    ("missing.onnx", "not found"),
    ("not_onnx.onnx", "not"),
    ("truncated.onnx", "truncated"),
    ("unsupported.onnx", "Celu"),
])
def test_bad_models_give_one_line_and_exit_2(bad_models, command, case, needle):
    extra = ["-o", str(bad_models / "out")] if command == "compile" else []
    result = runner.invoke(app, [command, str(bad_models / case), "--target", "llvm", *extra])
    assert result.exit_code == 2, (result.output, result.stderr)
    line = _one_line_error(result.stderr)
    assert needle in line
    if case == "unsupported.onnx":
        assert "node 'celu_node'" in line and "opset 17" in line


def test_verbose_shows_the_traceback(bad_models):
    result = runner.invoke(app, ["tune", str(bad_models / "not_onnx.onnx"), "--verbose"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def test_bad_target_is_one_line(example_model):
    result = runner.invoke(app, ["compile", str(example_model), "--target", "metal", "-o", "x"])
    assert result.exit_code == 2
    assert "metal" in _one_line_error(result.stderr)


def test_run_on_a_folder_that_is_not_an_artifact(tmp_path):
    result = runner.invoke(app, ["run", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a tvmfuse artifact" in _one_line_error(result.stderr)


def test_compile_untuned_and_run_json(example_model, tmp_path):
    out = tmp_path / "art"
    r = runner.invoke(app, ["compile", str(example_model), "--target", "llvm", "--untuned", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["untuned"] and all(k["schedule"] == "default" for k in report["kernels"])
    r = runner.invoke(app, ["run", str(out), "--verify-against", str(example_model), "--repeat", "3", "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["verification"]["ok"] and report["latency_ms"]["repeat"] == 3


@pytest.mark.slow
def test_cli_subprocess_tune_json_resumes(tuned_example):
    """The installed console script, as a user runs it, against the session's tuned database."""
    cfg, _ = tuned_example
    proc = subprocess.run(
        [sys.executable, "-m", "tvmfuse.cli.main", "tune", str(cfg.model), "--target", "llvm",
         "--db", str(cfg.db), "--trials", "14", "--trials-per-kernel", "2", "--json"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert report["trials_run"] == 0
    assert all(k["status"] in ("skipped-spent", "exhausted") for k in report["kernels"])


def test_cli_subprocess_bad_input_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", "compile", str(tmp_path / "nope.onnx"),
                           "-o", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    _one_line_error(proc.stderr)
