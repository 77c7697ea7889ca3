"""The TF32 floor: a model computed by onnxruntime with the operands of its MatMul, Gemm and one-group Conv rounded
to TF32 (constants rounded once, activations by three inserted fp32 nodes), and how far that lands from the fp32
run: the error a TF32 build's check allows 1.5 times where the tolerance is below it."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvmfuse import verify
from tvmfuse.plan.tf32 import tf32_rounded


def _model(tmp_path, depth=1):
    """x -> depthwise 3x3 -> ReLU -> (1x1 conv -> ReLU) x depth -> flatten -> MatMul: every op kind the floor
    rounds or leaves."""
    rng = np.random.default_rng(0)
    c = 32
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "dw"),
             numpy_helper.from_array((rng.standard_normal((c * 64, 10)) / 40).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["x", "dw"], ["a0"], group=c, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a0"], ["h0"])]
    for i in range(depth):
        inits.append(numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / 5).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [f"h{i}", f"w{i}"], [f"c{i}"]),
                  helper.make_node("Relu", [f"c{i}"], [f"h{i + 1}"])]
    nodes += [helper.make_node("Flatten", [f"h{depth}"], ["f"]), helper.make_node("MatMul", ["f", "fc"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / f"m{depth}.onnx"
    onnx.save(model, path)
    return model, path, {"x": rng.standard_normal((2, c, 8, 8)).astype(np.float32)}


def test_the_emulated_graph_rounds_what_the_tensor_cores_read_and_nothing_else(tmp_path):
    model, path, feeds = _model(tmp_path)
    em = verify.tf32_emulated(model)
    ops = [n.op_type for n in em.graph.node]
    # the depthwise conv reads x as it is; the 1x1 conv's and the MatMul's activations pass Mul, Sub, Sub
    assert ops == ["Conv", "Relu", "Mul", "Sub", "Sub", "Conv", "Relu", "Flatten", "Mul", "Sub", "Sub", "MatMul"]
    inits = {i.name: numpy_helper.to_array(i) for i in em.graph.initializer}
    assert np.array_equal(inits["w0__tf32"], tf32_rounded(inits["w0"]))
    assert np.array_equal(inits["fc__tf32"], tf32_rounded(inits["fc"]))
    assert not any(n.startswith("dw__") for n in inits)
    # the inserted nodes round to TF32's 11 significant bits (to nearest; cvt.rna differs only at ties)
    out = em.graph.node[4].output[0]
    em.graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    onnx.save(em, tmp_path / "em.onnx")
    h0_rounded = verify.run_onnxruntime(tmp_path / "em.onnx", feeds)[1]
    bits = h0_rounded.view(np.uint32)
    assert not (bits & np.uint32(0x1FFF)).any()
    ref = verify.run_onnxruntime(path, feeds)[0]
    assert 0 < verify.relative_error(verify.run_onnxruntime(tmp_path / "em.onnx", feeds)[0], ref) < 1e-2


def test_the_floor_grows_with_depth_and_is_the_rounded_graphs_error(tmp_path):
    floors = []
    for depth in (1, 8):
        model, path, feeds = _model(tmp_path, depth)
        ref = verify.run_onnxruntime(path, feeds)
        floors.append(verify.tf32_floor(model, feeds, ref))
    assert 1e-5 < floors[0] < floors[1] < 5e-2, floors


def test_a_graph_that_cannot_be_rounded_says_so_in_one_line(tmp_path):
    """A TF32 reference that cannot be built or run is a ModelError of one line (the checks record it instead of a
    floor): here onnxruntime refuses an unknown op."""
    import pytest

    from tvmfuse.errors import ModelError

    model, _, feeds = _model(tmp_path)
    broken = onnx.ModelProto.FromString(model.SerializeToString())
    broken.graph.node[2].op_type = "NoSuchOp"
    with pytest.raises(ModelError) as err:
        verify.tf32_floor(broken, feeds, [np.zeros((2, 10), np.float32)])
    assert len(str(err.value).splitlines()) == 1
