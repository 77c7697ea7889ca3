"""The tvmfuse planner: rewrites, legalization, grouping (legality + cost model), outlining, FuseTIR.

Phases (each a module pass, in one Sequential):
  1. high-level rewrites on Relax ops: fold inference BatchNorm into conv weights, fuse attention into
     one kernel, merge GEMMs sharing an input (when the cost model says so);
  2. legalize to TIR (one ``call_tir`` per operator) and fold constants;
  3. group ``call_tir``s: every producer -> consumer edge is offered to ``can_fuse`` (correctness) and the
     cost model (profitability); every refusal is recorded with its reason on ``tvmfuse.plan.why``;
  4. outline each group as a ``Primitive`` Relax function and let ``FuseTIR`` make one PrimFunc of it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from tvmfuse._tvm import PrimFunc, RelaxConstant, param_buffers, relax, tvm
from tvmfuse.plan.cluster import Cluster, bytes_fused, reused_inputs
from tvmfuse.plan.cost import CostModel
from tvmfuse.plan.fastmath import legalize_ops
from tvmfuse.plan.graph import (CONV, GEMM, INJECTIVE_K, NORM, NOT_KERNEL, POINTWISE, REDUCE, Graph, build_graph,
                                kernel_bytes, kernel_calls, static_params)
from tvmfuse.plan.legality import can_fuse, results_stored, whole_tensor
from tvmfuse.plan.outline import outline_groups
from tvmfuse.plan.patterns import classify
from tvmfuse.plan.report import Group, Plan, Rejection
from tvmfuse.plan.tags import RewriteLog
from tvmfuse.target import TargetInfo

why = logging.getLogger("tvmfuse.plan.why")


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the tvmfuse planner.

    cost_model : any object with ``score(graph, a, b) -> Score``; ``None``: :meth:`CostModel.for_target`
    fold_batchnorm, attention, horizontal : enable the high-level rewrites (``horizontal``: the gated GEMMs too)
    debug_dump : a folder to write ``mod.script()`` after each phase
    """

    cost_model: object | None = None
    fold_batchnorm: bool = True
    attention: bool = True
    horizontal: bool = True
    debug_dump: Path | None = None


@dataclass
class Grouping:
    clusters: list[Cluster]
    rejected: list[Rejection] = field(default_factory=list)
    scores: dict = field(default_factory=dict)  # id(cluster) -> last gain


def group_nodes(graph: Graph, cost_model) -> Grouping:
    """Greedy grouping in topological order: each consumer takes its producers' clusters, best first."""
    cluster_of: dict[int, Cluster] = {}
    for n in graph.nodes:
        if n.kind != NOT_KERNEL:
            cluster_of[id(n)] = Cluster([n])
    rejected: list[Rejection] = []
    seen_reasons: set = set()
    scores: dict = {}

    def reject(a: Cluster, b: Cluster, reason: str) -> None:
        ops = a.ops + b.ops
        key = (ops, reason)
        if key in seen_reasons:
            return
        seen_reasons.add(key)
        rejected.append(Rejection(ops=ops, reason=reason))
        why.info("not fused %s + %s: %s", "/".join(a.ops), "/".join(b.ops), reason)

    for node in graph.nodes:
        if node.kind == NOT_KERNEL:
            continue
        while True:
            mine = cluster_of[id(node)]
            candidates = []
            for v in node.inputs:
                p = graph.producer.get(v)
                if p is None or p.kind == NOT_KERNEL:
                    continue
                pc = cluster_of[id(p)]
                if pc is mine or any(pc is c for _, c in candidates):
                    continue
                candidates.append((p, pc))
            best = None
            for p, pc in candidates:
                verdict = can_fuse(graph, pc, mine)
                if not verdict:
                    reject(pc, mine, verdict.reason)
                    continue
                score = cost_model.score(graph, pc.members, mine.members)
                if not score.profitable:
                    reject(pc, mine, score.reason or "not profitable")
                    continue
                if best is None or score > best[0]:
                    best = (score, pc)
            if best is None:
                break
            score, pc = best
            merged = Cluster(pc.members + mine.members)
            for n in merged.members:
                cluster_of[id(n)] = merged
            scores[id(merged)] = score.gain
            # loop: the merged cluster may take another producer (multi-input consumers)
    clusters, seen = [], set()
    for n in graph.nodes:
        c = cluster_of.get(id(n))
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            clusters.extend(_one_result(graph, c, reject, getattr(cost_model, "reduction_results", 0)))
    return Grouping(clusters=_reoffered(graph, clusters, cost_model), rejected=rejected, scores=scores)


