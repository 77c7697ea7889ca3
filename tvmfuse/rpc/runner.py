"""A MetaSchedule runner that measures on the RPC servers under a key and keeps a ledger of which server measured
each trial and which trials were lost with their server.

MetaSchedule's ``RPCRunner`` reports a server that died the way it reports a kernel that failed (a
``RunnerResult`` with an ``error_msg``), so a dead server's trials would be stored as failed schedules and its
kernel could end up ``failed``; and its worker pool has no timeout, so a server that stops answering hangs the
run. This runner runs the same steps in a worker pool with a timeout (``tvmfuse.rpc.measure``), tells the two
kinds of failure apart, and marks a lost trial's ``error_msg`` with ``LOST_PREFIX``: the tuner leaves lost trials
out of the database (the next run measures them again) and counts them apart.
"""
from __future__ import annotations

import os
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field

from tvmfuse._tvm import derived_object, ms
from tvmfuse.rpc import RPCOptions

LOST_PREFIX = "tvmfuse-rpc-lost: "
# the pool's bound on one trial past the session's and the queue's own bounds: the tracker request, connect,
# cleanup, and the worker's own start
_POOL_MARGIN_S = 30.0


def is_lost(runner_result) -> bool:
    """Whether a ``RunnerResult`` is a trial lost with its server (not a failure of the kernel)."""
    msg = getattr(runner_result, "error_msg", None)
    return msg is not None and str(msg).startswith(LOST_PREFIX)


@dataclass
class Loss:
    server: str | None
    reason: str


@dataclass
class Ledger:
    """What the runner saw, shared with the tuner: per server the trials measured, failed and lost; the losses
    with their reasons; and whether no server is left under the key (``gone``)."""

    measured: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)
    losses: list = field(default_factory=list)
    where: dict = field(default_factory=dict)  # artifact path -> server that measured (or lost) it
    gone: str = ""  # why the run cannot go on: no server left under the key, or no tracker
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, artifact_path: str, status: str, server: str | None, message: str) -> None:
        with self._lock:
            self.where[artifact_path] = server
            name = server or "(no server)"
            if status == "ok":
                self.measured[name] += 1
            elif status == "error":
                self.failed[name] += 1
            else:
                self.lost[name] += 1
                self.losses.append(Loss(server, message))
                if status == "gone":  # no server can be had at all: the key is empty or the tracker is gone
                    self.gone = message

    def server_of(self, artifact_path: str) -> str | None:
        return self.where.get(str(artifact_path))

    def servers(self) -> dict[str, dict]:
        names = sorted(set(self.measured) | set(self.failed) | set(self.lost))
        return {n: {"measured": self.measured[n], "failed": self.failed[n], "lost": self.lost[n]} for n in names}

    def lost_total(self) -> int:
        return sum(self.lost.values())


