"""Branches taken when the model is compiled: an ``If`` whose condition is known once the inputs are bound.

optimum's merged decoders (``decoder_model_merged.onnx``, the form most published decoder ONNX files have) hold
two graphs under one ``If``: the first step, without a KV cache, and the later steps, with it, chosen at run time
by a boolean input ``use_cache_branch``. tvmfuse compiles one static graph, so that input follows the shapes it is
given: a past of length 0 is the first step (false), a longer one a later step (true). The input stays in the
compiled model's signature with its value fixed (``TensorSpec.fixed``): generated inputs take that value, and a run
handed another is refused. Every ``If`` whose condition is then a constant (that input, or a test of shapes the
folding computed) is replaced by the nodes of the branch it takes, and the folding goes on inside them.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper as onnx_helper
from onnx import numpy_helper

from tvmfuse.errors import ModelError
from tvmfuse.frontend.external_data import is_external

CACHE_SWITCH = "use_cache_branch"   # optimum's merged decoders


def _past_axes(vi: onnx.ValueInfoProto) -> list[int]:
    """The axes a KV cache's length is declared on: one name with "past" in it (the attention mask's
    ``past_sequence_length + sequence_length`` spans the new tokens too)."""
    return [i for i, d in enumerate(vi.type.tensor_type.shape.dim)
            if "past" in d.dim_param and d.dim_param.replace("_", "").replace(".", "").isalnum()]


def fix_cache_switch(model: onnx.ModelProto, overrides: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Give optimum's ``use_cache_branch`` the value the bound past implies, read through a ``Constant``;
    ``{input: value}`` of what was fixed so (nothing for a model without that input)."""
    inputs = {vi.name: vi for vi in model.graph.input}
    switch = inputs.get(CACHE_SWITCH)
    if switch is None:
        return {}
    lengths = []
    for name, vi in inputs.items():
        for axis in _past_axes(vi):
            if name in overrides and axis < len(overrides[name]):
                lengths.append(overrides[name][axis])
    if not lengths:
        pasts = [n for n, vi in inputs.items() if _past_axes(vi)]
        if not pasts:
            raise ModelError(f"input '{CACHE_SWITCH}' chooses a branch at run time, and no input has a past length "
                             "to decide it from")
        raise ModelError(f"input '{CACHE_SWITCH}' follows the KV cache's length, which no --input-shape gives",
                         hint=f"give --input-shape {pasts[0]}=... (its past axis 0 for the first step)")
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in switch.type.tensor_type.shape.dim]
    value = np.full(dims, max(lengths) > 0, dtype=bool)
    fixed = f"{CACHE_SWITCH}_fixed"
    _rename_reads(model.graph, {CACHE_SWITCH: fixed})
    model.graph.node.insert(0, onnx_helper.make_node("Constant", [], [fixed], name=fixed,
                                                     value=numpy_helper.from_array(value, fixed)))
    return {CACHE_SWITCH: value}


def _rename_reads(graph: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Every read of a renamed value, in ``graph`` and the subgraphs under it (which read the outer scope)."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _rename_reads(sub, rename)


def _conditions(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The values the main graph's ``If`` conditions read, where they are constants."""
    wanted = {n.input[0] for n in graph.node if n.op_type == "If" and n.input}
    found = {t.name: t for t in graph.initializer if t.name in wanted}
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in wanted and node.attribute \
                and node.attribute[0].name == "value":
            found[node.output[0]] = node.attribute[0].t
    values = {}
    for name, t in found.items():
        if is_external(t):
            continue
        try:
            values[name] = numpy_helper.to_array(t)
        except Exception:  # noqa: BLE001 - data that does not fit its dims: the checker reports it next
            continue
    return values


def _names(graph: onnx.GraphProto) -> set[str]:
    names = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.output)
        names.update(node.input)
    return names


def inline_known_branches(model: onnx.ModelProto) -> int:
    """Replace each ``If`` of the main graph whose condition is a constant by its taken branch's nodes; return
    how many were replaced."""
    graph = model.graph
    consts = _conditions(graph)
    if not consts:   # most graphs, every folding round
        return 0
    taken_names = _names(graph)
    nodes, inlined, results = [], 0, {}
    for node in graph.node:
        cond = consts.get(node.input[0]) if node.op_type == "If" and node.domain in ("", "ai.onnx") else None
        if cond is None or cond.size != 1:
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if bool(cond.ravel()[0])
                                                                  else "else_branch"))
        nodes += _branch_nodes(graph, branch, node, taken_names)
        results.update({result: out.type for result, out in zip(node.output, branch.output)})
        inlined += 1
    if inlined:
        del graph.node[:]
        graph.node.extend(nodes)
        # the If's outputs were declared for either branch; the taken one decides: optimum's seq2seq merge returns
        # an empty constant for the encoder's K/V on the with-past branch, where the declaration says (batch, heads,
        # encoder length, head dim)
        kept = [vi for vi in graph.value_info if vi.name not in results]
        del graph.value_info[:]
        graph.value_info.extend(kept)
        for out in graph.output:
            if out.name in results:
                declared = results[out.name]
                if declared.tensor_type.HasField("shape"):
                    out.type.CopyFrom(declared)
                else:   # any size, same rank: inference fills it in
                    for d in out.type.tensor_type.shape.dim:
                        d.Clear()
    return inlined


def _branch_nodes(graph: onnx.GraphProto, branch: onnx.GraphProto, node: onnx.NodeProto,
                  taken: set[str]) -> list[onnx.NodeProto]:
    """``branch``'s nodes for the main graph: its outputs renamed to the ``If``'s, its other values renamed where
    the main graph already uses the name, its initializers moved to the main graph."""
    prefix = (node.name or node.output[0]).replace("/", "_").strip("_")
    produced = {name for n in branch.node for name in n.output if name} | {t.name for t in branch.initializer}
    rename = {}
    for name in produced:
        if name in taken:
            rename[name] = f"{prefix}/{name}"
    out_nodes, assigned = [], set()
    for out, result in zip(branch.output, node.output):
        # a value produced inside takes the If's output name (once); an outer value, or a second output of the same
        # value, is passed on by an Identity
        if out.name in produced and out.name not in assigned:
            rename[out.name] = result
            assigned.add(out.name)
        else:
            out_nodes.append((out.name, result))
    taken.update(rename.get(name, name) for name in produced)
    for t in branch.initializer:
        moved = onnx.TensorProto()
        moved.CopyFrom(t)
        moved.name = rename.get(t.name, t.name)
        graph.initializer.append(moved)
    inner = []
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        for i, name in enumerate(copy.output):
            copy.output[i] = rename.get(name, name)
        for i, name in enumerate(copy.input):
            copy.input[i] = rename.get(name, name)
        for attr in copy.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _rename_reads(sub, rename)
        inner.append(copy)
    for source, result in out_nodes:
        inner.append(onnx_helper.make_node("Identity", [rename.get(source, source)], [result],
                                           name=f"{prefix}/output_{result}"))
    return inner
