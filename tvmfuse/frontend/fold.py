"""Fold the graph's shape arithmetic into constants once every input has a static shape.

Exporters that declare dynamic axes (PyTorch's TorchScript exporter with ``dynamic_axes``, the form most
published ONNX files have) compute every reshape, mask and position range from ``Shape`` of the inputs:
``Shape -> Gather -> Unsqueeze -> Concat -> ConstantOfShape / Expand / Reshape / Pad``. TVM 0.27's
importer turns those chains into symbolic shape expressions and then fails on them: ``ConstantOfShape``
of a computed shape, ``Pad`` with computed pads, ``Expand`` of a computed shape, ``Reshape`` of a value
whose shape became unknown. With the shapes bound (:mod:`tvmfuse.frontend.shapes`) each of those values
is a constant, so they are computed here, once, with ONNX's reference evaluator, and the nodes become
``Constant`` nodes: the importer then sees the graph a static export would have given it.

Only small values are folded (``MOST_ELEMENTS``), and only integer or boolean ones (shape vectors, indices,
position ids) or values computed from a ``Shape`` (a size divided in floats, then floored). A large value, or a
float computed from weights alone (a cast scale, a transposed weight), stays a node; TVM folds those itself
once their shapes are known. Nodes with subgraphs, random or sequence ops, and ops outside the default domain are
never folded.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper as onnx_helper
from onnx import numpy_helper

from tvmfuse.frontend.external_data import is_external

MOST_ELEMENTS = 1 << 16
_NEVER = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
    "If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceAt", "SequenceErase",
    "SequenceLength", "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement",
    "OptionalHasElement",
})


def _static_shapes(inferred: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if all(d >= 0 for d in dims):
            shapes[vi.name] = tuple(int(d) for d in dims)
    return shapes


def _known_constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    consts = {}
    for t in model.graph.initializer:
        if not is_external(t) and int(np.prod(t.dims, dtype=np.int64)) <= MOST_ELEMENTS:
            try:
                consts[t.name] = numpy_helper.to_array(t)
            except Exception:  # noqa: BLE001 - data that does not fit its dims: the checker reports it next
                continue
    return consts


def _is_index(value: np.ndarray) -> bool:
    return value.dtype.kind in "iub"


def _shape_of(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    """``Shape``'s value, with opset 15's optional ``start`` / ``end`` (clamped like the op)."""
    attrs = {a.name: onnx_helper.get_attribute_value(a) for a in node.attribute}
    rank = len(shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(shape[start:end], dtype=np.int64)


class _Evaluator:
    """Runs one node with ONNX's reference implementation at the model's own opset."""

    def __init__(self, model: onnx.ModelProto):
        self.opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
        self.ir_version = model.ir_version

    def __call__(self, node: onnx.NodeProto, values: list[np.ndarray | None]) -> list[np.ndarray] | None:
        from onnx.reference import ReferenceEvaluator

        names = [f"in{i}" if name else "" for i, name in enumerate(node.input)]
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(names)
        del copy.output[:]
        copy.output.extend(f"out{i}" if name else "" for i, name in enumerate(node.output))
        inputs = [onnx_helper.make_tensor_value_info(n, onnx_helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                  for n, v in zip(names, values) if n]
        outputs = [onnx_helper.make_empty_tensor_value_info(o) for o in copy.output if o]
        graph = onnx_helper.make_graph([copy], "fold", inputs, outputs)
        proto = onnx_helper.make_model(graph, opset_imports=self.opsets, ir_version=self.ir_version)
        try:
            run = ReferenceEvaluator(proto).run(None, {n: v for n, v in zip(names, values) if n})
        except Exception:  # noqa: BLE001 - an op the evaluator lacks stays a node for TVM to import
            return None
        return [np.asarray(r) for r in run]


def fold_shape_arithmetic(model: onnx.ModelProto, inferred: onnx.ModelProto) -> int:
    """Replace every node whose outputs are small and computable now by ``Constant`` nodes; return how many.

    ``inferred`` is ``model`` (or its weight-free skeleton) after shape inference with the inputs bound.
    ``model.graph`` is rewritten in place; nodes left without a consumer are removed.
    """
    shapes = _static_shapes(inferred)
    consts = _known_constants(model)
    from_shapes: set[str] = set()   # values computed from a Shape or Size: floats among them are shape arithmetic
    evaluate = _Evaluator(model)
    folded: dict[int, list[np.ndarray]] = {}
    for idx, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER \
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        derived = node.op_type in ("Shape", "Size") or any(name in from_shapes for name in node.input)
        value_attr = [a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR]
        if node.op_type == "Constant" and value_attr and not is_external(value_attr[0]):
            values = [numpy_helper.to_array(value_attr[0])]   # read, not run: hundreds a model, every round
        elif node.op_type == "Shape" and node.input[0] in shapes:
            values = [_shape_of(node, shapes[node.input[0]])]
        elif node.op_type == "Size" and node.input[0] in shapes:
            values = [np.array(int(np.prod(shapes[node.input[0]], dtype=np.int64)), dtype=np.int64)]
        elif all(not name or name in consts for name in node.input):
            values = evaluate(node, [consts[name] if name else None for name in node.input])
            if values is None:
                continue
        else:
            continue
        if any(v.size > MOST_ELEMENTS or v.dtype == object for v in values):
            continue
        if node.op_type != "Constant" and (derived or all(_is_index(v) for v in values)):
            # a float computed from weights alone (a cast scale) is the weights' business: TVM folds it
            folded[idx] = values
        for name, value in zip(node.output, values):
            if name:
                consts[name] = value
                if derived:
                    from_shapes.add(name)
    if not folded:
        return 0
    _rewrite(model, folded)
    return len(folded)


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """Every value a node's subgraphs read, at any depth (some come from the outer scope)."""
    reads: set[str] = set()
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            for inner in sub.node:
                reads.update(name for name in inner.input if name)
                reads |= outer_reads(inner)
    return reads


def _rewrite(model: onnx.ModelProto, folded: dict[int, list[np.ndarray]]) -> None:
    """Folded nodes become one ``Constant`` a used output; then drop nodes nothing reads."""
    graph = model.graph
    nodes = []
    for idx, node in enumerate(graph.node):
        if idx not in folded:
            nodes.append(node)
            continue
        for name, value in zip(node.output, folded[idx]):
            if name:
                tensor = numpy_helper.from_array(np.array(value, order="C"), name=name)  # 0-d stays 0-d
                nodes.append(onnx_helper.make_node("Constant", [], [name], name=f"tvmfuse_folded_{name}",
                                                   value=tensor))
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        used = any(name and name in needed for name in node.output)
        if used or not node.output:
            kept.append(node)
            needed.update(name for name in node.input if name)
            needed.update(outer_reads(node))
    del graph.node[:]
    graph.node.extend(reversed(kept))
