"""What values an integer input may take, as far as the graph says: the rows of the table it indexes.

Generated inputs (``bench``, ``run`` without ``--inputs``, the tuning check) must be inputs the model accepts:
``token_type_ids`` index a table of two rows in BERT, so a random 3 makes onnxruntime refuse the Gather (and leaves
tvmfuse's output unchecked), and ``input_ids`` should reach more of the vocabulary than four rows. An integer input
that reaches a ``Gather``'s indices through value-keeping ops (Cast, Unsqueeze, Reshape, ...) from a constant table
is bounded by that table's length along the gathered axis; an input that indexes several tables takes the smallest.
"""
from __future__ import annotations

import onnx

# ops whose output holds the input's values, rearranged or converted: a bound on the input bounds the output
_KEEPS_VALUES = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Identity", "Transpose",
                           "Slice", "Concat", "Tile"})


# ops whose output is a constant table's values converted, same shape: a quantized model's embedding table is
# DequantizeLinear of its int8 rows (onnxruntime's quantize_static)
_KEEPS_TABLE = frozenset({"DequantizeLinear", "Cast", "Identity"})


def _table_lengths(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    dims = {t.name: tuple(int(d) for d in t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    dims[node.output[0]] = tuple(int(d) for d in attr.t.dims)
        elif node.op_type in _KEEPS_TABLE and node.input and node.input[0] in dims and node.output:
            dims[node.output[0]] = dims[node.input[0]]
    return dims


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """``{input name: exclusive upper bound}`` for each integer graph input that indexes a constant table."""
    graph = model.graph
    tables = _table_lengths(graph)
    init_names = {t.name for t in graph.initializer}
    ints = {vi.name for vi in graph.input if vi.name not in init_names
            and vi.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    bounds: dict[str, int] = {}
    for name in ints:
        todo, seen = [name], set()
        while todo:
            value = todo.pop()
            if value in seen:
                continue
            seen.add(value)
            for node in readers.get(value, []):
                if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == value \
                        and node.input[0] in tables:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    shape = tables[node.input[0]]
                    if -len(shape) <= axis < len(shape) and shape[axis] > 0:
                        bounds[name] = min(bounds.get(name, shape[axis]), shape[axis])
                elif node.op_type in _KEEPS_VALUES and (node.input[0] == value or node.op_type == "Concat"):
                    todo.extend(o for o in node.output if o)
    return bounds
