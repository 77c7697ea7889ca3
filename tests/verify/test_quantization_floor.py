"""A quantized model's check allows the drift of two faithful runs of its rounding (``verify.quantization_floor``):
onnxruntime's optimised run against its reference run, and the reference run on inputs moved by a few ulps."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvmfuse import verify


def _rounding(tmp_path):
    """y = dequantize(quantize(x, 1, 128)): every value rounded to an integer."""
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])], inits)
    path = tmp_path / "r.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_values_on_a_rounding_boundary_widen_the_floor(tmp_path):
    """Half-integers round either way once moved by an ulp: both faithful runs agree exactly, yet the graph's output
    is a whole quantum away under the smallest change; values between the boundaries keep the floor at 0."""
    path = _rounding(tmp_path)
    half = (np.arange(64, dtype=np.float32) - 32) + 0.5
    ref = verify.run_onnxruntime(path, {"x": half})
    assert verify.relative_error(verify.run_onnxruntime(path, {"x": half}, fused=True)[0], ref[0]) == 0
    assert verify.quantization_floor(path, {"x": half}, ref) > 1e-2
    inside = (np.arange(64, dtype=np.float32) - 32) + 0.25
    assert verify.quantization_floor(path, {"x": inside}, verify.run_onnxruntime(path, {"x": inside})) == 0


def test_scales_that_are_not_finite_are_named(tmp_path):
    """A calibration that saw a mask's -3.4e38 gives a scale of inf or 1e36: the report names it."""
    model = onnx.load(_rounding(tmp_path))
    assert verify.degenerate_scales(model) == []
    for init in model.graph.initializer:
        if init.name == "s":
            init.CopyFrom(numpy_helper.from_array(np.array(np.inf, np.float32), "s"))
    assert verify.degenerate_scales(model) == ["s"]
