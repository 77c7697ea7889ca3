"""Legalization with fast math: ``erf`` (alone or inside ``Gelu``) becomes TVM's rational approximation.

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


def _gelu(bb, call):
    """GELU (the ONNX ``Gelu`` op, erf form) as ``x * (0.5 + 0.5 * fast_erf(x / sqrt(2)))`` in fp32."""
    from tvm import te, topi

    x = call.args[0]
    dtype = str(x.ty.dtype)
    if dtype not in ("float32", "float16", "bfloat16"):
        return tvm.ir.Op.get("relax.nn.gelu").get_attr("FLegalize")(bb, call)

    def gelu(t):
        scaled = te.compute(t.shape, lambda *i: t(*i).astype("float32") * 0.7071067811865476, name="gelu_scaled")
        erf = topi.fast_erf(scaled)
        return te.compute(t.shape, lambda *i: (t(*i).astype("float32") * (0.5 + 0.5 * erf(*i))).astype(dtype),
                          name="gelu")

    return bb.call_te(gelu, x, primfunc_name_hint="gelu")


def legalize_ops():
    """Relax's LegalizeOps with tvmfuse's fast-math lowerings."""
    return relax.transform.LegalizeOps(customize_legalize_map={"relax.erf": _erf, "relax.nn.gelu": _gelu})
