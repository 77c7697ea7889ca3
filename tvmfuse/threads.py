"""The CPU threads TVM's runtime runs parallel loops on (``--threads`` of tune, compile, run and bench).

TVM's thread pool takes ``hardware_concurrency() / 2`` threads on x86 unless ``TVM_NUM_THREADS`` is set (on a
2-vCPU machine: one, so every parallel loop ran on one core), and reads it once, when the pool starts at the
process's first parallel call. So the count is set in the environment before that: this process's pool and the
processes it starts (MetaSchedule's runner workers, which time the candidates) see the same count, so tuning
measures what deployment runs. The default is the machine's physical cores (a hyperthread sibling adds no
vector unit).
"""
from __future__ import annotations

import os

from tvmfuse.errors import TvmfuseError

ENV = "TVM_NUM_THREADS"
MAX_THREADS = 1024


class ThreadsError(TvmfuseError):
    exit_code = 2


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def physical_cores() -> int:
    """The physical cores this process may run on (psutil's count, at most the CPUs of its affinity mask)."""
    usable = usable_cpus()
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or usable
    except Exception:  # noqa: BLE001 - without psutil: every usable CPU
        physical = usable
    return max(1, min(int(physical), usable))


def check_threads(value) -> int:
    """``value`` as a thread count, or one line and exit 2."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ThreadsError(f"--threads must be a whole number, not '{value}'") from None
    if not 1 <= n <= MAX_THREADS:
        raise ThreadsError(f"--threads must be between 1 and {MAX_THREADS}, not {n}")
    return n


def apply_threads(value=None) -> int:
    """Set the runtime's thread count (``value``, default :func:`physical_cores`; at most the CPUs this process
    may use, as TVM's pool caps it in the processes it starts) for this process and those it starts; returns it.
    It holds for this process only where its TVM thread pool has not started yet (call it before the first TVM
    run); the processes it starts later always see it."""
    n = physical_cores() if value is None else min(check_threads(value), usable_cpus())
    os.environ[ENV] = str(n)
    try:  # a pool that has started already is resized where TVM allows it
        import tvm_ffi

        tvm_ffi.get_global_func("runtime.config_threadpool")(0, n)
    except Exception:  # noqa: BLE001 - no such call in this TVM: the environment is what counts
        pass
    return n


def runtime_threads() -> int:
    """The threads TVM's runtime reports for this process."""
    from tvmfuse._tvm import tvm

    return int(tvm.runtime.num_threads())
