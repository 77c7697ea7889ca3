"""Load an ONNX file, validate it, and describe its inputs and outputs.

Order matters: nothing follows an external-data path before it is checked, and nothing large is read
before the memory check.

1. parse the protobuf with ``load_external_data=False`` (bytes never leave the model file);
2. check every external-data reference (``external_data.py``: inside the folder, no links, sizes fit);
3. refuse inputs larger than this machine's available memory ("input too large for this machine");
4. apply graph fix-ups (``fixups.py``) so exporter quirks validate;
5. bind static input shapes (``shapes.py``), fold the shape arithmetic they make constant (``fold.py``),
   then the onnx checker and strict shape inference
   (the full check) on a weight-free skeleton of the graph;
6. read the external data, now checked, into the protobuf.

Every failure is a :class:`~tvmfuse.errors.ModelError` with one line a user can act on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as onnx_helper

from tvmfuse.errors import ModelError
from tvmfuse.frontend.external_data import check_external_data, is_external, load_external_data, tensor_nbytes
from tvmfuse.frontend.fixups import apply_fixups, value_types
from tvmfuse.frontend.branches import fix_cache_switch, inline_known_branches
from tvmfuse.frontend.fold import fold_shape_arithmetic
from tvmfuse.frontend.precision import check_precision
from tvmfuse.frontend.precision import convert as convert_precision
from tvmfuse.frontend.shapes import bind_input_shapes
from tvmfuse.frontend.value_ranges import index_bounds

_MAX_MODEL_BYTES = 2 << 30  # protobuf's own limit; larger models need external data
_MEMORY_FACTOR = 3  # weights are held as protobuf bytes, numpy and a TVM constant while importing
_SKELETON_KEEP_ELEMS = 4096  # initializers up to this size stay in the skeleton (shape constants)
# each folding round reaches one reshape deeper (torchvision's Swin-T: 17 rounds); it stops at a round with no fold
_FOLD_ROUNDS = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    high: int | None = None   # an integer input's exclusive upper bound where the graph gives one (value_ranges.py)
    fixed: tuple | None = None  # the value, flat, an input was fixed to when compiled (branches.py)

    def to_json(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        d = d if self.high is None else {**d, "high": self.high}
        return d if self.fixed is None else {**d, "fixed": list(self.fixed)}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        high, fixed = d.get("high"), d.get("fixed")
        return cls(name=d["name"], shape=tuple(int(x) for x in d["shape"]), dtype=d["dtype"],
                   high=None if high is None else int(high), fixed=None if fixed is None else tuple(fixed))


@dataclass(frozen=True)
class LoadedModel:
    """A validated ONNX model with static input shapes.

    ``proto`` holds all weights in memory (external data read and checked) and the fix-ups applied,
    so onnxruntime and TVM see the same graph; ``fixups`` names them.
    """

    path: Path
    proto: onnx.ModelProto
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int
    fixups: tuple[str, ...] = ()
    precision: str = "model"  # what the graph was converted to (tvmfuse.frontend.precision); "model": as stored

    @property
    def name(self) -> str:
        return self.path.stem


def parse_input_shapes(items: list[str] | None) -> dict[str, tuple[int, ...]]:
    """Parse ``NAME=1x3x224x224`` items (``--input-shape``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.lower().split("x"))
            if any(d < 0 for d in shape):   # 0: a decoder's empty KV cache on its first step
                raise ValueError
        except ValueError:
            raise ModelError(f"bad --input-shape '{item}'", hint="expected NAME=D1xD2x..., e.g. input=1x3x224x224") from None
        shapes[name] = shape
    return shapes


def _dtype_name(elem_type: int, what: str) -> str:
    try:
        return str(np.dtype(onnx_helper.tensor_dtype_to_np_dtype(elem_type)))
    except Exception:  # noqa: BLE001 - unknown or non-numeric element types
        raise ModelError(f"{what} has an unsupported element type {elem_type}") from None


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by RLIMIT_AS / cgroup limits."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for cg in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(cg).read_text().strip()
            if text.isdigit():
                avail = min(avail, int(text))
        except OSError:
            pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            avail = min(avail, soft)
    except (ImportError, ValueError):
        pass
    return avail


