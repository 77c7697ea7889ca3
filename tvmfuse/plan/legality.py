"""Legality: may two clusters become one kernel? Correctness only; whether it pays is :mod:`cost`'s call.

``can_fuse`` checks, in order: what the kernel generator can emit (one GEMM/conv/norm anchor per kernel,
epilogues and prologues it can inline), shapes and broadcasting of the fused intermediate, and that the
merged kernel creates no cycle in the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmfuse.plan.cluster import Cluster
from tvmfuse.plan.graph import (ATTENTION, CONV, GEMM, INJECTIVE_K, NORM, NOT_KERNEL, OPAQUE_K, POINTWISE,
                                REDUCE, Graph, Node)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


OK = Verdict(True)

# an anchor's result this small is kept on chip when an epilogue broadcasts it (not recomputed)
SMALL_INTERMEDIATE = 16 * 1024


def _no(reason: str) -> Verdict:
    return Verdict(False, reason)


def _edges(graph: Graph, producer: Cluster, consumer: Cluster) -> list[tuple[Node, Node]]:
    """(producer node, consumer node) pairs where the consumer reads the producer's result."""
    pids = producer.ids()
    cids = consumer.ids()
    out = []
    for c in consumer.members:
        for v in c.inputs:
            p = graph.producer.get(v)
            if p is not None and id(p) in pids and id(c) in cids:
                out.append((p, c))
    return out


def _creates_cycle(graph: Graph, a: Cluster, b: Cluster) -> Node | None:
    """A node outside ``a`` and ``b`` that is reached from the merged set and reaches back into it."""
    merged = a.ids() | b.ids()
    last = max(n.index for n in a.members + b.members)
    frontier = [u for n in a.members + b.members for u in n.users if id(u) not in merged]
    seen: set[int] = set()
    while frontier:
        n = frontier.pop()
        if id(n) in seen or n.index > last:
            continue
        seen.add(id(n))
        for u in n.users:
            if id(u) in merged:
                return n
            frontier.append(u)
    return None


def _elements(shape) -> int:
    return int(np.prod(shape)) if shape is not None else 0


def whole_tensor(shape) -> bool:
    """Whether a reduction's result is one value (rank 0, or every dimension 1): the whole input reduced."""
    return shape is not None and all(int(d) == 1 for d in shape)


def _epilogue_ok(n: Node) -> bool:
    """Ops an anchor's epilogue can hold: pointwise, or a layout change that moves every element once."""
    if n.kind == POINTWISE:
        return True
    if n.kind == INJECTIVE_K and len(n.inputs) == 1 and not n.consts and n.out_shape is not None:
        src = n.inputs[0].ty
        try:
            numel_in = int(np.prod([int(d) for d in src.shape.values]))
        except (AttributeError, TypeError):
            return False
        numel_out = int(np.prod(n.out_shape))
        if numel_in == numel_out:
            return True
        if n.column_pairs:
            # a gated GEMM's g or u (every other column): the GEMM template stores one gated value per pair
            return True
        # a slice that keeps nearly all of its input (the channels a padded weight added, dropped: the CPU's
        # pad_output_channels): the epilogue writes the kept elements from the tile in registers, where a kernel of
        # its own would read the whole result back
        return n.op == "strided_slice" and len(n.out_shape) == len(src.shape.values) \
            and 8 * numel_out >= 7 * numel_in
    return False


def results_stored(graph: Graph, a: Cluster, b: Cluster, *, final: bool = False) -> list[Node]:
    """The members of ``a`` and ``b`` merged whose results the merged kernel must store: outputs of the graph, or
    read by an op outside it that cannot join it later: one no epilogue takes, or a pointwise one that also reads
    a value computed from the merged kernel's results elsewhere (joining would make a cycle: T5's clamp reads the
    residual sum and whether any of it is infinite, a reduction of it). ``final``: the grouping is done, and every
    reader outside the kernel reads from memory."""
    members = a.members + b.members
    merged = a.ids() | b.ids()
    below: set[int] = set()   # ops outside the merged kernel that depend on it
    frontier = [u for n in members for u in n.users if id(u) not in merged]
    while frontier:
        n = frontier.pop()
        if id(n) not in below:
            below.add(id(n))
            frontier.extend(n.users)

    def stays_out(u: Node) -> bool:
        if id(u) in merged:
            return False
        if final or not _epilogue_ok(u):
            return True
        producers = (graph.producer.get(v) for v in u.inputs)
        return any(p is not None and id(p) in below for p in producers)

    return [n for n in members if any(n.var.same_as(v) for v in graph.outputs) or any(stays_out(u) for u in n.users)]


