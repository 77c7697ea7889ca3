"""Numerical checks: inputs for a model, onnxruntime as the reference, relative error with dtype tolerances."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tvmfuse.errors import ModelError, TvmfuseError

# relative error = ||out - ref|| / ||ref|| must stay below this, by output dtype
TOLERANCE = {"float64": 1e-7, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def tolerance(dtype: str) -> float:
    return TOLERANCE.get(str(dtype), 0.0)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` over the finite elements; inf where the shapes differ or a non-finite element of
    either (inf, NaN: an unwritten, NaN-poisoned output, or an fp16 overflow) is not the same in the other (a plain
    norm would make an inf in ``ref`` alone an infinite denominator and the error 0: any output would pass)."""
    out64, ref64 = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if out64.shape != ref64.shape:
        return float("inf")
    finite = np.isfinite(ref64)
    if not np.array_equal(finite, np.isfinite(out64)):
        return float("inf")
    if not finite.all():
        o, r = out64[~finite], ref64[~finite]
        if not ((o == r) | (np.isnan(o) & np.isnan(r))).all():   # inf of the other sign, inf against NaN
            return float("inf")
        out64, ref64 = out64[finite], ref64[finite]
    denom = np.linalg.norm(ref64)
    diff = np.linalg.norm(out64 - ref64)
    return float(diff / denom) if denom > 0 else float(diff)


def padding_mask(shape) -> np.ndarray:
    """A tokenizer's attention mask: ones, with the last quarter of the last sequence's positions padding (0)."""
    mask = np.ones(shape, dtype=np.int64)
    if len(shape) >= 2 and shape[0] > 1 and shape[-1] >= 4:
        mask[-1, ..., shape[-1] - shape[-1] // 4:] = 0
    return mask


def _field(spec, key: str):
    """A spec's field, from a TensorSpec or its manifest JSON (a dict)."""
    return spec.get(key) if isinstance(spec, dict) else getattr(spec, key, None)


def random_inputs(specs, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs the model accepts, by each spec's shape and dtype: standard-normal floats; integers in
    ``[0, high)`` where the spec bounds them (the rows of the table they index), else in ``[0, 4)``; an integer or
    boolean input named like a mask (``attention_mask``) is :func:`padding_mask`."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in specs:
        name, shape, dtype, high, fixed = (_field(s, k) for k in ("name", "shape", "dtype", "high", "fixed"))
        if fixed is not None:   # the value the input was compiled for (optimum's use_cache_branch)
            out[name] = np.array(fixed, dtype=dtype).reshape(shape)
        elif np.issubdtype(np.dtype(dtype), np.floating):
            out[name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in name.lower():
            out[name] = padding_mask(shape).astype(dtype)
        elif dtype == "bool":
            out[name] = rng.random(shape) > 0.5
        else:
            out[name] = rng.integers(0, high or 4, size=shape).astype(dtype)
    return out


def load_inputs(path: str | Path, specs) -> dict[str, np.ndarray]:
    """Inputs from an ``.npz`` whose keys are the model's input names."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise TvmfuseError(f"inputs file not found: {path}") from None
    except Exception as err:  # noqa: BLE001 - zipfile/pickle/ValueError
        raise TvmfuseError(f"not a readable .npz file: {path}: {type(err).__name__}") from None
    names = [_field(s, "name") for s in specs]
    missing = [n for n in names if n not in data]
    if missing:
        raise TvmfuseError(f"{path.name} lacks input(s) {', '.join(missing)}", hint="its keys are " + ", ".join(sorted(data)))
    for s in specs:
        name, fixed = _field(s, "name"), _field(s, "fixed")
        given = None if fixed is None else np.asarray(data[name]).ravel().tolist()
        if given is not None and given != list(fixed):
            raise TvmfuseError(f"{path.name}: input '{name}' is {given}, but the model was compiled for {list(fixed)}",
                               hint="compile it again with the shapes of this step (the KV cache's length decides it)")
    return {n: data[n] for n in names}


def run_onnxruntime(model_path: str | Path, inputs: dict[str, np.ndarray], *, fused: bool = False) -> list[np.ndarray]:
    """onnxruntime's run of ``model_path`` on the CPU: the reference, with its basic graph rewrites only (constant
    folding, dead nodes), which keep the graph's semantics; ``fused``: all of them, as onnxruntime deploys it (its
    extended fusions move a dynamically quantized BERT-base's output 1.8e-2: MatMulIntegerToFloat)."""
    import onnxruntime as ort

    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if not fused:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        sess = ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])
        return [np.asarray(x) for x in sess.run(None, inputs)]
    except Exception as err:  # noqa: BLE001
        raise ModelError(f"onnxruntime could not run {Path(model_path).name}: {str(err).splitlines()[0][:300]}") from None


