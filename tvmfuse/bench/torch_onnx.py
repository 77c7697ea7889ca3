"""A small ONNX interpreter over PyTorch ops, for the torch baselines of ``tvmfuse bench``.

onnx2torch is not available on the GPU machine, so ``tvmfuse bench --against torch`` rebuilds the ONNX
graph as a Python function of torch ops (eager), and ``torch.compile`` of that function. It covers the
ops of the benchmark cases and common transformer/CNN graphs; a graph with any other op gets a clear
"not available" entry instead of a number.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


class Unsupported(Exception):
    pass


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


SUPPORTED = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Erf", "Exp", "Tanh", "Sigmoid", "Relu", "Gelu", "Neg",
             "MatMul", "Gemm", "Softmax", "LayerNormalization", "Conv", "BatchNormalization", "Transpose",
             "Reshape", "Identity", "Cast", "ReduceMean", "Constant", "Flatten", "MaxPool", "GlobalAveragePool",
             "Unsqueeze", "Concat", "Where", "Equal", "Clip"}


def check_supported(model: onnx.ModelProto) -> None:
    bad = sorted({n.op_type for n in model.graph.node} - SUPPORTED)
    if bad:
        raise Unsupported("ops not in tvmfuse's torch interpreter: " + ", ".join(bad))


def build_fn(model: onnx.ModelProto, device, float_dtype=None, channels_last: bool = False):
    """A function ``f(*inputs) -> outputs`` (torch tensors) computing the ONNX graph with torch ops.

    ``float_dtype`` (e.g. ``torch.float32``) casts the floating-point weights, for a higher-precision
    reference run on upcast inputs. ``channels_last`` stores 4-D weights channels-last (give 4-D inputs
    the same memory format), the layout cuDNN and Inductor run convolutions fastest in.
    """
    import torch
    import torch.nn.functional as F

    check_supported(model)
    inits = {t.name: torch.from_numpy(np.array(numpy_helper.to_array(t))).to(device) for t in model.graph.initializer}
    if float_dtype is not None:
        inits = {k: v.to(float_dtype) if v.is_floating_point() else v for k, v in inits.items()}
    if channels_last:
        inits = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in inits.items()}
    init_names = set(inits)
    in_names = [i.name for i in model.graph.input if i.name not in init_names]
    out_names = [o.name for o in model.graph.output]
    nodes = list(model.graph.node)

    def run(*args):
        env = dict(inits)
        env.update(zip(in_names, args))
        for n in nodes:
            a = _attrs(n)
            x = [env[i] if i else None for i in n.input]
            op = n.op_type
            if op == "Add":
                y = x[0] + x[1]
            elif op == "Sub":
                y = x[0] - x[1]
            elif op == "Mul":
                y = x[0] * x[1]
            elif op == "Div":
                y = x[0] / x[1]
            elif op == "Pow":
                y = torch.pow(x[0], x[1])
            elif op == "Sqrt":
                y = torch.sqrt(x[0])
            elif op == "Erf":
                y = torch.erf(x[0])
            elif op == "Exp":
                y = torch.exp(x[0])
            elif op == "Tanh":
                y = torch.tanh(x[0])
            elif op == "Neg":
                y = -x[0]
            elif op == "Sigmoid":
                y = torch.sigmoid(x[0])
            elif op == "Relu":
                y = torch.relu(x[0])
            elif op == "Gelu":
                y = F.gelu(x[0], approximate="tanh" if a.get("approximate", b"none") in (b"tanh", "tanh") else "none")
            elif op == "Clip":
                y = torch.clamp(x[0], x[1] if len(x) > 1 else None, x[2] if len(x) > 2 else None)
            elif op == "MatMul":
                y = x[0] @ x[1]
            elif op == "Gemm":
                A = x[0].T if a.get("transA", 0) else x[0]
                B = x[1].T if a.get("transB", 0) else x[1]
                y = a.get("alpha", 1.0) * (A @ B)
                if len(x) > 2 and x[2] is not None:
                    y = y + a.get("beta", 1.0) * x[2]
            elif op == "Softmax":
                y = torch.softmax(x[0], dim=a.get("axis", -1))
            elif op == "LayerNormalization":
                axis = a.get("axis", -1)
                shape = tuple(x[0].shape[axis:])
                y = F.layer_norm(x[0], shape, x[1], x[2] if len(x) > 2 else None, eps=a.get("epsilon", 1e-5))
            elif op == "Conv":
                pads = a.get("pads", [0, 0, 0, 0])
                k = len(pads) // 2
                if list(pads[:k]) != list(pads[k:]):
                    raise Unsupported("asymmetric Conv padding")
                y = F.conv2d(x[0], x[1], x[2] if len(x) > 2 else None, stride=tuple(a.get("strides", [1, 1])),
                             padding=tuple(pads[:k]), dilation=tuple(a.get("dilations", [1, 1])), groups=a.get("group", 1))
            elif op == "BatchNormalization":
                y = F.batch_norm(x[0], x[3], x[4], x[1], x[2], training=False, eps=a.get("epsilon", 1e-5))
            elif op == "Transpose":
                y = x[0].permute(*a["perm"]) if "perm" in a else x[0].permute(*reversed(range(x[0].dim())))
            elif op == "Reshape":
                shape = [int(v) for v in x[1].tolist()]
                shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
                y = x[0].reshape(shape)
            elif op == "Flatten":
                y = torch.flatten(x[0], a.get("axis", 1))
            elif op in ("Identity", "Cast"):
                y = x[0] if op == "Identity" else x[0].to(getattr(torch, onnx.helper.tensor_dtype_to_np_dtype(a["to"]).name))
            elif op == "ReduceMean":
                axes = a.get("axes") or (x[1].tolist() if len(x) > 1 and x[1] is not None else None)
                y = torch.mean(x[0], dim=tuple(axes), keepdim=bool(a.get("keepdims", 1)))
            elif op == "Constant":
                y = torch.from_numpy(np.array(numpy_helper.to_array(a["value"]))).to(device)
                if float_dtype is not None and y.is_floating_point():
                    y = y.to(float_dtype)
            elif op == "MaxPool":
                pads = a.get("pads", [0, 0, 0, 0])
                y = F.max_pool2d(x[0], tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"])), tuple(pads[:2]))
            elif op == "GlobalAveragePool":
                y = torch.mean(x[0], dim=(2, 3), keepdim=True)
            elif op == "Unsqueeze":
                axes = a.get("axes") or x[1].tolist()
                y = x[0]
                for ax in sorted(int(v) for v in axes):
                    y = y.unsqueeze(ax)
            elif op == "Concat":
                y = torch.cat(x, dim=a["axis"])
            elif op == "Where":
                y = torch.where(x[0], x[1], x[2])
            elif op == "Equal":
                y = x[0] == x[1]
            else:  # pragma: no cover - check_supported guards this
                raise Unsupported(op)
            env[n.output[0]] = y
        return tuple(env[o] for o in out_names)

    return run
