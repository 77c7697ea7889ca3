"""Identities at inference dropped before the other rewrites look for their patterns (Dropout, for now)."""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, module_pass, op_name, rebuild_main


def drop_inference_identities(mod) -> tvm.IRModule:
    """Dropout is the identity at inference: ``dropout(x)`` -> ``(x, x)`` (CanonicalizeBindings removes it)."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan = {}
    for b in bindings:
        if op_name(b.value) == "relax.nn.dropout":
            plan[b.var] = lambda bb, vmap, x=b.value.args[0]: relax.Tuple([vmap.get(x, x), vmap.get(x, x)])
    if not plan:
        return mod
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def DropInferenceIdentities() -> tvm.transform.Pass:
    """:func:`drop_inference_identities` as a Relax module pass."""
    return module_pass("DropInferenceIdentities", drop_inference_identities)