def _reoffered(graph: Graph, clusters: list[Cluster], cost_model) -> list[Cluster]:
    """``clusters`` where a kernel of pointwise and layout ops alone, every reader of which sits in one other kernel,
    joins that kernel as its prologue. :func:`_one_result` leaves such kernels behind: a GEMM took the pointwise
    reader of its result while grouping, and then could not store it beside its own result (LLaMA's and T5's
    fp16 residual sums cast to fp32 for the RMSNorm: a kernel writing the cast sum, 2 x the fp16 bytes, for the
    norm to read back, twice a layer). Grouping offered the cast to its producer first; its reader never saw it."""
    readers: dict = {}
    for n in graph.nodes:
        for v in n.inputs:
            p = graph.producer.get(v)
            if p is not None:
                readers.setdefault(id(p), []).append(n)
    out = list(clusters)
    owner = {id(n): k for k in out for n in k.members}   # kept current as clusters merge
    for c in list(out):
        if not any(k is c for k in out) or any(n.kind not in (POINTWISE, INJECTIVE_K) or n.var in graph.outputs
                                               for n in c.members):
            continue   # (a cluster already merged into another is gone)
        mine = c.ids()
        targets = {id(owner[id(r)]): owner[id(r)] for n in c.members for r in readers.get(id(n), [])
                   if id(r) not in mine and id(r) in owner}
        if len(targets) != 1:
            continue
        (d,) = targets.values()
        if not can_fuse(graph, c, d) or not cost_model.score(graph, c.members, d.members).profitable:
            continue
        merged = Cluster(c.members + d.members)
        if len(results_stored(graph, merged, Cluster([]), final=True)) > len(
                results_stored(graph, d, Cluster([]), final=True)):
            continue
        out = [merged if k is d else k for k in out if k is not c]
        owner.update((id(n), merged) for n in merged.members)
    return out


def _one_result(graph: Graph, cluster: Cluster, reject, reduction_results: int = 0) -> list[Cluster]:
    """``cluster``, or where a GEMM / conv kernel ended up storing more than one result (a pointwise reader that
    ``can_fuse`` let it expect to take in stayed out), the kernel of its first result and, apart, the members that
    result does not need (they read it from memory). With ``reduction_results`` (the cost model's), a kernel
    holding a reduction that stores more results is split the same way."""
    anchors = cluster.anchors
    gemm = bool(anchors) and anchors[0].kind in (GEMM, CONV)
    # row reductions (statistics a row): a whole-tensor reduction's scalar results are no row template's
    reducing = reduction_results > 0 and (bool(anchors) and anchors[0].kind == NORM or any(
        n.kind == REDUCE and n.out_shape is not None and not whole_tensor(n.out_shape) for n in cluster.members))
    if not gemm and not reducing:
        return [cluster]
    stored = results_stored(graph, cluster, Cluster([]), final=True)
    if len(stored) < 2 or (not gemm and len(stored) <= reduction_results):
        return [cluster]
    first = min(stored, key=lambda n: n.index)
    keep, todo = {id(first)}, [first]
    by_var = {id(n.var): n for n in cluster.members}
    while todo:   # the members ``first`` depends on
        for v in todo.pop().inputs:
            p = graph.producer.get(v)
            if p is not None and id(p.var) in by_var and id(p) not in keep:
                keep.add(id(p))
                todo.append(p)
    kept = Cluster([n for n in cluster.members if id(n) in keep])
    rest = Cluster([n for n in cluster.members if id(n) not in keep])
    if not rest.members:
        return [cluster]
    what = anchors[0].op if anchors else "a reduction"
    reject(kept, rest, f"{what}'s kernel would store {len(stored)} results: its templates store one")
    if gemm:
        return [kept, rest]
    return [*_one_result(graph, kept, reject, reduction_results), *_one_result(graph, rest, reject, reduction_results)]