@derived_object
class _RemoteFuture(ms.runner.PyRunnerFuture):
    """One trial in flight: its result is read once, noted in the ledger, and kept."""

    def __init__(self, future, ledger: Ledger, artifact_path: str, claim_path: str, timeout_s: float):
        super().__init__()
        self.future = future
        self.ledger = ledger
        self.artifact_path = artifact_path
        self.claim_path = claim_path
        self.timeout_s = timeout_s
        self.answer = None

    def done(self) -> bool:
        return self.future.done()

    def _claimed(self) -> str | None:
        try:
            with open(self.claim_path, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError:
            return None

    def result(self):
        if self.answer is None:
            try:
                status, server, payload = self.future.result()
            except TimeoutError:
                status, server, payload = "lost", self._claimed(), f"no answer within {self.timeout_s:g} s"
            except Exception as e:  # noqa: BLE001 - the worker process died: nothing measured
                status, server, payload = "lost", self._claimed(), f"the measuring worker failed: {e}"
            try:
                os.unlink(self.claim_path)
            except OSError:
                pass
            self.ledger.note(self.artifact_path, status, server, payload if status != "ok" else "")
            if status == "ok":
                self.answer = ms.runner.RunnerResult(payload, None)
            elif status in ("lost", "gone"):
                self.answer = ms.runner.RunnerResult(None, f"{LOST_PREFIX}{server or 'no server'}: {payload}")
            else:
                self.answer = ms.runner.RunnerResult(None, f"RPC server {server}: {payload}")
        return self.answer


@derived_object
class RemoteRunner(ms.runner.PyRunner):
    """Measures on the servers under ``opts.key``: ``workers`` trials at a time (each its own session, so each on
    another server while servers are free). A trial's bound: the wait for a free server, its session on the server
    (which the server enforces), and ``_POOL_MARGIN_S``; past it the worker is killed and the trial is lost."""

    def __init__(self, opts: RPCOptions, *, workers: int, ledger: Ledger, number: int = 3, repeat: int = 1,
                 min_repeat_ms: int = 20):
        super().__init__()
        from tvm.support.popen_pool import PopenPoolExecutor

        self.opts = opts
        self.ledger = ledger
        self.evaluator = (number, repeat, min_repeat_ms, False)
        self.timeout_s = opts.queue_wait_s + opts.session_timeout_s + _POOL_MARGIN_S
        self.pool = PopenPoolExecutor(max_workers=max(1, workers), timeout=self.timeout_s)
        self.claims = tempfile.mkdtemp(prefix="tvmfuse-rpc-")
        self._n = 0

    def run(self, runner_inputs):
        from tvmfuse.rpc.measure import measure

        futures = []
        for runner_input in runner_inputs:
            self._n += 1
            claim = os.path.join(self.claims, f"{self._n}.server")
            artifact = str(runner_input.artifact_path)
            future = self.pool.submit(
                measure, (self.opts.host, self.opts.port), self.opts.key, self.opts.session_timeout_s,
                self.opts.queue_wait_s, self.evaluator, artifact, _device_name(str(runner_input.device_type)),
                tuple(arg.as_json() for arg in runner_input.args_info), claim)
            futures.append(_RemoteFuture(future, self.ledger, artifact, claim, self.timeout_s))
        return futures

    def shutdown(self) -> None:
        import shutil

        self.pool.shutdown(wait=False)
        shutil.rmtree(self.claims, ignore_errors=True)


def _device_name(device_type: str) -> str:
    # MetaSchedule names the device by the target's kind; an RPC session knows "llvm" only as "cpu"
    return {"llvm": "cpu", "c": "cpu"}.get(device_type, device_type)


def make_runner(opts: RPCOptions, *, workers: int, number: int = 3, repeat: int = 1,
                min_repeat_ms: int = 20) -> tuple[object, Ledger]:
    """(the runner, its ledger). The runner is MetaSchedule's object; ``runner._inst`` the Python one behind it."""
    ledger = Ledger()
    runner = RemoteRunner(opts, workers=workers, ledger=ledger, number=number, repeat=repeat,
                          min_repeat_ms=min_repeat_ms)
    return runner, ledger


@derived_object
class SkipLost(ms.measure_callback.PyMeasureCallback):
    """Runs ``inner`` (MetaSchedule's AddToDatabase) on the trials that were not lost: a lost trial is no record,
    so it is neither a failed schedule in the database nor a spent trial (the next run measures it again)."""

    def __init__(self, inner):
        self.inner = inner

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        keep = [i for i, r in enumerate(runner_results) if not is_lost(r)]
        if not keep:
            return
        if len(keep) == len(runner_results):
            self.inner.apply(task_scheduler, task_id, measure_candidates, builder_results, runner_results)
            return
        self.inner.apply(task_scheduler, task_id, [measure_candidates[i] for i in keep],
                         [builder_results[i] for i in keep], [runner_results[i] for i in keep])


def measure_callbacks() -> list:
    """MetaSchedule's default callbacks with the database's skipping lost trials (the tuner's cost-model update,
    ``tvmfuse.tune.cost_model.LearnEveryTrial``, skips them itself)."""
    out = []
    for cb in ms.measure_callback.MeasureCallback.create("default"):
        out.append(SkipLost(cb) if type(cb).__name__ == "AddToDatabase" else cb)
    return out
