"""A MobileNetV2-style CNN as an ONNX graph built with ``onnx.helper`` (torchvision is not in the venv), for
measuring the CPU defaults beside onnxruntime: a 3x3 stride-2 stem conv + BatchNorm + ReLU6, inverted-residual
blocks (1x1 expand + BN + ReLU6, 3x3 depthwise + BN + ReLU6, 1x1 project + BN, a residual add where the shape
allows), a 1x1 head conv, global average pooling and a Gemm classifier. Random weights (seed 0).

    python scripts/make_cnn.py --out /tmp/mbv2.onnx [--size 112] [--batch 1] [--width 1.0]
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# (expansion, output channels, repeats, stride) of MobileNetV2's stages
STAGES = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def build(size: int = 112, batch: int = 1, width: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    count = [0]

    def name(p):
        count[0] += 1
        return f"{p}{count[0]}"

    def const(arr):
        n = name("w")
        inits.append(numpy_helper.from_array(arr.astype(np.float32), n))
        return n

    def conv_bn(x, cin, cout, k, stride, groups=1, act=True):
        w = const(rng.standard_normal((cout, cin // groups, k, k)) * np.sqrt(2.0 / (cin // groups * k * k)))
        y = name("conv")
        nodes.append(helper.make_node("Conv", [x, w], [y], kernel_shape=[k, k], strides=[stride, stride],
                                      pads=[k // 2] * 4, group=groups))
        bn = name("bn")
        nodes.append(helper.make_node("BatchNormalization", [y, const(rng.uniform(0.5, 1.5, cout)),
                                      const(rng.standard_normal(cout) * 0.1), const(rng.standard_normal(cout) * 0.1),
                                      const(rng.uniform(0.5, 1.5, cout))], [bn], epsilon=1e-5))
        if not act:
            return bn
        out = name("relu6")
        nodes.append(helper.make_node("Clip", [bn, "six_lo", "six_hi"], [out]))
        return out

    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "six_lo"),
              numpy_helper.from_array(np.array(6.0, np.float32), "six_hi")]
    c = max(8, int(32 * width))
    x = conv_bn("image", 3, c, 3, 2)
    for t, cout, n, s in STAGES:
        cout = max(8, int(cout * width))
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = c * t
            y = conv_bn(x, c, hidden, 1, 1) if t != 1 else x
            y = conv_bn(y, hidden, hidden, 3, stride, groups=hidden)
            y = conv_bn(y, hidden, cout, 1, 1, act=False)
            if stride == 1 and c == cout:
                r = name("add")
                nodes.append(helper.make_node("Add", [x, y], [r]))
                y = r
            x, c = y, cout
    x = conv_bn(x, c, 1280, 1, 1)
    pooled = name("pool")
    nodes.append(helper.make_node("GlobalAveragePool", [x], [pooled]))
    flat = name("flat")
    nodes.append(helper.make_node("Flatten", [pooled], [flat], axis=1))
    nodes.append(helper.make_node("Gemm", [flat, const(rng.standard_normal((1000, 1280)) * 0.02),
                                           const(rng.standard_normal(1000) * 0.01)], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "mbv2", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                            [batch, 3, size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 1000])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=float, default=1.0)
    a = ap.parse_args()
    onnx.save(build(a.size, a.batch, a.width), a.out)
    print(a.out)


if __name__ == "__main__":
    main()
