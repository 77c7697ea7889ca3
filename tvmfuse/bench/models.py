"""Whole models for end-to-end benchmarks, built with onnx.helper and random weights, at any size.

ResNet-50 and BERT-base as their exporters write them (Conv + BatchNormalization + Relu; MatMul + Add,
Reshape/Transpose heads, Softmax attention, LayerNormalization, Gelu), so they can be generated on a
machine without torchvision or transformers (the GPU machine) instead of carried there: BERT-base in
fp16 is 220 MB of weights. Each builder returns ``(model, bytes_min, flops)`` like the kernel cases
(``bytes_min``: inputs, weights and outputs once; ``flops``: multiply-adds x 2 of the convs and matmuls).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


class _Graph:
    """Nodes and random initializers of one model under construction."""

    def __init__(self, dtype: str, seed: int):
        self.dtype = np.dtype(dtype)
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self.flops = 0
        self.weight_bytes = 0
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def weight(self, shape, scale: float, prefix: str = "w", *, positive: bool = False, gain: float = 1.0) -> str:
        """Random normal weights times ``scale``, or with ``positive`` uniform in [0.5, 1.5] times ``gain``."""
        arr = self.rng.uniform(0.5, 1.5, shape) * gain if positive else self.rng.standard_normal(shape) * scale
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(arr.astype(self.dtype), name))
        self.weight_bytes += int(np.prod(shape)) * self.dtype.itemsize
        return name

    def const_i64(self, values, prefix: str = "shape") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
        m.ir_version = 9
        return m

    def tensor_type(self) -> int:
        return helper.np_dtype_to_tensor_dtype(self.dtype)


# ---------------------------------------------------------------------------------------------- ResNet
def _conv_bn(g: _Graph, x: str, cin: int, cout: int, k: int, stride: int, hw: int, batch: int, *, relu: bool,
             gamma: float = 1.0) -> str:
    w = g.weight((cout, cin, k, k), (2.0 / (cin * k * k)) ** 0.5)
    y = g.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)
    out_hw = (hw + 2 * (k // 2) - k) // stride + 1
    g.flops += 2 * batch * out_hw * out_hw * cout * cin * k * k
    bn = [g.weight((cout,), 0, "gamma", positive=True, gain=gamma), g.weight((cout,), 0.1, "beta"),
          g.weight((cout,), 0.1, "mean"), g.weight((cout,), 0, "var", positive=True)]
    y = g.op("BatchNormalization", [y, *bn], epsilon=1e-5)
    return g.op("Relu", [y]) if relu else y


def resnet50(batch=32, size=224, width=64, blocks=(3, 4, 6, 3), classes=1000, dtype="float16", seed=0):
    """ResNet-50 (bottleneck blocks, expansion 4), NCHW, inference form (BatchNormalization kept)."""
    g = _Graph(dtype, seed)
    x = _conv_bn(g, "x", 3, width, 7, 2, size, batch, relu=True)
    hw = (size + 1) // 2
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    hw = (hw + 1) // 2
    cin = width
    for stage, n in enumerate(blocks):
        mid = width * 2 ** stage
        cout = mid * 4
        for b in range(n):
            stride = 2 if stage > 0 and b == 0 else 1
            y = _conv_bn(g, x, cin, mid, 1, 1, hw, batch, relu=True)
            y = _conv_bn(g, y, mid, mid, 3, stride, hw, batch, relu=True)
            out_hw = (hw - 1) // stride + 1
            # the residual branch's last BatchNorm starts small, as trained ResNets' do (zero-init-residual):
            # with unit gammas the block outputs double in variance 16 times and overflow fp16 (58473 at the
            # last block with random weights, measured in fp32)
            y = _conv_bn(g, y, mid, cout, 1, 1, out_hw, batch, relu=False, gamma=0.2)
            short = x if (stride == 1 and cin == cout) else _conv_bn(g, x, cin, cout, 1, stride, hw, batch, relu=False)
            x = g.op("Relu", [g.op("Add", [y, short])])
            cin, hw = cout, out_hw
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    fc_w = g.weight((classes, cin), (1.0 / cin) ** 0.5)
    fc_b = g.weight((classes,), 0.01, "b")
    g.flops += 2 * batch * cin * classes
    y = g.op("Gemm", [x, fc_w, fc_b], transB=1)
    g.nodes[-1].output[0] = "y"
    t = g.tensor_type()
    model = g.model("resnet50", [helper.make_tensor_value_info("x", t, [batch, 3, size, size])],
                    [helper.make_tensor_value_info("y", t, [batch, classes])])
    io = (batch * 3 * size * size + batch * classes) * g.dtype.itemsize
    return model, io + g.weight_bytes, g.flops


# ------------------------------------------------------------------------------------------------ BERT
def _linear(g: _Graph, x: str, rows: int, cin: int, cout: int) -> str:
    w = g.weight((cin, cout), 0.02)
    b = g.weight((cout,), 0.02, "b")
    g.flops += 2 * rows * cin * cout
    return g.op("Add", [g.op("MatMul", [x, w]), b])


def bert_base(batch=8, seq=512, hidden=768, layers=12, heads=12, ffn=3072, dtype="float16", seed=0):
    """BERT-base encoder layers (post-LayerNorm, GELU) on the embeddings ``x`` [batch, seq, hidden]."""
    g = _Graph(dtype, seed)
    d = hidden // heads
    rows = batch * seq
    split = g.const_i64([batch, seq, heads, d])
    merge = g.const_i64([batch, seq, hidden])
    scale = g.name("scale")
    g.inits.append(numpy_helper.from_array(np.asarray(d ** -0.5, dtype=g.dtype), scale))
    x = "x"
    for _ in range(layers):
        def heads_of(t, perm):
            return g.op("Transpose", [g.op("Reshape", [t, split])], perm=perm)

        q = heads_of(_linear(g, x, rows, hidden, hidden), [0, 2, 1, 3])
        k = heads_of(_linear(g, x, rows, hidden, hidden), [0, 2, 3, 1])
        v = heads_of(_linear(g, x, rows, hidden, hidden), [0, 2, 1, 3])
        p = g.op("Softmax", [g.op("Mul", [g.op("MatMul", [q, k]), scale])], axis=-1)
        ctx = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3]), merge])
        g.flops += 2 * 2 * batch * heads * seq * seq * d
        attn = _linear(g, ctx, rows, hidden, hidden)
        x = g.op("LayerNormalization", [g.op("Add", [attn, x]), g.weight((hidden,), 0, "ln_g", positive=True),
                                        g.weight((hidden,), 0.02, "ln_b")], axis=-1, epsilon=1e-12)
        h = g.op("Gelu", [_linear(g, x, rows, hidden, ffn)])
        h = _linear(g, h, rows, ffn, hidden)
        x = g.op("LayerNormalization", [g.op("Add", [h, x]), g.weight((hidden,), 0, "ln_g", positive=True),
                                        g.weight((hidden,), 0.02, "ln_b")], axis=-1, epsilon=1e-12)
    g.nodes[-1].output[0] = "y"
    t = g.tensor_type()
    shape = [batch, seq, hidden]
    model = g.model("bert_base", [helper.make_tensor_value_info("x", t, shape)],
                    [helper.make_tensor_value_info("y", t, shape)])
    return model, 2 * rows * hidden * g.dtype.itemsize + g.weight_bytes, g.flops


MODELS = {"resnet50": resnet50, "bert_base": bert_base}

# tiny versions of the same graphs, for CPU tests and smoke runs
SMALL_MODELS = {
    "resnet50": dict(batch=2, size=32, width=8, blocks=(1, 1, 1, 1), classes=10),
    "bert_base": dict(batch=2, seq=16, hidden=32, layers=2, heads=2, ffn=64),
}
