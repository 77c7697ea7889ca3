"""`tvmfuse rpc tracker|server|status` and `tune --rpc-*` on bad input: one line, exit 2, never a hang or a
traceback. A real tracker (a subprocess) where one is needed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpc_helpers import free_port, ready, start, stop

EXAMPLE = Path(__file__).resolve().parents[2] / "tvmfuse" / "data" / "example.onnx"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "250"})


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tracker():
    proc = start("rpc", "tracker", "--port", str(free_port()), "--json")
    try:
        yield ready(proc)["address"]
    finally:
        stop(proc)


def _invoke_error_line(*args: str) -> str:
    """Through typer's runner, in this process (the bad-option cases cost no interpreter start)."""
    from typer.testing import CliRunner

    from tvmfuse.cli.main import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, (result.output, result.stderr)
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["tune", "compile"])
def test_no_tracker_there_is_one_line_at_once(command, tmp_path):
    port = free_port()  # nothing listens on it
    extra = ["-o", str(tmp_path / "out")] if command == "compile" else []
    t0 = time.monotonic()
    line = _invoke_error_line(command, str(EXAMPLE), *extra, "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", "x")
    assert "cannot reach the RPC tracker" in line and f"127.0.0.1:{port}" in line
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("args, says", [(["--rpc-tracker", "nohost"], "HOST:PORT"),
                                        (["--rpc-key", "h200"], "--rpc-tracker"),
                                        (["--rpc-tracker", "127.0.0.1:9190"], "--rpc-key"),
                                        (["--rpc-tracker", "127.0.0.1:9190", "--rpc-key", "k", "--rpc-workers", "0"],
                                         "--rpc-workers")])
def test_tune_rpc_options_that_do_not_go_together(args, says):
    assert says in _invoke_error_line("tune", str(EXAMPLE), *args)


def test_tune_with_no_server_under_the_key_says_so_within_the_timeout(tracker):
    t0 = time.monotonic()
    line = _one_error_line(_cli("tune", str(EXAMPLE), "--rpc-tracker", tracker, "--rpc-key", "nobody"))
    assert "no RPC server registered under key 'nobody'" in line and "tvmfuse rpc server" in line
    assert time.monotonic() - t0 < 60


def test_status_lists_the_keys_and_refuses_an_unknown_one(tracker):
    done = _cli("rpc", "status", "--tracker", tracker, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"tracker": tracker, "keys": {}}
    assert "no server under key 'gpu'" in _one_error_line(_cli("rpc", "status", "--tracker", tracker, "--key", "gpu"))


def test_a_tracker_on_a_taken_port_or_a_server_without_its_tracker_is_one_line(tracker):
    port = int(tracker.rsplit(":", 1)[1])
    assert "cannot start the RPC tracker" in _one_error_line(_cli("rpc", "tracker", "--port", str(port)))
    nobody = free_port()
    line = _one_error_line(_cli("rpc", "server", "--tracker", f"127.0.0.1:{nobody}", "--key", "k"))
    assert "cannot reach the RPC tracker" in line


def test_a_tracker_bound_beyond_loopback_warns_that_rpc_runs_any_code():
    proc = start("rpc", "tracker", "--host", "0.0.0.0", "--port", str(free_port()), "--json")
    try:
        assert ready(proc)["host"] == "0.0.0.0"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "warning: TVM RPC has no authentication" in err and "run any code" in err, err
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.slow
def test_a_tvmfuse_server_and_a_plain_tvm_server_are_each_described(tracker):
    """A tvmfuse server describes its own CPU and GPU in the session (no GPU here: ``cuda`` None, not an error); a
    plain TVM server is asked attribute by attribute and keyed by its LLVM CPU name."""
    from tvmfuse.rpc import rpc_options
    from tvmfuse.rpc.device import probe
    from tvmfuse.target import host_cpu_description

    ours = start("rpc", "server", "--tracker", tracker, "--key", "ours", "--port", str(free_port()), "--json")
    port = free_port()
    plain = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", tracker, "--key", "plain",
                              "--port", str(port), "--port-end", str(port + 1)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ready(ours)
        dev, servers = probe(rpc_options(tracker, "ours"))
        assert dev.described_by == "tvmfuse" and dev.cuda is None and len(servers) == 1
        assert dev.cpu == host_cpu_description()["cpu_model"]
        dev, _ = probe(rpc_options(tracker, "plain"))
        assert dev.described_by == "tvm" and dev.cuda is None and dev.cores >= 1
    finally:
        stop(ours)
        stop(plain)
