"""Hypothesis strategies for hostile ONNX input, shared by test_fuzz.py and benchmarks/fuzz_frontend.py.

Two families: protobuf bytes mutated blindly (flips, truncation, splices), and graphs mutated with
structure (wrong op types, dangling or swapped inputs, bad attributes, shape and dtype mismatches,
reordered nodes, odd opsets). The contract checked on each: ``load_model`` + ``import_model`` return or
raise :class:`~tvmfuse.errors.ModelError`; nothing else, no crash, no hang.
"""
from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tvmfuse.errors import ModelError
from tvmfuse.frontend import import_model, load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXAMPLE_SECONDS = 60  # "no hang": one example may take at most this long

OPS = ["Relu", "Add", "Mul", "MatMul", "Conv", "Reshape", "Transpose", "Softmax", "Gather", "Concat", "Slice",
       "LayerNormalization", "Cast", "Resize", "Pad", "ReduceMean", "Expand", "Tile", "ConstantOfShape", "Range",
       "Where", "Split", "Squeeze", "Unsqueeze", "Gemm", "BatchNormalization", "MaxPool", "Einsum", "TopK",
       "NonZero", "Loop", "If", "Det", "Identity", "Erf", "Sqrt", "Pow", "Clip", "Flatten", "GlobalAveragePool",
       "NotAnOp", "ScatterND", "GatherElements", "CumSum", "OneHot", "Shape", "Size", "Trilu"]
ATTRS = ["axis", "axes", "perm", "kernel_shape", "pads", "strides", "to", "epsilon", "shape", "value", "mode",
         "keepdims", "transA", "equation", "group", "dilations", "auto_pad", "body"]
DTYPES = [TP.FLOAT, TP.FLOAT16, TP.INT64, TP.INT32, TP.BOOL, TP.DOUBLE, TP.UINT8, TP.STRING, TP.BFLOAT16, 0, 99]


def _seed_models() -> list[onnx.ModelProto]:
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    seeds = []
    # matmul + add
    seeds.append(h.make_model(h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["xw"]), h.make_node("Add", ["xw", "b"], ["y"])], "mm",
        [h.make_tensor_value_info("x", TP.FLOAT, ["n", 4])], [h.make_tensor_value_info("y", TP.FLOAT, ["n", 4])],
        [nh.from_array(f(4, 4), "W"), nh.from_array(f(4), "b")]), opset_imports=[h.make_opsetid("", 17)]))
    # conv net
    seeds.append(h.make_model(h.make_graph(
        [h.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
         h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
         h.make_node("GlobalAveragePool", ["p"], ["g"]), h.make_node("Flatten", ["g"], ["y"])], "conv",
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])], [h.make_tensor_value_info("y", TP.FLOAT, [1, 4])],
        [nh.from_array(f(4, 3, 3, 3), "w"), nh.from_array(f(4), "cb")]), opset_imports=[h.make_opsetid("", 17)]))
    # attention-ish block with shape constants and LayerNorm
    seeds.append(h.make_model(h.make_graph(
        [h.make_node("LayerNormalization", ["x", "s", "bb"], ["ln"], axis=-1),
         h.make_node("MatMul", ["ln", "wq"], ["q"]), h.make_node("Reshape", ["q", "shape"], ["qh"]),
         h.make_node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
         h.make_node("MatMul", ["qt", "qt_T"], ["att"]) if False else h.make_node("Softmax", ["qt"], ["sm"], axis=-1),
         h.make_node("Transpose", ["sm"], ["st"], perm=[0, 2, 1, 3]), h.make_node("Reshape", ["st", "shape2"], ["o"]),
         h.make_node("Gather", ["o", "idx"], ["y"], axis=1)], "attn",
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8])], [h.make_tensor_value_info("y", TP.FLOAT, [1, 2, 8])],
        [nh.from_array(np.ones(8, np.float32), "s"), nh.from_array(np.zeros(8, np.float32), "bb"),
         nh.from_array(f(8, 8), "wq"), nh.from_array(np.array([1, 4, 2, 4], np.int64), "shape"),
         nh.from_array(np.array([1, 4, 8], np.int64), "shape2"), nh.from_array(np.array([0, 3], np.int64), "idx")]),
        opset_imports=[h.make_opsetid("", 17)]))
    for p in sorted(FIXTURES.glob("*.onnx")):
        seeds.append(onnx.load_model(str(p)))
    return seeds


SEEDS = _seed_models()
SEED_BYTES = [m.SerializeToString() for m in SEEDS]


@st.composite
def mutated_bytes(draw) -> bytes:
    data = bytearray(SEED_BYTES[draw(st.integers(0, len(SEED_BYTES) - 1))])
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "splice"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[i] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, 0x08, 0x12, 0x1A, 0x22]))
        elif kind == "truncate":
            del data[i:]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[i:i + draw(st.integers(1, 16))]
        else:
            j = draw(st.integers(0, len(data) - 1))
            data[i:i] = data[j:j + draw(st.integers(1, 64))]
    return bytes(data)


