"""Each fix-up: the raw graph fails (onnxruntime, the checker or TVM), the fixed one imports and matches."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tvmfuse._tvm import from_onnx
from tvmfuse.frontend import import_model, load_model
from tvmfuse.frontend.fixups import FIXUPS

from .helpers import rel_err, run_ort, run_tvm


def _layernorm(x_type: int, param_type: int, *, bias: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    pdt = onnx.helper.tensor_dtype_to_np_dtype(param_type)
    inits = [nh.from_array((1 + 0.1 * rng.standard_normal(16)).astype(pdt), "scale")]
    ins = ["x", "scale"]
    if bias:
        inits.append(nh.from_array((0.1 * rng.standard_normal(16)).astype(pdt), "bias"))
        ins.append("bias")
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"]), h.make_node("LayerNormalization", ["r"] + ins[1:], ["y"], axis=-1, epsilon=1e-5)],
        "ln", [h.make_tensor_value_info("x", x_type, [2, 5, 16])], [h.make_tensor_value_info("y", x_type, [2, 5, 16])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    inits = {t.name: nh.to_array(t).astype(np.float64) for t in model.graph.initializer}
    r = np.maximum(x.astype(np.float64), 0)
    mu, var = r.mean(-1, keepdims=True), r.var(-1, keepdims=True)
    return (r - mu) / np.sqrt(var + 1e-5) * inits["scale"] + inits.get("bias", 0.0)


@pytest.mark.parametrize("x_type,param_type,bias", [(TP.FLOAT, TP.FLOAT16, True), (TP.FLOAT16, TP.FLOAT, True),
                                                     (TP.FLOAT, TP.FLOAT16, False)])
def test_layernorm_mixed_precision(tmp_path, x_type, param_type, bias):
    raw = _layernorm(x_type, param_type, bias=bias)
    path = tmp_path / "ln.onnx"
    onnx.save_model(raw, str(path))
    # the raw graph is what PyTorch fp16 export emits; onnxruntime rejects it ...
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(onnx.helper.tensor_dtype_to_np_dtype(x_type))
    with pytest.raises(Exception, match="bound to different types|inconsistent type|Type Error"):
        run_ort(raw, {"x": x})
    # ... and so does TVM 0.27's importer (or it builds a module that will not compile)
    with pytest.raises(Exception):  # noqa: B017 - any failure of the stock path counts
        run_tvm(from_onnx(raw, keep_params_in_input=False), [x])

    loaded = load_model(path)
    assert loaded.fixups == (f"layernorm-mixed-precision x{2 if bias else 1}",)
    got = run_tvm(import_model(loaded), [x])
    assert got.dtype == x.dtype
    tol = 1e-5 if x_type == TP.FLOAT else 2e-3
    assert rel_err(got, _reference(x, raw)) < tol
    # the fixed graph is valid ONNX: onnxruntime runs it and agrees
    assert rel_err(got, run_ort(loaded.proto, {"x": x})) < tol


def test_layernorm_same_types_untouched(tmp_path):
    path = tmp_path / "ln.onnx"
    onnx.save_model(_layernorm(TP.FLOAT, TP.FLOAT), str(path))
    assert load_model(path).fixups == ()


def test_every_fixup_is_named_and_explained():
    names = [f.name for f in FIXUPS]
    assert len(names) == len(set(names)) and all(f.why for f in FIXUPS)


def test_fp16_matmul_accumulates_in_fp32(tmp_path):
    # TVM 0.27 imports fp16 MatMul with an fp16 accumulator: 2048 products of 0.1 drift far from 204.8
    x = np.full((1, 2048), 0.1, np.float16)
    w = nh.from_array(np.ones((2048, 1), np.float16), "w")
    g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "mm", [h.make_tensor_value_info("x", TP.FLOAT16, [1, 2048])],
                     [h.make_tensor_value_info("y", TP.FLOAT16, [1, 1])], [w])
    raw = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    path = tmp_path / "mm16.onnx"
    onnx.save_model(raw, str(path))
    exact = x.astype(np.float64) @ np.ones((2048, 1))
    stock = run_tvm(from_onnx(raw, keep_params_in_input=False), [x])
    assert rel_err(stock, exact) > 0.05  # the problem, so this test can fail
    mod = import_model(load_model(path))
    assert 'out_dtype="float32"' in mod.script()
    got = run_tvm(mod, [x])
    assert got.dtype == np.float16 and rel_err(got, exact) < 1e-3


def test_an_fp16_mean_over_more_elements_than_fp16_counts_runs_in_fp32(tmp_path):
    """An RMSNorm over 65536 fp16 columns (ReduceMean): TVM divides the sum by 65536 in fp16, which is no fp16
    number, and the import raised. The mean now runs in fp32 and is cast back; the model matches onnxruntime.
    A mean over fewer elements keeps its fp16 graph."""
    from tvmfuse.bench.cases import rmsnorm

    for cols, widened in ((65536, True), (1024, False)):
        model = rmsnorm(M=2, N=cols)[0]
        path = tmp_path / f"rms{cols}.onnx"
        onnx.save(model, path)
        mod = import_model(load_model(path))
        assert ('dtype="float32") = R.mean(' in mod.script()) == widened
        if widened:
            x = np.random.default_rng(0).standard_normal((2, cols)).astype("float16")
            assert rel_err(run_tvm(mod, [x]), run_ort(model, {"x": x})) < 2e-3


@pytest.mark.parametrize("per_channel", [False, True])
def test_conv_integer_runs_as_the_conv_of_its_dequantized_operands(tmp_path, per_channel):
    """quantize_dynamic's ConvInteger (TVM 0.27 has no converter): the conv of the operands dequantized at scale 1
    (the weight's zero point one in all, or one per output channel, which onnxruntime's ConvInteger refuses: there
    the fixed graph run by onnxruntime is the reference), cast back to int32; the same integers as onnxruntime's."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (32, 3, 4, 4)).astype(np.int8)
    zw = rng.integers(-3, 4, 32).astype(np.int8) if per_channel else np.array(0, np.int8)
    nodes = [h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             h.make_node("ConvInteger", ["xq", "w", "xz", "zw"], ["ci"], strides=[4, 4], kernel_shape=[4, 4],
                         pads=[1, 1, 1, 1]),
             h.make_node("Cast", ["ci"], ["cf"], to=TP.FLOAT),
             h.make_node("Mul", ["xs", "ws"], ["sc"]), h.make_node("Mul", ["cf", "sc"], ["y"])]
    g = h.make_graph(nodes, "ci", [h.make_tensor_value_info("x", TP.FLOAT, [1, 3, 16, 16])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [1, 32, 4, 4])],
                     [nh.from_array(w, "w"), nh.from_array(zw, "zw"), nh.from_array(np.array(0.01, np.float32), "ws")])
    raw = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    path = tmp_path / "ci.onnx"
    onnx.save_model(raw, str(path))
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    loaded = load_model(path)
    assert loaded.fixups == ("conv-integer x1",)
    got, fixed = run_tvm(import_model(loaded), [x]), run_ort(loaded.proto, {"x": x})
    assert np.array_equal(got, fixed)
    if not per_channel:
        assert np.array_equal(run_ort(raw, {"x": x}), fixed)
