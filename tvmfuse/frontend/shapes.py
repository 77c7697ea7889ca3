"""Static input shapes: ``--input-shape`` overrides and symbolic dims bound consistently across inputs.

An exporter names a dynamic dim (``batch``, ``sequence``); two inputs sharing a name must get the same
size. A dim given for one input binds that name for every other input and output that uses it.
"""
from __future__ import annotations

import re

import onnx

from tvmfuse.errors import ModelError


def _show(dims) -> str:
    # spaces around a named dim's x: "batch_size x sequence_length", not "batch_sizexsequence_length"
    sep = "x" if all(isinstance(d, int) for d in dims) else " x "
    return sep.join(str(d) if isinstance(d, int) else (d or "?") for d in dims)


_TERM = re.compile(r"\s*([+-])?\s*([A-Za-z_][\w.]*|\d+)\s*")


def _sum_of(dim: str, size) -> int | None:
    """A dim an exporter declares as a sum of names and numbers (optimum's ``past_sequence_length +
    sequence_length``), each name's size from ``size(name)``; None where it is not such a sum or a name has no
    size."""
    total, pos, terms = 0, 0, 0
    while pos < len(dim):
        m = _TERM.match(dim, pos)
        if not m or m.end() == pos:
            return None
        value = int(m.group(2)) if m.group(2).isdigit() else size(m.group(2))
        if value is None:
            return None
        total += -value if m.group(1) == "-" else value
        pos, terms = m.end(), terms + 1
    return total if terms > 1 else None


def _or(value, default):
    return default if value is None else value


def _example(dim) -> int:
    """A size for a dynamic dim in the suggested flags: 1 for each name, so a sum of names suggests their sum,
    consistent with the inputs that take the names one by one."""
    return dim if isinstance(dim, int) else max(_or(_sum_of(dim or "", lambda _: 1), 1), 1)


def _declared(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    """Dims as declared: an int, a symbol name, or None for an anonymous dynamic dim."""
    dims: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def bind_input_shapes(model: onnx.ModelProto, overrides: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Resolve every graph input to a static shape and write it into ``model`` (inputs and outputs).

    Returns ``{input name: shape}`` in graph order. Raises ModelError naming the input whose shape is
    still dynamic, an override that contradicts the model, or a symbol given two sizes.
    """
    init_names = {init.name for init in model.graph.initializer}
    graph_inputs = [vi for vi in model.graph.input if vi.name not in init_names]
    names = {vi.name for vi in graph_inputs}
    unknown = set(overrides) - names
    if unknown:
        raise ModelError(f"--input-shape names no input of the model: {', '.join(sorted(unknown))}",
                         hint="inputs are " + ", ".join(vi.name for vi in graph_inputs))
    symbols: dict[str, tuple[int, str]] = {}  # symbol -> (size, the input that bound it)

    def bind(sym: str, size: int, where: str) -> None:
        if sym in symbols and symbols[sym][0] != size:
            raise ModelError(f"dynamic dim '{sym}' is {symbols[sym][0]} for input '{symbols[sym][1]}' but {size} for input '{where}'",
                             hint="inputs sharing a named dim need the same size")
        symbols.setdefault(sym, (size, where))

    for vi in graph_inputs:
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"input '{vi.name}' is not a tensor; only tensor inputs are supported")
        if not vi.type.tensor_type.HasField("shape"):
            if vi.name not in overrides:
                raise ModelError(f"input '{vi.name}' has an unknown rank", hint=f"give its shape with --input-shape {vi.name}=D1xD2...")
            continue
        dims = _declared(vi)
        if vi.name not in overrides:
            continue
        shape = overrides[vi.name]
        if len(shape) != len(dims):
            raise ModelError(f"--input-shape for '{vi.name}' has rank {len(shape)}, the model's input has rank {len(dims)}")
        for given, declared in zip(shape, dims):
            if isinstance(declared, int) and declared != given:
                raise ModelError(f"--input-shape for '{vi.name}' is {_show(shape)}, but the model fixes it to {_show(dims)}")
            if isinstance(declared, str):
                bind(declared, given, vi.name)

    def bound(name: str) -> int | None:
        return symbols[name][0] if name in symbols else None

    for vi in graph_inputs:   # a dim declared as a sum of names agrees with the sizes the names took
        for given, declared in zip(overrides.get(vi.name, ()), _declared(vi) if vi.name in overrides else ()):
            total = _sum_of(declared, bound) if isinstance(declared, str) else None
            if total is not None and total != given:
                raise ModelError(f"--input-shape for '{vi.name}' gives {given} for '{declared}', which the other "
                                 f"inputs make {total}")

    resolved: dict[str, tuple[int, ...]] = {}
    dynamic: list[tuple[str, list, list]] = []   # (input, declared dims, dims with the bound symbols filled in)
    for vi in graph_inputs:
        if vi.name in overrides:
            resolved[vi.name] = tuple(int(d) for d in overrides[vi.name])
            continue
        dims = _declared(vi)
        filled = [symbols[d][0] if isinstance(d, str) and d in symbols else d for d in dims]
        # a sum of bound names: the attention mask of a decoder given its past and its new tokens
        filled = [_or(_sum_of(d, bound), d) if isinstance(d, str) else d for d in filled]
        if any(not isinstance(d, int) for d in filled):
            dynamic.append((vi.name, dims, filled))
            continue
        resolved[vi.name] = tuple(int(d) for d in filled)
    if dynamic:
        # every dynamic input in one line: a tokenizer's three inputs took three runs, one error each
        example = " ".join(f"--input-shape {name}=" + "x".join(str(_example(d)) for d in filled)
                           for name, _, filled in dynamic)
        if len(dynamic) == 1:
            name, dims, _ = dynamic[0]
            raise ModelError(f"input '{name}' has a dynamic shape ({_show(dims)})", hint=f"give it with {example}")
        listed = ", ".join(f"'{name}' ({_show(dims)})" for name, dims, _ in dynamic)
        raise ModelError(f"inputs {listed} have dynamic shapes",
                         hint=f"give them with {example} (inputs sharing a dim name take one size)")
    for vi in graph_inputs:
        shape_proto = vi.type.tensor_type.shape
        del shape_proto.dim[:]
        for d in resolved[vi.name]:
            shape_proto.dim.add().dim_value = d
    for vi in model.graph.output:
        if vi.type.HasField("tensor_type"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param") and d.dim_param in symbols:
                    d.dim_value = symbols[d.dim_param][0]
    return resolved