# integer quantization: a value's rounding to its int8 / uint8 grid follows the last bit of the float computed
# before it, so two faithful implementations drift apart by whole quanta, layer after layer. One pair of them is
# one sample of that drift: a QDQ ResNet-18 (random weights) computed with exact integer convs lands 1.45e-2 from
# both onnxruntime runs, which are 0.96e-2 apart (its first conv: 2 of 802816 values a quantum off, the twentieth:
# half of them); BERT-base 1.05x. A wrong zero point, scale or padding is off by the order of the values.
QUANTIZED_OPS = frozenset({"DynamicQuantizeLinear", "QuantizeLinear", "MatMulInteger", "ConvInteger",
                           "QLinearMatMul", "QLinearConv"})
QUANTIZED_SLACK = 2.0


def is_quantized(model) -> bool:
    """Whether an ONNX model (proto) rounds values to an integer grid on the way (onnxruntime's quantize_dynamic
    and QDQ exports)."""
    return any(n.op_type in QUANTIZED_OPS for n in model.graph.node)


def degenerate_scales(model) -> list[str]:
    """The QuantizeLinear / DequantizeLinear scales of an ONNX model (proto) that are constants and not a finite
    positive number below 1e30: quantize_static calibrates a tensor holding a mask's -3.4e38 (GPT-Neo's causal scores) to a
    scale of 1e36 or inf, and dequantizing through it gives inf and NaN (0 * inf), in onnxruntime's run too. A
    check against such a reference says nothing of the build; the report names these scales."""
    from onnx import numpy_helper

    consts = {i.name: i for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 1 \
                and node.input[1] in consts and node.input[1] not in found:
            scale = numpy_helper.to_array(consts[node.input[1]]).astype(np.float64)
            if not np.all(np.isfinite(scale) & (scale > 0) & (scale < 1e30)):
                found.append(node.input[1])
    return found


def quantization_floor(model_path: str | Path, inputs: dict[str, np.ndarray], refs: list[np.ndarray]) -> float:
    """How far two faithful runs of ``model_path``'s rounding drift apart, which a quantized model's check allows
    (``QUANTIZED_SLACK`` times it): the larger of onnxruntime's fully optimised run's distance from the reference
    run (its basic rewrites only) and the reference run's on float inputs moved by 1e-6 of themselves (a few ulps:
    what another order of the same fp32 operations moves a value by). A dynamically quantized BERT-base with random
    weights drifts 1.8e-2 (a two-layer one 1e-7); a dynamically quantized DeiT-base's two onnxruntime runs are
    3.5e-3 apart, but its output moves 2.2e-2 when its image moves by 1e-6."""
    runs = [run_onnxruntime(model_path, inputs, fused=True)]
    floats = {k for k, v in inputs.items() if np.issubdtype(v.dtype, np.floating)}
    if floats:   # (token ids and masks only: no input to move)
        rng = np.random.default_rng(0)
        runs.append(run_onnxruntime(model_path, {k: (v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(v.dtype)
                                                 if k in floats else v for k, v in inputs.items()}))
    return max(relative_error(a, b) for outs in runs for a, b in zip(outs, refs))


def tf32_rounded(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` rounded to TF32's 10-bit mantissa, to nearest with ties away from zero (PTX's
    ``cvt.rna.tf32.f32``, what a TF32 kernel applies to the operands it reads; infinities and NaNs kept)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits).astype(np.uint32).view(np.float32)


# A TF32 build's products round their operands to a 10-bit mantissa, layer after layer: a deep fp32 model's output
# moves by about that fp16-like error (MobileNetV2 at batch 32: 8.7e-3 under torch's own TF32, 1.03e-2 under
# torch.compile's), which says nothing of a kernel. Its check allows TF32_SLACK times the error of the same graph
# computed with TF32 operands (:func:`tf32_floor`), where that is above the tolerance.
TF32_SLACK = 1.5
# the ops a TF32 build computes on the tensor cores (a Conv of one group: depthwise convs stay fp32)
_TF32_OPS = ("MatMul", "Gemm", "Conv")
_VELTKAMP = 8193.0   # 2^13 + 1: c = x * 8193, x rounded to 11 significant bits (TF32's) is c - (c - x)


def tf32_emulated(model):
    """A copy of the fp32 ONNX model (proto) whose MatMul, Gemm and one-group Conv read their two operands rounded to
    TF32: constants rounded here (``cvt.rna``, :func:`tf32_rounded`), the others by three
    inserted nodes (Veltkamp's split: ``c - (c - x)`` for ``c = x * 8193``, fp32 round to nearest). Operands whose
    type shape inference does not give as fp32 are left as they are."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an op shape inference does not know: no type for its outputs
        typed = model
    g = typed.graph
    floats = {v.name for v in [*g.input, *g.value_info, *g.output]
              if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    inits = {i.name: i for i in model.graph.initializer}
    floats |= {n for n, i in inits.items() if i.data_type == onnx.TensorProto.FLOAT}
    scale = numpy_helper.from_array(np.array(_VELTKAMP, np.float32), "tvmfuse_tf32_split")
    nodes, rounded, extra = [], {}, []
    for node in model.graph.node:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type in _TF32_OPS and (node.op_type != "Conv" or group == 1):
            for slot, name in enumerate(node.input[:2]):
                if name not in floats:
                    continue
                if name not in rounded:
                    out = f"{name}__tf32"
                    if name in inits:
                        arr = tf32_rounded(numpy_helper.to_array(inits[name]))
                        extra.append(numpy_helper.from_array(arr, out))
                    else:
                        c, d = f"{name}__tf32c", f"{name}__tf32d"
                        nodes += [helper.make_node("Mul", [name, scale.name], [c]),
                                  helper.make_node("Sub", [c, name], [d]), helper.make_node("Sub", [c, d], [out])]
                    rounded[name] = out
                node.input[slot] = rounded[name]
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend([scale, *extra])
    return model


def tf32_floor(model, inputs: dict[str, np.ndarray], refs: list[np.ndarray]) -> float:
    """How far the fp32 model (proto) computed with TF32 operands (:func:`tf32_emulated`, onnxruntime) lands from
    its fp32 reference run ``refs``: the error TF32 arithmetic alone gives this model on these inputs."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="tvmfuse_tf32_") as tmp:
        path = Path(tmp) / "tf32.onnx"
        try:
            emulated = tf32_emulated(model)
            large = emulated.ByteSize() > (1 << 30)   # (protobuf's 2 GB limit: the weights beside it)
            onnx.save(emulated, path, save_as_external_data=large, location="weights.bin" if large else None)
        except Exception as err:  # noqa: BLE001 - protobuf's size limits, an unsaveable graph: said in one line
            raise ModelError(f"cannot build the TF32 reference: {str(err).splitlines()[0][:200]}") from None
        runs = run_onnxruntime(path, inputs)
    return max(relative_error(a, b) for a, b in zip(runs, refs))


@dataclass(frozen=True)
class OutputCheck:
    name: str
    dtype: str
    rel_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.tolerance

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "rel_error": self.rel_error, "tolerance": self.tolerance, "ok": self.ok}


def compare(outputs: list[np.ndarray], references: list[np.ndarray], names: list[str], *,
            min_tolerance: float = 0.0) -> list[OutputCheck]:
    """Each output against its reference at its dtype's tolerance, or ``min_tolerance`` where that is looser (a
    model compiled in a lower precision than it is stored in: ``--precision fp16`` on an fp32 model)."""
    if len(outputs) != len(references):
        raise TvmfuseError(f"the build returned {len(outputs)} outputs, the reference {len(references)}")
    return [OutputCheck(n, str(r.dtype), relative_error(o, r), max(tolerance(str(r.dtype)), min_tolerance))
            for n, o, r in zip(names, outputs, references)]
