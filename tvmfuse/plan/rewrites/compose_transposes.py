"""Transposes composed: a transpose of a transpose is one transpose, and an identity permutation is none."""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import (CLEAN, count_calls, main_bindings, module_pass, op_name,
                                           permute_axes, rebuild_main)


def compose_transposes(mod) -> "tuple[tvm.IRModule, int]":
    """``permute_dims(permute_dims(x, p), q)`` -> ``permute_dims(x, p[q])``, and ``x`` for an identity permutation
    (ConvertLayout leaves one where a model's own output transpose followed the layout).

    A model that takes NHWC tensors says so in ONNX as Transpose -> Conv (NCHW); once the convs run NHWC the
    layout transpose that :func:`channels_last` puts in front of them undoes the model's, and the pair would
    otherwise cost a copy of the input. The inner transpose stays while something else reads it. Returns
    the module and the number of transposes removed."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod, 0
    defs = {b.var: b.value for b in bindings}
    plan = {}
    for b in bindings:
        if op_name(b.value) != "relax.permute_dims":
            continue
        axes, x = permute_axes(b.value), b.value.args[0]
        inner = defs.get(x)
        composed = op_name(inner) == "relax.permute_dims"
        if composed:
            p = permute_axes(inner)
            axes, x = [p[i] for i in axes], inner.args[0]
        if axes == list(range(len(axes))):
            plan[b.var] = lambda bb, vmap, x=x: vmap.get(x, x)
        elif composed:
            plan[b.var] = lambda bb, vmap, x=x, axes=axes: relax.op.permute_dims(vmap.get(x, x), axes)
    if not plan:
        return mod, 0
    before = count_calls(mod, "relax.permute_dims")
    mod = tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))
    return mod, before - count_calls(mod, "relax.permute_dims")


def ComposeTransposes() -> tvm.transform.Pass:
    """:func:`compose_transposes` as a Relax module pass (the count of transposes removed is dropped)."""
    return module_pass("ComposeTransposes", lambda mod: compose_transposes(mod)[0])
