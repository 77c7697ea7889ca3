"""Real workloads and real MetaSchedule records for the database tests (also run in child processes)."""
from __future__ import annotations

import json

from tvmfuse._tvm import ms, tvm
from tvmfuse.target import TargetInfo, resolve_target

LLVM1 = {"kind": "llvm", "num-cores": 1}
LLVM2 = {"kind": "llvm", "num-cores": 2}


def target(spec: dict = LLVM1) -> TargetInfo:
    return resolve_target(json.dumps(spec))


def make_mod(n: int, *, op: str = "add") -> tvm.IRModule:
    """An n x n elementwise kernel whose block is named after its shape (``c<n>``)."""
    from tvm import te

    a = te.placeholder((n, n), name="a")
    b = te.placeholder((n, n), name="b")
    if op == "add":
        c = te.compute((n, n), lambda i, j: a[i, j] + b[i, j], name=f"c{n}")
    else:
        c = te.compute((n, n), lambda i, j: a[i, j] * b[i, j], name=f"c{n}")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")})


def make_record(db, mod, secs: float | None, *, split: int = 4) -> "ms.database.TuningRecord":
    """A real tuning record: a schedule trace on ``mod`` (parallel + split), its arg info and run time."""
    n = int(mod_side(mod))
    sch = tvm.s_tir.Schedule(mod)
    blk = sch.get_sblock(f"c{n}")
    i, j = sch.get_loops(blk)
    sch.parallel(i)
    sch.split(j, factors=[None, split])
    workload = db.commit_workload(mod)
    return ms.database.TuningRecord(
        sch.trace, workload, run_secs=None if secs is None else [secs], target=db.target_info.target,
        args_info=ms.arg_info.ArgInfo.from_prim_func(mod["main"]))


def mod_side(mod) -> int:
    f = mod["main"]
    return int(f.params[0].shape[0])


def record_side(record) -> int:
    """The n the record's own arg info says it was measured for."""
    return int(record.args_info[0].shape[0])
