"""ONNX's variadic Max / Min / Sum as pairwise elementwise ops, not a reduction over a stacked axis.

TVM's importer writes ``Max(a, b)`` with static shapes as ``max(stack([broadcast_to(a), broadcast_to(b)]),
axis=0)``: a reduction over a new leading axis of two. The planner then treats an elementwise op as a reduction: a
row template declines it (it reduces no row), nothing fuses behind it as a pointwise epilogue, and dlight's Fallback
schedules the kernel, one thread an output (T5's fp16 clamp, ``max(min(x, c), -c)`` exported as Max and Min, put
every layer's RMSNorm on it). ``maximum(a, b)`` is the same value, elementwise.
"""
from __future__ import annotations

import functools

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, module_pass, op_name, rebuild_main, users_of

_PAIRWISE = {"relax.max": (relax.op.maximum, "maximum"), "relax.min": (relax.op.minimum, "minimum"),
             "relax.sum": (relax.op.add, "add")}


def _stacked_inputs(value, defs: dict, users: dict):
    """The tensors of ``stack([...], axis=0)`` that ``value`` (a max / min / sum over axis 0 of it, without
    keepdims) reduces, when the stack is read by nothing else; else None."""
    name = op_name(value)
    if name not in _PAIRWISE or not isinstance(value.args[0], relax.Var):
        return None
    attrs = value.attrs
    axes = [int(a) for a in attrs.axis] if attrs.axis is not None else None
    if axes != [0] or bool(attrs.keepdims):
        return None
    stack = defs.get(value.args[0])
    if stack is None or op_name(stack) != "relax.stack" or int(stack.attrs.axis) != 0:
        return None
    if len(users.get(value.args[0], [])) != 1:
        return None
    items = stack.args[0]
    if not isinstance(items, relax.Tuple) or len(items.fields) < 2:
        return None
    return list(items.fields)


def pairwise_extrema(mod, log=None) -> tvm.IRModule:
    """Each ``max / min / sum(stack([x1, ..., xn], axis=0), axis=0)`` becomes ``x1 op x2 op ... op xn`` (``maximum``,
    ``minimum``, ``add``); the stack is dropped with its last reader."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    defs = {b.var: b.value for b in bindings}
    users = users_of(bindings)
    plan = {}
    for b in bindings:
        fields = _stacked_inputs(b.value, defs, users)
        if fields is None:
            continue
        op, pairwise = _PAIRWISE[op_name(b.value)]

        def emit(bb, vmap, fields=fields, op=op):
            args = [vmap.get(f, f) for f in fields]
            return functools.reduce(lambda lhs, rhs: bb.normalize(op(lhs, rhs)), args)

        plan[b.var] = emit
        if log is not None:
            log.notes.append(f"{op_name(b.value)} over a stack of {len(fields)} ({b.var.name}) -> pairwise "
                             f"relax.{pairwise}")
    if not plan:
        return mod
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def PairwiseExtrema(log=None) -> tvm.transform.Pass:
    """:func:`pairwise_extrema` as a Relax module pass."""
    return module_pass("PairwiseExtrema", lambda mod: pairwise_extrema(mod, log=log))
