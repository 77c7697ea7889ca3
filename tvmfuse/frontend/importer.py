"""Import a validated ONNX model into a Relax IRModule with static shapes.

Before TVM sees the graph, every node (subgraphs included) is checked against the importer's converter
map for its opset, so an unsupported op is one line naming the op, the node and the opset rather than a
traceback from deep inside the converter. TVM's importer prints to stdout and warns on every renamed
input; both are captured here, and its exceptions become :class:`~tvmfuse.errors.ModelError`.
"""
from __future__ import annotations

import contextlib
import io
import re
import warnings

import onnx

from tvmfuse._tvm import from_onnx, onnx_supported_ops, relax, tvm
from tvmfuse.errors import ModelError, UnsupportedOpError
from tvmfuse.frontend.loader import LoadedModel
from tvmfuse.frontend.relax_fixups import fp32_accumulation


def _all_nodes(graph: onnx.GraphProto, where: str = ""):
    for i, node in enumerate(graph.node):
        label = node.name or f"#{i}"
        yield node, where + label
        for attr in node.attribute:
            subs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            for sub in subs:
                yield from _all_nodes(sub, f"{where}{label}/{attr.name}/")


def _check_ops(model: LoadedModel) -> None:
    supported = onnx_supported_ops()
    for node, label in _all_nodes(model.proto.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            raise UnsupportedOpError(op, label, model.opset)
        has_subgraph = any(a.HasField("g") or len(a.graphs) for a in node.attribute)
        if has_subgraph and node.op_type != "If":
            # Loop and Scan bodies: TVM 0.27's Relax importer has no converter that runs a subgraph
            raise UnsupportedOpError(node.op_type, label, model.opset)


def _failure(model: LoadedModel, err: Exception, printed: str) -> ModelError:
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    first = (lines[-1] if lines else type(err).__name__).strip()
    if type(err).__name__ not in first:
        first = f"{type(err).__name__}: {first}"
    m = re.search(r"Error converting operator (\w+)", printed)
    where = f" at a {m.group(1)} node" if m else ""
    return ModelError(f"TVM could not import {model.path.name}{where}: {first[:300]}")


def import_model(model: LoadedModel) -> tvm.IRModule:
    """Import into Relax. Weights are bound as constants so later passes can fold them (BatchNorm into conv).

    Parameters
    ----------
    model : a model from :func:`~tvmfuse.frontend.load_model` (validated, static shapes, fix-ups applied)

    Raises
    ------
    UnsupportedOpError
        for an op (or an op at this opset) TVM 0.27's importer has no converter for.
    ModelError
        when TVM's importer fails on the graph.
    """
    _check_ops(model)
    shape_dict = {spec.name: list(spec.shape) for spec in model.inputs}
    dtype_dict = {spec.name: spec.dtype for spec in model.inputs}
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")
            mod = from_onnx(model.proto, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=False)
            mod = relax.transform.DecomposeOpsForInference()(mod)
            mod, _ = fp32_accumulation(mod)  # fp16 conv/matmul accumulate in fp32, like onnxruntime
            return mod
    except (MemoryError, RecursionError) as err:
        raise ModelError(f"TVM could not import {model.path.name}: {type(err).__name__}",
                         hint="input too large for this machine") from None
    except Exception as err:  # noqa: BLE001 - the importer raises many types; the user needs one line
        raise _failure(model, err, printed.getvalue()) from None
