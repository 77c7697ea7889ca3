"""The samples a record keeps: a trial's times without the ones another process stretched.

A CPU trial is timed as several samples (tvmfuse.tune.tuner.CPU_SAMPLES). On a shared machine one sample in four
or five runs 3-10x the others (a neighbour took a core for part of its window), and a mean of the samples ranked
records by chance: a SqueezeNet kernel measured [0.25, 1.14, 0.11, 0.11, 0.11] ms (five samples of 20 ms each). The median is what the kernel runs at
when nothing else interferes; a sample more than ``STRETCH`` times it is dropped before the record is stored,
so the database, the cost model and the report all see the kept samples (their mean is the record's time).
A GPU trial is one sample and passes unchanged.
"""
from __future__ import annotations

from tvmfuse._tvm import derived_object, ms

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
