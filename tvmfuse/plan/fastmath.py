"""Legalization with fast math: ``erf`` (alone or inside ``Gelu``) becomes TVM's rational approximation;
half-precision ``sigmoid`` and ``silu`` are computed in fp32 through ``exp2``, half-precision division in fp32.

``erf`` has no vector instruction anywhere: on llvm every element is a scalar libm call, which kept the
example's GELU GEMM epilogue 5x slower than its plain twin; on CUDA ``erff`` branches on the argument.
``topi.fast_erf`` clamps to [-4, 4] and evaluates two short polynomials: branch-free, vectorizable,
within a few ulp of ``erf`` in fp32 (tested against ``math.erf``). Half-precision arguments are computed
in fp32 and cast back, as the frontend's GELU already does. Both planners legalize through here, so
FuseOps and tvmfuse plans stay comparable.

fp16/bf16 ``sigmoid`` (TVM: ``1 / (1 + exp(-x))`` in the half type) becomes ``1 / (1 + 2^(-x log2 e))`` in fp32,
cast back. On CUDA the half version costs cuda_fp16's ``hexp`` (an ``ex2`` plus four compares and four fmas
correcting special values, in its PTX) and a half division (a float reciprocal refined by fmas) per element:
SwiGLU's kernel at 16384x8192 ran at 94% of the copy ceiling, behind torch.compile, and at 102% (185 us, ahead)
with this lowering (the H200). In fp32, ``exp2`` is one ``ex2.approx`` (2 ulp) and the result is
rounded once, to the half type: within an ulp of it.

``power`` is legalized for TVM's CUDA builds, which nvcc compiles with ``--use_fast_math``: ``powf`` becomes
``__powf`` (``exp2(y * log2(x))``), NaN for every negative base, so GPT-2's tanh-GELU (``pow(x, 3)``) turned half
its activations into NaN on the GPU. A constant integer exponent (|n| <= 8) becomes multiplications (exact, and
cheaper everywhere), 0.5 a square root; any other exponent is computed on ``|x|`` with the sign and NaN of a
negative base restored (odd integer exponents negative, fractional ones NaN) and ``x ** 0 = 1``.
"""
from __future__ import annotations

from tvmfuse._tvm import relax, tirx, tvm


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


_HALF = ("float16", "bfloat16")
_LOG2E = 1.4426950408889634


def _sigmoid32(v):
    """sigmoid of a float32 TIR value through exp2."""
    one = tirx.const(1.0, "float32")
    return one / (one + tirx.exp2(v * tirx.const(-_LOG2E, "float32")))


def _half_activation(op: str, name: str, fn):
    """A legalization of ``op`` that computes ``fn`` (float32 TIR value -> float32) in fp32 for half types and
    falls back to TVM's own lowering for the others."""
    from tvm import te

    def legalize(bb, call):
        x = call.args[0]
        dtype = str(x.ty.dtype)
        if dtype not in _HALF:
            return tvm.ir.Op.get(op).get_attr("FLegalize")(bb, call)
        return bb.call_te(lambda t: te.compute(t.shape, lambda *i: fn(t(*i).astype("float32")).astype(dtype),
                                               name="compute"), x, primfunc_name_hint=name)

    return legalize


def _const_scalar(expr):
    """A scalar (or one-element) Relax constant's float value, else None."""
    if type(expr).__name__ not in ("Constant", "GenericConst"):
        return None
    from tvmfuse._tvm import const_numpy

    value = const_numpy(expr)
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _int_power(v, n: int, dtype: str):
    """``v ** n`` by squaring, for a small integer ``n``."""
    one = tirx.const(1.0, dtype)
    if n == 0:
        return one
    result, base, k = None, v, abs(n)
    while k:
        if k & 1:
            result = base if result is None else result * base
        k >>= 1
        if k:
            base = base * base
    return one / result if n < 0 else result


def _robust_pow(x, y, dtype: str):
    """``x ** y`` that does not depend on the base's sign reaching ``powf``: computed on ``|x|``, negated for a
    negative base and an odd integer exponent, NaN for a negative base and a fractional exponent."""
    zero, one = tirx.const(0.0, dtype), tirx.const(1.0, dtype)
    mag = tirx.pow(tirx.abs(x), y)
    integral = tirx.floor(y) == y
    odd = tirx.floor(y * tirx.const(0.5, dtype)) * tirx.const(2.0, dtype) != y
    neg = tirx.Select(integral, tirx.Select(odd, -mag, mag), tirx.const(float("nan"), dtype))
    return tirx.Select(y == zero, one, tirx.Select(x < zero, neg, mag))