def _group_name(ops: tuple[str, ...], used: set[str]) -> str:
    parts = []
    for op in ops:
        if not parts or parts[-1] != op:
            parts.append(op)
    base = "fused_" + "_".join(parts[:6]) + ("_etc" if len(parts) > 6 else "")
    name, k = base, 1
    while name in used:
        name, k = f"{base}{k}", k + 1
    used.add(name)
    return name


class _Dump:
    def __init__(self, folder: Path | None):
        self.folder, self.k = (Path(folder) if folder else None), 0

    def __call__(self, phase: str, mod) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.k += 1
        (self.folder / f"{self.k:02d}_{phase}.py").write_text(mod.script(show_meta=False))


def _sorts_and_scans(mod, target: TargetInfo):
    """Sort, argsort, top-k, cumsum and cumprod as topi's kernels for the target (RoBERTa's and OPT's position ids
    are a cumsum of the mask): TVM 0.27's LegalizeOps has no entry for them. topi writes these kernels scheduled
    (a serial scan a row, or a GPU scan), with no block to schedule, so they are marked scheduled: no rule or
    search of tvmfuse's touches them, and the build reports them as ``prescheduled``."""
    before = {gv.name_hint for gv in mod.functions}
    with target.target:
        mod = relax.backend.DispatchSortScan()(mod)
    new = [gv for gv, f in mod.functions.items() if gv.name_hint not in before and isinstance(f, PrimFunc)]
    for gv in new:
        mod[gv] = _rooted(mod[gv]).with_attr("tirx.is_scheduled", True)
    return mod


def _rooted(func: PrimFunc) -> PrimFunc:
    """``func`` with a block named ``root`` at the top. topi's extern kernels (the CPU scan) have their one opaque
    block there instead, and passes that look the root up by name (the weight packing's SplitLayoutRewritePreproc,
    a schedule's ``get_sblock("root")``) fail on them."""
    from tvm import s_tir

    body = func.body
    if isinstance(body, s_tir.SBlockRealize) and body.block.name_hint == "root":
        return func
    return func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body)))


def _legalize(mod, target: TargetInfo):
    mod = _sorts_and_scans(mod, target)
    seq = tvm.transform.Sequential([
        legalize_ops(cpu=not target.is_gpu),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination(),
    ])
    with target.target:
        return seq(mod)


def _high_level(mod, target: TargetInfo, config: PlannerConfig, log: RewriteLog, cost_model, dump: _Dump):
    import tvmfuse.plan.rewrites as rewrites

    mod = rewrites.RedundantRequantize(log=log)(mod)
    dump("requantize", mod)
    int8 = getattr(cost_model, "int8_dot", False)
    if int8:   # first: the other rewrites' constant folding dequantizes weights
        mod = rewrites.Int8Convs(log=log)(rewrites.Int8Gemms(log=log)(mod))
        dump("int8_gemms", mod)
    mod = rewrites.PairwiseExtrema(log=log)(mod)
    dump("pairwise_extrema", mod)
    if config.fold_batchnorm:
        mod = rewrites.FoldBatchNorm(log=log)(mod)
        dump("fold_batchnorm", mod)
    mod = rewrites.TrimDeadTaps(log=log)(mod)
    dump("dead_taps", mod)
    layout = getattr(cost_model, "conv_layout", None)
    if layout == "NHWC":
        mod = rewrites.channels_last(mod, log=log,
                                     kernel_layout=getattr(cost_model, "conv_kernel_layout", "OHWI"),
                                     conv1d_kernel_layout=getattr(cost_model, "conv1d_kernel_layout", None),
                                     depthwise_kernel_layout=getattr(cost_model, "depthwise_kernel_layout", None))
        dump("channels_last", mod)
        if int8:
            mod = rewrites.Int8ConvsAsGemms(log=log)(mod)
            dump("int8_convs", mod)
        if getattr(cost_model, "im2col_k", 0):
            mod = rewrites.im2col_narrow_convs(mod, log=log, limit_k=cost_model.im2col_k,
                                               allow_dtypes=getattr(cost_model, "tensor_core_dtypes", ("float16",)),
                                               few_pixels=getattr(cost_model, "im2col_pixels", 0),
                                               untemplated_pixels=getattr(cost_model, "im2col_untemplated_pixels", 0),
                                               pad_dtypes=getattr(cost_model, "narrow_conv_pad", ()))
            dump("im2col", mod)
        if getattr(cost_model, "gemm_conv_rows", 0):
            mod = rewrites.pointwise_convs_as_gemms(mod, log=log, max_rows=cost_model.gemm_conv_rows)
            dump("pointwise_convs", mod)
    if config.horizontal:   # before the attention matcher, which then finds Q, K and V as BERT's projections give them
        mod = rewrites.SplitGemm(log=log)(mod)
        dump("split_gemm", mod)
    if config.attention:
        mod = rewrites.FuseAttention(log=log, decline=getattr(cost_model, "attention_decline", None))(mod)
        dump("attention", mod)
    if config.horizontal and getattr(cost_model, "gated_gemm_rows", 0):
        mod = rewrites.GatedGemm(log=log, min_rows=cost_model.gated_gemm_rows,
                                 dtypes=getattr(cost_model, "tensor_core_dtypes", ("float16",)))(mod)
        dump("gated_gemm", mod)
    if config.horizontal:
        mod = rewrites.HorizontalGemm(log=log, cost_model=cost_model)(mod)
        dump("horizontal", mod)
    if getattr(cost_model, "pad_channels_to", 0):
        mod = rewrites.pad_output_channels(mod, log=log, lanes=cost_model.pad_channels_to)
        dump("pad_channels", mod)
    return mod


