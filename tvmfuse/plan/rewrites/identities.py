"""Identities at inference dropped before the other rewrites look for their patterns: Dropout, and casts to the
type a tensor already has."""
from __future__ import annotations

from tvmfuse._tvm import TensorType, expr_type, relax, tvm
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, module_pass, op_name, rebuild_main


def drop_inference_identities(mod) -> tvm.IRModule:
    """Dropout is the identity at inference: ``dropout(x)`` -> ``(x, x)`` (CanonicalizeBindings removes it). A cast
    to the type its input already has is too: ViT's TorchScript export casts the probabilities from fp32 to fp32 twice
    between softmax and P·V, which hid the attention from its matcher (fp32 ViT-B ran Q·Kᵀ, softmax and P·V as three
    kernels, the scores through HBM)."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan = {}
    for b in bindings:
        if op_name(b.value) == "relax.nn.dropout":
            plan[b.var] = lambda bb, vmap, x=b.value.args[0]: relax.Tuple([vmap.get(x, x), vmap.get(x, x)])
        elif op_name(b.value) == "relax.astype" and _dtype(b.value.args[0]) == str(b.value.attrs.dtype):
            plan[b.var] = lambda bb, vmap, x=b.value.args[0]: vmap.get(x, x)
    if not plan:
        return mod
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def DropInferenceIdentities() -> tvm.transform.Pass:
    """:func:`drop_inference_identities` as a Relax module pass."""
    return module_pass("DropInferenceIdentities", drop_inference_identities)


def _dtype(expr) -> str | None:
    ty = expr_type(expr)
    return str(ty.dtype) if isinstance(ty, TensorType) else None
