"""The end-to-end check: a whole model's tuned build timed against its untuned one, side by side, and the build
that ships chosen from it.

Each kernel is tuned alone, its inputs warm in cache from its own previous call; in the model its inputs come from
the kernel before it, and the records' order of speed need not hold there. On the 2-core EPYC a MobileNetV2 tuned
that way (every kernel's best, timed again side by side) ran 12% slower than its untuned build in one comparison
and 2% faster in another, half an hour apart. So ``tune`` on a CPU ends by timing both builds of the model in
interleaved rounds on random inputs and keeps the times in the database (:meth:`TuningDatabase.record_model_check`);
``compile`` and ``bench`` then ship the untuned build where the tuned one was slower by more than ``TOLERANCE``,
as long as no record came after the check, and say so.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

from tvmfuse._tvm import PrimFunc, relax, structural_hash, tvm
from tvmfuse.compile.build import BuildResult, build, on_device
from tvmfuse.target import TargetInfo

# the tuned build ships unless the untuned one ran faster by more than this share (the check's own spread: two
# interleaved comparisons of the same builds differed by 1-2% on the 2-core EPYC)
TOLERANCE = 0.02
ROUNDS = 15
CALLS = 10


def model_key(fused: tvm.IRModule) -> str:
    """What identifies a partitioned model to its checks: its kernels' structural hashes, in call order."""
    hashes = [str(structural_hash(f)) for gv, f in sorted(fused.functions.items(), key=lambda kv: kv[0].name_hint)
              if isinstance(f, PrimFunc)]
    return hashlib.sha256(",".join(hashes).encode()).hexdigest()[:32]


def _inputs(fused: tvm.IRModule, dev, seed: int = 0) -> list:
    """Random inputs for ``main``'s parameters: normal floats, zero integers (token ids, shapes), False flags."""
    rng = np.random.default_rng(seed)
    arrays = []
    for p in fused["main"].params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        arrays.append(rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype))
    return on_device(arrays, dev)


def time_builds(builds: dict[str, BuildResult], fused: tvm.IRModule, target: TargetInfo, *, rounds: int = ROUNDS,
                calls: int = CALLS) -> dict[str, float]:
    """Each build's median milliseconds a call over ``rounds`` interleaved rounds of ``calls`` back-to-back calls
    (after as many untimed), on the same random inputs."""
    dev = target.tvm_device()
    inputs = _inputs(fused, dev)
    runs = {}
    for name, built in builds.items():
        vm = relax.VirtualMachine(built.executable, dev)
        args = inputs + on_device(built.lifted_params, dev)
        runs[name] = (lambda vm=vm, args=args: vm["main"](*args))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, call in runs.items():
            for _ in range(calls):
                call()
            dev.sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            dev.sync()
            samples[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: float(np.median(s)) for name, s in samples.items()}


def check_model(fused: tvm.IRModule, *, target: TargetInfo, database, rounds: int = ROUNDS) -> dict:
    """Build ``fused`` with ``database``'s records and without, time both side by side and keep the result in the
    database; the times and the build that will ship."""
    tuned = build(fused, target=target, database=database, cuda_graph=False)
    untuned = build(fused, target=target, database=None, cuda_graph=False)
    times = time_builds({"tuned": tuned, "untuned": untuned}, fused, target, rounds=rounds)
    database.record_model_check(model_key(fused), tuned_ms=times["tuned"], untuned_ms=times["untuned"])
    return {"tuned_ms": round(times["tuned"], 4), "untuned_ms": round(times["untuned"], 4), "rounds": rounds,
            "ships": "untuned" if _untuned_wins(times["tuned"], times["untuned"]) else "tuned"}


def _untuned_wins(tuned_ms: float, untuned_ms: float) -> bool:
    return tuned_ms > untuned_ms * (1 + TOLERANCE)


def build_checked(fused: tvm.IRModule, *, target: TargetInfo, database, cuda_graph: bool = True
                  ) -> tuple[BuildResult, dict | None]:
    """:func:`build` with ``database``'s records, or without them where the database's current end-to-end check of
    this model found the tuned build slower (see the module); the check as reported (None: there is none)."""
    check = database.model_check(model_key(fused)) if database is not None else None
    if check is None:
        return build(fused, target=target, database=database, cuda_graph=cuda_graph), None
    applied = check["current"] and _untuned_wins(check["tuned_ms"], check["untuned_ms"])
    report = {"tuned_ms": round(check["tuned_ms"], 4), "untuned_ms": round(check["untuned_ms"], 4),
              "current": check["current"], "ships": "untuned" if applied else "tuned"}
    return build(fused, target=target, database=None if applied else database, cuda_graph=cuda_graph), report
