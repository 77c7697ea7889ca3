"""The partition step: Relax module -> Relax ``main`` calling fused TIR kernels, plus a :class:`Plan`.

Planners share one interface, ``(mod, target) -> (fused_mod, Plan)``; ``tune`` and ``compile`` call
:func:`partition` with the same planner so the kernels they see are the same workloads.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tvmfuse._tvm import PrimFunc, relax, tvm
from tvmfuse.plan.report import Group, Plan
from tvmfuse.target import TargetInfo

Planner = Callable[[tvm.IRModule, TargetInfo], "tuple[tvm.IRModule, Plan]"]


def _param_bytes(param) -> int:
    # TVM 0.27: a PrimFunc's tensor parameters carry their shape and dtype (no buffer_map)
    shape = getattr(param, "shape", None)
    if shape is None:
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n * np.dtype(str(param.dtype)).itemsize


def kernel_bytes(func: PrimFunc) -> int:
    """HBM bytes a kernel moves at best: each parameter buffer read or written once."""
    return sum(_param_bytes(p) for p in func.params)


def fused_functions(mod: tvm.IRModule) -> dict[str, PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, PrimFunc)}


def _fuseops(mod: tvm.IRModule, target: TargetInfo) -> "tuple[tvm.IRModule, Plan]":
    """TVM's stock FuseOps, for comparison (``--planner fuseops``)."""
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])
    with target.target:
        fused = seq(mod)
    groups = []
    for name, func in sorted(fused_functions(fused).items()):
        ops = tuple(name[len("fused_"):].split("_")) if name.startswith("fused_") else (name,)
        b = kernel_bytes(func)
        groups.append(Group(name=name, pattern="fuseops", ops=ops, bytes_unfused=b, bytes_fused=b))
    return fused, Plan(planner="fuseops", groups=tuple(groups))


def _tvmfuse(mod: tvm.IRModule, target: TargetInfo) -> "tuple[tvm.IRModule, Plan]":
    """tvmfuse's planner: rewrites, legality + cost model grouping, reasons (``--planner tvmfuse``)."""
    from tvmfuse.plan.planner import plan_tvmfuse

    return plan_tvmfuse(mod, target)


PLANNERS: dict[str, Planner] = {"fuseops": _fuseops, "tvmfuse": _tvmfuse}
DEFAULT_PLANNER = "fuseops"


def partition(mod: tvm.IRModule, *, target: TargetInfo, planner: str = DEFAULT_PLANNER) -> "tuple[tvm.IRModule, Plan]":
    """Partition ``mod`` into fused kernels.

    Returns the module whose ``main`` calls one PrimFunc per fused kernel, and the plan explaining it.
    """
    try:
        fn = PLANNERS[planner]
    except KeyError:
        from tvmfuse.errors import TvmfuseError

        raise TvmfuseError(f"unknown planner '{planner}'", hint="choose one of " + ", ".join(sorted(PLANNERS))) from None
    return fn(mod, target)
