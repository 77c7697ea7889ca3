"""A small ONNX interpreter over PyTorch ops, for the torch baselines of ``tvmfuse bench``.

onnx2torch is not available on the GPU machine, so ``tvmfuse bench --against torch`` rebuilds the ONNX
graph as a torch module of torch ops (eager), and ``torch.compile`` of that module. It covers the
ops of the benchmark cases and common transformer/CNN graphs; a graph with any other op gets a clear
"not available" entry instead of a number.

Shape-like inputs (Reshape/Expand shapes, Slice bounds, Split sizes, axes, ...) are read when the module is
built. Where an exporter computes one in the graph (Shape -> Gather -> Concat -> Reshape), the nodes whose
inputs are all known then are evaluated with numpy at build time, so the module itself only holds tensor
math with fixed shapes.
"""
from __future__ import annotations

import functools
import math

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
             "Unsqueeze", "Concat", "Where", "Equal", "Clip",
             "Reciprocal", "Abs", "Log", "Sin", "Cos", "Softplus", "LeakyRelu", "IsInf", "IsNaN",
             "Min", "Max", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor", "Not",
             "ReduceMax", "ReduceMin", "ReduceSum", "Gather", "GatherElements", "Expand", "Slice", "Split",
             "Squeeze", "Trilu", "Shape", "Size", "ConstantOfShape", "Range", "CumSum"}

# Evaluated with numpy at build time when all their inputs are known then (Shape and Size when their input's
# shape is). That is what makes a shape computed in the graph a static one; the float math of the model itself
# stays in torch. A result over _FOLD_LIMIT elements is left to run in torch (from the buffers) instead.
_FOLDABLE = {"Shape", "Size", "Gather", "GatherElements", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Expand",
             "Cast", "Slice", "Identity", "Transpose", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual",
             "And", "Or", "Xor", "Not", "Where", "ConstantOfShape", "Range", "Trilu", "Add", "Sub", "Mul", "Div",
             "Neg", "Abs", "Min", "Max"}
_FOLD_LIMIT = 1 << 20

# Reductions whose axes are an input (ReduceSum from opset 13, the others from 18) or an attribute before.
_REDUCE = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum"}


def check_supported(model: onnx.ModelProto) -> None:
    bad = sorted({n.op_type for n in model.graph.node} - SUPPORTED)
    if bad:
        raise Unsupported("ops not in tvmfuse's torch interpreter: " + ", ".join(bad))


def _constant(node) -> np.ndarray:
    a = _attrs(node)
    if "value" in a:
        return np.array(numpy_helper.to_array(a["value"]))
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in a:
            return np.array(a[key], dtype=dtype)
    raise Unsupported(f"Constant {node.name!r} with attribute {sorted(a)}")


def _dims(value_info):
    """The static shape of a graph value, or None where a dim is symbolic or unknown."""
    t = value_info.type.tensor_type
    if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
        return None
    return tuple(d.dim_value for d in t.shape.dim)