def _power(bb, call):
    from tvm import te

    x, y = call.args
    dtype = str(x.ty.dtype)
    if dtype not in ("float32", "float16", "bfloat16", "float64"):
        return tvm.ir.Op.get("relax.power").get_attr("FLegalize")(bb, call)
    work = "float64" if dtype == "float64" else "float32"
    exponent = _const_scalar(y)
    if exponent is not None and exponent == int(exponent) and abs(exponent) <= 8:
        n = int(exponent)
        return bb.call_te(lambda t: te.compute(t.shape, lambda *i: _int_power(t(*i).astype(work), n, work)
                                               .astype(dtype), name="T_power"), x, primfunc_name_hint="power")
    if exponent == 0.5:
        return bb.call_te(lambda t: te.compute(t.shape, lambda *i: tirx.sqrt(t(*i).astype(work)).astype(dtype),
                                               name="T_power"), x, primfunc_name_hint="power")

    xs, ys = (tuple(x.ty.shape), tuple(y.ty.shape)) if hasattr(y.ty, "shape") else ((), ())
    if not all(isinstance(d, tvm.tirx.IntImm) for d in xs + ys):
        return tvm.ir.Op.get("relax.power").get_attr("FLegalize")(bb, call)  # symbolic shapes: TVM's own
    xs, ys = [int(d) for d in xs], [int(d) for d in ys]
    rank = max(len(xs), len(ys))
    shape = [max(([1] * (rank - len(xs)) + xs)[d], ([1] * (rank - len(ys)) + ys)[d]) for d in range(rank)]

    def robust(a, b):
        def at(t, dims, i):  # numpy broadcasting: right-aligned, size-1 axes read at 0
            return t(*[i[rank - len(dims) + d] if dims[d] != 1 else 0 for d in range(len(dims))])

        return te.compute(shape, lambda *i: _robust_pow(at(a, xs, i).astype(work), at(b, ys, i).astype(work), work)
                          .astype(dtype), name="T_power")

    return bb.call_te(robust, x, y, primfunc_name_hint="power")


def _cpu_fp32(op: str, name: str, build):
    """A legalization of ``op`` for llvm targets: ``build`` (a TE function of the input and the call's attrs) for
    fp32 inputs, TVM's own lowering (or tvmfuse's half one) for the rest."""
    fallback = _LEGAL.get(op) or tvm.ir.Op.get(op).get_attr("FLegalize")

    def legalize(bb, call):
        x = call.args[0]
        if str(x.ty.dtype) != "float32" or x.ty.shape is None:
            return fallback(bb, call)
        return bb.call_te(lambda t: build(t, call.attrs), x, primfunc_name_hint=name)

    return legalize


def _row_softmax(t, axis: int, log: bool):
    """softmax (or log-softmax) of ``t`` along ``axis``: the row max, ``fast_exp`` of the shifted row, its sum,
    the quotient (log: the shifted row less the sum's log)."""
    from tvm import te, topi

    nd = len(t.shape)
    ax = axis % nd
    row = lambda i: (*i[:ax], *i[ax + 1:])  # noqa: E731 - the row index of an element
    kmax = te.reduce_axis((0, t.shape[ax]), "k")
    mx = te.compute(t.shape[:ax] + t.shape[ax + 1:], lambda *i: te.max(t(*i[:ax], kmax, *i[ax:]), axis=kmax),
                    name="T_softmax_maxelem")
    shifted = te.compute(t.shape, lambda *i: t(*i) - mx(*row(i)), name="T_softmax_shifted")
    ex = topi.fast_exp(shifted)
    ksum = te.reduce_axis((0, t.shape[ax]), "k")
    total = te.compute(mx.shape, lambda *i: te.sum(ex(*i[:ax], ksum, *i[ax:]), axis=ksum), name="T_softmax_expsum")
    if log:
        return te.compute(t.shape, lambda *i: shifted(*i) - tirx.log(total(*row(i))), name="T_log_softmax_norm")
    return te.compute(t.shape, lambda *i: ex(*i) / total(*row(i)), name="T_softmax_norm")


