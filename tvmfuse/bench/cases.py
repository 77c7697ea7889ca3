"""The ANCHORS.md kernel cases as small ONNX models (onnx.helper), at any size.

Each builder returns ``(model, bytes_min, flops)``: ``bytes_min`` counts each input read once and each
output written once (weights included); ``flops`` is 0 for memory-bound cases.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

_F16 = TensorProto.FLOAT16


def _vi(name, shape, dtype=_F16):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _model(nodes, name, inputs, outputs, inits):
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 9
    return m


def _const(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def pointwise(M=16384, N=8192, seed=0):
    """y = gelu(x + b) * s + r."""
    rng = np.random.default_rng(seed)
    b = _const("b", rng.standard_normal(N).astype("float16"))
    s = _const("s", rng.standard_normal(N).astype("float16"))
    nodes = [helper.make_node("Add", ["x", "b"], ["t0"]), helper.make_node("Gelu", ["t0"], ["t1"]),
             helper.make_node("Mul", ["t1", "s"], ["t2"]), helper.make_node("Add", ["t2", "r"], ["y"])]
    return _model(nodes, "pointwise", [_vi("x", (M, N)), _vi("r", (M, N))], [_vi("y", (M, N))], [b, s]), 3 * M * N * 2, 0


def add_layernorm(M=16384, N=8192, seed=0):
    """y = LayerNorm(x + r) * w + bb (fp16 in, fp16 gamma/beta)."""
    rng = np.random.default_rng(seed)
    w = _const("w", rng.standard_normal(N).astype("float16"))
    bb = _const("bb", rng.standard_normal(N).astype("float16"))
    nodes = [helper.make_node("Add", ["x", "r"], ["t0"]),
             helper.make_node("LayerNormalization", ["t0", "w", "bb"], ["y"], axis=-1, epsilon=1e-5)]
    return _model(nodes, "add_ln", [_vi("x", (M, N)), _vi("r", (M, N))], [_vi("y", (M, N))], [w, bb]), 3 * M * N * 2, 0


def layernorm(M=16384, N=4096, seed=0):
    """y = LayerNorm(x) * w + bb (fp16, one input row read, one written)."""
    rng = np.random.default_rng(seed)
    w = _const("w", rng.standard_normal(N).astype("float16"))
    bb = _const("bb", rng.standard_normal(N).astype("float16"))
    nodes = [helper.make_node("LayerNormalization", ["x", "w", "bb"], ["y"], axis=-1, epsilon=1e-5)]
    return _model(nodes, "ln", [_vi("x", (M, N))], [_vi("y", (M, N))], [w, bb]), 2 * M * N * 2, 0


def rmsnorm(M=16384, N=4096, seed=0):
    """y = x / sqrt(mean(x^2) + eps) * w, decomposed as LLaMA exports write it (Mul, ReduceMean, Add, Sqrt,
    Div, Mul; fp16)."""
    rng = np.random.default_rng(seed)
    w = _const("w", rng.standard_normal(N).astype("float16"))
    eps = _const("eps", np.array(1e-5, dtype="float16"))
    axes = _const("axes", np.array([-1], dtype="int64"))
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["x", "rms"], ["xn"]), helper.make_node("Mul", ["xn", "w"], ["y"])]
    return _model(nodes, "rms", [_vi("x", (M, N))], [_vi("y", (M, N))], [w, eps, axes]), 2 * M * N * 2, 0


def swiglu(M=16384, N=8192, seed=0):
    """y = silu(a) * g = a * sigmoid(a) * g."""
    nodes = [helper.make_node("Sigmoid", ["a"], ["t0"]), helper.make_node("Mul", ["a", "t0"], ["t1"]),
             helper.make_node("Mul", ["t1", "g"], ["y"])]
    return _model(nodes, "swiglu", [_vi("a", (M, N)), _vi("g", (M, N))], [_vi("y", (M, N))], []), 3 * M * N * 2, 0


def softmax(M=65536, N=2048, seed=0):
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    return _model(nodes, "softmax", [_vi("x", (M, N))], [_vi("y", (M, N))], []), 2 * M * N * 2, 0


def gemm_bias_relu(M=8192, K=8192, N=8192, seed=0):
    rng = np.random.default_rng(seed)
    W = _const("W", (rng.standard_normal((K, N)) * 0.02).astype("float16"))
    b = _const("b", rng.standard_normal(N).astype("float16"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t0"]), helper.make_node("Add", ["t0", "b"], ["t1"]),
             helper.make_node("Relu", ["t1"], ["y"])]
    return (_model(nodes, "gemm_bias_relu", [_vi("x", (M, K))], [_vi("y", (M, N))], [W, b]),
            (M * K + K * N + M * N) * 2, 2 * M * N * K)


def llama_mlp(M=2048, H=4096, I=11008, seed=0):
    """y = (silu(x @ Wg) * (x @ Wu)) @ Wd, a LLaMA MLP as exporters write it (MatMul, Sigmoid, Mul, Mul, MatMul):
    the planner's horizontal fusion makes the two up projections one GEMM over [Wg | Wu] with silu(g) * u applied
    to its accumulators; the down projection is a second GEMM."""
    rng = np.random.default_rng(seed)
    wg, wu = (_const(n, (rng.standard_normal((H, I)) * 0.02).astype("float16")) for n in ("Wg", "Wu"))
    wd = _const("Wd", (rng.standard_normal((I, H)) * 0.02).astype("float16"))
    nodes = [helper.make_node("MatMul", ["x", "Wg"], ["g"]), helper.make_node("MatMul", ["x", "Wu"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["h"]), helper.make_node("MatMul", ["h", "Wd"], ["y"])]
    return (_model(nodes, "llama_mlp", [_vi("x", (M, H))], [_vi("y", (M, H))], [wg, wu, wd]),
            (2 * M * H + 3 * H * I) * 2, 2 * M * H * I * 3)


def conv_bn_relu(B=64, C=256, H=56, W=56, seed=0, layout="NHWC"):
    """conv3x3 (pad 1) -> BatchNormalization -> Relu on ``layout`` tensors.

    ANCHORS.md times this case channels-last (PyTorch's ``channels_last`` input and output), so the default
    model takes and returns NHWC tensors, which ONNX (whose Conv is NCHW) writes as Transpose -> Conv -> ... ->
    Transpose. ``layout="NCHW"``: the plain ONNX form, whose channels-last build transposes its input first."""
    if layout not in ("NHWC", "NCHW"):
        raise ValueError(f"layout must be NHWC or NCHW, not {layout!r}")
    rng = np.random.default_rng(seed)
    w = _const("w", (rng.standard_normal((C, C, 3, 3)) * 0.05).astype("float16"))
    scale = _const("scale", rng.uniform(0.5, 1.5, C).astype("float16"))
    bias = _const("bias", rng.standard_normal(C).astype("float16"))
    mean = _const("mean", rng.standard_normal(C).astype("float16"))
    var = _const("var", rng.uniform(0.5, 2.0, C).astype("float16"))
    nhwc = layout == "NHWC"
    nodes = [helper.make_node("Conv", ["xc" if nhwc else "x", "w"], ["t0"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("BatchNormalization", ["t0", "scale", "bias", "mean", "var"], ["t1"], epsilon=1e-5),
             helper.make_node("Relu", ["t1"], ["yc" if nhwc else "y"])]
    shape = (B, H, W, C) if nhwc else (B, C, H, W)
    if nhwc:
        nodes = ([helper.make_node("Transpose", ["x"], ["xc"], perm=[0, 3, 1, 2])] + nodes
                 + [helper.make_node("Transpose", ["yc"], ["y"], perm=[0, 2, 3, 1])])
    return (_model(nodes, "conv_bn_relu", [_vi("x", shape)], [_vi("y", shape)], [w, scale, bias, mean, var]),
            (2 * B * C * H * W + C * C * 9) * 2, 2 * B * H * W * C * C * 9)


def attention(B=4, H=32, S=4096, D=128, seed=0):
    """softmax(q @ kᵀ * D^-0.5) @ v, as an exporter writes it (Transpose, MatMul, Mul, Softmax, MatMul)."""
    scale = _const("scale", np.array(D ** -0.5, dtype="float16"))
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]), helper.make_node("Mul", ["s0", "scale"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    shp = (B, H, S, D)
    return (_model(nodes, "attention", [_vi("q", shp), _vi("k", shp), _vi("v", shp)], [_vi("y", shp)], [scale]),
            4 * B * H * S * D * 2, 4 * B * H * S * S * D)


CASES = {
    "pointwise": pointwise, "add_layernorm": add_layernorm, "swiglu": swiglu, "softmax": softmax,
    "layernorm": layernorm, "rmsnorm": rmsnorm, "gemm_bias_relu": gemm_bias_relu, "conv_bn_relu": conv_bn_relu, "attention": attention,
    "llama_mlp": llama_mlp,
}

# tiny sizes for CPU tests (same graphs)
SMALL = {
    "pointwise": dict(M=64, N=256), "add_layernorm": dict(M=64, N=256), "swiglu": dict(M=64, N=256),
    "softmax": dict(M=64, N=256), "layernorm": dict(M=64, N=256), "rmsnorm": dict(M=64, N=256), "gemm_bias_relu": dict(M=64, K=64, N=64), "conv_bn_relu": dict(B=1, C=16, H=8, W=8),
    "attention": dict(B=1, H=2, S=64, D=32), "llama_mlp": dict(M=128, H=64, I=96),
}


def attention_kernel(B=4, H=32, S=4096, D=128):
    """The planner's attention PrimFunc (online softmax, no N×N scores) as a MetaSchedule workload, without
    going through an ONNX graph (the space tests use it). Parameters: q, k (rows, [B,H,S,D]), v, out.
    """
    from tvmfuse._tvm import tvm
    from tvmfuse.plan.attention import AttentionSpec, attention_primfunc

    spec = AttentionSpec(batch=(B, H), seq_q=S, seq_k=S, head_dim=D, head_dim_v=D, dtype="float16",
                         scale=float(np.float16(D ** -0.5)), mask_shape=None, k_rows=True)
    return tvm.IRModule({"main": attention_primfunc(spec).with_attr("global_symbol", "main")})