def plan_tvmfuse(mod: tvm.IRModule, target: TargetInfo, *, config: PlannerConfig | None = None
                 ) -> "tuple[tvm.IRModule, Plan]":
    """The tvmfuse planner (``--planner tvmfuse``).

    Parameters
    ----------
    mod : an imported Relax module (high-level ops, weights bound as constants)
    target : the resolved target (the cost model's parallelism and memory limits come from it)
    config : planner knobs; defaults when ``None``

    Returns
    -------
    The module whose ``main`` calls one PrimFunc per fused kernel, and the :class:`Plan` explaining it.
    """
    config = config or PlannerConfig()
    cost_model = config.cost_model or CostModel.for_target(target)
    dump = _Dump(config.debug_dump)
    log = RewriteLog()
    # phase 1: rewrites on high-level Relax ops
    mod = _high_level(mod, target, config, log, cost_model, dump)
    # phase 2: one call_tir per operator
    mod = _legalize(mod, target)
    dump("legalized", mod)
    # phase 3: grouping
    graph = build_graph(mod, column_pairs={name for name, tag in log.tags.items() if tag.tag == "pair"})
    grouping = group_nodes(graph, cost_model)
    multi = [c for c in grouping.clusters if len(c.members) > 1]
    used: set[str] = {gv.name_hint for gv in mod.functions}
    names = [_group_name(c.ops, used) for c in multi]
    # phase 4: outline and merge into PrimFuncs
    outlined = outline_groups(graph, [c.members for c in multi], names)
    dump("outlined", outlined)
    fused = tvm.transform.Sequential([relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()])(outlined)
    if not target.is_gpu:
        # on the CPU each kernel's weights (Relax constants) are marked layout-free, so its schedule may read them
        # in a packed layout of its own (the CPU default's GEMM and conv tiles, MetaSchedule's RewriteLayout in a
        # tuned record); the build packs them once, at compile time (compile/build.py)
        fused = mark_weights(fused)
    dump("fused", fused)
    plan = _report(graph, fused, grouping, dict(zip((id(c) for c in multi), names)), log)
    return fused, plan