def can_fuse(graph: Graph, producer: Cluster, consumer: Cluster) -> Verdict:
    """Whether ``producer``'s kernel and ``consumer``'s kernel may be one kernel (correctness only)."""
    for cl in (producer, consumer):
        for n in cl.members:
            if n.kind in (OPAQUE_K, NOT_KERNEL):
                return _no(f"{n.op} is opaque to the kernel generator")
            if n.kind == ATTENTION:
                return _no("the attention kernel is complete: nothing fuses into it")
    anchors = producer.anchors + consumer.anchors
    if len(anchors) > 1:
        names = ", ".join(n.op for n in anchors)
        return _no(f"two anchors ({names}): a kernel holds one GEMM/conv/normalization")
    if anchors and (REDUCE in producer.kinds or REDUCE in consumer.kinds):
        return _no(f"a reduction and {anchors[0].op} in one kernel are not emitted")
    if anchors and anchors[0].kind in (GEMM, CONV):
        stored = results_stored(graph, producer, consumer)
        if len(stored) > 1:
            # the GEMM / conv templates store one result: a second one (LLaMA fp16's residual sum and its square
            # for the RMSNorm) left such a kernel to dlight. Pairwise merging cannot see every later merge: a
            # pointwise reader counted as joining later may stay out (T5's clamp chain still ends with two)
            return _no(f"{anchors[0].op}'s kernel would store {len(stored)} results "
                       f"({', '.join(n.op for n in stored)}): its templates store one")
    edges = _edges(graph, producer, consumer)
    if not edges:
        return _no("no data flows between them")
    p_anchor = producer.anchors[0] if producer.anchors else None
    c_anchor = consumer.anchors[0] if consumer.anchors else None
    for p, c in edges:
        t_shape = p.out_shape
        if c_anchor is not None and c is c_anchor:
            if c.kind in (GEMM, CONV):
                return _no(f"{c.op} reads its operands from memory: a prologue ({p.op}) is not emitted")
            if c.kind == NORM:
                if any(n.kind != POINTWISE for n in producer.members):
                    return _no(f"only pointwise ops fuse as a {c.op} prologue, not {producer.ops}")
                data = c.inputs[0] if c.inputs else None
                if data is None or not data.same_as(p.var):
                    return _no(f"{p.op} feeds {c.op}'s parameters, not its data")
            continue
        if p_anchor is not None and not _epilogue_ok(c):
            return _no(f"{c.op} ({c.kind}) is not emitted as an epilogue of {p_anchor.op}")
        if c.kind == INJECTIVE_K and REDUCE in producer.kinds and not _epilogue_ok(c):
            return _no(f"layout op {c.op} after a reduction is not emitted")
        if c.kind == REDUCE and (p_anchor is not None):
            return _no(f"reduction {c.op} after {p_anchor.op}")
        if whole_tensor(t_shape) and _elements(c.out_shape) > 1 and any(
                n.kind == REDUCE and whole_tensor(n.out_shape) for n in producer.members):
            # T5's fp16 clamp reduces isinf over the whole hidden state to one flag, then clamps and normalizes
            # each row: in one kernel no rule splits that reduction over threads, and dlight's Fallback ran it in
            # one thread (T5 fp16 took 15x its fp32 time on the H200). Its own kernel is a plain reduction.
            return _no(f"{producer.ops} reduces a whole tensor to {t_shape}: its own kernel, not a prologue of "
                       f"{c.op} over {c.out_shape}")
        if c.kind == POINTWISE and t_shape != c.out_shape:
            if REDUCE in producer.kinds or (p_anchor is not None and p_anchor.kind == NORM):
                continue  # row statistics broadcast back over their row: one kernel (a normalization)
            if p_anchor is not None and p.out_bytes <= SMALL_INTERMEDIATE:
                continue  # a small anchor result (squeeze-excitation scale) stays on chip and is broadcast
            return _no(f"{c.op} broadcasts the fused intermediate {t_shape} to {c.out_shape}: "
                       f"it would be recomputed per output element")
    # the consumer cluster's other members must sit behind the anchor (epilogue) when the producer has one
    if p_anchor is not None and not all(_epilogue_ok(n) for n in consumer.members):
        bad = next(n for n in consumer.members if not _epilogue_ok(n))
        return _no(f"{bad.op} ({bad.kind}) is not emitted as an epilogue of {p_anchor.op}")
    if c_anchor is not None and c_anchor.kind == NORM and any(n.kind != POINTWISE for n in producer.members):
        return _no(f"only pointwise ops fuse as a {c_anchor.op} prologue")
    via = _creates_cycle(graph, producer, consumer)
    if via is not None:
        return _no(f"fusing would create a cycle through {via.op} (#{via.index})")
    return OK
