"""How a trial is timed (:func:`local_runner`) and the samples its record keeps: its times without the ones
another process stretched.

A CPU trial is timed as several samples (``CPU_SAMPLES``). On a shared machine one sample in four
or five runs 3-10x the others (a neighbour took a core for part of its window), and a mean of the samples ranked
records by chance: a SqueezeNet kernel measured [0.25, 1.14, 0.11, 0.11, 0.11] ms (five samples of 20 ms each). The median is what the kernel runs at
when nothing else interferes; a sample more than ``STRETCH`` times it is dropped before the record is stored,
so the database, the cost model and the report all see the kept samples (their mean is the record's time).
A GPU trial is one sample and passes unchanged.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tvmfuse._tvm import derived_object, ms, tvm
from tvmfuse.errors import TvmfuseError
from tvmfuse.tune.builder import worker_initializer
from tvmfuse.tune.measure_args import alloc_arguments

# a sample above this multiple of the trial's median is another process's time, not the kernel's: the kernels'
# own spread on the CI-class machine, hot, stayed within 10% of the median
STRETCH = 1.25
_MIN_SAMPLES = 3   # the median of fewer says nothing about which sample is the odd one


def kept_samples(secs: list[float]) -> list[float]:
    """``secs`` without the samples above ``STRETCH`` times their median, in their order; all of them when
    fewer than three (the median of two cannot tell which one was stretched)."""
    if len(secs) < _MIN_SAMPLES:
        return list(secs)
    ordered = sorted(secs)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    return [s for s in secs if s <= STRETCH * median]


@derived_object
class _KeptFuture(ms.runner.PyRunnerFuture):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.answer = None

    def done(self) -> bool:
        return self.inner.done()

    def result(self):
        if self.answer is None:
            res = self.inner.result()
            secs = [float(s) for s in (res.run_secs or [])]
            # a failed trial (an error, or MetaSchedule's 1e9 s marks) keeps its times as they are
            if res.error_msg is None and secs and max(secs) < 1e9:
                self.answer = ms.runner.RunnerResult(kept_samples(secs), None)
            else:
                self.answer = res
        return self.answer


@derived_object
class KeptSamplesRunner(ms.runner.PyRunner):
    """``inner`` (any MetaSchedule runner) whose results keep only :func:`kept_samples` of their times."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def run(self, runner_inputs):
        return [_KeptFuture(f) for f in self.inner.run(runner_inputs)]


# LocalRunner checks its worker at construction under the trials' own timeout: a short runner timeout made
# that check itself time out (a TimeoutError traceback before any trial, seen in CI). The worker
# is checked under this bound and the trials then run under the configured one.
_WORKER_START_S = 60.0


CPU_SAMPLES = 9   # single calls a CPU trial is timed with
# "auto" times a CPU trial warm where the model's weights take at most this share of the last-level cache
WARM_SHARE = 0.5
CPU_TRIAL_MODES = ("auto", "cold", "warm")


def last_level_cache_bytes() -> int | None:
    """The largest data cache of this machine's first CPU (Linux sysfs), or None where it is not known."""
    sizes = []
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind, size = (d / "type").read_text().strip(), (d / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        if kind != "Instruction" and size.rstrip("KMG").isdigit():
            sizes.append(int(size.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


def weight_bytes(kernels) -> int:
    """The weights a model's kernels read in one call of it: each kernel's constant parameters (the planner's
    ``layout_free_buffers``) times the kernel's calls."""
    from tvmfuse.tune.check import param_specs

    total = 0
    for k in kernels:
        func = k.mod["main"]
        specs = param_specs(func)
        for i in (func.attrs or {}).get("layout_free_buffers", []):
            _, shape, dtype = specs[int(i)]
            total += k.weight * int(np.prod(shape, dtype=np.int64)) * (tvm.runtime.DataType(dtype).bits // 8)
    return total


def check_cpu_trial_mode(mode: str) -> None:
    """Raise a one-line error (exit 2) for a mode not in ``CPU_TRIAL_MODES``."""
    if mode not in CPU_TRIAL_MODES:
        raise TvmfuseError(f"--cpu-trials {mode!r}: expected auto, cold or warm")


def cpu_trials(kernels, mode: str = "auto") -> tuple[str, str]:
    """How a CPU run times its trials, ``cold`` or ``warm``, and why. ``auto``: cold where the model's weights
    outgrow ``WARM_SHARE`` of the last-level cache (a model at batch 1 then streams them from DRAM every call:
    ResNet-50's 100 MB), warm where they fit (SqueezeNet's 5 MB stay in a 32 MB L3 between calls: cold times
    rank its kernels by a DRAM stream the model never waits for)."""
    check_cpu_trial_mode(mode)
    if mode != "auto":
        return mode, "asked"
    weights, llc = weight_bytes(kernels), last_level_cache_bytes()
    if llc is None:
        return "cold", f"weights {weights / 1e6:.1f} MB; the last-level cache's size is not known here"
    fits = weights <= WARM_SHARE * llc
    return ("warm" if fits else "cold"), (f"weights {weights / 1e6:.1f} MB {'within' if fits else 'past'} "
                                          f"{WARM_SHARE:g} of the {llc / 1e6:.0f} MB last-level cache")


def local_runner(timeout_s, *, gpu: bool = True, cold: bool = True):
    # A GPU trial: one sample of at least 20 ms of back-to-back calls. A CPU trial: CPU_SAMPLES single calls; ``cold``
    # (see cpu_trials), each after the kernel's arguments but the first (its weights; the first is the activations a
    # model hands it warm) are flushed from the caches, as a model whose weights outgrow the cache runs it: ResNet-50
    # at batch 1 streams 100 MB a call from DRAM, and ranked by hot times a 26-minute search made it 2.5% faster than
    # its untuned build while the kernels' hot sums said 40%. The shared machine stretches some samples:
    # KeptSamplesRunner drops them before the record is stored
    evaluator = (ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20) if gpu else
                 ms.runner.EvaluatorConfig(number=1, repeat=CPU_SAMPLES, min_repeat_ms=0, enable_cpu_cache_flush=cold))
    runner = ms.runner.LocalRunner(timeout_sec=max(timeout_s, _WORKER_START_S), evaluator_config=evaluator,
                                   f_alloc_argument=alloc_arguments, initializer=worker_initializer())
    inst = getattr(runner, "_inst", runner)  # the Python object behind TVM's derived-object wrapper
    inst.timeout_sec = timeout_s
    inst.pool._timeout = timeout_s  # PopenPoolExecutor reads it on each submit (TVM 0.27)
    return runner
