"""A cluster: the set of graph nodes the planner has put in one kernel so far, with its byte accounting."""
from __future__ import annotations

from dataclasses import dataclass, field

from tvmfuse.plan.graph import ANCHORS, Graph, Node, tensor_bytes


@dataclass(eq=False)
class Cluster:
    members: list[Node] = field(default_factory=list)

    @property
    def kinds(self) -> set[str]:
        return {n.kind for n in self.members}

    @property
    def anchors(self) -> list[Node]:
        return [n for n in self.members if n.kind in ANCHORS]

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(n.op for n in sorted(self.members, key=lambda n: n.index))

    def ids(self) -> set[int]:
        return {id(n) for n in self.members}


def external_inputs(members: list[Node]) -> list:
    """Vars and constants read from outside ``members``, each once (a fused kernel reads them once)."""
    defined = {id(n.var) for n in members}
    inside_vars = [n.var for n in members]
    seen: list = []
    for n in sorted(members, key=lambda n: n.index):
        for v in list(n.inputs) + list(n.consts):
            if any(v.same_as(d) for d in inside_vars) or id(v) in defined:
                continue
            if not any(v.same_as(s) for s in seen):
                seen.append(v)
    return seen


def external_outputs(graph: Graph, members: list[Node]) -> list[Node]:
    """Members whose result is used outside the group or leaves the function."""
    inside = {id(n) for n in members}
    return [n for n in members if n.var in graph.outputs or any(id(u) not in inside for u in n.users)]


def bytes_fused(graph: Graph, members: list[Node]) -> int:
    """HBM bytes of one kernel for ``members``: external inputs read once, escaping results written once."""
    return sum(tensor_bytes(v.ty) for v in external_inputs(members)) + sum(
        n.out_bytes for n in external_outputs(graph, members))


def bytes_unfused(members: list[Node]) -> int:
    return sum(n.bytes_unfused for n in members)


def reused_inputs(members: list[Node]) -> list[tuple[str, int, int]]:
    """Residual reuse: external tensors read by several members -> (name, reads unfused, bytes saved)."""
    defined = [n.var for n in members]
    counts: dict = {}
    for n in members:
        for v in n.inputs:
            if any(v.same_as(d) for d in defined):
                continue
            key = next((k for k in counts if k.same_as(v)), v)
            counts[key] = counts.get(key, 0) + 1
    return [(str(v.name), c, (c - 1) * tensor_bytes(v.ty)) for v, c in counts.items() if c > 1]
