"""A small ONNX interpreter over PyTorch ops, for the torch baselines of ``tvmfuse bench``.

onnx2torch is not available on the GPU machine, so ``tvmfuse bench --against torch`` rebuilds the ONNX
graph as a torch module of torch ops (eager), and ``torch.compile`` of that module. It covers the
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
    """A ``torch.nn.Module`` whose ``forward(*inputs) -> outputs`` (torch tensors) computes the ONNX graph with
    torch ops, the initializers held as its buffers (what ``torch.compile`` expects of a model's weights).

    ``float_dtype`` (e.g. ``torch.float32``) casts the floating-point weights, for a higher-precision
    reference run on upcast inputs. ``channels_last`` stores 4-D weights channels-last (give 4-D inputs
    the same memory format), the layout cuDNN and Inductor run convolutions fastest in.
    """
    import torch
    import torch.nn.functional as F

    check_supported(model)
    # Everything read from the ONNX protobufs is read here, once. Until 2026-12-01 ``run`` read the nodes' attributes
    # itself, and torch.compile traced no graph of it at all (torch._dynamo.explain: 0 graphs): the "compiled"
    # replay ran op by op as eager did (ResNet-50 b32 on the H200: eager 4921 us, "compiled" 5095 us, built in
    # 0.5 s). Now it traces as one graph with no break.
    static = {t.name: np.array(numpy_helper.to_array(t)) for t in model.graph.initializer}
    static.update({n.output[0]: np.array(numpy_helper.to_array(_attrs(n)["value"]))
                   for n in model.graph.node if n.op_type == "Constant"})
    inits = {}
    for name, value in static.items():
        t = torch.from_numpy(value).to(device)
        if float_dtype is not None and t.is_floating_point():
            t = t.to(float_dtype)
        inits[name] = t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
    init_names = {t.name for t in model.graph.initializer}
    in_names = [i.name for i in model.graph.input if i.name not in init_names]
    out_names = [o.name for o in model.graph.output]
    nodes = []
    for n in model.graph.node:
        if n.op_type == "Constant":
            continue
        a = {k: v.decode() if isinstance(v, bytes) else v for k, v in _attrs(n).items()}
        if n.op_type in ("Reshape", "ReduceMean", "Unsqueeze") and len(n.input) > 1 and n.input[1]:
            if n.input[1] not in static:
                raise Unsupported(f"{n.op_type} with a computed {'shape' if n.op_type == 'Reshape' else 'axes'}")
            a["shape" if n.op_type == "Reshape" else "axes"] = [int(v) for v in static[n.input[1]].reshape(-1)]
        if n.op_type == "Cast":
            a["to"] = getattr(torch, onnx.helper.tensor_dtype_to_np_dtype(a["to"]).name)
        nodes.append((n.op_type, list(n.input), n.output[0], a))

    def run(weights: dict, *args):
        env = dict(weights)
        env.update(zip(in_names, args))
        for op, inputs, output, a in nodes:
            x = [env[i] if i else None for i in inputs]
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
                y = F.gelu(x[0], approximate="tanh" if a.get("approximate", "none") == "tanh" else "none")
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
                shape = a["shape"]
                shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
                y = x[0].reshape(shape)
            elif op == "Flatten":
                y = torch.flatten(x[0], a.get("axis", 1))
            elif op in ("Identity", "Cast"):
                y = x[0] if op == "Identity" else x[0].to(a["to"])
            elif op == "ReduceMean":
                axes = a.get("axes")
                y = torch.mean(x[0], dim=tuple(range(x[0].dim()) if axes is None else axes), keepdim=bool(a.get("keepdims", 1)))
            elif op == "MaxPool":
                pads = a.get("pads", [0, 0, 0, 0])
                y = F.max_pool2d(x[0], tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"])), tuple(pads[:2]))
            elif op == "GlobalAveragePool":
                y = torch.mean(x[0], dim=(2, 3), keepdim=True)
            elif op == "Unsqueeze":
                axes = a["axes"]
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
            env[output] = y
        return tuple(env[o] for o in out_names)

    class Replay(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.slots = {}
            for i, (name, value) in enumerate(inits.items()):
                self.register_buffer(f"w{i}", value)
                self.slots[name] = f"w{i}"

        def forward(self, *args):
            return run({name: getattr(self, slot) for name, slot in self.slots.items()}, *args)

    return Replay().eval()
