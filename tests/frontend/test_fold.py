"""Folding the shape arithmetic of a dynamic-axes graph once its inputs are bound (tvmfuse/frontend/fold.py)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tvmfuse.frontend import import_model, load_model
from tvmfuse.frontend.fold import MOST_ELEMENTS, fold_shape_arithmetic
from tvmfuse.plan import partition

from .helpers import rel_err, run_ort, run_tvm


def _ints(name, values, dims=None):
    return nh.from_array(np.array(values, dtype=np.int64).reshape(dims if dims is not None else [len(values)]), name)


def dynamic_model() -> onnx.ModelProto:
    """What the TorchScript exporter writes for ``x.view(b, n, 2, 4)``, a ones mask of ``(b, n)`` and a pad of the
    sequence to a multiple of 8, all computed from ``Shape(x)`` with ``x`` declared ``[batch, seq, 8]``."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Constant", [], ["i0"], value=nh.from_array(np.array(0, dtype=np.int64))),   # 0-d indices
        h.make_node("Constant", [], ["i1"], value=nh.from_array(np.array(1, dtype=np.int64))),
        h.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        h.make_node("Gather", ["s", "i1"], ["n"], axis=0),
        h.make_node("Unsqueeze", ["b", "ax0"], ["ub"]),
        h.make_node("Unsqueeze", ["n", "ax0"], ["un"]),
        h.make_node("Concat", ["ub", "un", "two_four"], ["shape4"], axis=0),
        h.make_node("Reshape", ["x", "shape4"], ["x4"]),
        h.make_node("Concat", ["ub", "un"], ["shape2"], axis=0),
        h.make_node("ConstantOfShape", ["shape2"], ["ones"], value=nh.from_array(np.array([1.0], dtype=np.float32))),
        h.make_node("Unsqueeze", ["ones", "axes23"], ["ones4"]),
        h.make_node("Mul", ["x4", "ones4"], ["y4"]),
        # pads: (8 - n % 8) % 8 positions at the end of the sequence axis
        h.make_node("Mod", ["n", "eight"], ["r"]),
        h.make_node("Sub", ["eight", "r"], ["p0"]),
        h.make_node("Mod", ["p0", "eight"], ["p"]),
        h.make_node("Unsqueeze", ["p", "ax0"], ["up"]),
        h.make_node("Concat", ["zeros4", "zero1", "up", "zeros2"], ["pads"], axis=0),
        h.make_node("Pad", ["y4", "pads"], ["y"]),
    ]
    inits = [_ints("ax0", [0]), _ints("axes23", [2, 3]), _ints("two_four", [2, 4]), _ints("eight", [8], []),
             _ints("zeros4", [0, 0, 0, 0]), _ints("zero1", [0]), _ints("zeros2", [0, 0])]
    g = h.make_graph(nodes, "dyn", [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 8])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["batch", "padded", 2, 4])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_the_shape_arithmetic_becomes_constants_and_the_model_still_matches_onnxruntime(tmp_path, llvm_target):
    model = dynamic_model()
    onnx.save(model, tmp_path / "dyn.onnx")
    loaded = load_model(tmp_path / "dyn.onnx", input_shapes={"x": (2, 5, 8)})
    assert [f for f in loaded.fixups if f.startswith("shape-arithmetic-folded")]
    ops = [n.op_type for n in loaded.proto.graph.node]
    assert "Shape" not in ops and "Gather" not in ops and "Concat" not in ops
    # a 0-d index stays 0-d: Gather of a scalar index gives a scalar, which Unsqueeze makes a 1-vector
    shapes = {n.output[0]: list(n.attribute[0].t.dims) for n in loaded.proto.graph.node if n.op_type == "Constant"}
    assert shapes.get("shape4") == [4] and shapes.get("pads") == [8]
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    fused, _ = partition(import_model(loaded), target=llvm_target)
    got = run_tvm(fused, [x])
    ref = run_ort(tmp_path / "dyn.onnx", {"x": x})
    assert got.shape == ref.shape == (2, 8, 2, 4) and rel_err(got, ref) < 1e-6


def _bound(model: onnx.ModelProto, shape) -> onnx.ModelProto:
    model.graph.input[0].type.tensor_type.shape.ClearField("dim")
    for d in shape:
        model.graph.input[0].type.tensor_type.shape.dim.add().dim_value = d
    return model


def test_large_values_stay_nodes_for_tvm_to_fold():
    # a mask-sized value computed from constants alone is left as a node: folding is for shapes
    n = int(np.sqrt(MOST_ELEMENTS)) + 8
    model = _bound(dynamic_model(), (1, n, 8))
    assert fold_shape_arithmetic(model, onnx.shape_inference.infer_shapes(model, data_prop=True))
    assert "ConstantOfShape" not in [nd.op_type for nd in model.graph.node]   # (1, n) ones: small, folded
    model = _bound(dynamic_model(), (n, n, 8))
    fold_shape_arithmetic(model, onnx.shape_inference.infer_shapes(model, data_prop=True))
    assert [nd.op_type for nd in model.graph.node if nd.output[0] == "ones"] == ["ConstantOfShape"]


def test_a_folded_value_that_only_a_subgraph_reads_is_kept():
    then = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["t"])], "then", [],
                        [h.make_tensor_value_info("t", TP.FLOAT, None)])
    other = h.make_graph([h.make_node("Identity", ["x"], ["e"])], "else", [],
                         [h.make_tensor_value_info("e", TP.FLOAT, None)])
    nodes = [h.make_node("Shape", ["x"], ["s"]),
             h.make_node("ReduceProd", ["s"], ["shape"], keepdims=1),
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [2, 3]),
                                  h.make_tensor_value_info("cond", TP.BOOL, [])],
                     [h.make_tensor_value_info("y", TP.FLOAT, None)])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    fold_shape_arithmetic(model, onnx.shape_inference.infer_shapes(model, data_prop=True))
    consts = {n.output[0]: nh.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    assert list(consts) == ["shape"] and consts["shape"].tolist() == [6]
    assert [n.op_type for n in model.graph.node] == ["Constant", "If"]
    out = run_ort(model, {"x": np.ones((2, 3), np.float32), "cond": np.array(True)})
    assert out.shape == (6,)
