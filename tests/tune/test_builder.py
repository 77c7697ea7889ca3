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
