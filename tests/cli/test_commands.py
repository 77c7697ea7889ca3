"""The CLI through typer's runner and as a real subprocess: JSON output, exit codes, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    # every kernel of the example, its LayerNorm included, takes the CPU default (none keeps TVM's plain lowering)
    assert report["untuned"] and {k["schedule"] for k in report["kernels"]} == {"cpu-default"}
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
    assert report["end_to_end"] is None   # nothing tuned this run: nothing to check end to end


def test_cli_subprocess_bad_input_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", "compile", str(tmp_path / "nope.onnx"),
                           "-o", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    _one_line_error(proc.stderr)


# -- bad input: one line, exit 2 --------------------------------------------------------------------------------


@pytest.fixture
def untuned_artifact(untuned_example_artifact):
    return untuned_example_artifact


@pytest.mark.parametrize("db", ["/proc/nope/x.db", "{tmp}/a_file/x.db", "/proc/x.db"],
                         ids=["missing-folder", "folder-is-a-file", "unwritable-folder"])
def test_tune_with_a_db_that_cannot_be_created_is_one_line(example_model, tmp_path, db):
    (tmp_path / "a_file").write_text("not a folder")
    db = db.format(tmp=tmp_path)
    result = runner.invoke(app, ["tune", str(example_model), "--target", "llvm", "--db", db, "--trials", "1"])
    assert result.exit_code == 2, (result.output, result.stderr)
    line = _one_line_error(result.stderr)
    assert db in line and "internal error" not in line


def _identity_model(path, name, dims, elem=TensorProto.FLOAT, out="y"):
    node = helper.make_node("Identity", [name], [out])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(name, elem, dims)],
                              [helper.make_tensor_value_info(out, elem, dims)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("case,needle", [
    ("other_input", "no input 'x'"),
    ("other_shape", "input 'x' is 1x8x16x15 in the model, 1x8x16x16 in the artifact"),
    ("other_dtype", "input 'x' is float64 in the model, float32 in the artifact"),
    ("other_output", "output 'y' is not in both"),
])
def test_verify_against_a_model_that_does_not_match_the_artifact(untuned_artifact, tmp_path, case, needle):
    model = {
        "other_input": lambda p: _identity_model(p, "image", [1, 8, 16, 16]),
        "other_shape": lambda p: _identity_model(p, "x", [1, 8, 16, 15]),
        "other_dtype": lambda p: _identity_model(p, "x", [1, 8, 16, 16], elem=TensorProto.DOUBLE),
        "other_output": lambda p: _identity_model(p, "x", [1, 8, 16, 16], out="z"),
    }[case](tmp_path / f"{case}.onnx")
    result = runner.invoke(app, ["run", str(untuned_artifact), "--verify-against", str(model), "--repeat", "0"])
    assert result.exit_code == 2, (result.output, result.stderr)
    line = _one_line_error(result.stderr)
    assert "does not match the artifact" in line and needle in line, line
    assert "--input-shape" not in line


def test_verify_against_a_fixture_model_of_another_network(untuned_artifact):
    other = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_tinycnn.float32.onnx"
    result = runner.invoke(app, ["run", str(untuned_artifact), "--verify-against", str(other), "--repeat", "0"])
    assert result.exit_code == 2
    line = _one_line_error(result.stderr)
    assert "tiny_tinycnn.float32.onnx does not match the artifact" in line and "'x'" in line and "image" in line


@pytest.mark.parametrize("where", ["file", "below-a-file"])
def test_compile_into_a_file_is_refused_before_building(example_model, tmp_path, where):
    (tmp_path / "a_file").write_text("keep me")
    out = tmp_path / "a_file" if where == "file" else tmp_path / "a_file" / "art"
    result = runner.invoke(app, ["compile", str(example_model), "--target", "llvm", "--untuned", "-o", str(out)])
    assert result.exit_code == 2, (result.output, result.stderr)
    line = _one_line_error(result.stderr)
    assert "a_file" in line and "is a file" in line
    assert (tmp_path / "a_file").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no half-written artifact beside it


@pytest.mark.parametrize("array,needle", [
    (np.zeros((1, 8, 16, 15), np.float32), "float32[1, 8, 16, 15], the artifact takes float32[1, 8, 16, 16]"),
    (np.zeros((1, 8, 16, 16), np.float64), "float64[1, 8, 16, 16], the artifact takes float32[1, 8, 16, 16]"),
], ids=["shape", "dtype"])
def test_inputs_of_the_wrong_shape_or_dtype(untuned_artifact, tmp_path, array, needle):
    np.savez(tmp_path / "in.npz", x=array)
    result = runner.invoke(app, ["run", str(untuned_artifact), "--inputs", str(tmp_path / "in.npz")])
    assert result.exit_code == 2, (result.output, result.stderr)
    line = _one_line_error(result.stderr)
    assert "input 'x'" in line and needle in line


# -- --version, flags in --help ---------------------------------------------------------------------------------


def test_version_names_tvmfuse_tvm_and_tvm_ffi():
    from importlib import metadata

    import tvmfuse

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines == [f"tvmfuse {tvmfuse.__version__}", f"TVM {metadata.version('apache-tvm')}",
                     f"apache-tvm-ffi {metadata.version('apache-tvm-ffi')}"]
    result = runner.invoke(app, ["version", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"tvmfuse": tvmfuse.__version__, "tvm": metadata.version("apache-tvm"),
                                         "apache-tvm-ffi": metadata.version("apache-tvm-ffi")}


@pytest.mark.parametrize("command", [["run"], ["tune"], ["compile"], ["example"], ["plan"], ["inspect"], ["bench"],
                                     ["db", "info"], ["db", "export"], ["version"], []])
def test_help_shows_boolean_options_as_plain_flags(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "--help" in text and "<bool>" not in text, text
    if command and command != ["version"]:
        json_line = next(l for l in text.splitlines() if "--json" in l)
        assert "<" not in json_line.split("--json", 1)[1].split("Print")[0], json_line
    if command == ["run"]:
        assert "<path>" in text  # value options still show what they take


# -- run: --outputs, --compare-to, --warmup, --duration -----------------------------------------------------------


def test_run_saves_outputs_and_compares_to_them(untuned_artifact, tmp_path):
    saved = tmp_path / "out.npz"
    r = runner.invoke(app, ["run", str(untuned_artifact), "--outputs", str(saved), "--repeat", "2", "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["outputs_file"] == str(saved) and saved.exists()  # the exact name, no suffix added
    with np.load(saved) as npz:
        assert npz.files == ["y"] and npz["y"].shape == (1, 64, 32) and npz["y"].dtype == np.float32
        y = npz["y"]
    # the same random inputs (seed 0): the same outputs
    r = runner.invoke(app, ["run", str(untuned_artifact), "--compare-to", str(saved), "--repeat", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    ver = json.loads(r.stdout)["verification"]
    assert ver["ok"] and ver["reference"] == str(saved)
    assert ver["outputs"] == [{"name": "y", "dtype": "float32", "rel_error": 0.0, "tolerance": 1e-4, "ok": True}]
    r = runner.invoke(app, ["run", str(untuned_artifact), "--compare-to", str(saved), "--repeat", "0"])
    assert r.exit_code == 0 and f"against {saved.name}" in r.stdout

    np.savez(tmp_path / "off.npz", y=y * 1.01)
    r = runner.invoke(app, ["run", str(untuned_artifact), "--compare-to", str(tmp_path / "off.npz"), "--repeat", "0",
                            "--json"])
    assert r.exit_code == 1
    assert "output 'y' differs from off.npz" in _one_line_error(r.stderr)
    assert json.loads(r.stdout)["verification"]["ok"] is False

    np.savez(tmp_path / "cut.npz", y=y[:, :3])
    r = runner.invoke(app, ["run", str(untuned_artifact), "--compare-to", str(tmp_path / "cut.npz"), "--repeat", "0"])
    assert r.exit_code == 1
    assert "output 'y' is float32[1, 64, 32], the reference in cut.npz is float32[1, 3, 32]" in _one_line_error(r.stderr)

    np.savez(tmp_path / "other.npz", z=y)
    r = runner.invoke(app, ["run", str(untuned_artifact), "--compare-to", str(tmp_path / "other.npz")])
    assert r.exit_code == 2
    line = _one_line_error(r.stderr)
    assert "other.npz has no output 'y'" in line and "z" in line


@pytest.mark.parametrize("args,needle", [
    (["--compare-to", "{tmp}/missing.npz"], "not found"),
    (["--compare-to", "{tmp}/junk.npz"], "not a readable .npz"),
    (["--outputs", "{tmp}/no/such/folder/o.npz"], "does not exist"),
    (["--outputs", "{tmp}"], "is a folder"),
    (["--compare-to", "{tmp}/junk.npz", "--verify-against", "{model}"], "not both"),
])
def test_run_option_errors_are_one_line(untuned_artifact, example_model, tmp_path, args, needle):
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    args = [a.format(tmp=tmp_path, model=example_model) for a in args]
    r = runner.invoke(app, ["run", str(untuned_artifact), *args, "--repeat", "0"])
    assert r.exit_code == 2, (r.output, r.stderr)
    assert needle in _one_line_error(r.stderr)


def test_run_times_for_a_duration_after_warmup(untuned_artifact):
    r = runner.invoke(app, ["run", str(untuned_artifact), "--repeat", "3", "--warmup", "2", "--duration", "0.3",
                            "--json"])
    assert r.exit_code == 0, r.stderr
    lat = json.loads(r.stdout)["latency_ms"]
    assert lat["warmup"] == 2 and lat["duration_s"] == 0.3
    assert lat["seconds"] >= 0.3 and lat["repeat"] > 3  # a run takes well under 0.1 s: more than --repeat
    assert lat["repeat"] * lat["min"] / 1e3 <= lat["seconds"]
    r = runner.invoke(app, ["run", str(untuned_artifact), "--repeat", "4", "--warmup", "0", "--json"])
    lat = json.loads(r.stdout)["latency_ms"]
    assert lat["repeat"] == 4 and lat["warmup"] == 0
    r = runner.invoke(app, ["run", str(untuned_artifact), "--repeat", "2", "--duration", "0.2"])
    assert r.exit_code == 0 and "runs in" in r.stdout and "warm-up" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["tune", "tvmfuse/data/example.onnx", "--bogus"], "No such option: --bogus"),
    (["run"], "Missing argument 'artifact'"),
    (["compile", "tvmfuse/data/example.onnx", "-o", "x", "--precision"], "requires an argument"),
    (["bench", "tvmfuse/data/example.onnx", "--torch-tf32", "maybe"], "--torch-tf32 'maybe': auto, on or off"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, message):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")


def test_an_internal_error_keeps_the_lines_that_name_the_failing_kernel():
    """TVM's failed CUDA launch names the kernel and its grid after its first line, then the whole CUDA source: the
    one-line error keeps the first paragraph and drops the source."""
    from tvmfuse.errors import headline as _headline

    err = RuntimeError("CUDALaunch Error: CUDA_ERROR_INVALID_VALUE\n grid=(512,1,1),  block=(128,1,1)\n"
                       "// func_name=fused_rotary_kernel\n// CUDA Source\n// -----------\n\n#ifdef __CUDACC_RTC__\n")
    line = _headline(err)
    assert line == ("CUDALaunch Error: CUDA_ERROR_INVALID_VALUE | grid=(512,1,1),  block=(128,1,1) | "
                    "// func_name=fused_rotary_kernel")
    assert "\n" not in _headline(RuntimeError("x" * 1000 + "\ny")) and len(_headline(RuntimeError("x" * 1000))) == 300