def reduced_params(func: PrimFunc) -> set[int] | None:
    """The parameters of ``func`` whose values reach a reduction (a GEMM's or conv's weight, directly or through a
    transpose or cast in the kernel), or None where its blocks are not flat (the planner's attention). A constant
    read only after every reduction (an additive mask, a bias, a position table in an epilogue) is read in the
    output's own order, so a packed layout has nothing to gain there; where tiles do not divide the output (or a
    contraction is padded to whole vectors), MetaSchedule's ``RewriteLayout`` indexed such a constant by div and mod
    of the tiles' loops in every lane (ViT's zero mask in the 197 x 197 scores: 3x its kernel's time)."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if any(sch.get_child_blocks(b) for b in blocks):
        return None
    reduce_type = tvm.tirx.IterVar.CommReduce
    # each block: (whether it reduces, the buffers it reads, the buffers it writes)
    facts = [(any(int(iv.iter_type) == reduce_type for iv in b.iter_vars), [r.source for r in b.reads],
              [w.source for w in b.writes]) for b in map(sch.get, blocks)]
    reached = set()
    for i, buffer in enumerate(param_buffers(func)):
        todo, seen = [buffer], set()
        while todo and i not in reached:
            buf = todo.pop()
            for j, (reduces, reads, writes) in enumerate(facts):
                if j in seen or not any(r.same_as(buf) for r in reads):
                    continue
                seen.add(j)
                if reduces:
                    reached.add(i)
                todo.extend(writes)
    return reached


def mark_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """Each kernel's ``layout_free_buffers``: the parameters ``main`` passes a constant (a weight) at every call
    that reach a reduction in the kernel (:func:`reduced_params`). (Relax's AttachAttrLayoutFreeBuffers marks every
    constant but renames every kernel it touches.)"""
    consts = {gv: set.intersection(*({i for i, a in enumerate(args) if isinstance(a, RelaxConstant)}
                                     for args in sites))
              for gv, sites in kernel_calls(mod["main"]).items()}
    for gv, idx in consts.items():
        reached = reduced_params(mod[gv]) if idx else None
        if reached is not None:
            consts[gv] = idx & reached
    marked = {gv: mod[gv].with_attr("layout_free_buffers", sorted(idx)) for gv, idx in consts.items() if idx}
    if not marked:
        return mod
    return tvm.IRModule({gv: marked.get(gv, f) for gv, f in mod.functions.items()}, attrs=mod.attrs)


def _report(graph: Graph, fused, grouping: Grouping, name_of: dict, log: RewriteLog) -> Plan:
    prims = {gv.name_hint: f for gv, f in fused.functions.items() if isinstance(f, PrimFunc)}
    groups = []
    used_names: set[str] = set()
    for c in grouping.clusters:
        members = sorted(c.members, key=lambda n: n.index)
        ops: list[str] = []
        unfused = 0
        notes: list[str] = []
        tags = set()
        for n in members:
            tag = log.tags.get(str(n.var.name))
            if tag is not None:
                ops.extend(tag.ops)
                unfused += tag.bytes_unfused
                tags.add(tag.tag)
                if tag.note:
                    notes.append(tag.note)
            else:
                ops.append(n.op)
                unfused += n.bytes_unfused
        for name, reads, saved in reused_inputs(members):
            notes.append(f"{name} read once instead of {reads}x ({saved} B saved)")
        kernel = name_of.get(id(c))
        if kernel is None:  # a lone operator: the legalized PrimFunc it calls
            kernel = members[0].value.args[0].name_hint
        name = kernel
        k = 1
        while name in used_names:
            k += 1
            name = f"{kernel}#{k}"
        used_names.add(name)
        b_fused = _prim_bytes(prims[kernel]) if kernel in prims and static_params(prims[kernel]) \
            else bytes_fused(graph, members)
        groups.append(Group(name=name, pattern=classify(members, tags), ops=tuple(ops), bytes_unfused=unfused,
                            bytes_fused=b_fused, kernel=kernel, notes=tuple(notes),
                            score=float(grouping.scores.get(id(c), 0.0))))
    return Plan(planner="tvmfuse", groups=tuple(groups), rejected=tuple(log.rejected) + tuple(grouping.rejected),
                rewrites=tuple(log.notes))


def _prim_bytes(func: PrimFunc) -> int:
    return kernel_bytes(func)


class TvmfusePartition:
    """``tvm.transform.module_pass`` form of the planner; the plan of the last run is kept on ``.plan``."""

    def __new__(cls, *, target: TargetInfo, config: PlannerConfig | None = None):
        holder = {}

        @tvm.transform.module_pass(opt_level=0, name="TvmfusePartition")
        def _pass(mod, _ctx):
            fused, holder["plan"] = plan_tvmfuse(mod, target, config=config)
            return fused

        _pass.plan_holder = holder
        return _pass
