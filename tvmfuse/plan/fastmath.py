"""Legalization with fast math: ``erf`` becomes TVM's rational approximation (``topi.fast_erf``).

``erf`` has no vector instruction anywhere: on llvm every element is a scalar libm call, which kept the
example's GELU GEMM epilogue 5x slower than its plain twin; on CUDA ``erff`` branches on the argument.
``topi.fast_erf`` clamps to [-4, 4] and evaluates two short polynomials: branch-free, vectorizable,
within a few ulp of ``erf`` in fp32 (tested against ``math.erf``). Half-precision arguments are computed
in fp32 and cast back, as the frontend's GELU already does. Both planners legalize through here, so
FuseOps and tvmfuse plans stay comparable.
"""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm


def _erf(bb, call):
    from tvm import topi

    x = call.args[0]
    dtype = str(x.ty.dtype)
    if dtype == "float32":
        return bb.call_te(topi.fast_erf, x, primfunc_name_hint="erf")
    if dtype in ("float16", "bfloat16"):
        return bb.call_te(lambda t: topi.cast(topi.fast_erf(topi.cast(t, "float32")), dtype), x,
                          primfunc_name_hint="erf")
    return tvm.ir.Op.get("relax.erf").get_attr("FLegalize")(bb, call)  # float64: the exact one


def legalize_ops():
    """Relax's LegalizeOps with tvmfuse's fast-math lowerings."""
    return relax.transform.LegalizeOps(customize_legalize_map={"relax.erf": _erf})
