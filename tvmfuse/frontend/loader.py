"""Load an ONNX file, validate it, and describe its inputs and outputs.

Every failure is a :class:`~tvmfuse.errors.ModelError` with one line a user can act on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as onnx_helper

from tvmfuse.errors import ModelError

_MAX_MODEL_BYTES = 2 << 30  # protobuf's own limit; larger models need external data


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(name=d["name"], shape=tuple(int(x) for x in d["shape"]), dtype=d["dtype"])


@dataclass(frozen=True)
class LoadedModel:
    """A validated ONNX model with static input shapes."""

    path: Path
    proto: onnx.ModelProto
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int

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
            if any(d <= 0 for d in shape):
                raise ValueError
        except ValueError:
            raise ModelError(f"bad --input-shape '{item}'", hint="expected NAME=D1xD2x..., e.g. input=1x3x224x224") from None
        shapes[name] = shape
    return shapes


def _dtype_name(elem_type: int) -> str:
    return str(np.dtype(onnx_helper.tensor_dtype_to_np_dtype(elem_type)))


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


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
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeError, ...
        raise ModelError(f"not a readable ONNX model (truncated or not ONNX): {path}: {type(err).__name__}") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"not an ONNX model (no graph): {path}")
    return model


def _io_specs(model: onnx.ModelProto, overrides: dict[str, tuple[int, ...]]) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    init_names = {init.name for init in model.graph.initializer}
    inputs = []
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"input '{vi.name}' is not a tensor; only tensor inputs are supported")
        dims = []
        for i, d in enumerate(tt.shape.dim):
            dims.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None)
        if vi.name in overrides:
            shape = overrides[vi.name]
            if len(shape) != len(dims):
                raise ModelError(f"--input-shape for '{vi.name}' has rank {len(shape)}, the model's input has rank {len(dims)}")
            for given, declared in zip(shape, dims):
                if declared is not None and declared != given:
                    raise ModelError(f"--input-shape for '{vi.name}' is {'x'.join(map(str, shape))}, "
                                     f"but the model fixes it to {'x'.join(str(x or '?') for x in dims)}")
        elif any(d is None for d in dims):
            shown = "x".join(str(d) if d is not None else "?" for d in dims)
            raise ModelError(f"input '{vi.name}' has a dynamic shape ({shown})",
                             hint=f"give it with --input-shape {vi.name}=" + "x".join(str(d or 1) for d in dims))
        else:
            shape = tuple(int(d) for d in dims)
        inputs.append(TensorSpec(vi.name, tuple(shape), _dtype_name(tt.elem_type)))
    unknown = set(overrides) - {s.name for s in inputs}
    if unknown:
        raise ModelError(f"--input-shape names no input of the model: {', '.join(sorted(unknown))}",
                         hint="inputs are " + ", ".join(s.name for s in inputs))
    outputs = []
    for vi in model.graph.output:
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        outputs.append(TensorSpec(vi.name, shape, _dtype_name(tt.elem_type) if tt.elem_type else "float32"))
    return tuple(inputs), tuple(outputs)


def load_model(path: str | Path, *, input_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedModel:
    """Read, check and describe an ONNX model.

    Parameters
    ----------
    path : the ``.onnx`` file
    input_shapes : static shapes for inputs declared with dynamic dimensions
    """
    path = Path(path)
    model = _read(path)
    try:
        onnx.checker.check_model(model, full_check=False)
    except Exception as err:  # noqa: BLE001 - onnx raises ValidationError and others
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"invalid ONNX model {path.name}: {first}") from None
    inputs, outputs = _io_specs(model, input_shapes or {})
    return LoadedModel(path=path, proto=model, inputs=inputs, outputs=outputs, opset=_opset(model))
