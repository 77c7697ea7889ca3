"""Turn the planner's groups into Relax functions marked ``Primitive`` that ``FuseTIR`` merges into one PrimFunc.

This is what ``FuseOps`` does internally, with the grouping decided by tvmfuse instead: each group of
``call_tir`` bindings becomes a private function whose parameters are the tensors the group reads from
outside and whose result is every tensor used outside the group (a tuple when several).
"""
from __future__ import annotations

from tvmfuse._tvm import TupleType, relax, tvm
from tvmfuse.plan.graph import Graph, Node, substitute


def _group_outputs(graph: Graph, members: list[Node]) -> list[Node]:
    inside = set(id(n) for n in members)
    outs = []
    for n in members:
        if n.var in graph.outputs or any(id(u) not in inside for u in n.users):
            outs.append(n)
    return outs


def _group_inputs(members: list[Node]) -> list:
    """Vars and constants the group reads from outside (FuseTIR wants constants as parameters)."""
    defined = [n.var for n in members]
    seen: list = []
    for n in members:
        for v in list(n.inputs) + list(n.consts):
            if not any(v.same_as(d) for d in defined) and not any(v.same_as(s) for s in seen):
                seen.append(v)
    return seen


def _step_order(graph: Graph, steps: list[list[Node]]) -> list[list[Node]]:
    """Topological order of the steps (a step: one group or one lone binding), stable by first binding."""
    step_of = {}
    for s, members in enumerate(steps):
        for n in members:
            step_of[id(n)] = s
    deps = [set() for _ in steps]
    for s, members in enumerate(steps):
        for n in members:
            for v in n.inputs:
                p = graph.producer.get(v)
                if p is not None and step_of[id(p)] != s:
                    deps[s].add(step_of[id(p)])
    order, done = [], set()
    pending = sorted(range(len(steps)), key=lambda s: min(n.index for n in steps[s]))
    while pending:
        for k, s in enumerate(pending):
            if deps[s] <= done:
                order.append(s)
                done.add(s)
                del pending[k]
                break
        else:
            raise ValueError("the groups form a cycle")  # legality should have prevented this
    return [steps[s] for s in order]


def outline_groups(graph: Graph, groups: list[list[Node]], names: list[str]) -> tvm.IRModule:
    """Rewrite ``main`` so each group (more than one kernel) is a call to a new ``Primitive`` function.

    Parameters
    ----------
    graph : the graph of the legalized module
    groups : lists of kernel nodes; nodes not in any group stay as they are
    names : a function name per group
    """
    mod = graph.mod
    main = mod["main"]
    grouped = {id(n) for g in groups for n in g}
    steps: list[list[Node]] = [list(g) for g in groups] + [[n] for n in graph.nodes if id(n) not in grouped]
    name_of = {id(g[0]): name for g, name in zip(groups, names)}
    steps = _step_order(graph, steps)

    rest = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}, attrs=mod.attrs)
    bb = relax.BlockBuilder(rest)
    vmap: dict = {}
    with bb.function("main", list(main.params), attrs=dict(main.attrs) if main.attrs is not None else None, private=False):
        with bb.dataflow():
            for members in steps:
                if len(members) == 1 and id(members[0]) not in name_of:
                    n = members[0]
                    value = substitute(n.value, vmap)
                    new = bb.emit_output(value, name_hint=n.var.name) if n.var in graph.outputs \
                        else bb.emit(value, name_hint=n.var.name)
                    vmap[n.var] = new
                    continue
                fname = name_of[id(members[0])]
                members = sorted(members, key=lambda n: n.index)
                ins = _group_inputs(members)
                outs = _group_outputs(graph, members)
                params = [relax.Var(v.name if isinstance(v, relax.Var) else f"c{k}", v.ty) for k, v in enumerate(ins)]
                inner_map = {v: p for v, p in zip(ins, params)}
                bindings = []
                for n in members:
                    value = substitute(n.value, inner_map)
                    dv = relax.DataflowVar(n.var.name, n.var.ty)
                    inner_map[n.var] = dv
                    bindings.append(relax.VarBinding(dv, value))
                if len(outs) == 1:
                    result_var = relax.Var("gv", outs[0].var.ty)
                    bindings.append(relax.VarBinding(result_var, inner_map[outs[0].var]))
                else:
                    tup = relax.Tuple([inner_map[o.var] for o in outs])
                    result_var = relax.Var("gv", TupleType([o.var.ty for o in outs]))
                    bindings.append(relax.VarBinding(result_var, tup))
                # only the last binding leaves the dataflow block
                body = relax.SeqExpr([relax.DataflowBlock(bindings)], result_var)
                func = relax.Function(params, body, result_var.ty, is_pure=True)
                func = func.with_attr("Primitive", True)
                gv = bb.add_func(func, fname)
                call = relax.Call(gv, [vmap.get(v, v) for v in ins])
                if len(outs) == 1:
                    o = outs[0]
                    new = bb.emit_output(call, name_hint=o.var.name) if o.var in graph.outputs \
                        else bb.emit(call, name_hint=o.var.name)
                    vmap[o.var] = new
                else:
                    tup = bb.emit(call, name_hint="tup")
                    for k, o in enumerate(outs):
                        item = relax.TupleGetItem(tup, k)
                        new = bb.emit_output(item, name_hint=o.var.name) if o.var in graph.outputs \
                            else bb.emit(item, name_hint=o.var.name)
                        vmap[o.var] = new
        bb.emit_func_output(substitute(main.body.body, vmap))
    return bb.finalize()
