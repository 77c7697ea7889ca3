"""MetaSchedule's build function for tvmfuse's candidates: template kernels swapped in, tvmfuse's pass options."""
from __future__ import annotations

from tvmfuse._tvm import build_context
from tvmfuse.kernels import expand


def fast_build(mod, target, _params):
    """MetaSchedule builder function without the 42 s tensor-intrinsic import of the stock one.

    The candidate reaching the builder is already scheduled (tensorized blocks carry their bodies),
    so the intrinsic registry is not needed to compile it.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = expand(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod))  # flash attention, wgmma GEMMs
    with build_context():
        return tvm_build(mod, target=target)
