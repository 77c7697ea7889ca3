"""Small ONNX models, one per fusion pattern, built with onnx.helper (random weights, fixed seed)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _B:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.inits: list = []
        self.nodes: list = []
        self.k = 0

    def const(self, arr, name=None) -> str:
        self.k += 1
        name = name or f"c{self.k}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name))
        return name

    def w(self, *shape, scale=0.3) -> str:
        return self.const(self.rng.standard_normal(shape) * scale)

    def op(self, op_type, inputs, **attrs) -> str:
        self.k += 1
        out = f"t{self.k}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self.k}", **attrs))
        return out

    def model(self, inputs: dict, output: str, out_shape) -> onnx.ModelProto:
        self.nodes[-1].output[0] = "y"
        for n in self.nodes:  # rename uses of the last output
            for i, x in enumerate(n.input):
                if x == output:
                    n.input[i] = "y"
        graph = helper.make_graph(
            self.nodes, "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializer=self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def conv_bn_relu(n=1, cin=16, cout=16, hw=16, bias=False) -> onnx.ModelProto:
    b = _B(1)
    ins = ["x", b.w(cout, cin, 3, 3)] + ([b.const(b.rng.standard_normal(cout) * 0.1)] if bias else [])
    c = b.op("Conv", ins, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    bn = b.op("BatchNormalization", [c, b.const(1 + 0.1 * b.rng.standard_normal(cout)),
                                     b.const(0.1 * b.rng.standard_normal(cout)),
                                     b.const(0.1 * b.rng.standard_normal(cout)),
                                     b.const(1 + 0.1 * b.rng.random(cout))], epsilon=1e-5)
    y = b.op("Relu", [bn])
    return b.model({"x": [n, cin, hw, hw]}, y, [n, cout, hw, hw])


def conv_bn_relu_residual(n=1, c=16, hw=16) -> onnx.ModelProto:
    b = _B(2)
    conv = b.op("Conv", ["x", b.w(c, c, 3, 3)], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    bn = b.op("BatchNormalization", [conv, b.const(1 + 0.1 * b.rng.standard_normal(c)), b.const(0.1 * b.rng.standard_normal(c)),
                                     b.const(0.1 * b.rng.standard_normal(c)), b.const(1 + 0.1 * b.rng.random(c))])
    add = b.op("Add", [bn, "x"])
    y = b.op("Relu", [add])
    return b.model({"x": [n, c, hw, hw]}, y, [n, c, hw, hw])


def pointwise_chain(m=64, n=96) -> onnx.ModelProto:
    """GELU (tanh form) -> Dropout (identity) -> Add -> Cast -> Mul: one kernel."""
    b = _B(3)
    x3 = b.op("Mul", [b.op("Mul", ["x", "x"]), "x"])
    inner = b.op("Mul", [b.op("Add", ["x", b.op("Mul", [x3, b.const(0.044715)])]), b.const(np.sqrt(2 / np.pi))])
    g = b.op("Mul", [b.op("Mul", ["x", b.const(0.5)]), b.op("Add", [b.op("Tanh", [inner]), b.const(1.0)])])
    d = b.op("Dropout", [g])
    a = b.op("Add", [d, "r"])
    c = b.op("Cast", [a], to=TensorProto.FLOAT)
    y = b.op("Mul", [c, b.const(b.rng.standard_normal(n))])
    return b.model({"x": [m, n], "r": [m, n]}, y, [m, n])


def gemm_epilogue(m=64, k=48, n=80, act="Relu", batched=False) -> onnx.ModelProto:
    """MatMul -> bias -> activation -> residual Add (batched: [4, m, k] @ [4, k, n])."""
    b = _B(4)
    shape_x = [4, m, k] if batched else [m, k]
    w = b.w(4, k, n) if batched else b.w(k, n)
    h = b.op("Add", [b.op("MatMul", ["x", w]), b.const(b.rng.standard_normal(n) * 0.1)])
    if act == "Relu":
        h = b.op("Relu", [h])
    elif act == "SiLU":
        h = b.op("Mul", [h, b.op("Sigmoid", [h])])
    elif act == "GELU":
        h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(np.sqrt(2.0))])]), b.const(1.0)])]), b.const(0.5)])
    out_shape = shape_x[:-1] + [n]
    y = b.op("Add", [h, "r"])
    return b.model({"x": shape_x, "r": out_shape}, y, out_shape)


def add_norm(kind="LayerNorm", m=64, n=96) -> onnx.ModelProto:
    """(x + r) -> LayerNorm | RMSNorm (decomposed: Pow, ReduceMean, Add, Sqrt, Div, Mul) | Softmax."""
    b = _B(5)
    s = b.op("Add", ["x", "r"])
    if kind == "LayerNorm":
        y = b.op("LayerNormalization", [s, b.const(1 + 0.1 * b.rng.standard_normal(n)), b.const(0.1 * b.rng.standard_normal(n))],
                 axis=-1, epsilon=1e-5)
    elif kind == "RMSNorm":
        ms = b.op("ReduceMean", [b.op("Pow", [s, b.const(2.0)])], axes=[-1], keepdims=1)
        y = b.op("Mul", [b.op("Div", [s, b.op("Sqrt", [b.op("Add", [ms, b.const(1e-6)])])]), b.const(1 + 0.1 * b.rng.standard_normal(n))])
    else:
        y = b.op("Softmax", [s], axis=-1)
    return b.model({"x": [m, n], "r": [m, n]}, y, [m, n])


def gated(kind="SiLU", m=32, d=48, f=64) -> onnx.ModelProto:
    """SwiGLU / GeGLU: act(x @ W1) * (x @ W3) -> @ W2."""
    b = _B(6)
    a = b.op("MatMul", ["x", b.w(d, f)])
    g = b.op("MatMul", ["x", b.w(d, f)])
    if kind == "SiLU":
        act = b.op("Mul", [a, b.op("Sigmoid", [a])])
    else:
        act = b.op("Mul", [b.op("Mul", [a, b.op("Add", [b.op("Erf", [b.op("Div", [a, b.const(np.sqrt(2.0))])]), b.const(1.0)])]), b.const(0.5)])
    h = b.op("Mul", [act, g])
    y = b.op("MatMul", [h, b.w(f, d)])
    return b.model({"x": [m, d]}, y, [m, d])


def qkv(m=64, d=64, heads=4) -> onnx.ModelProto:
    """Q/K/V projections of one input, each with bias, reshaped to heads: candidates for one GEMM."""
    b = _B(7)
    outs = []
    for _ in range(3):
        p = b.op("Add", [b.op("MatMul", ["x", b.w(d, d)]), b.const(b.rng.standard_normal(d) * 0.1)])
        r = b.op("Reshape", [p, b.const(np.array([1, m, heads, d // heads]), name=None)] if False else
                 [p, _int64(b, [1, m, heads, d // heads])])
        outs.append(b.op("Transpose", [r], perm=[0, 2, 1, 3]))
    y = b.op("Concat", outs, axis=-1)
    return b.model({"x": [1, m, d]}, y, [1, heads, m, 3 * d // heads])


def fused_qkv_attention(m=64, d=64, heads=4, sizes=None) -> onnx.ModelProto:
    """GPT-2's attention input: one GEMM with bias for Q, K and V together, split along its columns (``sizes``:
    the parts' widths; equal thirds by default), each part reshaped to heads and transposed, then attention."""
    b = _B(9)
    widths = sizes or [d, d, d]
    p = b.op("Add", [b.op("MatMul", ["x", b.w(d, sum(widths))]), b.const(b.rng.standard_normal(sum(widths)) * 0.1)])
    b.k += 1
    parts = [f"part{b.k}_{i}" for i in range(3)]
    b.nodes.append(helper.make_node("Split", [p, _int64(b, widths)], parts, name=f"n{b.k}", axis=-1))
    q, k, v = (b.op("Transpose", [b.op("Reshape", [x, _int64(b, [1, m, heads, w // heads])])], perm=perm)
               for x, w, perm in zip(parts, widths, ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])))
    s = b.op("Mul", [b.op("MatMul", [q, k]), b.const(1 / np.sqrt(widths[0] // heads))])
    y = b.op("MatMul", [b.op("Softmax", [s], axis=-1), v])
    return b.model({"x": [1, m, d]}, y, [1, heads, m, widths[2] // heads])


def fused_heads_qkv_attention(m=64, d=64, heads=4, kv_heads=1) -> onnx.ModelProto:
    """Falcon's attention input: one GEMM for the query heads and the K and V heads together, viewed as [1, m,
    heads + 2 kv_heads, head dim] and split along the heads, the K and V heads repeated for the query heads."""
    b = _B(13)
    hd = d // heads
    n = (heads + 2 * kv_heads) * hd
    p = b.op("Reshape", [b.op("MatMul", ["x", b.w(d, n)]), _int64(b, [1, m, heads + 2 * kv_heads, hd])])
    b.k += 1
    parts = [f"part{b.k}_{i}" for i in range(3)]
    b.nodes.append(helper.make_node("Split", [p, _int64(b, [heads, kv_heads, kv_heads])], parts, name=f"n{b.k}",
                                    axis=2))

    def heads_of(x, perm, rep):
        t = b.op("Transpose", [x], perm=perm)
        return t if rep == 1 else b.op("Tile", [t, _int64(b, [1, rep, 1, 1])])

    q = heads_of(parts[0], [0, 2, 1, 3], 1)
    k = heads_of(parts[1], [0, 2, 3, 1], heads // kv_heads)
    v = heads_of(parts[2], [0, 2, 1, 3], heads // kv_heads)
    s = b.op("Mul", [b.op("MatMul", [q, k]), b.const(1 / np.sqrt(hd))])
    y = b.op("MatMul", [b.op("Softmax", [s], axis=-1), v])
    return b.model({"x": [1, m, d]}, y, [1, heads, m, hd])


def fused_gate_up(m=128, d=64, n=128) -> onnx.ModelProto:
    """Phi-3's MLP: one GEMM for the gate and up projections together, ``chunk(2)`` along its columns (an ONNX
    Split), ``silu(gate) * up``, then the down projection."""
    b = _B(11)
    mm = b.op("MatMul", ["x", b.w(d, 2 * n)])
    b.k += 1
    gate, up = f"gate{b.k}", f"up{b.k}"
    b.nodes.append(helper.make_node("Split", [mm, _int64(b, [n, n])], [gate, up], name=f"n{b.k}", axis=-1))
    h = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
    y = b.op("MatMul", [h, b.w(n, d)])
    return b.model({"x": [m, d]}, y, [m, d])


def _int64(b: _B, values) -> str:
    b.k += 1
    name = f"s{b.k}"
    b.inits.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def attention(batch=2, heads=3, seq=32, dim=16, mask=True, casts=0) -> onnx.ModelProto:
    """softmax(Q Kᵀ / sqrt(d) + mask) V with Q, K, V inputs [B, H, S, D] and a [B, 1, 1, S] mask; ``casts``
    identity casts (fp32 to fp32, as ViT's exports have) between the softmax and P·V."""
    b = _B(8)
    kt = b.op("Transpose", ["k"], perm=[0, 1, 3, 2])
    s = b.op("Div", [b.op("MatMul", ["q", kt]), b.const(np.sqrt(dim))])
    if mask:
        s = b.op("Add", [s, "mask"])
    p = b.op("Softmax", [s], axis=-1)
    for _ in range(casts):
        p = b.op("Cast", [p], to=TensorProto.FLOAT)
    y = b.op("MatMul", [p, "v"])
    ins = {"q": [batch, heads, seq, dim], "k": [batch, heads, seq, dim], "v": [batch, heads, seq, dim]}
    if mask:
        ins["mask"] = [batch, 1, 1, seq]
    return b.model(ins, y, [batch, heads, seq, dim])


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its float inputs, outputs and initializers in fp16."""
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for i, init in enumerate(model.graph.initializer):
        if init.data_type == TensorProto.FLOAT:   # shapes (int64) stay as they are
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16),
                                                                        init.name))
    return model


def wide_branches(m=64, k=512, n=8) -> onnx.ModelProto:
    """Three narrow GEMMs of one wide input, each result used twice: reading x once pays."""
    b = _B(9)
    outs = []
    for _ in range(3):
        p = b.op("MatMul", ["x", b.w(k, n, scale=0.05)])
        outs.append(b.op("Add", [b.op("Relu", [p]), b.op("Sigmoid", [p])]))
    y = b.op("Concat", outs, axis=-1)
    return b.model({"x": [m, k]}, y, [m, 3 * n])


def run_built(fused, target, *inputs):
    """The partitioned module ``fused`` built for the CPU ``target`` (its kernels' TIR) run on ``inputs`` (numpy),
    its lifted parameters passed after them: a plan's rewrites checked where its GPU kernels cannot run."""
    from tvmfuse._tvm import tvm
    from tvmfuse.compile import build

    result = build(fused, target=target, database=None)
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    params = [tvm.runtime.tensor(np.asarray(p.numpy() if hasattr(p, "numpy") else p)) for p in result.lifted_params]
    return vm["main"](*(tvm.runtime.tensor(x) for x in inputs), *params).numpy()
