"""Build the embedded example model (tvmfuse/data/example.onnx) with onnx.helper.

It holds the seed's fusion patterns at tiny sizes so the README's first command tunes it in a minute
or two on 2 CPU cores:

    Conv -> BatchNormalization -> Relu          (conv epilogue, BN to fold)
    MatMul -> Add(bias) -> Relu                 (GEMM epilogue)
    MatMul -> Add(bias) -> Add(residual) -> LayerNormalization   (residual add + norm)
    MatMul -> Add(bias) -> GELU (erf form) -> MatMul -> Add -> Add(residual)   (pointwise chain)

Usage: python scripts/make_example.py [OUT.onnx]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def build(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name))
        return name

    def w(name: str, *shape: int, scale: float | None = None) -> str:
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[0] if len(shape) == 2 else np.prod(shape[1:]))
        return const(name, rng.standard_normal(shape) * scale)

    cin, c, hidden, ffn = 8, 32, 64, 128
    nodes = [
        # Conv -> BN -> ReLU, stride 2: [1,8,16,16] -> [1,32,8,8]
        helper.make_node("Conv", ["x", w("conv_w", c, cin, 3, 3), const("conv_b", rng.standard_normal(c) * 0.1)],
                         ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], name="conv"),
        helper.make_node("BatchNormalization",
                         ["conv", const("bn_scale", 1 + 0.1 * rng.standard_normal(c)),
                          const("bn_bias", 0.1 * rng.standard_normal(c)),
                          const("bn_mean", 0.1 * rng.standard_normal(c)),
                          const("bn_var", 1 + 0.1 * rng.random(c))],
                         ["bn"], epsilon=1e-5, name="bn"),
        helper.make_node("Relu", ["bn"], ["act0"], name="relu0"),
        # tokens: [1,32,8,8] -> [1,32,64] -> [1,64,32]
        helper.make_node("Reshape", ["act0", "tok_shape"], ["tok_cf"], name="to_tokens"),
        helper.make_node("Transpose", ["tok_cf"], ["tok"], perm=[0, 2, 1], name="transpose"),
        # MatMul -> bias -> ReLU
        helper.make_node("MatMul", ["tok", w("w1", c, hidden)], ["mm1"], name="mm1"),
        helper.make_node("Add", ["mm1", const("b1", 0.1 * rng.standard_normal(hidden))], ["mm1b"], name="bias1"),
        helper.make_node("Relu", ["mm1b"], ["h1"], name="relu1"),
        # MatMul -> bias -> residual add -> LayerNorm
        helper.make_node("MatMul", ["h1", w("w2", hidden, c)], ["mm2"], name="mm2"),
        helper.make_node("Add", ["mm2", const("b2", 0.1 * rng.standard_normal(c))], ["mm2b"], name="bias2"),
        helper.make_node("Add", ["mm2b", "tok"], ["res1"], name="residual1"),
        helper.make_node("LayerNormalization", ["res1", const("ln_g", 1 + 0.1 * rng.standard_normal(c)),
                                                const("ln_b", 0.1 * rng.standard_normal(c))],
                         ["ln"], axis=-1, epsilon=1e-5, name="layernorm"),
        # FFN with an erf-GELU chain and a residual add
        helper.make_node("MatMul", ["ln", w("w3", c, ffn)], ["mm3"], name="mm3"),
        helper.make_node("Add", ["mm3", const("b3", 0.1 * rng.standard_normal(ffn))], ["mm3b"], name="bias3"),
        helper.make_node("Div", ["mm3b", const("sqrt2", np.array(np.sqrt(2.0)))], ["g_div"], name="gelu_div"),
        helper.make_node("Erf", ["g_div"], ["g_erf"], name="gelu_erf"),
        helper.make_node("Add", ["g_erf", const("one", np.array(1.0))], ["g_add"], name="gelu_add"),
        helper.make_node("Mul", ["mm3b", "g_add"], ["g_mul"], name="gelu_mul"),
        helper.make_node("Mul", ["g_mul", const("half", np.array(0.5))], ["gelu"], name="gelu_half"),
        helper.make_node("MatMul", ["gelu", w("w4", ffn, c)], ["mm4"], name="mm4"),
        helper.make_node("Add", ["mm4", const("b4", 0.1 * rng.standard_normal(c))], ["mm4b"], name="bias4"),
        helper.make_node("Add", ["mm4b", "ln"], ["y"], name="residual2"),
    ]
    inits.append(numpy_helper.from_array(np.array([1, c, 64], dtype=np.int64), "tok_shape"))
    graph = helper.make_graph(
        nodes, "tvmfuse_example",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, c])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tvmfuse-make-example")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "tvmfuse" / "data" / "example.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