def _sigmoid_fast(t, _attrs):
    from tvm import te, topi

    ex = topi.fast_exp(te.compute(t.shape, lambda *i: -t(*i), name="T_negative"))
    return te.compute(t.shape, lambda *i: tirx.const(1.0, "float32") / (tirx.const(1.0, "float32") + ex(*i)),
                      name="T_sigmoid")


def _silu_fast(t, _attrs):
    from tvm import te

    sig = _sigmoid_fast(t, _attrs)
    return te.compute(t.shape, lambda *i: t(*i) * sig(*i), name="T_silu")


def _cpu_lowerings() -> dict:
    """fp32 ``exp``, ``tanh``, ``sigmoid``, ``silu``, softmax and log-softmax on llvm, branch-free and vectorisable.

    LLVM has no vector ``exp`` or ``tanh`` here (no vector math library): a vectorised loop calls libm's ``expf``
    once per lane, which kept GPT-2's attention softmax at 377 us a call on the CPU, 40% of the model's kernel time.
    ``topi.fast_exp`` (a degree-5 polynomial times 2^n, clamped to +-88.38) is within 4.1e-6 relative of
    ``exp`` over [-87, 88] and keeps inf, 0 (at -inf) and NaN; ``topi.fast_tanh`` (a rational function, clamped to
    +-9) within 2.9e-7 (both measured against numpy's float64). Softmax computes ``exp`` of the row less its max,
    so arguments are at most 0. fp32 only: the tolerance of half types is coarser than what they save, and CUDA
    builds already run ``__expf`` (nvcc's fast math)."""
    from tvm import topi

    return {
        "relax.exp": _cpu_fp32("relax.exp", "exp", lambda t, _a: topi.fast_exp(t)),
        "relax.tanh": _cpu_fp32("relax.tanh", "tanh", lambda t, _a: topi.fast_tanh(t)),
        "relax.sigmoid": _cpu_fp32("relax.sigmoid", "sigmoid", _sigmoid_fast),
        "relax.nn.silu": _cpu_fp32("relax.nn.silu", "silu", _silu_fast),
        "relax.nn.softmax": _cpu_fp32("relax.nn.softmax", "softmax",
                                      lambda t, a: _row_softmax(t, int(a.axis), log=False)),
        "relax.nn.log_softmax": _cpu_fp32("relax.nn.log_softmax", "log_softmax",
                                          lambda t, a: _row_softmax(t, int(a.axis), log=True)),
    }


def _divide(bb, call):
    """Half-precision division computed in fp32 and rounded once to the half type. Rounded exactly, that is the
    half quotient itself (fp32's 24 bits are at least twice a half type's 11, plus 2); under nvcc's fast math (TVM's
    CUDA builds) fp32 division is within 2 ulp, so it may differ by an ulp of the half type next to a rounding
    boundary. CUDA's half division is inline assembly (a float reciprocal refined by fmas and compares), which nvcc
    neither merges nor moves: an fp16 erf-GELU divides by sqrt(2) once, but erf's polynomial reads the quotient 21
    times and a fused kernel inlines it at each read. A pointwise fp16 GELU compiled to 744 SASS instructions for
    four elements a thread with half division, 128 with this (nvcc 13.0, --use_fast_math, sm_90a)."""
    from tvm import topi

    x, y = call.args
    dtype = str(x.ty.dtype)
    if dtype not in _HALF or str(y.ty.dtype) != dtype:
        return tvm.ir.Op.get("relax.divide").get_attr("FLegalize")(bb, call)
    return bb.call_te(lambda a, b: topi.cast(topi.divide(topi.cast(a, "float32"), topi.cast(b, "float32")), dtype),
                      x, y, primfunc_name_hint="divide")


_LEGAL = {
    "relax.erf": _erf, "relax.nn.gelu": _gelu, "relax.power": _power, "relax.divide": _divide,
    "relax.sigmoid": _half_activation("relax.sigmoid", "sigmoid", _sigmoid32),
    "relax.nn.silu": _half_activation("relax.nn.silu", "silu", lambda v: v * _sigmoid32(v)),
}


def legalize_ops(cpu: bool = False):
    """Relax's LegalizeOps with tvmfuse's fast-math lowerings; ``cpu``: also the llvm ones (``_cpu_lowerings``)."""
    return relax.transform.LegalizeOps(customize_legalize_map={**_LEGAL, **(_cpu_lowerings() if cpu else {})})
