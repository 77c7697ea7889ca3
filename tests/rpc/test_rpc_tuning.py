"""Tuning through a real TVM RPC tracker and real CPU RPC servers on loopback (`tvmfuse rpc tracker|server` as
subprocesses, ports picked free), into a real SQLite database: records land under the servers' device, each trial
names the server that measured it, a server killed in the middle of a trial costs only that trial (lost, not
failed), the run stops (exit 2 in the CLI) when the last server is gone, and a kernel that crashes its session is
a failed trial while the server serves on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from rpc_helpers import free_port, ready, start, stop

pytestmark = pytest.mark.slow

KEY = "loopback-cpu"


@contextmanager
def _cluster(n_servers: int):
    """A tracker and ``n_servers`` servers under KEY: (tracker address, [(server process, its address)])."""
    tracker = start("rpc", "tracker", "--port", str(free_port()), "--json")
    procs = [tracker]
    try:
        address = ready(tracker)["address"]
        servers = []
        for _ in range(n_servers):
            p = free_port()
            procs.append(start("rpc", "server", "--tracker", address, "--key", KEY, "--port", str(p),
                               "--port-end", str(p + 1), "--json"))
            servers.append(procs[-1])
        yield address, [(s, ready(s)["address"]) for s in servers]
    finally:
        for p in procs:
            stop(p)


@pytest.fixture()
def cluster():
    with _cluster(2) as found:
        yield found


@pytest.fixture()
def lone_server():
    with _cluster(1) as found:
        yield found


def _tiny_model(path: Path) -> Path:
    """relu(x @ W + b) on 8x16 @ 16x16: one small fused kernel."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    w = nh.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W")
    b = nh.from_array(rng.standard_normal((16,)).astype(np.float32), "b")
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["xw"]), h.make_node("Add", ["xw", "b"], ["s"]),
                      h.make_node("Relu", ["s"], ["y"])], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, [8, 16])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [8, 16])], [w, b])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def _config(address: str, **rpc):
    from tvmfuse.rpc import RPCOptions, parse_address
    from tvmfuse.tune import TuneConfig

    host, port = parse_address(address)
    return TuneConfig(trials=4, trials_per_kernel=4, trials_per_round=2, population=16, cost_model="random",
                      rpc=RPCOptions(host=host, port=port, key=KEY, **rpc))


def _records(db: Path) -> list[tuple]:
    from tvmfuse.db import open_store

    store = open_store(db)
    try:
        return store.query("SELECT target, device, failed FROM records")
    finally:
        store.close()


def test_tune_through_the_tracker_measures_on_both_servers_and_stores_the_records(cluster, tmp_path):
    from tvmfuse.target import resolve_target

    address, servers = cluster
    db = tmp_path / "rpc.db"
    done = subprocess.run(
        [sys.executable, "-m", "tvmfuse.cli.main", "tune", str(_tiny_model(tmp_path / "tiny.onnx")), "--db", str(db),
         "--trials", "4", "--trials-per-kernel", "4", "--cost-model", "random", "--rpc-tracker", address,
         "--rpc-key", KEY], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    # progress (piped: one line per kernel) and the report name the servers that measured
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("[1/1]")]
    named = [a for _, a in servers if a in line]
    assert named and ": tuned," in line, line
    (summary,) = [ln for ln in done.stdout.splitlines() if ln.startswith("measured on ")]
    assert f"through {address} (key '{KEY}', 2 at a time)" in summary and all(a in summary for a in named), summary
    # the servers are this machine: records keyed exactly as a local run keys them, so a local compile finds them
    local = resolve_target("llvm")
    rows = _records(db)
    assert len(rows) >= 3 and {(t, d) for t, d, _ in rows} == {(local.canonical, local.device)}
    assert any(not failed for *_, failed in rows)


class _KillOnFirstSession:
    """A progress object that, once tuning starts, kills ``victim`` (SIGKILL to its process group) as soon as it
    serves a session. The server forks one process per session: its first child then is a trial in flight (the
    probe's sessions are over before tuning starts), and the group takes that session down with the server."""

    def __init__(self, victim: subprocess.Popen, killed: threading.Event):
        self.victim, self.killed = victim, killed

    def _watch(self) -> None:
        import psutil

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if psutil.Process(self.victim.pid).children():
                    os.killpg(self.victim.pid, signal.SIGKILL)
                    self.killed.set()
                    return
            except psutil.NoSuchProcess:
                return
            time.sleep(0.02)

    def on_start(self, kernels, budgets):
        threading.Thread(target=self._watch, daemon=True).start()

    def on_batch(self, index, trials_done, best_s):
        pass

    def on_kernel_done(self, index, result):
        pass


