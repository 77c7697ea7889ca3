"""The partition step: Relax module -> Relax ``main`` calling fused TIR kernels, plus a :class:`Plan`.

Planners share one interface, ``(mod, target) -> (fused_mod, Plan)``; ``tune`` and ``compile`` call
:func:`partition` with the same planner so the kernels they see are the same workloads.
"""
from __future__ import annotations

from typing import Callable

from tvmfuse._tvm import PrimFunc, relax, tvm
from tvmfuse.plan.fastmath import legalize_ops
from tvmfuse.plan.graph import kernel_bytes
from tvmfuse.plan.report import Group, Plan
from tvmfuse.target import TargetInfo

Planner = Callable[[tvm.IRModule, TargetInfo], "tuple[tvm.IRModule, Plan]"]


def fused_functions(mod: tvm.IRModule) -> dict[str, PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, PrimFunc)}


def _call_sites(mod: tvm.IRModule) -> list[str]:
    """The PrimFuncs ``main`` calls, one entry per call site (a kernel launch), in order."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    names: list[str] = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(call_tir):
            names.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return names


def _primitive_ops(mod: tvm.IRModule) -> dict[str, tuple[tuple[str, ...], int]]:
    """For each ``Primitive`` Relax function (FuseOps' groups): its operators and their unfused bytes."""
    from tvmfuse.plan.graph import op_name, tensor_bytes

    call_tir = tvm.ir.Op.get("relax.call_tir")
    out = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or func.attrs is None or "Primitive" not in func.attrs:
            continue
        ops, total = [], 0

        def visit(e, ops=ops):
            nonlocal total
            if isinstance(e, relax.Call) and e.op.same_as(call_tir):
                ops.append(op_name(e.args[0].name_hint))
                total += sum(tensor_bytes(a.ty) for a in e.args[1].fields) + tensor_bytes(e.ty)

        relax.analysis.post_order_visit(func.body, visit)
        out[gv.name_hint] = (tuple(ops), total)
    return out


def _fuseops(mod: tvm.IRModule, target: TargetInfo) -> "tuple[tvm.IRModule, Plan]":
    """TVM's stock FuseOps, for comparison (``--planner fuseops``)."""
    from tvmfuse.plan.graph import op_name

    before = tvm.transform.Sequential([
        legalize_ops(cpu=not target.is_gpu),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
    ])
    with target.target:
        grouped = before(mod)
    per_group = _primitive_ops(grouped)
    fused = tvm.transform.Sequential([relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()])(grouped)
    prims = fused_functions(fused)
    groups, used = [], set()
    for kernel in _call_sites(fused):
        b = kernel_bytes(prims[kernel])
        ops, unfused = per_group.get(kernel, ((op_name(kernel),), b))
        name, k = kernel, 1
        while name in used:
            k += 1
            name = f"{kernel}#{k}"
        used.add(name)
        groups.append(Group(name=name, pattern="fuseops" if len(ops) > 1 else "single", ops=ops,
                            bytes_unfused=unfused, bytes_fused=b, kernel=kernel))
    return fused, Plan(planner="fuseops", groups=tuple(groups))


def _tvmfuse(mod: tvm.IRModule, target: TargetInfo, tf32: bool = False,
             cost_overrides: dict | None = None, x3: bool = False) -> "tuple[tvm.IRModule, Plan]":
    """tvmfuse's planner: rewrites, legality + cost model grouping, reasons (``--planner tvmfuse``). ``tf32``: fp32
    GEMMs and convs have a tensor-core template (wgmma in TF32): a small fp32 conv is not made im2col + GEMM for lack
    of one, and a narrow one (a stem) is, for the template's GEMM, as in fp16; fp32 attention is fused where the TF32
    flash kernel takes it; ``x3``: the same in three TF32 products each (fp32's accuracy).
    ``cost_overrides``: fields of the target's :class:`CostModel` set otherwise."""
    from tvmfuse.plan.cost import CostModel, gpu_tf32_attention_decline, gpu_x3_attention_decline
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    overrides = dict(cost_overrides or {})
    if (tf32 or x3) and target.is_gpu:
        overrides = dict(im2col_untemplated_pixels=0, tensor_core_dtypes=("float16", "float32"),
                         **{"attention_decline": gpu_tf32_attention_decline if tf32 else gpu_x3_attention_decline,
                            **overrides})
    if not overrides:
        return plan_tvmfuse(mod, target)
    return plan_tvmfuse(mod, target, config=PlannerConfig(cost_model=CostModel.for_target(target, **overrides)))


PLANNERS: dict[str, Planner] = {"fuseops": _fuseops, "tvmfuse": _tvmfuse}
DEFAULT_PLANNER = "tvmfuse"


def partition(mod: tvm.IRModule, *, target: TargetInfo, planner: str = DEFAULT_PLANNER,
              precision: str = "model", cost_overrides: dict | None = None,
              fp32_tensor_cores: bool = True) -> "tuple[tvm.IRModule, Plan]":
    """Partition ``mod`` into fused kernels.

    ``precision`` (``--precision``; the graph is converted before, by the loader): under ``tf32`` on a GPU the fp32
    GEMM and conv kernels are marked for the tensor cores and their weights stored in the order those read them
    (:mod:`tvmfuse.plan.tf32`); otherwise, on Hopper, the fp32 ones are marked for three TF32 products each (fp32's
    accuracy; ``fp32-strict``, or ``fp32_tensor_cores`` False, keeps them on the CUDA cores). ``cost_overrides``:
    fields of tvmfuse's cost model set otherwise (an A/B of one decision, e.g. ``{"gated_gemm_rows": 0}``).

    Returns the module whose ``main`` calls one PrimFunc per fused kernel, and the plan explaining it.
    """
    try:
        fn = PLANNERS[planner]
    except KeyError:
        from tvmfuse.errors import TvmfuseError

        raise TvmfuseError(f"unknown planner '{planner}'", hint="choose one of " + ", ".join(sorted(PLANNERS))) from None
    from tvmfuse.plan.tf32 import hopper

    tf32 = precision == "tf32"
    # fp32 GEMMs and convs elsewhere on Hopper: three TF32 products each, fp32's accuracy on the tensor cores
    # (fp32-strict: the CUDA cores')
    x3 = not tf32 and precision != "fp32-strict" and fp32_tensor_cores and target.is_gpu and hopper(target.target)
    fused, plan = fn(mod, target, tf32, cost_overrides, x3) if fn is _tvmfuse else fn(mod, target)
    if target.is_gpu or tf32:
        from dataclasses import replace

        from tvmfuse.plan.tf32 import tf32_kernels
        from tvmfuse.plan.weights import odd_columns_kmajor

        notes = []
        if not tf32:   # fp16 weights of odd columns, K-major for the tensor cores (TF32 transposes every weight)
            fused, note = odd_columns_kmajor(fused)
            notes.append(note)
            if x3:
                fused, note = tf32_kernels(fused, target.target, x3=True)
                notes.append(note)
        elif target.is_gpu:
            fused, note = tf32_kernels(fused, target.target)
            notes.append(note)
        else:
            notes.append("tf32: no tensor cores on this target; GEMMs and convs run in fp32")
        plan = replace(plan, rewrites=(*plan.rewrites, *(n for n in notes if n is not None)))
    return fused, plan


def plan_model(model, *, target: str | dict | None = "auto", planner: str = DEFAULT_PLANNER,
               input_shapes: dict | None = None, precision: str = "model") -> "tuple[tvm.IRModule, Plan]":
    """Load an ONNX file, import it and partition it (what ``tvmfuse plan`` shows).

    Parameters
    ----------
    model : path of the ``.onnx`` file
    target : ``auto``, ``llvm``, ``cuda`` or a TVM target JSON
    planner : ``tvmfuse`` or ``fuseops``
    input_shapes : static shapes for dynamic inputs
    precision : as for ``tune`` (``tvmfuse.frontend.precision``)
    """
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.target import resolve_target

    info = resolve_target(target)
    mod = import_model(load_model(model, input_shapes=input_shapes, precision=precision))
    return partition(mod, target=info, planner=planner, precision=precision)
