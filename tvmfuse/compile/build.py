"""Apply tuned records to a partitioned module and build it, reporting what each kernel runs with.

TVM's ``MetaScheduleApplyDatabase`` silently keeps the untuned schedule when a record is missing
("Tuning record is not found for primfunc"); tvmfuse applies records itself and reports every kernel's
schedule source, so a build never hides an untuned kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tvmfuse import nvcc_cache
from tvmfuse._gpu_rules import default_gpu_schedule
from tvmfuse._tvm import PrimFunc, build_context, const_value, is_scheduled, relax, tvm
from tvmfuse.target import TargetInfo, device_figures
from tvmfuse.kernels import expand
from tvmfuse.kernels.cpu.prefetch import tir_pipeline
from tvmfuse.tune.defaults import untuned_kernel


@dataclass(frozen=True)
class KernelStatus:
    name: str
    schedule: str  # tuned | default (llvm, untuned) | dlight-<rule> (cuda, untuned: the dlight rule that took it,
    #                dlight-matmul, dlight-gemv, dlight-reduction, dlight-general-reduction, dlight-fallback) |
    #                narrow-matmul, simt-matmul (cuda, untuned: _gpu_rules) | flash-default (cuda attention,
    #                untuned: the flash template's default tiles) | wgmma-default (a GEMM or conv on sm_90a,
    #                untuned: the wgmma template's default tiles) | rows-default (a row kernel on cuda,
    #                untuned: the row program's default config) | pointwise-default (a pointwise kernel on
    #                cuda, untuned: the pointwise template at the space's `untuned` knobs) | cpu-default (llvm,
    #                untuned: tvmfuse/kernels/cpu's parallel, vectorised schedule) | whole-reduction (cuda,
    #                untuned: a whole tensor reduced to one element by one block, _gpu_rules.WholeReduction) |
    #                short-reduction (cuda, untuned: reductions of at most 64 elements, one output a thread,
    #                _gpu_rules.ShortReduction) | prescheduled (topi's sorts and scans, scheduled where they are
    #                made: plan/planner.py _sorts_and_scans)
    best_ms: float | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "schedule": self.schedule, "best_ms": self.best_ms}


@dataclass(frozen=True)
class BuildResult:
    executable: object  # tvm.runtime.Executable
    kernels: tuple[KernelStatus, ...]
    lifted_params: tuple  # constants lifted out of main, in the order main takes them after the inputs
    cuda_graph: bool = False  # main's static part replays as one CUDA graph
    tir_pipeline: str = "default"  # the kernels' TIR lowering: "tvmfuse-llvm" adds the weight prefetch (kernels/cpu)

    @property
    def untuned(self) -> list[str]:
        return [k.name for k in self.kernels if k.schedule not in ("tuned", "prescheduled")]


def on_device(values, dev) -> list:
    """``values`` (numpy arrays, or tensors such as a build's ``lifted_params``) as tensors on ``dev``, in order: the
    arguments a built ``main`` takes after its inputs, or the inputs themselves."""
    return [v.copyto(dev) if hasattr(v, "copyto") else tvm.runtime.tensor(np.asarray(v), dev) for v in values]


def _normalized(func: PrimFunc) -> tvm.IRModule:
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def apply_records(fused_mod: tvm.IRModule, *, target: TargetInfo, database) -> tuple[tvm.IRModule, list[KernelStatus]]:
    """Replace every PrimFunc that has a record for ``target`` with its best schedule.

    ``database`` may be ``None`` (an untuned build). Unrecorded kernels get a template's default (on llvm the
    CPU default), else dlight's default GPU schedules on CUDA and TVM's default lowering on llvm; each kernel's
    source is reported.
    """
    updates: dict = {}
    statuses: list[KernelStatus] = []
    ms_db = database.ms_database if database is not None else None
    for gv, func in fused_mod.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        name = gv.name_hint
        if is_scheduled(func):
            statuses.append(KernelStatus(name, "prescheduled"))
            continue
        sch, workload = None, _normalized(func)
        if ms_db is not None:
            with target.target:
                sch = ms_db.query_schedule(workload, target.target, name)
        if sch is not None:  # (a tuned attention record names its flash tiles: expand() below swaps them in)
            updates[gv] = sch.mod["main"].with_attr("global_symbol", name).with_attr("tirx.is_scheduled", True)
            best = database.best_run_secs(workload)
            statuses.append(KernelStatus(name, "tuned", None if best is None else best * 1e3))
        elif (found := untuned_kernel(func, target)) is not None:
            # untuned, and a tvmfuse template takes it: the template's default config (see tvmfuse/kernels/)
            source, kernel = found
            updates[gv] = kernel.with_attr("global_symbol", name)
            statuses.append(KernelStatus(name, source))
        else:   # on a GPU the rule that schedules it names it below
            statuses.append(KernelStatus(name, "dlight" if target.is_gpu else "default"))
    # a new module (dlight's ApplyDefaultSchedule below updates the module it is given in place)
    mod = expand(tvm.IRModule({gv: updates.get(gv, f) for gv, f in fused_mod.functions.items()},
                              attrs=fused_mod.attrs))
    if target.is_gpu:
        mod, sources = _default_gpu_schedules(mod, target)
        statuses = [replace(s, schedule=sources[s.name]) if s.schedule == "dlight" and s.name in sources else s
                    for s in statuses]
    return mod, statuses


def _default_gpu_schedules(mod: tvm.IRModule, target: TargetInfo) -> tuple[tvm.IRModule, dict]:
    """(module, {kernel: the rule's name}): the first of the default GPU rules that takes each unscheduled kernel. dlight's own pass stops the build when a rule
    raises (its Matmul asserts on some GEMM epilogues: "consumers of the cache-write stage that are not properly
    inlined", LLaMA and T5 in fp32); here that rule is passed over and the next one schedules the kernel."""
    funcs, sources = {}, {}
    sms = device_figures(target).sm_count   # the rules' thresholds are waves over the target's SMs
    for gv, func in mod.functions.items():
        if isinstance(func, PrimFunc) and not is_scheduled(func):
            sch, sources[gv.name_hint] = default_gpu_schedule(_normalized(func), target.target, sms)
            if sch is not None:
                funcs[gv] = sch.mod["main"].with_attr("global_symbol", gv.name_hint).with_attr("tirx.is_scheduled", True)
    return tvm.IRModule({gv: funcs.get(gv, f) for gv, f in mod.functions.items()}, attrs=mod.attrs), sources


def _with_function(mod: tvm.IRModule, gv, func) -> tvm.IRModule:
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions, attrs=mod.attrs)
    mod[gv] = func
    return mod


def _backend(target: TargetInfo):
    if target.is_gpu:
        from tvm.relax.backend.cuda import pipeline as p
    else:
        from tvm.relax.backend.cpu_generic import pipeline as p
    return p


def finish_pipeline(target: TargetInfo) -> tvm.transform.Pass:
    """Relax passes after partitioning: lower dataflow, plan memory, lower to the VM (no re-fusion).

    ``RewriteDataflowReshape`` is left out: it asks every one-input kernel whether it is a reshape, an analysis
    that needs a root block, which the hand-written kernels (a row program's softmax) do not have. ``build``
    runs it before the records are applied, on the planner's kernels."""
    p = _backend(target)
    lower = [t for t in p.dataflow_lower_passes(target.target) if "RewriteDataflowReshape" not in str(t.info.name)]
    return tvm.transform.Sequential(lower + p.finalize_passes(target.target))


def pack_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """The weights of the kernels whose schedules read them in a packed layout (a CPU GEMM's or conv's tiles:
    a layout-rewrite block at the kernel's start), packed once here: each rewrite becomes a function of its own
    (``SplitLayoutRewritePreproc``) that constant folding runs on the weight, so the built kernels read the packed
    weight and nothing packs at run time."""
    if not any(isinstance(f, PrimFunc) and "layout_free_buffers" in (f.attrs or {}) for f in mod.functions.values()):
        return mod
    seq = tvm.transform.Sequential([relax.transform.SplitLayoutRewritePreproc(), relax.transform.FoldConstant()])
    return _kernel_names_kept(seq(mod))


def _kernel_names_kept(mod: tvm.IRModule) -> tvm.IRModule:
    """The split calls kernel ``X`` as ``X_prepacked`` and packs its weight with ``X_weight_prepack``: the kernel
    takes its name back (the plan, the report and a profile name it so), and what no call reaches any more (``X``,
    the folded packing) goes."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    suffix = "_prepacked"

    def callees(func) -> set:
        found: set = set()

        @relax.expr_functor.visitor
        class Calls(relax.PyExprVisitor):
            def visit_call_(self, call):  # noqa: N802 - the visitor's name
                if call.op.same_as(call_tir) and isinstance(call.args[0], tvm.ir.GlobalVar):
                    found.add(call.args[0].name_hint)
                super().visit_call_(call)

        Calls().visit_expr(func.body)
        return found

    relax_funcs = {gv: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    called = set().union(*(callees(f) for f in relax_funcs.values()))
    names = {gv.name_hint for gv in mod.get_global_vars()}
    # X_prepacked -> a GlobalVar named X (typed as the packed kernel is), where nothing calls X itself any more
    rename = {}
    for gv in mod.get_global_vars():
        base = gv.name_hint[: -len(suffix)]
        if gv.name_hint.endswith(suffix) and base in names and base not in called:
            rename[gv] = tvm.ir.GlobalVar(base)
            relax.expr._update_type(rename[gv], gv.ty)
    if not rename:
        return mod

    @relax.expr_functor.mutator
    class Rename(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the mutator's name
            call = super().visit_call_(call)
            if call.op.same_as(call_tir) and call.args[0] in rename:
                call = relax.Call(call.op, [rename[call.args[0]], *call.args[1:]], call.attrs, ty_args=call.ty_args)
            return call

    funcs = {gv: relax.Function(f.params, Rename().visit_expr(f.body), f.ret_ty, f.is_pure, attrs=f.attrs)
             for gv, f in relax_funcs.items()}
    renamed = {gv.name_hint for gv in rename.values()}
    for gv, func in mod.functions.items():
        if gv in rename:
            funcs[rename[gv]] = func.with_attr("global_symbol", rename[gv].name_hint)
        elif gv not in relax_funcs and gv.name_hint not in renamed and (
                gv.name_hint in called or not gv.name_hint.endswith("_weight_prepack")):
            funcs[gv] = func
    return tvm.IRModule(funcs, attrs=mod.attrs)


def lift_constants(mod: tvm.IRModule, *, min_elements: int = 64) -> tuple[tvm.IRModule, list]:
    """Turn ``main``'s large constants (the weights) into trailing parameters.

    The artifact then ships weights in ``params.npz`` beside the code instead of inside the library.
    """
    main = mod["main"]
    consts: list = []

    @relax.expr_functor.mutator
    class Lift(relax.PyExprMutator):
        def visit_generic_const_(self, op):  # noqa: N802 - TVM 0.27 names relax constants GenericConst
            value = const_value(op)
            if int(np.prod(value.shape)) >= min_elements:
                var = relax.Var(f"param_{len(consts)}", op.ty)
                consts.append((var, value))
                return var
            return op

    body = Lift(mod).visit_expr(main.body)
    if not consts:
        return mod, []
    params = list(main.params) + [v for v, _ in consts]
    new_main = relax.Function(params, body, main.ret_ty, main.is_pure, attrs=main.attrs)
    new_mod = _with_function(mod, mod.get_global_var("main"), new_main)
    return new_mod, [c for _, c in consts]


def build(fused_mod: tvm.IRModule, *, target: TargetInfo, database=None, lift_params: bool = True,
          cuda_graph: bool = True) -> BuildResult:
    """Apply records from ``database`` (or none), build for ``target``, and report each kernel's schedule.

    ``cuda_graph`` (GPU targets): the kernels of ``main`` that read only weights and intermediates are captured
    into one CUDA graph on the first call and replayed after it, so a launch-bound model (batch 1) pays one
    graph launch instead of one launch per kernel. The lifted weights are ``main``'s static parameters
    (``num_input``): a graph holds their addresses, so they must be the same tensors on every call, as the
    artifact's loader passes them."""
    # kernels that only reshape become the VM's reshape (no copy); the kernels they replace go with DCE
    fused_mod = relax.transform.DeadCodeElimination(["main"])(relax.transform.RewriteDataflowReshape()(fused_mod))
    mod, statuses = apply_records(fused_mod, target=target, database=database)
    if not target.is_gpu:
        mod = pack_weights(mod)
    params: list = []
    if lift_params:
        mod, params = lift_constants(mod)
    graph = bool(cuda_graph and target.is_gpu)
    if graph:
        main = mod["main"]
        n_inputs = len(main.params) - len(params)
        mod = _with_function(mod, mod.get_global_var("main"), main.with_attr("num_input", n_inputs))
    if target.is_gpu:   # the kernels compile when the build is loaded on a GPU (a bench, a check): through the cache
        nvcc_cache.install()
    with target.target, build_context(cuda_graph=graph):
        lowering = tir_pipeline(target.target)
        exe = tvm.compile(mod, target.target, relax_pipeline=finish_pipeline(target), tir_pipeline=lowering)
    return BuildResult(executable=exe, kernels=tuple(statuses), lifted_params=tuple(params), cuda_graph=graph,
                       tir_pipeline=lowering)
