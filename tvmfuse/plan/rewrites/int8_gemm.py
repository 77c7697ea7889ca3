"""Quantized GEMMs on their 8-bit operands: ``(a - za) @ w`` as ``a @ w - za * colsum(w)``.

TVM imports ONNX's ``MatMulInteger`` (onnxruntime's ``quantize_dynamic``: uint8 activations with a zero point,
int8 weights) as an int32 matmul of ``astype(a, int32) - za`` by ``astype(w, int32) - zw``: the kernel reads 4-byte
activations and multiplies 32-bit integers, no faster than an fp32 GEMM. With the zero point moved out (the weight's
column sums are constants, computed here once) the matmul reads the uint8 and int8 tensors themselves, the form
x86's VNNI dot product (``vpdpbusd``: 64 uint8 x int8 products a vector instruction) computes
(:mod:`tvmfuse.kernels.cpu.int8`). Only weights with a zero point of 0 (onnxruntime's symmetric int8 default) are
rewritten; the result is the same integers. QDQ's int8 activations (quantize_static's default) are shifted to
uint8 first: ``a + 128`` with zero point ``za + 128``.
"""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import main_bindings, module_pass, op_name, replaced
from tvmfuse.plan.tags import RewriteLog


def _dtype(expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def _widened(expr, values: dict, dtype: str):
    """The ``dtype`` tensor ``expr`` widens to int32 (``astype(x, int32)``), or None."""
    call = values.get(expr, expr)
    if op_name(call) == "relax.astype" and _dtype(call.args[0]) == dtype:
        return call.args[0]
    return None


def _operands(call, values: dict):
    """``(a_u8, za, w_i8, None)`` of ``matmul(astype(a) - astype(za), astype(w) - 0)`` (MatMulInteger), or None."""
    if op_name(call) != "relax.matmul" or _dtype(call) != "int32":
        return None
    lhs, rhs = (values.get(a, a) for a in call.args[:2])
    if op_name(lhs) != "relax.subtract":
        return None
    a, za = _widened(lhs.args[0], values, "uint8"), _widened(lhs.args[1], values, "uint8")
    w = _int8_weight(rhs, values)
    if a is None or za is None or w is None or w.ndim != 2:
        return None
    return a, za, w, None


def _int8_weight(expr, values: dict) -> np.ndarray | None:
    """The int8 weight of ``astype(w_i8, int32) - 0``, or of an int32 constant (the importer folds that) whose
    values are int8's."""
    if op_name(expr) == "relax.subtract":
        zero = values.get(expr.args[1], expr.args[1])
        zero = zero.args[0] if op_name(zero) == "relax.astype" else zero
        if not isinstance(zero, RelaxConstant) or np.any(const_numpy(zero)):
            return None
        expr = values.get(expr.args[0], expr.args[0])
    if op_name(expr) == "relax.astype":
        expr = expr.args[0]
    if not isinstance(expr, RelaxConstant) or _dtype(expr) not in ("int8", "int32"):
        return None
    w = const_numpy(expr)
    if w.dtype != np.int8 and (w.min() < -128 or w.max() > 127):
        return None
    return w.astype(np.int8)


def _scalar(expr, values: dict) -> np.ndarray | None:
    expr = values.get(expr, expr)
    return const_numpy(expr) if isinstance(expr, RelaxConstant) else None


def as_unsigned(bb, x):
    """The int8 tensor ``x`` plus 128, as uint8: vpdpbusd multiplies unsigned by signed bytes, and (x + 128) - (z +
    128) is x - z (the add fuses into the kernel that quantizes x)."""
    return bb.emit(relax.op.astype(relax.op.add(relax.op.astype(x, "int32"), relax.const(128, "int32")), "uint8"))


def dequantized_operands(call, values: dict):
    """``(a, sa, za, rhs, w, sw)`` of an op over ``dequantize(a, sa, za)`` (a uint8 or int8, one scale) and ``rhs``
    = ``dequantize(w, sw, 0)`` (an int8 constant, symmetric), or None; ``sa`` and ``sw`` as numpy."""
    lhs, rhs = (values.get(a, a) for a in call.args[:2])
    if op_name(lhs) != "relax.dequantize" or op_name(rhs) != "relax.dequantize":
        return None
    a, sa, za = lhs.args
    w, sw, zw = (values.get(x, x) for x in rhs.args)
    sa, zw, sw = _scalar(sa, values), _scalar(zw, values), _scalar(sw, values)
    if _dtype(a) not in ("uint8", "int8") or sa is None or sa.size != 1 or zw is None or np.any(zw) \
            or not isinstance(w, RelaxConstant) or _dtype(w) != "int8" or sw is None:
        return None
    return a, sa, za, rhs, w, sw


def _qdq_operands(call, values: dict):
    """``(a, za, w_i8, scale)`` of ``matmul(dequantize(a, sa, za), dequantize(w_i8, sw, 0))`` (a QDQ model's GEMM:
    onnxruntime's quantize_static), ``a`` uint8 or int8 (quantize_static's default), ``scale`` the product of the
    two scales (per column where ``sw`` is), or None."""
    if op_name(call) != "relax.matmul" or _dtype(call) != "float32":
        return None
    found = dequantized_operands(call, values)
    if found is None or len(found[4].ty.shape) != 2:
        return None
    a, sa, za, rhs, w, sw = found
    n = int(w.ty.shape[1])
    if sw.size != 1 and (sw.size != n or int(rhs.attrs.axis) not in (1, -1)):
        return None
    za_shape = tensor_shape(values.get(za, za).ty)
    if za_shape is None or int(np.prod(za_shape, dtype=np.int64)) != 1:
        return None
    return a, za, const_numpy(w), (sa.reshape(()) * sw.reshape(-1 if sw.size > 1 else ())).astype(np.float32)


def int8_gemms(mod, *, log: RewriteLog):
    """Every quantized GEMM, MatMulInteger's int32 matmul or QDQ's fp32 matmul of dequantized operands (uint8
    activations with a zero point, or QDQ's int8 ones shifted to uint8; int8 constant weights), on its 8-bit
    operands, the zero point's share subtracted after (and QDQ's scales multiplied)."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    values = {b.var: b.value for b in bindings}
    plan, shifted = {}, 0
    for b in bindings:
        found = _operands(b.value, values) or _qdq_operands(b.value, values)
        if found is None:
            continue
        a, za, w, scale = found
        shifted += _dtype(a) == "int8"
        colsum = w.astype(np.int32).sum(axis=0)

        def emit(bb, vmap, a=a, za=za, w=w, colsum=colsum, scale=scale):
            a, za = vmap.get(a, a), relax.op.astype(vmap.get(za, za), "int32")
            if _dtype(a) == "int8":
                a = as_unsigned(bb, a)
                za = relax.op.add(za, relax.const(128, "int32"))
            prod = bb.emit(relax.op.matmul(a, relax.const(w), out_dtype="int32"))
            shift = bb.emit(relax.op.multiply(za, relax.const(colsum)))
            exact = relax.op.subtract(prod, shift)
            if scale is None:
                return exact
            # the QDQ GEMM's float result: the integer sum times both scales
            return relax.op.multiply(relax.op.astype(bb.emit(exact), "float32"), relax.const(scale))

        plan[b.var] = emit
    return replaced(mod, plan, log, f"{len(plan)} quantized GEMMs read their uint8 activations and int8 weights (the "
                    "activation's zero point times the weights' column sums subtracted after"
                    + (f"; {shifted} int8 activations shifted to uint8" if shifted else "") + ")")


def Int8Gemms(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`int8_gemms` as a Relax module pass."""
    return module_pass("Int8Gemms", lambda mod: int8_gemms(mod, log=log))