def test_a_server_killed_in_the_middle_of_a_trial_costs_only_that_trial(cluster, tmp_path):
    from tvmfuse import api

    address, servers = cluster
    (_, a_addr), (victim, victim_addr) = servers
    killed = threading.Event()
    cfg = api.ModelConfig(model=_tiny_model(tmp_path / "tiny.onnx"), target="auto", db=tmp_path / "rpc.db")
    t0 = time.monotonic()
    report = api.tune(cfg, _config(address), progress=_KillOnFirstSession(victim, killed))
    assert killed.is_set(), "the victim server never got a trial"
    assert time.monotonic() - t0 < 120

    remote = report["rpc"]
    assert remote["registered"] == sorted(a for _, a in servers) and remote["workers"] == 2
    assert remote["described_by"] == "tvmfuse" and remote["stopped"] is None
    assert remote["lost_trials"] >= 1, remote
    assert {x["server"] for x in remote["losses"]} == {victim_addr}, remote["losses"]
    assert all("went away" in x["reason"] for x in remote["losses"]), remote["losses"]
    assert remote["servers"][victim_addr]["lost"] == remote["lost_trials"]
    assert remote["servers"][a_addr]["measured"] >= 1
    # lost, not failed: the kernel is tuned on the other server, and nothing of the lost trial was stored
    (kernel,) = report["kernels"]
    assert kernel["status"] == "tuned" and not report["failed"], kernel
    assert kernel["lost_trials"] == remote["lost_trials"] and set(kernel["servers"]) == {a_addr}
    assert sum(kernel["servers"].values()) == kernel["trials_run"]
    rows = _records(cfg.db)
    assert len(rows) == kernel["trials_run"] and not any(failed for *_, failed in rows)
    assert kernel["check"]["ok"] is True  # the servers' device is this machine's: checked here


def test_when_the_last_server_dies_the_run_stops_and_says_so(lone_server, tmp_path):
    from tvmfuse import api

    address, [(victim, victim_addr)] = lone_server
    killed = threading.Event()
    cfg = api.ModelConfig(model=_tiny_model(tmp_path / "tiny.onnx"), target="auto", db=tmp_path / "rpc.db")
    t0 = time.monotonic()
    report = api.tune(cfg, _config(address), progress=_KillOnFirstSession(victim, killed))
    assert killed.is_set() and time.monotonic() - t0 < 120

    remote = report["rpc"]
    assert remote["stopped"] and f"no server is registered under key '{KEY}'" in remote["stopped"], remote
    assert remote["lost_trials"] >= 1 and remote["servers"][victim_addr]["lost"] >= 1
    (kernel,) = report["kernels"]
    # nothing of it was measured: lost (the next run tunes it afresh), not failed
    assert kernel["status"] == "lost" and not report["failed"] and report["left"] == [kernel["name"]], kernel
    assert _records(cfg.db) == []


def test_a_kernel_that_crashes_its_session_is_a_failed_trial_and_the_server_serves_on(lone_server):
    """A segfaulting candidate takes down its session's process, not the server (TVM's own listen loop would end
    there, leaving a server registered that never serves again): the trial is the kernel's failure, not lost."""
    from tvm.script import tirx as T

    from tvmfuse._tvm import ms, tvm
    from tvmfuse.rpc import RPCOptions, parse_address
    from tvmfuse.rpc.runner import is_lost, make_runner
    from tvmfuse.rpc.tracker import servers_under
    from tvmfuse.tune.builder import fast_build

    @T.prim_func
    def crash(a: T.handle):
        A = T.match_buffer(a, (16,), "float32")
        far = T.decl_buffer((1 << 40,), "float32", data=A.data)
        far[1 << 39] = T.float32(1)  # 2 TiB past the argument: SIGSEGV

    @T.prim_func
    def fine(a: T.handle):
        A = T.match_buffer(a, (16,), "float32")
        for i in range(16):
            A[i] = A[i] + T.float32(1)

    address, [(_, server)] = lone_server
    host, port = parse_address(address)
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    builder = ms.builder.LocalBuilder(f_build=fast_build, max_workers=1)
    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}),
                                                   target) for f in (crash, fine)])
    assert all(b.error_msg is None for b in built), [b.error_msg for b in built]
    runner, ledger = make_runner(RPCOptions(host, port, KEY, session_timeout_s=20), workers=1)
    try:
        results = []
        for b, f in ((built[0], crash), (built[1], fine)):
            (future,) = runner.run([ms.runner.RunnerInput(b.artifact_path, "llvm",
                                                          ms.arg_info.ArgInfo.from_prim_func(f))])
            results.append(future.result())
    finally:
        runner._inst.shutdown()
    crashed, measured = results
    assert not is_lost(crashed) and "crashed its RPC session" in crashed.error_msg, crashed.error_msg
    assert measured.error_msg is None and measured.run_secs, measured.error_msg
    assert ledger.servers() == {server: {"measured": 1, "failed": 1, "lost": 0}}
    assert servers_under(host, port, KEY) == [server]
