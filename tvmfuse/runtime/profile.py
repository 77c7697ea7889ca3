"""Per-kernel times of an artifact's own run (``tvmfuse run --profile``).

TVM 0.27's Relax VM has no profiler of its own, but it calls an instrument function before and after every
call instruction it executes. The one here syncs the device before and after each kernel call and reads the
host clock: a kernel's time is what the host waited for it, its launch included, never overlapped with its
neighbours (the syncs serialize them, so the sum can exceed an unprofiled run's latency on a GPU). The VM's
builtins (allocation, shape checks, ``vm.builtin.*``) are not timed: they are the rest of a run. A model built
as one CUDA graph runs its captured kernels inside one builtin call, which is timed as ``[cuda graph]``; its
kernels are not seen one by one (compile with ``--no-cuda-graph`` to see them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

NOTE = ("host-timed: each kernel's time includes its launch and a device sync before and after it; the VM's "
        "builtins (allocation, shape checks) are the rest of a run")
_BUILTIN = "vm.builtin"
_CUDA_GRAPH_RUN = "vm.builtin.cuda_graph.run_or_capture"
CUDA_GRAPH = "[cuda graph]"


@dataclass
class Profile:
    """What ``runs`` profiled calls of ``main`` did: every timed call, in the order made, and each run's span
    (host nanoseconds of ``time.perf_counter_ns``)."""

    runs: int
    warmup: int
    calls: list = field(default_factory=list)  # (name, run index, start ns, end ns)
    spans: list = field(default_factory=list)  # (start ns, end ns) of each run, its final sync included
    kernels: list = field(default_factory=list)  # the manifest's kernels: name, schedule, best_ms

    def summary(self) -> dict:
        """Per kernel (heaviest first): calls per run, time per run (ms, the mean over the runs), mean per call,
        share of the kernels' time; the manifest's schedule and tuned latency joined in by name. A kernel of the
        manifest that never ran has 0 calls (``seen`` false)."""
        runs = max(1, self.runs)
        by_name: dict[str, list[int]] = {}
        for name, _, start, end in self.calls:
            by_name.setdefault(name, []).append(end - start)
        manifest = {k["name"]: k for k in self.kernels}
        total_ns = sum(sum(v) for v in by_name.values())
        rows = []
        for name, durs in by_name.items():
            m = manifest.get(name, {})
            rows.append({
                "name": name, "schedule": m.get("schedule", "cuda-graph" if name == CUDA_GRAPH else None),
                "tuned_ms": m.get("best_ms"), "calls": len(durs) / runs, "total_ms": sum(durs) / runs / 1e6,
                "mean_ms": sum(durs) / len(durs) / 1e6, "share": sum(durs) / total_ns if total_ns else 0.0,
                "seen": True,
            })
        rows.sort(key=lambda r: (-r["total_ms"], r["name"]))
        rows += [{"name": k["name"], "schedule": k.get("schedule"), "tuned_ms": k.get("best_ms"), "calls": 0,
                  "total_ms": 0.0, "mean_ms": None, "share": 0.0, "seen": False}
                 for k in self.kernels if k["name"] not in by_name]
        for r in rows:  # a whole number of calls per run reads as one
            if float(r["calls"]).is_integer():
                r["calls"] = int(r["calls"])
        run_ms = sum(e - s for s, e in self.spans) / runs / 1e6
        return {"runs": self.runs, "warmup": self.warmup, "run_ms": run_ms, "kernels_ms": total_ns / runs / 1e6,
                "kernels": rows, "note": NOTE}

    def chrome_trace(self, *, label: str = "tvmfuse run") -> dict:
        """The Trace Event Format (chrome://tracing, Perfetto): one complete event per run and per kernel call,
        in microseconds from the first run's start, ordered by start time (a run before the kernels it holds)."""
        t0 = self.spans[0][0] if self.spans else min((c[2] for c in self.calls), default=0)
        manifest = {k["name"]: k for k in self.kernels}

        def us(ns: int) -> float:
            return round((ns - t0) / 1e3, 3)

        events = [{"name": f"main (run {i + 1} of {self.runs})", "cat": "run", "ph": "X", "ts": us(s),
                   "dur": round((e - s) / 1e3, 3), "pid": 1, "tid": 1, "args": {"run": i + 1}}
                  for i, (s, e) in enumerate(self.spans)]
        for name, run, start, end in self.calls:
            m = manifest.get(name, {})
            events.append({"name": name, "cat": "kernel", "ph": "X", "ts": us(start),
                           "dur": round((end - start) / 1e3, 3), "pid": 1, "tid": 1,
                           "args": {"run": run + 1, "schedule": m.get("schedule"), "tuned_ms": m.get("best_ms")}})
        events.sort(key=lambda ev: (ev["ts"], -ev["dur"]))
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": label}},
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "host (VM)"}}]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": {"note": NOTE}}


def profile_vm(vm, device, args: list, *, runs: int = 1, warmup: int = 3, kernels: list | None = None,
               cuda_graph: bool = False) -> Profile:
    """``warmup`` untimed calls of ``vm["main"](*args)``, then ``runs`` calls with every kernel call timed.

    ``cuda_graph``: the model captures a CUDA graph on its first call, and a device sync inside a capture would
    break it, so at least one untimed call comes first.
    """
    fn = vm["main"]
    warmup = max(warmup, 1) if cuda_graph else warmup
    for _ in range(warmup):
        fn(*args)
    device.sync()
    prof = Profile(runs=runs, warmup=warmup, kernels=list(kernels or []))
    clock = time.perf_counter_ns
    open_calls: list[int] = []  # start times of the calls in progress (a stack, should a call hold others)
    run = [0]

    def instrument(func, name, before_run, ret, *call_args) -> int:
        name = str(name)
        if name.startswith(_BUILTIN) and name != _CUDA_GRAPH_RUN:
            return 0
        device.sync()
        if before_run:
            open_calls.append(clock())
        elif open_calls:
            start = open_calls.pop()
            prof.calls.append((CUDA_GRAPH if name == _CUDA_GRAPH_RUN else name, run[0], start, clock()))
        return 0  # VMInstrumentReturnKind.NO_OP: run the call

    vm.set_instrument(instrument)
    try:
        for i in range(runs):
            run[0] = i
            start = clock()
            fn(*args)
            device.sync()
            prof.spans.append((start, clock()))
    finally:
        vm.set_instrument(None)
    return prof
