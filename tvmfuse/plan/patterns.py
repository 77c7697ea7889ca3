"""The fusion patterns tvmfuse names, as data: first match wins. Each reads like the seed's list."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvmfuse.plan.graph import (ACTIVATION_OPS, ATTENTION, CONV, GEMM, INJECTIVE_K, NORM, POINTWISE, REDUCE,
                                Node)


@dataclass(frozen=True)
class GroupView:
    """What a pattern sees of a group: its nodes in order and tags set by the rewrites."""

    nodes: tuple[Node, ...]
    tags: frozenset[str] = frozenset()

    @property
    def kinds(self) -> set[str]:
        return {n.kind for n in self.nodes}

    def first(self, kinds) -> int | None:
        return next((i for i, n in enumerate(self.nodes) if n.kind in kinds), None)


def _gating(g: GroupView) -> bool:
    # a multiply of a tensor computed from an activation inside the group by a tensor from outside it
    derived: list = []
    for n in g.nodes:
        if n.op in ACTIVATION_OPS or n.op.startswith("gelu") or any(v.same_as(d) for v in n.inputs for d in derived):
            derived.append(n.var)
    inside = [n.var for n in g.nodes]
    for n in g.nodes:
        if n.op == "multiply" and len(n.inputs) == 2:
            a, b = n.inputs
            for x, y in ((a, b), (b, a)):
                if any(x.same_as(d) for d in derived) and not any(y.same_as(v) for v in inside):
                    return True
    return False


def _norm_prologue(g: GroupView) -> bool:
    i = g.first((NORM, REDUCE))
    return i is not None and i > 0 and g.nodes[i - 1].kind == POINTWISE


@dataclass(frozen=True)
class Pattern:
    name: str
    comment: str
    matches: Callable[[GroupView], bool]


PATTERNS: tuple[Pattern, ...] = (
    Pattern("attention", "MatMul(Q,Kᵀ) → scale → (mask) → Softmax → MatMul(·,V); scores stay on chip",
            lambda g: ATTENTION in g.kinds),
    Pattern("gated_gemm", "act(x·Wg)·(x·Wu) as one GEMM on interleaved weights, gated in accumulator pairs",
            lambda g: "gated" in g.tags),
    Pattern("horizontal_gemm", "GEMMs reading one input merged into one GEMM on concatenated weights",
            lambda g: "horizontal" in g.tags),
    Pattern("conv_epilogue", "Conv (inference BatchNorm folded into its weights) → bias → activation → residual",
            lambda g: CONV in g.kinds and len(g.nodes) > 1),
    Pattern("gating", "SiLU(a)·b / GELU(a)·b: an activation gating a second tensor (SwiGLU, GeGLU)",
            lambda g: len(g.nodes) > 1 and _gating(g)),
    Pattern("gemm_epilogue", "MatMul / batched MatMul → bias → activation → residual add",
            lambda g: GEMM in g.kinds and len(g.nodes) > 1),
    Pattern("norm_prologue", "(x + r) → LayerNorm / RMSNorm / Softmax: the add is the reduction's prologue",
            _norm_prologue),
    Pattern("normalization", "a normalization (or a decomposed one: reduce → broadcast) with its epilogue",
            lambda g: bool(g.kinds & {NORM, REDUCE}) and len(g.nodes) > 1),
    Pattern("pointwise_chain", "elementwise / broadcast / layout ops in one pass over memory",
            lambda g: len(g.nodes) > 1 and g.kinds <= {POINTWISE, INJECTIVE_K}),
    Pattern("single", "one operator, nothing fused with it", lambda g: True),
)


def classify(nodes, tags=frozenset()) -> str:
    view = GroupView(tuple(sorted(nodes, key=lambda n: n.index)), frozenset(tags))
    return next(p.name for p in PATTERNS if p.matches(view))
