"""What the rewrites share: reading ``main``'s dataflow block (and the channels-last convs in it), re-emitting it
with some bindings replaced, and wrapping a ``mod -> mod`` function as a Relax module pass."""
from __future__ import annotations

from typing import Callable

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import substitute, tensor_shape

# the clean-up after a rewrite: fold what became constant, drop the identities and what nothing reads
CLEAN = [relax.transform.FoldConstant(), relax.transform.CanonicalizeBindings(),
         relax.transform.DeadCodeElimination()]


def op_name(call) -> str:
    """``"relax.nn.conv2d"`` for a call of that operator; ``""`` for anything else."""
    return str(call.op.name) if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else ""


def permute_axes(call) -> list[int]:
    """A ``permute_dims`` call's permutation (no axes: the reversed order)."""
    axes = call.attrs.axes
    return list(range(int(call.args[0].ty.ndim)))[::-1] if axes is None else [int(a) for a in axes]


def main_bindings(mod):
    """``main``'s bindings when its body is one dataflow block; ``None`` otherwise (nothing to rewrite)."""
    blocks = [b for b in mod["main"].body.blocks if isinstance(b, relax.DataflowBlock)]
    return list(blocks[0].bindings) if len(blocks) == 1 else None


def channels_last_convs(bindings):
    """``(binding, x, x_shape, y_shape, weight)`` for each conv of ``bindings`` with a constant filter, one group,
    NHWC activations and OHWI filters (``weight`` the filter as numpy, ``[F, R, S, C]``), in order."""
    for b in bindings:
        call = b.value
        if op_name(call) != "relax.nn.conv2d" or not isinstance(call.args[1], RelaxConstant):
            continue
        at, x = call.attrs, call.args[0]
        xs, ys = tensor_shape(x.ty), tensor_shape(b.var.ty)
        if (str(at.data_layout), str(at.kernel_layout), str(at.out_layout)) == ("NHWC", "OHWI", "NHWC") \
                and int(at.groups) == 1 and xs is not None and ys is not None:
            yield b, x, xs, ys, const_numpy(call.args[1])


def users_of(bindings) -> dict:
    """Each variable -> the bindings that read it (once per read)."""
    users: dict = {}
    for b in bindings:
        def visit(e, b=b):
            if isinstance(e, relax.Var):
                users.setdefault(e, []).append(b)
        relax.analysis.post_order_visit(b.value, visit)
    return users


def count_calls(mod, op: str) -> int:
    """Calls of ``op`` in ``main``."""
    n = [0]

    def visit(e):
        if op_name(e) == op:
            n[0] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return n[0]


def rebuild_main(mod, plan: dict, skip: set, names: dict | None = None, pre: dict | None = None) -> tvm.IRModule:
    """Re-emit ``main``: ``plan[var] = fn(bb, vmap) -> value`` replaces that binding's value (named
    ``names[var]`` when given); bindings whose var is in ``skip`` are dropped; ``pre[var](bb, vmap)`` runs
    just before that binding is emitted."""
    names, pre = names or {}, pre or {}
    main = mod["main"]
    rest = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}, attrs=mod.attrs)
    bb = relax.BlockBuilder(rest)
    vmap: dict = {}
    with bb.function("main", list(main.params), attrs=dict(main.attrs) if main.attrs else None):
        with bb.dataflow():
            for b in main.body.blocks[0].bindings:
                if b.var in pre:
                    pre[b.var](bb, vmap)
                if b.var in skip:
                    continue
                is_out = not isinstance(b.var, relax.DataflowVar)
                if b.var in plan:
                    value, name = plan[b.var](bb, vmap), names.get(b.var, str(b.var.name))
                else:
                    value, name = substitute(b.value, vmap), str(b.var.name)
                new = bb.emit_output(value, name_hint=name) if is_out else bb.emit(value, name_hint=name)
                vmap[b.var] = new
        bb.emit_func_output(substitute(main.body.body, vmap))
    return bb.finalize()


def replaced(mod, plan: dict, log, note: str) -> tvm.IRModule:
    """``mod`` with ``plan``'s bindings replaced (:func:`rebuild_main`), cleaned (``CLEAN``), ``note`` logged;
    ``mod`` itself where the plan is empty."""
    if not plan:
        return mod
    log.notes.append(note)
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def module_pass(name: str, fn: Callable) -> tvm.transform.Pass:
    """``fn(mod) -> mod`` as a Relax module pass named ``name``."""
    return tvm.transform.module_pass(lambda mod, _ctx: fn(mod), opt_level=0, name=name)


def cleaned_dataflow(mod, prepare: Callable | None = None):
    """``mod`` cleaned (and ``prepare``d), ``main``'s dataflow bindings and each variable's users.

    Bindings (and users) are ``None`` when ``main`` has no single dataflow block to rewrite.
    """
    mod = tvm.transform.Sequential(CLEAN)(mod)
    if prepare is not None:
        mod = prepare(mod)
    bindings = main_bindings(mod)
    return mod, bindings, (None if bindings is None else users_of(bindings))
