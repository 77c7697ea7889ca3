"""--threads: TVM's runtime takes the requested count in this process and in the processes it starts (the pool
MetaSchedule's runner measures in), the manifest records it, and bad values are one line and exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_tinycnn.float32.onnx"

PROBE = """
import json
from tvmfuse.threads import apply_threads, runtime_threads
from tvm.support.popen_pool import PopenPoolExecutor

def worker():
    import tvm
    return int(tvm.runtime.num_threads())

n = apply_threads(WANT)
pool = PopenPoolExecutor(max_workers=1)   # MetaSchedule's LocalRunner measures in such workers
print(json.dumps({"applied": n, "here": runtime_threads(), "worker": pool.submit(worker).result()}))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_the_runtime_and_the_runner_workers_report_the_requested_count():
    # 2 where there are 2 CPUs: more than TVM's own default there (half the hardware threads on x86: 1)
    want = min(2, len(os.sched_getaffinity(0)))
    done = subprocess.run([sys.executable, "-c", f"WANT = {want}\n" + PROBE], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"applied": want, "here": want, "worker": want}


def test_the_default_is_the_physical_cores():
    from tvmfuse.threads import physical_cores

    assert 1 <= physical_cores() <= (os.cpu_count() or 1)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                          env=_env(), timeout=300, cwd=ROOT)


@pytest.mark.parametrize("bad", ["0", "two"])
def test_bad_thread_counts_are_one_line_and_exit_2(bad, tmp_path):
    done = _cli("compile", str(FIXTURE), "--target", "llvm", "-o", str(tmp_path / "a"), "--untuned", "--threads", bad)
    assert done.returncode == 2
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--threads" in lines[0], done.stderr


@pytest.mark.slow
def test_compile_records_the_count_and_run_uses_it_unless_told(tmp_path):
    art = tmp_path / "a"
    done = _cli("compile", str(FIXTURE), "--target", "llvm", "-o", str(art), "--untuned", "--threads", "2")
    assert done.returncode == 0, done.stderr
    assert json.loads((art / "manifest.json").read_text())["threads"] == 2
    ran = _cli("run", str(art), "--repeat", "1", "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["threads"] == 2
    ran = _cli("run", str(art), "--repeat", "1", "--threads", "1", "--json")
    assert json.loads(ran.stdout)["threads"] == 1