def _too_large(what: str, nbytes: int, budget: int) -> ModelError:
    return ModelError(f"input too large for this machine: {what} needs {nbytes / 2**30:.1f} GiB, "
                      f"{budget / 2**30:.1f} GiB of memory is available")


def _read(path: Path) -> onnx.ModelProto:
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model path is not a file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"model file is empty: {path}")
    if size > _MAX_MODEL_BYTES:
        raise ModelError(f"model file is larger than 2 GiB: {path}", hint="save its weights as ONNX external data")
    budget = available_memory()
    if size * _MEMORY_FACTOR > budget:
        raise _too_large(path.name, size * _MEMORY_FACTOR, budget)
    data = path.read_bytes()
    model = onnx.ModelProto()
    try:
        # parse from bytes: onnx.load would also resolve external data paths (we check them first)
        model.ParseFromString(data)
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeError, ...
        raise ModelError(f"not a readable ONNX model (truncated or not ONNX): {path.name}: {type(err).__name__}") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"not an ONNX model (no graph): {path.name}")
    if model.ir_version < 3:
        raise ModelError(f"ONNX IR version {model.ir_version} of {path.name} is too old (3 or newer is supported)")
    return model


def _skeleton(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """The model without its large weights: they become typed graph inputs.

    The checker and shape inference serialize the whole model; the skeleton keeps that cheap, keeps
    >2 GiB models checkable, and carries no external-data reference for them to follow.
    """
    graph = model.graph
    sk = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            if hasattr(value, "extend"):
                getattr(sk, field.name).extend(value)
            elif hasattr(value, "CopyFrom"):
                getattr(sk, field.name).CopyFrom(value)
            else:
                setattr(sk, field.name, value)
    for field, value in graph.ListFields():
        if field.name == "initializer":
            continue
        if hasattr(value, "extend"):
            getattr(sk.graph, field.name).extend(value)
        else:
            setattr(sk.graph, field.name, value)
    big = [t for t in graph.initializer if is_external(t) or _numel(t) > _SKELETON_KEEP_ELEMS]
    sk.graph.initializer.extend(t for t in graph.initializer if not (is_external(t) or _numel(t) > _SKELETON_KEEP_ELEMS))
    listed = {vi.name for vi in sk.graph.input}
    for t in big:
        if t.name not in listed:
            sk.graph.input.append(onnx_helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    # external tensors left are node attributes (Constant values): read them, checked, so that neither
    # the checker nor shape inference resolves a location on its own
    load_external_data(sk, folder)
    return sk


def _numel(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= max(int(d), 0)
    return n


def _check_embedded(model: onnx.ModelProto) -> None:
    """Embedded raw data must match its declared shape (the checker does not look)."""
    for t in model.graph.initializer:
        if t.HasField("raw_data") and not is_external(t) and t.data_type != TensorProto.STRING:
            need = tensor_nbytes(t)
            if len(t.raw_data) != need:
                raise ModelError(f"initializer '{t.name}' holds {len(t.raw_data)} bytes, its shape needs {need}")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _validate(model: onnx.ModelProto, name: str, folder: Path) -> onnx.ModelProto:
    """onnx checker + strict shape inference on the skeleton; returns the inferred skeleton."""
    sk = _skeleton(model, folder)
    try:
        onnx.checker.check_model(sk, full_check=False)
    except Exception as err:  # noqa: BLE001 - ValidationError and others
        raise ModelError(f"invalid ONNX model {name}: {_first_line(err)}") from None
    try:
        return onnx.shape_inference.infer_shapes(sk, check_type=True, strict_mode=True, data_prop=True)
    except Exception as err:  # noqa: BLE001 - InferenceError and others
        raise ModelError(f"invalid ONNX model {name} (shape inference): {_first_line(err)}") from None


def _inferred(sk: onnx.ModelProto) -> onnx.ModelProto:
    """Lenient shape inference with value propagation; a graph it cannot type is judged by ``_validate``."""
    try:
        return onnx.shape_inference.infer_shapes(sk, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - InferenceError and others
        return sk


def _check_value_sizes(inferred: onnx.ModelProto, budget: int) -> None:
    """Refuse a graph whose inputs or intermediates alone would not fit in memory."""
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or not tt.elem_type:
            continue
        n = 1
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                n *= int(d.dim_value)
        try:
            itemsize = np.dtype(onnx_helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
        except Exception:  # noqa: BLE001 - non-numeric types
            continue
        if n * itemsize > budget:
            raise _too_large(f"tensor '{vi.name}'", n * itemsize, budget)


def load_model(path: str | Path, *, input_shapes: dict[str, tuple[int, ...]] | None = None,
               precision: str = "model") -> LoadedModel:
    """Read, check and describe an ONNX model.

    Parameters
    ----------
    path : the ``.onnx`` file; its external data must lie in its folder (no links)
    input_shapes : static shapes for inputs declared with dynamic dimensions
    precision : "model" (as stored), "fp32" or "fp16" (see :mod:`tvmfuse.frontend.precision`); inputs and
        outputs keep their types

    Raises
    ------
    ModelError
        for a missing, truncated, non-ONNX or invalid file, unsafe external data, a dynamic input without
        a shape, or an input too large for this machine.
    """
    path = Path(path)
    check_precision(precision)
    model = _read(path)
    try:
        return _check_and_describe(path, model, input_shapes or {}, precision)
    except UnicodeDecodeError:
        # protobuf decodes string fields lazily: a name with invalid UTF-8 surfaces on first access
        raise ModelError(f"not a valid ONNX model: {path.name} has a string field that is not UTF-8") from None


def _check_and_describe(path: Path, model: onnx.ModelProto, input_shapes: dict, precision: str) -> LoadedModel:
    folder = path.absolute().parent
    refs = check_external_data(model, folder)
    budget = available_memory()
    external = sum(r.length for r in refs)
    if (external + path.stat().st_size) * _MEMORY_FACTOR > budget:
        raise _too_large(f"{path.name} with its external data", (external + path.stat().st_size) * _MEMORY_FACTOR, budget)
    _check_embedded(model)
    fixups = apply_fixups(model, value_types(_skeleton(model, folder)))
    fixed = fix_cache_switch(model, input_shapes)
    shapes = bind_input_shapes(model, input_shapes)
    folded = inlined = 0
    for _ in range(_FOLD_ROUNDS):   # a folded value can make the next shapes static (a reshape's output)
        branches = inline_known_branches(model)
        more = fold_shape_arithmetic(model, _inferred(_skeleton(model, folder)))
        folded, inlined = folded + more, inlined + branches
        if not more and not branches:
            break
    fixups += tuple(f"input-fixed {name}={value.ravel()[0]}" for name, value in fixed.items())
    if inlined:
        fixups += (f"branches-inlined x{inlined}",)
    if folded:
        fixups += (f"shape-arithmetic-folded x{folded}",)
    inferred = _validate(model, path.name, folder)
    _check_value_sizes(inferred, budget)
    load_external_data(model, folder)
    model = convert_precision(model, precision, skeleton=lambda m: _skeleton(m, folder))

    init_names = {init.name for init in model.graph.initializer}
    bounds = index_bounds(model)
    inputs = tuple(
        TensorSpec(vi.name, shapes[vi.name], _dtype_name(vi.type.tensor_type.elem_type, f"input '{vi.name}'"),
                   bounds.get(vi.name), tuple(fixed[vi.name].ravel().tolist()) if vi.name in fixed else None)
        for vi in model.graph.input if vi.name not in init_names
    )
    inferred_out = {vi.name: vi for vi in inferred.graph.output}
    outputs = []
    for vi in model.graph.output:
        tt = inferred_out.get(vi.name, vi).type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        dtype = _dtype_name(tt.elem_type, f"output '{vi.name}'") if tt.elem_type else "float32"
        outputs.append(TensorSpec(vi.name, shape, dtype))
    return LoadedModel(path=path, proto=model, inputs=inputs, outputs=tuple(outputs), opset=_opset(model), fixups=fixups,
                       precision=precision)
