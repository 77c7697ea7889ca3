"""TVM's C++ log output (written straight to fd 2) is shown only with --verbose; our own stderr stays live.

Real subprocesses: the capture works on file descriptors, which an in-process runner would not exercise.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GPT2 = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_gpt2.float32.onnx"
# what TVM prints while importing and legalizing GPT-2 for CUDA (topi's take and tirx's pow)
TVM_WARNINGS = ("Warning: Detected pow", "Fast mode segfaults")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def plan_quiet():
    return _cli("plan", str(GPT2), "--target", "cuda")


def test_plan_hides_tvm_warnings_behind_one_note(plan_quiet):
    proc = plan_quiet
    assert proc.returncode == 0, proc.stderr
    assert not any(w in proc.stderr for w in TVM_WARNINGS), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: TVM printed "), proc.stderr
    assert "rerun with --verbose" in lines[0]
    n = int(lines[0].split()[3])
    assert n >= 2, lines[0]  # at least one of each kind above
    assert "fused" in proc.stdout.lower() or "kernel" in proc.stdout.lower(), proc.stdout[:500]


def test_plan_verbose_shows_them(plan_quiet):
    proc = _cli("plan", str(GPT2), "--target", "cuda", "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert all(w in proc.stderr for w in TVM_WARNINGS), proc.stderr
    assert "note: TVM printed" not in proc.stderr
    # as many as the quiet run counted
    shown = sum(1 for ln in proc.stderr.splitlines() if ": Warning: " in ln)
    assert f"note: TVM printed {shown} warnings" in plan_quiet.stderr, (shown, plan_quiet.stderr)


def test_missing_model_is_still_one_error_line_and_exit_2(tmp_path):
    proc = _cli("plan", str(tmp_path / "missing.onnx"), "--target", "cuda")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not found" in lines[0], proc.stderr


def test_native_lines_that_are_not_tvm_logs_still_reach_the_user():
    """A real TVM warning is counted, not shown; a native line that is not TVM's and a TVM error are passed on
    while the block still runs; tvmfuse's own stderr (print, rich) goes out directly, in order with them."""
    code = textwrap.dedent("""
        import os, sys, time
        from rich.console import Console
        from tvmfuse._tvm import tvm
        from tvmfuse.logs import capture_native_stderr

        with capture_native_stderr() as log:
            x = tvm.tirx.Var("x", "float32")
            tvm.tirx.pow(x, tvm.tirx.const(3.0, "float32"))  # TVM's C++ warning, straight to fd 2
            os.write(2, b"native line that is not TVM's\\n")
            os.write(2, b"[12:00:00] /src/a.cc:7: Warning: two lines\\n    the second, indented\\n")
            os.write(2, b"[12:00:00] /src/b.cc:9: Error: something broke\\n")
            deadline = time.monotonic() + 60
            while b"something broke" not in log.shown and time.monotonic() < deadline:
                time.sleep(0.01)  # passed on live: before the block ends
            print("live:", b"something broke" in log.shown, file=sys.stdout)
            print("error: our own line", file=sys.stderr)
            Console(stderr=True).print("rich on stderr")
            os.write(2, b"native line written last")  # no newline: shown on exit at the latest
        print(dict(log.counts), log.hidden, file=sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["live: True", "{'warning': 2, 'error': 1} 2"], proc.stdout
    assert proc.stderr.splitlines() == [
        "native line that is not TVM's",
        "[12:00:00] /src/b.cc:9: Error: something broke",
        "error: our own line",
        "rich on stderr",
        "native line written last",
        "note: TVM printed 2 warnings (rerun with --verbose to see them)",
    ], proc.stderr


def test_help_into_a_closed_pipe_is_no_traceback():
    """`tvmfuse run --help | head -1`: the reader goes away mid-output. The entry point's exception handling
    must hold with the installed typer (its Abort moved out of the vendored click: naming the old place turned
    this, and every Ctrl-C, into an AttributeError traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "tvmfuse.cli.main", "run", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the rest of the help meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1), err
    assert "Traceback" not in err, err


def test_entry_point_catches_the_abort_typer_raises():
    """typer turns Ctrl-C at a prompt into its Abort; main() maps that class to exit 130."""
    import typer.core

    from tvmfuse.cli.main import _click_exceptions

    usage_error, abort = _click_exceptions()
    assert typer.core.Abort is abort or issubclass(typer.core.Abort, abort)
    assert issubclass(usage_error, Exception) and usage_error.__name__ == "UsageError"