def _attr(draw, name: str) -> onnx.AttributeProto:
    kind = draw(st.sampled_from(["int", "ints", "float", "str", "tensor", "graph", "empty"]))
    if kind == "int":
        return h.make_attribute(name, draw(st.integers(-(2**40), 2**40)))
    if kind == "ints":
        return h.make_attribute(name, draw(st.lists(st.integers(-8, 70000), min_size=1, max_size=6)))
    if kind == "float":
        return h.make_attribute(name, draw(st.floats(allow_nan=True, allow_infinity=True, width=32)))
    if kind == "str":
        return h.make_attribute(name, draw(st.binary(max_size=12)))
    if kind == "tensor":
        dims = draw(st.lists(st.integers(0, 4), max_size=3))
        return h.make_attribute(name, nh.from_array(np.zeros(dims, np.float32), name))
    if kind == "graph":
        return h.make_attribute(name, SEEDS[0].graph)
    a = onnx.AttributeProto()
    a.name = name
    return a


@st.composite
def mutated_models(draw) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(SEEDS[draw(st.integers(0, len(SEEDS) - 1))])
    g = model.graph
    values = [i.name for i in g.input] + [t.name for t in g.initializer] + [o for n in g.node for o in n.output]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["op", "dangling", "rewire", "drop_input", "extra_input", "attr", "del_attr",
                                     "in_dims", "init_dims", "init_dtype", "init_data", "in_dtype", "opset",
                                     "reorder", "dup_output", "ir_version", "out_dims"]))
        node = g.node[draw(st.integers(0, len(g.node) - 1))] if g.node else None
        if kind == "op" and node is not None:
            node.op_type = draw(st.sampled_from(OPS))
        elif kind == "dangling" and node is not None and node.input:
            node.input[draw(st.integers(0, len(node.input) - 1))] = draw(st.sampled_from(["ghost", "", "x"]))
        elif kind == "rewire" and node is not None and node.input:
            node.input[draw(st.integers(0, len(node.input) - 1))] = draw(st.sampled_from(values))
        elif kind == "drop_input" and node is not None and node.input:
            del node.input[-1]
        elif kind == "extra_input" and node is not None:
            node.input.append(draw(st.sampled_from(values)))
        elif kind == "attr" and node is not None:
            node.attribute.append(_attr(draw, draw(st.sampled_from(ATTRS))))
        elif kind == "del_attr" and node is not None and node.attribute:
            del node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        elif kind in ("in_dims", "out_dims"):
            vi = (g.input if kind == "in_dims" else g.output)[0]
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for d in draw(st.lists(st.one_of(st.integers(-2, 9), st.just(2**31), st.sampled_from(["n", "m", ""])), max_size=5)):
                if isinstance(d, str):
                    shape.dim.add().dim_param = d
                else:
                    shape.dim.add().dim_value = d
        elif kind.startswith("init") and g.initializer:
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            if kind == "init_dims":
                del t.dims[:]
                t.dims.extend(draw(st.lists(st.integers(-1, 70), max_size=4)))
            elif kind == "init_dtype":
                t.data_type = draw(st.sampled_from(DTYPES))
            else:
                t.raw_data = t.raw_data[: draw(st.integers(0, max(len(t.raw_data), 1)))]
        elif kind == "in_dtype":
            g.input[0].type.tensor_type.elem_type = draw(st.sampled_from(DTYPES))
        elif kind == "opset":
            model.opset_import[0].version = draw(st.integers(1, 30))
        elif kind == "reorder" and len(g.node) > 1:
            nodes = [onnx.NodeProto() for _ in g.node]
            for dst, src in zip(nodes, g.node):
                dst.CopyFrom(src)
            order = draw(st.permutations(range(len(nodes))))
            del g.node[:]
            g.node.extend(nodes[i] for i in order)
        elif kind == "dup_output" and node is not None and node.output:
            node.output[0] = draw(st.sampled_from(values))
        elif kind == "ir_version":
            model.ir_version = draw(st.integers(0, 20))
    return model


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"an example ran past {EXAMPLE_SECONDS} s")


def check_contract(data: bytes, folder: Path, *, input_shapes=None) -> str:
    """Load and import ``data``; return "ok" or "ModelError"; anything else propagates (a finding)."""
    path = folder / "fuzz.onnx"
    path.write_bytes(data)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_SECONDS)
    try:
        try:
            model = load_model(path, input_shapes=input_shapes)
        except ModelError as err:
            assert "\n" not in str(err), repr(str(err))
            return "ModelError"
        try:
            import_model(model)
        except ModelError as err:
            assert "\n" not in str(err), repr(str(err))
            return "ModelError"
        return "ok"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
