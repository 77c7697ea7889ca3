"""Quantized GEMMs on their 8-bit operands: ``(a - za) @ w`` as ``a @ w - za * colsum(w)``.

TVM imports ONNX's ``MatMulInteger`` (onnxruntime's ``quantize_dynamic``: uint8 activations with a zero point,
int8 weights) as an int32 matmul of ``astype(a, int32) - za`` by ``astype(w, int32) - zw``: the kernel reads 4-byte
activations and multiplies 32-bit integers, no faster than an fp32 GEMM. With the zero point moved out (the weight's
column sums are constants, computed here once) the matmul reads the uint8 and int8 tensors themselves, the form
x86's VNNI dot product (``vpdpbusd``: 64 uint8 x int8 products a vector instruction) computes
(:mod:`tvmfuse.kernels.cpu.int8`). Only weights with a zero point of 0 (onnxruntime's symmetric int8 default) are
rewritten; the result is the same integers.
"""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, module_pass, op_name, rebuild_main
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
    """``(a_u8, za, w_i8)`` of ``matmul(astype(a) - astype(za), astype(w) - 0)``, or None."""
    if op_name(call) != "relax.matmul" or _dtype(call) != "int32":
        return None
    lhs, rhs = (values.get(a, a) for a in call.args[:2])
    if op_name(lhs) != "relax.subtract":
        return None
    a, za = _widened(lhs.args[0], values, "uint8"), _widened(lhs.args[1], values, "uint8")
    w = _int8_weight(rhs, values)
    if a is None or za is None or w is None or w.ndim != 2:
        return None
    return a, za, w


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


def int8_gemms(mod, *, log: RewriteLog):
    """Every MatMulInteger-shaped int32 matmul (uint8 activations less a zero point, int8 constant weights) on
    its 8-bit operands, the zero point's share subtracted after."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    values = {b.var: b.value for b in bindings}
    plan = {}
    for b in bindings:
        found = _operands(b.value, values)
        if found is None:
            continue
        a, za, w = found
        colsum = w.astype(np.int32).sum(axis=0)

        def emit(bb, vmap, a=a, za=za, w=w, colsum=colsum):
            prod = bb.emit(relax.op.matmul(vmap.get(a, a), relax.const(w), out_dtype="int32"))
            shift = bb.emit(relax.op.multiply(relax.op.astype(vmap.get(za, za), "int32"), relax.const(colsum)))
            return relax.op.subtract(prod, shift)

        plan[b.var] = emit
    if not plan:
        return mod
    log.notes.append(f"{len(plan)} quantized GEMMs read their uint8 activations and int8 weights (the activation's "
                     "zero point times the weights' column sums subtracted after)")
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def Int8Gemms(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`int8_gemms` as a Relax module pass."""
    return module_pass("Int8Gemms", lambda mod: int8_gemms(mod, log=log))