def _inferred_shapes(model: onnx.ModelProto) -> dict:
    """Shapes of intermediate values by ONNX shape inference, for a Shape node on one the exporter gave no
    value_info. Run on a copy whose large initializers are inputs instead (their data is not needed, and a copy
    of it would be as big as the model)."""
    g = model.graph
    small = [t for t in g.initializer if int(np.prod(t.dims)) <= 1024]
    kept = {t.name for t in small} | {i.name for i in g.input}
    inputs = list(g.input) + [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in g.initializer if t.name not in kept]
    copy = onnx.helper.make_model(onnx.helper.make_graph(g.node, g.name, inputs, g.output, small),
                                  opset_imports=model.opset_import, ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(copy).graph
    except Exception:  # inference failing only leaves the Shape node unfoldable, which is reported then
        return {}
    return {v.name: s for v in [*inferred.value_info, *inferred.output] if (s := _dims(v)) is not None}


def _slice_bounds(dim: int, start: int, end: int, step: int):
    """ONNX Slice's clamping of one axis: (start, stop, step) where stop is -1 for "through index 0" when
    step < 0 (a Python slice would read -1 as the last index)."""
    if step == 0:
        raise Unsupported("Slice with step 0")
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        return min(max(start, 0), dim), min(max(end, 0), dim), step
    return min(max(start, 0), dim - 1), min(max(end, -1), dim - 1), step


def _unsqueeze_axes(rank: int, axes) -> list:
    # Negative axes count from the end of the output, whose rank is the input's plus len(axes).
    out = rank + len(axes)
    return sorted(int(ax) + out if ax < 0 else int(ax) for ax in axes)


def _fold(op: str, x: list, a: dict):
    """numpy evaluation of a node whose inputs are all known at build time: its outputs, or None where the result
    would be too big to hold as a buffer (the node then runs in torch)."""
    if op in ("ConstantOfShape", "Expand"):
        shape = [int(v) for v in x[-1].reshape(-1)]
        if op == "Expand":
            shape = np.broadcast_shapes(x[0].shape, tuple(shape))
        if int(np.prod(shape)) > _FOLD_LIMIT:
            return None
    if op == "ConstantOfShape":
        value = a.get("value")
        value = np.array(numpy_helper.to_array(value)).reshape(-1) if value is not None else np.zeros(1, np.float32)
        y = np.full(shape, value[0], dtype=value.dtype)
    elif op == "Expand":
        y = np.broadcast_to(x[0], shape).copy()
    elif op == "Range":
        if abs((float(x[1]) - float(x[0])) / float(x[2])) > _FOLD_LIMIT:
            return None
        y = np.arange(x[0], x[1], x[2], dtype=x[0].dtype)
    elif op == "Gather":
        y = np.take(x[0], x[1], axis=a.get("axis", 0))
    elif op == "GatherElements":
        ax = a.get("axis", 0)
        y = np.take_along_axis(x[0], np.where(x[1] < 0, x[1] + x[0].shape[ax], x[1]), axis=ax)
    elif op == "Concat":
        y = np.concatenate(x, axis=a["axis"])
    elif op == "Unsqueeze":
        axes = a["axes"] if len(x) < 2 or x[1] is None else x[1].reshape(-1).tolist()
        y = np.expand_dims(x[0], tuple(_unsqueeze_axes(x[0].ndim, axes)))
    elif op == "Squeeze":
        axes = a.get("axes") if len(x) < 2 or x[1] is None else x[1].reshape(-1).tolist()
        y = np.squeeze(x[0], axis=tuple(int(v) for v in axes) if axes else None)  # none given: every 1
    elif op == "Reshape":
        shape = [int(v) for v in x[1].reshape(-1)]
        if not a.get("allowzero", 0):
            shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
        y = x[0].reshape(shape)
    elif op == "Cast":
        y = x[0].astype(onnx.helper.tensor_dtype_to_np_dtype(a["to"]))
    elif op == "Slice":
        if len(x) > 1:
            starts, ends = x[1].reshape(-1).tolist(), x[2].reshape(-1).tolist()
            axes = x[3].reshape(-1).tolist() if len(x) > 3 and x[3] is not None else range(len(starts))
            steps = x[4].reshape(-1).tolist() if len(x) > 4 and x[4] is not None else [1] * len(starts)
        else:
            starts, ends = a["starts"], a["ends"]
            axes, steps = a.get("axes", range(len(starts))), [1] * len(starts)
        index = [slice(None)] * x[0].ndim
        for ax, s, e, st in zip(axes, starts, ends, steps):
            s, e, st = _slice_bounds(x[0].shape[ax], int(s), int(e), int(st))
            index[ax] = slice(s, None if e < 0 else e, st)
        y = x[0][tuple(index)]
    elif op == "Identity":
        y = x[0]
    elif op == "Transpose":
        y = np.transpose(x[0], a.get("perm"))
    elif op == "Trilu":
        k = int(x[1]) if len(x) > 1 and x[1] is not None else 0
        y = np.triu(x[0], k) if a.get("upper", 1) else np.tril(x[0], k)
    elif op == "Div" and np.issubdtype(x[0].dtype, np.integer):
        # ONNX integer Div truncates toward zero; numpy's // floors.
        y = (np.abs(x[0]) // np.abs(x[1]) * np.sign(x[0]) * np.sign(x[1])).astype(x[0].dtype)
    elif op in ("Min", "Max"):
        y = functools.reduce(np.minimum if op == "Min" else np.maximum, x)
    else:
        fn = {"Equal": np.equal, "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
              "LessOrEqual": np.less_equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
              "Not": np.logical_not, "Where": np.where, "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
              "Div": np.divide, "Neg": np.negative, "Abs": np.abs}[op]
        y = fn(*x)
    y = np.array(y)
    if y.size > _FOLD_LIMIT:
        return None
    return [y]


def build_fn(model: onnx.ModelProto, device, float_dtype=None, channels_last: bool = False):
    """A ``torch.nn.Module`` whose ``forward(*inputs) -> outputs`` (torch tensors) computes the ONNX graph with
    torch ops, the initializers held as its buffers (what ``torch.compile`` expects of a model's weights).

    ``float_dtype`` (e.g. ``torch.float32``) casts the floating-point weights, and the results of Casts to a
    floating-point type, for a higher-precision reference run on upcast inputs. ``channels_last`` stores 4-D
    weights channels-last (give 4-D inputs the same memory format), the layout cuDNN and Inductor run
    convolutions fastest in.

    Raises ``Unsupported`` for an op outside ``SUPPORTED``, and for a shape-like input (a Reshape shape, Slice
    bounds, axes, ...) that is computed from the model's inputs' values rather than known when it is built.
    """
    import torch
    import torch.nn.functional as F

    check_supported(model)
    # Everything read from the ONNX protobufs is read here, once. A ``run`` that read the nodes' attributes itself
    # was traced as no graph at all by torch.compile (torch._dynamo.explain: 0 graphs): the "compiled" replay ran
    # op by op as eager did (ResNet-50 b32 on the H200: eager 4921 us, "compiled" 5095 us). Shape-like inputs
    # become Python ints here for the same reason: a tensor read back with .tolist() in ``run`` would break the
    # graph. Now it traces as one graph with no break.
    graph = model.graph
    init_names = {t.name for t in graph.initializer}
    static = {t.name: np.array(numpy_helper.to_array(t)) for t in graph.initializer}
    static.update({n.output[0]: _constant(n) for n in graph.node if n.op_type == "Constant"})
    # Static shapes of graph values, for folding Shape nodes: the inputs' (fixed in the exported models), the
    # exporter's value_info, and ONNX shape inference where a Shape node's input has neither.
    shapes = {v.name: s for v in [*graph.input, *graph.value_info, *graph.output] if (s := _dims(v)) is not None}
    if any(n.op_type in ("Shape", "Size") and n.input[0] not in static and n.input[0] not in shapes
           for n in graph.node):
        shapes.update(_inferred_shapes(model))
    in_names = [i.name for i in graph.input if i.name not in init_names]
    out_names = [o.name for o in graph.output]
    consumed = {i for n in graph.node for i in n.input} | set(out_names)

    def torch_dtype(np_dtype):
        dt = getattr(torch, np.dtype(np_dtype).name)
        return float_dtype if float_dtype is not None and dt.is_floating_point else dt

    def read_ints(op, ins, i, what):
        """A shape-like input as Python ints (None where the optional input is absent); it is then no input of the
        torch op."""
        if len(ins) <= i or not ins[i]:
            return None
        if ins[i] not in static:
            raise Unsupported(f"{op} with a computed {what} ({ins[i]!r} is not known when the graph is built)")
        value = static[ins[i]]
        ins[i] = ""
        return [int(v) for v in value.reshape(-1)]

    nodes = []
    for n in graph.node:
        op = n.op_type
        if op == "Constant":
            continue
        a = {k: v.decode() if isinstance(v, bytes) else v for k, v in _attrs(n).items()}
        ins = list(n.input)
        if op in ("Shape", "Size"):
            shape = static[ins[0]].shape if ins[0] in static else shapes.get(ins[0])
            if shape is None:
                raise Unsupported(f"{op} of {ins[0]!r}, whose shape is not known when the graph is built")
            value = shape[a.get("start", 0):a.get("end")] if op == "Shape" else int(np.prod(shape))
            static[n.output[0]] = np.array(value, dtype=np.int64)
            continue
        if op in _FOLDABLE and all(i in static for i in ins if i):
            ys = _fold(op, [static[i] if i else None for i in ins], a)
            if ys is not None:
                static.update(zip(n.output, ys))
                continue
        # Only Split's several outputs are computed; the optional extra outputs of the others (LayerNormalization's
        # mean, MaxPool's indices, ...) must be unused.
        outs = list(n.output) if op == "Split" else [n.output[0]]
        extra = [o for o in n.output[len(outs):] if o in consumed]
        if extra:
            raise Unsupported(f"{op}'s output {extra[0]!r} (only its first output is computed)")
        if op in ("Reshape", "Expand"):
            shape = read_ints(op, ins, 1, "shape")
            if shape is not None:  # Reshape's shape was an attribute before opset 5
                a["shape"] = shape
        elif op == "Slice":
            if len(ins) > 1:  # inputs from opset 10, attributes before
                starts, ends = read_ints(op, ins, 1, "starts"), read_ints(op, ins, 2, "ends")
                axes, steps = read_ints(op, ins, 3, "axes"), read_ints(op, ins, 4, "steps")
            else:
                starts, ends, axes, steps = a["starts"], a["ends"], a.get("axes"), None
            axes = list(range(len(starts))) if axes is None else axes
            steps = [1] * len(starts) if steps is None else steps
            if 0 in steps:
                raise Unsupported("Slice with step 0")
            a["slices"] = list(zip(axes, starts, ends, steps))
        elif op == "Split":
            split = read_ints(op, ins, 1, "split")
            if split is not None:  # an input from opset 13, an attribute before; absent: num_outputs or equal parts
                a["split"] = split
            a["n"] = len(outs)
        elif op in ("Squeeze", "Unsqueeze") or op in _REDUCE:
            axes = read_ints(op, ins, 1, "axes")
            if axes is not None:  # an input from opset 13 (18 for ReduceMean/Max/Min), an attribute before
                a["axes"] = axes
            if op in _REDUCE and not a.get("axes"):
                a["axes"] = None
                a["noop"] = bool(a.get("noop_with_empty_axes", 0))
        elif op == "Trilu":
            k = read_ints(op, ins, 1, "k")
            a["k"] = 0 if k is None else k[0]
        elif op == "ConstantOfShape":  # only here when too big to hold as a buffer
            a["shape"] = read_ints(op, ins, 0, "shape")
            value = a.get("value")
            value = np.array(numpy_helper.to_array(value)).reshape(-1) if value is not None else np.zeros(1, np.float32)
            a["fill"], a["dtype"] = value[0].item(), torch_dtype(value.dtype)
        elif op == "Range":  # likewise
            for i, key in enumerate(("start", "limit", "delta")):
                if ins[i] not in static:
                    raise Unsupported(f"Range with a computed {key}")
                a[key] = static[ins[i]].item()
            a["dtype"] = torch_dtype(static[ins[0]].dtype)
            ins = ["", "", ""]
        elif op == "Gather" and ins[1] in static and static[ins[1]].ndim == 0:
            # A constant scalar index selects (a view); other constant indices index from their buffer.
            a["index"] = int(static[ins[1]])
            ins[1] = ""
        elif op == "Cast":
            a["to"] = torch_dtype(onnx.helper.tensor_dtype_to_np_dtype(a["to"]))
        elif op == "CumSum":   # (RoBERTa's position ids: the cumulative count of its non-padding tokens)
            a["axis"] = read_ints(op, ins, 1, "axis")[0]
        nodes.append((op, ins, outs, a))

    # The initializers are the module's buffers, and so are the Constants and folded values the torch ops read
    # (those only the build read, such as a folded Reshape shape, are not).
    used = {i for _, ins, _, _ in nodes for i in ins if i} | set(out_names)
    inits = {}
    for name, value in static.items():
        if name not in init_names and name not in used:
            continue
        t = torch.from_numpy(np.ascontiguousarray(value)).to(device)
        if float_dtype is not None and t.is_floating_point():
            t = t.to(float_dtype)
        inits[name] = t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
    reducers = {"ReduceMean": torch.mean, "ReduceMax": torch.amax, "ReduceMin": torch.amin, "ReduceSum": torch.sum}
    # one-input elementwise ops: the torch function of each
    unary = {"Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Erf": torch.erf, "Exp": torch.exp, "Log": torch.log,
             "Sin": torch.sin, "Cos": torch.cos, "Abs": torch.abs, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid,
             "Relu": torch.relu, "IsNaN": torch.isnan, "Not": torch.logical_not, "Softplus": F.softplus,
             "Neg": torch.neg}

    def run(weights: dict, *args):
        env = dict(weights)
        env.update(zip(in_names, args))
        for op, inputs, outputs, a in nodes:
            x = [env[i] if i else None for i in inputs]
            if op in unary:
                y = unary[op](x[0])
            elif op == "Add":
                y = x[0] + x[1]
            elif op == "Sub":
                y = x[0] - x[1]
            elif op == "Mul":
                y = x[0] * x[1]
            elif op == "Div":
                # ONNX integer Div truncates toward zero; torch's / would give floats.
                y = x[0] / x[1] if x[0].is_floating_point() else torch.div(x[0], x[1], rounding_mode="trunc")
            elif op == "Pow":
                y = torch.pow(x[0], x[1])
            elif op == "LeakyRelu":
                y = F.leaky_relu(x[0], a.get("alpha", 0.01))
            elif op == "Gelu":
                y = F.gelu(x[0], approximate="tanh" if a.get("approximate", "none") == "tanh" else "none")
            elif op == "Clip":
                y = torch.clamp(x[0], x[1] if len(x) > 1 else None, x[2] if len(x) > 2 else None)
            elif op in ("Min", "Max"):
                y = functools.reduce(torch.minimum if op == "Min" else torch.maximum, x)
            elif op == "IsInf":
                pos, neg = a.get("detect_positive", 1), a.get("detect_negative", 1)
                y = (torch.isinf(x[0]) if pos and neg else torch.isposinf(x[0]) if pos
                     else torch.isneginf(x[0]) if neg else torch.zeros_like(x[0], dtype=torch.bool))
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
                k = x[1].dim() - 2  # spatial dims: Conv1d (Whisper's front end), Conv2d, Conv3d
                pads = a.get("pads", [0] * (2 * k))
                if list(pads[:k]) != list(pads[k:]):
                    raise Unsupported("asymmetric Conv padding")
                conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[k]
                y = conv(x[0], x[1], x[2] if len(x) > 2 else None, stride=tuple(a.get("strides", [1] * k)),
                         padding=tuple(pads[:k]), dilation=tuple(a.get("dilations", [1] * k)), groups=a.get("group", 1))
            elif op == "BatchNormalization":
                y = F.batch_norm(x[0], x[3], x[4], x[1], x[2], training=False, eps=a.get("epsilon", 1e-5))
            elif op == "Transpose":
                y = x[0].permute(*a["perm"]) if "perm" in a else x[0].permute(*reversed(range(x[0].dim())))
            elif op == "Reshape":
                shape = a["shape"]
                if not a.get("allowzero", 0):  # 0 copies the input's dim unless allowzero
                    shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
                y = x[0].reshape(shape)
            elif op == "Expand":
                # Bidirectional broadcast: a 1 in the shape keeps the input's dim.
                y = x[0].expand(torch.broadcast_shapes(x[0].shape, tuple(a["shape"])))
            elif op == "Flatten":   # ONNX's: always 2-D, the axes before ``axis`` and those from it (torch's
                ax = a.get("axis", 1)   # flatten keeps the leading axes instead)
                ax = ax + x[0].dim() if ax < 0 else ax
                y = x[0].reshape(math.prod(x[0].shape[:ax]), -1)
            elif op in ("Identity", "Cast"):
                y = x[0] if op == "Identity" else x[0].to(a["to"])
            elif op in _REDUCE:
                if a.get("noop"):
                    y = x[0]
                else:
                    dims = tuple(range(x[0].dim())) if a["axes"] is None else tuple(a["axes"])
                    y = reducers[op](x[0], dim=dims, keepdim=bool(a.get("keepdims", 1)))
            elif op == "MaxPool":
                pads = a.get("pads", [0, 0, 0, 0])
                y = F.max_pool2d(x[0], tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"])), tuple(pads[:2]))
            elif op == "GlobalAveragePool":
                y = torch.mean(x[0], dim=(2, 3), keepdim=True)
            elif op == "Unsqueeze":
                y = x[0]
                for ax in _unsqueeze_axes(x[0].dim(), a["axes"]):
                    y = y.unsqueeze(ax)
            elif op == "Squeeze":
                y = x[0].squeeze(tuple(a["axes"])) if a.get("axes") else x[0].squeeze()
            elif op == "Concat":
                y = torch.cat(x, dim=a["axis"])
            elif op == "Split":
                ax = a.get("axis", 0)
                # num_outputs (opset 18) or equal parts: chunks of ceil(dim / n), the last one smaller.
                sizes = a["split"] if "split" in a else -(-x[0].shape[ax] // a.get("num_outputs", a["n"]))
                y = torch.split(x[0], sizes, dim=ax)
            elif op == "Slice":
                y = x[0]
                index = [slice(None)] * y.dim()
                for ax, start, end, step in a["slices"]:
                    dim = y.shape[ax]
                    start, end, step = _slice_bounds(dim, start, end, step)
                    if step < 0:  # torch has no negative steps: the same elements, read from the flipped axis
                        y = y.flip(ax)
                        start, end, step = dim - 1 - start, dim - 1 - end, -step
                    index[ax] = slice(start, end, step)
                y = y[tuple(index)]
            elif op == "Gather":
                ax = a.get("axis", 0)
                if "index" in a:
                    y = x[0].select(ax, a["index"])
                else:  # torch's indexing wraps negative indices as Gather does
                    y = x[0][(slice(None),) * (ax % x[0].dim()) + (x[1],)]
            elif op == "GatherElements":
                ax = a.get("axis", 0)
                y = torch.gather(x[0], ax, torch.where(x[1] < 0, x[1] + x[0].shape[ax], x[1]))
            elif op == "Trilu":
                y = torch.triu(x[0], a["k"]) if a.get("upper", 1) else torch.tril(x[0], a["k"])
            elif op == "ConstantOfShape":
                y = torch.full(a["shape"], a["fill"], dtype=a["dtype"], device=device)
            elif op == "Range":
                y = torch.arange(a["start"], a["limit"], a["delta"], dtype=a["dtype"], device=device)
            elif op == "Where":
                y = torch.where(x[0], x[1], x[2])
            elif op == "CumSum":
                t = torch.flip(x[0], [a["axis"]]) if a.get("reverse", 0) else x[0]
                y = torch.cumsum(t, a["axis"], dtype=t.dtype)   # (torch would sum integers in int64)
                y = y - t if a.get("exclusive", 0) else y
                y = torch.flip(y, [a["axis"]]) if a.get("reverse", 0) else y
            elif op == "Equal":
                y = x[0] == x[1]
            elif op == "Greater":
                y = x[0] > x[1]
            elif op == "Less":
                y = x[0] < x[1]
            elif op == "GreaterOrEqual":
                y = x[0] >= x[1]
            elif op == "LessOrEqual":
                y = x[0] <= x[1]
            elif op == "And":
                y = torch.logical_and(x[0], x[1])
            elif op == "Or":
                y = torch.logical_or(x[0], x[1])
            elif op == "Xor":
                y = torch.logical_xor(x[0], x[1])
            else:  # pragma: no cover - check_supported guards this; Shape and Size are always folded
                raise Unsupported(op)
            if op == "Split":
                env.update(zip(outputs, y))
            else:
                env[outputs[0]] = y
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
