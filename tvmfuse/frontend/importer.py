"""Import a validated ONNX model into a Relax IRModule with static shapes."""
from __future__ import annotations

from tvmfuse._tvm import from_onnx, onnx_supported_ops, relax, tvm
from tvmfuse.errors import ModelError, UnsupportedOpError
from tvmfuse.frontend.loader import LoadedModel


def _check_ops(model: LoadedModel) -> None:
    supported = onnx_supported_ops()
    for i, node in enumerate(model.proto.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            raise UnsupportedOpError(op, node.name or f"#{i}", model.opset)


def import_model(model: LoadedModel) -> tvm.IRModule:
    """Import into Relax. Weights are bound as constants so later passes can fold them (BatchNorm into conv)."""
    _check_ops(model)
    shape_dict = {spec.name: list(spec.shape) for spec in model.inputs}
    dtype_dict = {spec.name: spec.dtype for spec in model.inputs}
    try:
        mod = from_onnx(model.proto, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=False)
    except Exception as err:  # noqa: BLE001 - the importer raises many types; the user needs the first line
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise ModelError(f"TVM could not import {model.path.name}: {first[:300]}") from None
    return relax.transform.DecomposeOpsForInference()(mod)
