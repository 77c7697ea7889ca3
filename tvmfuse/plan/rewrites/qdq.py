"""Requantizing a tensor already on its grid: ``dequantize(quantize(t, s, z), s, z)`` where ``t`` holds values of
that grid is ``t``.

onnxruntime's ``quantize_static`` puts a QuantizeLinear / DequantizeLinear pair after every op, data movement
included: a ShuffleNet's channel shuffle (Concat, Reshape, Transpose, Reshape, Split) requantizes its tensor five
times at the same scale and zero point, each pair a divide, round, clip and multiply per element on the float
value (QDQ ShuffleNet-v2 on the CPU: half its time in those kernels). onnxruntime drops such pairs when it fuses the
graph; this rewrite does the same for every target.

It is exact. A value on the grid ``(s, z)`` is ``(q - z) * s`` for an integer ``q`` of the quantized type; dividing
it by ``s`` lands within a few ulps of ``q - z`` (at most 255 away from 0), so rounding gives ``q - z`` back, the
clip leaves it and the dequantize returns the same float. Ops that only move, select or take the largest of their
inputs' values (reshapes, transposes, slices, splits, concatenations of inputs on one grid, max pooling, ReLU)
keep a tensor on its grid.
"""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import main_bindings, module_pass, op_name, rebuild_main, users_of
from tvmfuse.plan.rewrites.int8_gemm import _dtype, _scalar
from tvmfuse.plan.tags import RewriteLog

# ops whose output values are some of their first input's values (or, relu, 0: on a grid whose zero point the
# quantized type holds)
_KEEP_FIRST = {"relax.reshape", "relax.permute_dims", "relax.squeeze", "relax.expand_dims", "relax.flatten",
               "relax.strided_slice", "relax.split", "relax.nn.max_pool2d", "relax.nn.max_pool1d", "relax.nn.relu",
               "relax.take", "relax.broadcast_to", "relax.tile"}


# a pair read by these stays: they run on the quantized tensor itself (plan/rewrites/int8_gemm.py, int8_conv.py)
_QUANTIZED_READERS = {"relax.nn.conv2d", "relax.matmul"}


def _grid(call, values: dict):
    """``(scale, zero point, quantized dtype, float dtype)`` of a per-tensor ``quantize`` or ``dequantize``, or
    None."""
    x, scale, zero = call.args
    s, z = _scalar(scale, values), _scalar(zero, values)
    if s is None or z is None or s.size != 1 or z.size != 1:
        return None
    out = str(call.attrs.out_dtype)
    quantized, real = (out, _dtype(x)) if op_name(call) == "relax.quantize" else (_dtype(x), out)
    return float(s.reshape(())), int(z.reshape(())), quantized, real


def _grids(bindings, values: dict) -> dict:
    """Each variable whose every value lies on one quantization grid -> that grid."""
    grid: dict = {}
    for b in bindings:
        call = b.value
        kind = op_name(call)
        found = None
        if kind == "relax.dequantize":
            found = _grid(call, values)
        elif kind in _KEEP_FIRST:
            found = grid.get(call.args[0])
        elif kind == "relax.concat" and isinstance(call.args[0], relax.Tuple):
            each = {grid.get(f) for f in call.args[0].fields}
            found = each.pop() if len(each) == 1 else None
        elif isinstance(call, relax.TupleGetItem):
            found = grid.get(call.tuple_value)
        elif isinstance(call, relax.Var):
            found = grid.get(call)
        if found is not None:
            grid[b.var] = found
    return grid


def redundant_requantize(mod, *, log: RewriteLog):
    """Every ``dequantize(quantize(t))`` whose ``t`` is on the pair's grid already (see the module) replaced by
    ``t``."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    values = {b.var: b.value for b in bindings}
    grid, users = _grids(bindings, values), users_of(bindings)
    plan = {}
    for b in bindings:
        if op_name(b.value) != "relax.dequantize":
            continue
        q = values.get(b.value.args[0])
        if op_name(q) != "relax.quantize":
            continue
        t = q.args[0]
        pair = _grid(b.value, values)
        if pair is None or _grid(q, values) != pair or grid.get(t) != pair \
                or any(op_name(u.value) in _QUANTIZED_READERS for u in users.get(b.var, [])):
            continue
        plan[b.var] = lambda bb, vmap, t=t: vmap.get(t, t)
    if not plan:
        return mod
    log.notes.append(f"{len(plan)} quantize / dequantize pairs dropped: their input was on their grid already (a "
                     "reshape, transpose, slice, concatenation or max of quantized values)")
    # (no constant folding: it would dequantize the int8 weights the quantized GEMMs and convs read after)
    clean = [relax.transform.CanonicalizeBindings(), relax.transform.DeadCodeElimination()]
    return tvm.transform.Sequential(clean)(rebuild_main(mod, plan, set()))


def RedundantRequantize(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`redundant_requantize` as a Relax module pass."""
    return module_pass("RedundantRequantize", lambda mod: redundant_requantize(mod, log=log))
