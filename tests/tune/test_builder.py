"""The tuner's builder keeps its worker processes across batches (MetaSchedule's LocalBuilder starts a pool for
every batch), replaces a worker after its uses, and survives a build that outlasts its timeout."""
from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest

from tvmfuse._tvm import ms, tvm
from tvmfuse.tune.builder import PooledBuilder, fast_build

# the build functions below travel to the workers by value (the workers cannot import this test module)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid_build(mod, target, params):
    import os
    import pathlib

    pathlib.Path(os.environ["TVMFUSE_TEST_PIDS"], f"{os.getpid()}-{time.monotonic_ns()}").touch()
    return fast_build(mod, target, params)


def _slow_build(mod, target, params):
    time.sleep(60)


def _inputs(n: int = 1):
    from tvm import te

    x = te.placeholder((64,), "float32", name="x")
    y = te.compute((64,), lambda i: x[i] * 2.0, name="y")
    mod = tvm.IRModule({"main": te.create_prim_func([x, y])})
    return [ms.builder.BuilderInput(mod, tvm.target.Target("llvm")) for _ in range(n)]


def _pids(folder) -> list[int]:
    return [int(p.split("-")[0]) for p in sorted(os.listdir(folder), key=lambda p: int(p.split("-")[1]))]


def test_one_pool_serves_every_batch_and_workers_are_replaced_after_their_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFUSE_TEST_PIDS", str(tmp_path))
    builder = PooledBuilder(f_build=_pid_build, max_workers=1, timeout_sec=120, max_uses=2)
    try:
        for _ in range(3):
            (result,) = builder.build(_inputs())
            assert result.error_msg is None and os.path.exists(result.artifact_path)
    finally:
        builder.close()
    first, second, third = _pids(tmp_path)
    assert first == second   # the second batch found the first batch's worker
    assert third != first    # ... which was replaced after its two builds


@pytest.mark.slow
def test_a_build_past_its_timeout_is_killed_and_the_pool_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFUSE_TEST_PIDS", str(tmp_path))
    slow = PooledBuilder(f_build=_slow_build, max_workers=1, timeout_sec=3)
    try:
        (result,) = slow.build(_inputs())
        assert result.artifact_path is None and "Timeout, killed after 3" in result.error_msg
        slow.f_build = _pid_build   # the same pool, its worker killed: a new one takes the next build
        (result,) = slow.build(_inputs())
        assert result.error_msg is None
    finally:
        slow.close()


_PACK_UNDER_CTRL_C = """
import os, signal, subprocess, sys, time

from tvmfuse.tune.builder import worker_initializer

folder = sys.argv[1]


def pack():   # MetaSchedule's export of a built candidate (tvm.support.tar): tar -czf, which runs gzip
    tar = subprocess.Popen(["tar", "-czf", os.path.join(folder, "out.tgz"), "-C", folder, "big.bin"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    time.sleep(0.2)
    os.killpg(tar.pid, signal.SIGINT)   # a Ctrl-C reaches the whole process group
    out, _ = tar.communicate()
    return tar.returncode, out.decode()


for signum in (signal.SIGINT, signal.SIGTERM):   # a worker's own default, whatever this test's parent ignores
    signal.signal(signum, signal.SIG_DFL)            # (a shell's background job starts with SIGINT ignored)
if sys.argv[2] == "blocked":   # as `tvmfuse tune` starts its workers (tvmfuse.cli.interrupt)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
worker_initializer()()
print(sys.argv[2], signal.getsignal(signal.SIGINT) is signal.SIG_IGN, *pack())
"""


@pytest.mark.parametrize("start", ["blocked", "unblocked"])
def test_a_worker_ignores_the_signals_tune_blocks_so_its_tar_survives_a_ctrl_c(tmp_path, start):
    """`tvmfuse tune` blocks SIGINT and SIGTERM, and its workers start with them blocked, but gzip (run by the
    `tar -czf` that packs each built candidate) unblocks them: a Ctrl-C that came while a candidate was packed killed
    it and failed the build. A worker's initializer ignores the signals it starts with blocked, and a program keeps
    an ignored signal ignored. A worker started without them blocked keeps the default: its tar dies, as it did."""
    import shutil
    import subprocess

    if shutil.which("tar") is None or shutil.which("gzip") is None:
        pytest.skip("needs tar and gzip")
    (tmp_path / "big.bin").write_bytes(os.urandom(40_000_000))   # a second or so of gzip
    done = subprocess.run([sys.executable, "-c", _PACK_UNDER_CTRL_C, str(tmp_path), start], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    name, ignored, code, out = done.stdout.split(" ", 3)
    assert name == start and (ignored == "True") == (start == "blocked"), done.stdout
    assert (code == "0") == (start == "blocked"), done.stdout
