"""Models for measuring the CPU defaults beside onnxruntime, built with ``onnx.helper`` (torchvision and
transformers are not in the venv). Random weights (seed 0).

* ``cnn``: MobileNetV2-style: a 3x3 stride-2 stem conv + BatchNorm + ReLU6, inverted-residual blocks (1x1
  expand + BN + ReLU6, 3x3 depthwise + BN + ReLU6, 1x1 project + BN, a residual add where the shape allows), a
  1x1 head conv, global average pooling and a Gemm classifier;
* ``encoder``: BERT-style: embeddings' LayerNorm, then layers of QKV projections, 4-D attention (MatMul, scale,
  Softmax, MatMul), the output projection + residual + LayerNorm, an erf-GELU MLP + residual + LayerNorm.

    python scripts/make_cpu_models.py cnn --out /tmp/mbv2.onnx [--size 112] [--batch 1] [--width 1.0]
    python scripts/make_cpu_models.py encoder --out /tmp/bert.onnx [--batch 2] [--seq 128] [--hidden 256] [--layers 4]
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


def encoder(batch: int = 2, seq: int = 128, hidden: int = 256, layers: int = 4, heads: int = 4,
            seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    count = [0]
    head = hidden // heads

    def name(p):
        count[0] += 1
        return f"{p}{count[0]}"

    def const(arr, dtype=np.float32):
        n = name("c")
        inits.append(numpy_helper.from_array(np.asarray(arr).astype(dtype), n))
        return n

    def op(kind, ins, **kw):
        out = name(kind.lower())
        nodes.append(helper.make_node(kind, ins, [out], **kw))
        return out

    def linear(x, cin, cout):
        return op("Add", [op("MatMul", [x, const(rng.standard_normal((cin, cout)) / np.sqrt(cin))]),
                          const(rng.standard_normal(cout) * 0.02)])

    def norm(x):
        return op("LayerNormalization", [x, const(rng.uniform(0.8, 1.2, hidden)), const(rng.standard_normal(hidden) * 0.02)],
                  axis=-1, epsilon=1e-12)

    def heads_of(x):   # [B, S, H] -> [B, heads, S, head]
        return op("Transpose", [op("Reshape", [x, const([batch, seq, heads, head], np.int64)])], perm=[0, 2, 1, 3])

    x = norm("hidden_states")
    for _ in range(layers):
        q, k, v = (heads_of(linear(x, hidden, hidden)) for _ in range(3))
        scores = op("Mul", [op("MatMul", [q, op("Transpose", [k], perm=[0, 1, 3, 2])]), const(1.0 / np.sqrt(head))])
        ctx = op("MatMul", [op("Softmax", [scores], axis=-1), v])
        ctx = op("Reshape", [op("Transpose", [ctx], perm=[0, 2, 1, 3]), const([batch, seq, hidden], np.int64)])
        x = norm(op("Add", [linear(ctx, hidden, hidden), x]))
        h = linear(x, hidden, 4 * hidden)
        gelu = op("Mul", [op("Mul", [h, op("Add", [op("Erf", [op("Div", [h, const(np.sqrt(2.0))])]), const(1.0)])]),
                          const(0.5)])
        x = norm(op("Add", [linear(gelu, 4 * hidden, hidden), x]))
    nodes[-1].output[0] = "output"
    shape = [batch, seq, hidden]
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="model", required=True)
    c = sub.add_parser("cnn")
    c.add_argument("--out", required=True)
    c.add_argument("--size", type=int, default=112)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--width", type=float, default=1.0)
    e = sub.add_parser("encoder")
    e.add_argument("--out", required=True)
    e.add_argument("--batch", type=int, default=2)
    e.add_argument("--seq", type=int, default=128)
    e.add_argument("--hidden", type=int, default=256)
    e.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    model = build(a.size, a.batch, a.width) if a.model == "cnn" else encoder(a.batch, a.seq, a.hidden, a.layers)
    onnx.save(model, a.out)
    print(a.out)


if __name__ == "__main__":
    main()
