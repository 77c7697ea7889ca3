"""Graph rewrites applied before validation and import, where real exporters and TVM 0.27's importer disagree.

Each fix-up is a named function ``(model, types) -> count`` that rewrites ``model.graph`` in place,
keeps the model's meaning, and returns how many sites it changed; ``types`` maps a value name to its
ONNX element type as far as lenient type inference knows it. The list reads like a changelog of what
real models needed; each entry has a test in ``tests/frontend/test_fixups.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx
import onnx.numpy_helper
from onnx import TensorProto
from onnx import helper as onnx_helper


@dataclass(frozen=True)
class Fixup:
    name: str
    why: str
    apply: Callable[[onnx.ModelProto, dict[str, int]], int]


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value lenient shape inference could type (inputs, initializers, value_info)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - a broken graph is reported by the strict check later
        inferred = model
    g = inferred.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t") and node.output:
                    types[node.output[0]] = attr.t.data_type
    return types


_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


def _fresh(model: onnx.ModelProto, base: str) -> str:
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input} \
        | {i.name for i in model.graph.initializer}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def _replace_nodes(model: onnx.ModelProto, nodes: list) -> None:
    """``model``'s nodes become ``nodes`` (copies: some of them are the graph's own, cleared first)."""
    kept = [onnx.NodeProto() for _ in nodes]
    for dst, src in zip(kept, nodes):
        dst.CopyFrom(src)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _layernorm_mixed_precision(model: onnx.ModelProto, types: dict[str, int]) -> int:
    # PyTorch's fp16 exports (autocast, or a model half()-ed around an fp32 LayerNorm) emit
    # LayerNormalization with an fp32 X and fp16 Scale/B, or the reverse. ONNX requires one type T;
    # onnxruntime, the checker and TVM 0.27's converter all reject the mix. Cast Scale and B to X's type:
    # the output type follows X, which is what the exporter declared downstream.
    changed = 0
    new_nodes = []
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and node.input:
            x_type = types.get(node.input[0])
            for idx in range(1, min(3, len(node.input))):
                name = node.input[idx]
                if not name or x_type not in _FLOATS or types.get(name) not in _FLOATS - {x_type}:
                    continue
                cast_out = _fresh(model, f"{name}_as_{TensorProto.DataType.Name(x_type).lower()}")
                new_nodes.append(onnx_helper.make_node("Cast", [name], [cast_out], to=x_type,
                                                       name=_fresh(model, f"tvmfuse_cast_{cast_out}")))
                types[cast_out] = x_type
                node.input[idx] = cast_out
                changed += 1
        new_nodes.append(node)
    if changed:
        _replace_nodes(model, new_nodes)
    return changed


def _conv_integer(model: onnx.ModelProto, types: dict[str, int]) -> int:
    # onnxruntime's quantize_dynamic writes a quantized conv (a ViT's patch embedding) as ConvInteger, which TVM 0.27
    # cannot import. ConvInteger(x, w, zx, zw) is the conv of x - zx by w - zw, summed in int32: here the conv of
    # DequantizeLinear(x, 1, zx) by DequantizeLinear(w, 1, zw), cast back to int32. The planner turns such a conv
    # of dequantized 8-bit operands into an exact integer conv where the zero point is a constant
    # (plan/rewrites/int8_conv.py); in floats it is exact while the sums stay below 2^24, and the exporter casts the
    # int32 result to float next anyway.
    inits = {i.name: i for i in model.graph.initializer}
    changed, new_nodes = 0, []
    for node in model.graph.node:
        if node.op_type != "ConvInteger" or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        x, w, *zeros = list(node.input) + ["", ""]
        if zeros[1] and zeros[1] not in inits:
            new_nodes.append(node)   # a weight zero point computed at run time, of unknown shape: left to refuse
            continue
        per_channel = zeros[1] in inits and int(onnx.numpy_helper.to_array(inits[zeros[1]]).size) > 1
        parts = []
        for value, zero, kind in ((x, zeros[0], "x"), (w, zeros[1], "w")):
            dtype = types.get(value, TensorProto.UINT8 if kind == "x" else TensorProto.INT8)
            if not zero:
                zero = _fresh(model, f"{node.output[0]}_{kind}_zero")
                model.graph.initializer.append(onnx_helper.make_tensor(zero, dtype, [], [0]))
            count = int(onnx.numpy_helper.to_array(inits[zero]).size) if kind == "w" and per_channel else 1
            one = _fresh(model, f"{node.output[0]}_{kind}_unit")
            model.graph.initializer.append(onnx_helper.make_tensor(one, TensorProto.FLOAT, [count] if count > 1 else [],
                                                                   [1.0] * count))
            real = _fresh(model, f"{node.output[0]}_{kind}_real")
            parts.append(onnx_helper.make_node("DequantizeLinear", [value, one, zero], [real], axis=0,
                                               name=_fresh(model, f"tvmfuse_{real}")))
            types[real] = TensorProto.FLOAT
        conv = _fresh(model, f"{node.output[0]}_real")
        parts.append(onnx_helper.make_node("Conv", [parts[0].output[0], parts[1].output[0]], [conv],
                                           name=_fresh(model, f"tvmfuse_{conv}")))
        parts[-1].attribute.extend(node.attribute)
        parts.append(onnx_helper.make_node("Cast", [conv], [node.output[0]], to=TensorProto.INT32,
                                           name=_fresh(model, f"tvmfuse_cast_{conv}")))
        new_nodes.extend(parts)
        changed += 1
    if changed:
        _replace_nodes(model, new_nodes)
    return changed


FIXUPS: list[Fixup] = [
    # fp32 X with fp16 Scale/B (or the reverse) from PyTorch fp16 export: insert Casts to X's type
    Fixup("layernorm-mixed-precision", "LayerNormalization with mixed input/scale types", _layernorm_mixed_precision),
    # quantize_dynamic's quantized convs: the conv of the dequantized operands (scale 1), cast to int32
    Fixup("conv-integer", "ConvInteger, which TVM 0.27 does not import", _conv_integer),
]


def apply_fixups(model: onnx.ModelProto, types: dict[str, int]) -> tuple[str, ...]:
    """Apply every fix-up in order; return ``name x count`` for those that changed something."""
    done = []
    for fix in FIXUPS:
        n = fix.apply(model, types)
        if n:
            done.append(f"{fix.name} x{n}")
    return tuple(done)
