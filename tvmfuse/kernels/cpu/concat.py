"""A channel concatenation inlined into a CPU kernel: where its selection of inputs flips along the innermost axis.

Inlined, ``concatenate`` reads ``if_then_else(c0 <= v, a, if_then_else(c1 <= v, b, ..))`` on that axis' iterator:
every element walks the chain, and vectorised, every lane loads each input. The CPU default
(:func:`tvmfuse.kernels.cpu.schedule.schedule_pointwise`) runs the axis in chunks no boundary cuts instead.
"""
from __future__ import annotations

import math

from tvmfuse._tvm import subexprs, tvm


_COMPARISONS = (tvm.tirx.expr.LE, tvm.tirx.expr.LT, tvm.tirx.expr.GE, tvm.tirx.expr.GT)


def concat_chunk(sch, block) -> int | None:
    """Where ``block`` selects its inputs by the innermost axis (a channel concatenation inlined: nested
    ``if_then_else(c0 <= v, a, if_then_else(c1 <= v, b, ..))`` on that axis' iterator): the largest chunk of that
    axis no boundary cuts (the boundaries' and the extent's gcd); None where no such selection is found."""
    stmt = sch.get(block)
    if not stmt.iter_vars or not isinstance(stmt.body, tvm.tirx.BufferStore):
        return None
    inner = stmt.iter_vars[-1].var
    bounds = set()
    for node in subexprs(stmt.body.value):
        if not (isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") in ("prim.if_then_else",
                                                                                  "tir.if_then_else")):
            continue
        cond = node.args[0]
        a, b = getattr(cond, "a", None), getattr(cond, "b", None)
        const_left = isinstance(a, tvm.tirx.IntImm) and b is not None and b.same_as(inner)
        const_right = isinstance(b, tvm.tirx.IntImm) and a is not None and a.same_as(inner)
        if not (isinstance(cond, _COMPARISONS) and (const_left or const_right)):
            return None   # a selection by something else: not a concatenation along that axis
        k = int(a.value if const_left else b.value)
        # where the selection flips: k for k <= v, v >= k, v < k, k > v; k + 1 for k < v, v > k, v <= k, k >= v
        at_k = (isinstance(cond, (tvm.tirx.expr.LE, tvm.tirx.expr.GT)) and const_left) or (
            isinstance(cond, (tvm.tirx.expr.GE, tvm.tirx.expr.LT)) and const_right)
        bounds.add(k if at_k else k + 1)
    if not bounds:
        return None
    extent = int(stmt.iter_vars[-1].dom.extent)
    chunk = math.gcd(extent, *bounds)
    return chunk if 0 < chunk < extent else None
