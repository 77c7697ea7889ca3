"""Quantized convs (QDQ: ``conv(dequantize(x), dequantize(w_i8))``) on their 8-bit operands, as a VNNI GEMM.

onnxruntime's ``quantize_static`` writes a quantized CNN as DequantizeLinear / QuantizeLinear pairs around fp32
convs; TVM imports them so, and they ran as fp32 convs of dequantized tensors (QDQ ResNet-18: no faster than the
fp32 model). Two steps, one on each side of the channels-last layout:

1. :func:`int8_convs` (first, with the quantized GEMMs, before constant folding dequantizes the filters): the conv
   of ``x - zx`` becomes ``conv(x_u8, w_i8) - zx * taps(w)`` in int32, then scaled. ``taps(w)`` sums the filter over
   the taps inside the input at each output pixel (a zero-padded window reads fewer), a constant computed here;
   int8 activations are shifted to uint8 first (``x + 128``, zero point ``zx + 128``). The integer conv is exact.
2. :func:`int8_convs_as_gemms` (after the convs run NHWC): each such integer conv is im2col rows of its uint8
   input (a 1x1 conv of stride 1: its input as it is) by the int8 filter as a ``[K, F]`` constant, the form the VNNI
   GEMM kernel computes (:mod:`tvmfuse.kernels.cpu.int8`; K padded to a multiple of 4, F a multiple of 16).
"""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import main_bindings, module_pass, op_name, replaced
from tvmfuse.plan.rewrites.im2col import _im2col
from tvmfuse.plan.rewrites.int8_gemm import _dtype, _scalar, as_unsigned, dequantized_operands
from tvmfuse.plan.tags import RewriteLog


def _qdq_conv(call, values: dict):
    """``(x, zx, w_i8 [F, C, R, S], scale [F])`` of an NCHW conv of ``dequantize(x, sx, zx)`` (uint8 or int8, one
    zero point) by ``dequantize(w_i8 const, sw, 0)`` (one scale or one per output channel), one group; or None."""
    if op_name(call) != "relax.nn.conv2d" or _dtype(call) != "float32":
        return None
    at = call.attrs
    if (str(at.data_layout), str(at.kernel_layout)) != ("NCHW", "OIHW") or int(at.groups) != 1 \
            or str(at.out_layout) not in ("NCHW", ""):
        return None
    found = dequantized_operands(call, values)
    if found is None:
        return None
    x, sx, zx, rhs, w, sw = found
    zx_v = _scalar(zx, values)
    if zx_v is None or zx_v.size != 1:
        return None
    f = int(w.ty.shape[0])
    if sw.size != 1 and (sw.size != f or int(rhs.attrs.axis) != 0):
        return None
    scale = (sx.reshape(()) * np.broadcast_to(sw.reshape(-1), (f,))).astype(np.float32)
    return x, int(zx_v.reshape(())), const_numpy(w), scale


def _taps(w: np.ndarray, x_hw, y_hw, at) -> np.ndarray:
    """``[1, F, OH, OW]`` (or ``[1, F, 1, 1]`` where every window is inside the input): the filter summed over the
    taps each output pixel's window reads inside the input (the others read the zero padding)."""
    (h, wd), (oh, ow) = x_hw, y_hw
    (sh, sw), (dh, dw) = (int(v) for v in at.strides), (int(v) for v in at.dilation)
    pt, pl = int(at.padding[0]), int(at.padding[1])
    per_tap = w.astype(np.int64).sum(axis=1)                      # [F, R, S]
    r, s = per_tap.shape[1:]
    rows = (np.arange(oh)[:, None] * sh - pt + np.arange(r)[None, :] * dh)
    cols = (np.arange(ow)[:, None] * sw - pl + np.arange(s)[None, :] * dw)
    in_h, in_w = (rows >= 0) & (rows < h), (cols >= 0) & (cols < wd)   # [OH, R], [OW, S]
    if in_h.all() and in_w.all():
        return per_tap.sum(axis=(1, 2)).reshape(1, -1, 1, 1).astype(np.int32)
    taps = np.einsum("frs,or,ps->fop", per_tap, in_h.astype(np.int64), in_w.astype(np.int64))
    return taps[None].astype(np.int32)


def int8_convs(mod, *, log: RewriteLog):
    """Every QDQ conv (see :func:`_qdq_conv`) as an exact int32 conv of its 8-bit operands, the zero point's share
    subtracted after and the scales multiplied."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    values = {b.var: b.value for b in bindings}
    plan, shifted = {}, 0
    for b in bindings:
        found = _qdq_conv(b.value, values)
        xs, ys = (tensor_shape(v.ty) for v in (b.value.args[0], b.var)) if found else (None, None)
        if found is None or xs is None or ys is None:
            continue
        x, zx, w, scale = found
        if w.shape[1] < 16:
            # a network's stem (an image's 3 channels): K = R * S * C is no multiple of 4 and its im2col rows
            # gathered the quantize and the layout transpose before it again for each of the 49 taps (ResNet-18:
            # 5.2 ms, against 0.2 ms for the fp32 conv of the dequantized image)
            continue
        signed = _dtype(x) == "int8"
        shifted += signed
        zx += 128 if signed else 0
        at = b.value.attrs
        taps = _taps(w, xs[2:], ys[2:], at) * np.int32(zx)

        def emit(bb, vmap, x=x, w=w, at=at, taps=taps, scale=scale, signed=signed):
            x = vmap.get(x, x)
            if signed:   # (its zero point + 128 already)
                x = as_unsigned(bb, x)
            conv = bb.emit(relax.op.nn.conv2d(x, relax.const(w), strides=[int(v) for v in at.strides],
                                              padding=[int(v) for v in at.padding],
                                              dilation=[int(v) for v in at.dilation], out_dtype="int32"))
            exact = bb.emit(relax.op.subtract(conv, relax.const(taps)))
            return relax.op.multiply(relax.op.astype(exact, "float32"), relax.const(scale.reshape(1, -1, 1, 1)))

        plan[b.var] = emit
    convs = len(plan)
    if plan:
        plan.update(_elementwise_qdq(bindings, values, skip=set(plan)))
    return replaced(mod, plan, log, f"{convs} quantized convs run on their uint8 activations and int8 filters "
                    "(the activation's zero point times the filter's in-window sums subtracted after"
                    + (f"; {shifted} int8 activations shifted to uint8" if shifted else "")
                    + f"; {len(plan) - convs} per-tensor quantize / dequantize as their arithmetic)")


def _elementwise_qdq(bindings, values: dict, skip: set) -> dict:
    """The per-tensor QuantizeLinear / DequantizeLinear of ``bindings`` as the arithmetic they are
    (``saturate(round(x / s) + z)``, ``(x - z) * s``): TVM's ConvertLayout has no layout rule for them, so between
    two convs run channels-last it went back to NCHW for each, and a conv's epilogue read its GEMM's output through
    that transpose (QDQ ResNet-50: 0.9 ms each for its 1 x 1 convs of 3136 x 64 x 256, 0.2 ms of it the GEMM)."""
    plan = {}
    for b in bindings:
        kind = op_name(b.value)
        if b.var in skip or kind not in ("relax.quantize", "relax.dequantize"):
            continue
        x, scale, zero = b.value.args
        s, z = _scalar(scale, values), _scalar(zero, values)
        if s is None or z is None or s.size != 1 or z.size != 1:
            continue
        s, z = float(s.reshape(())), float(z.reshape(()))
        out = str(b.value.attrs.out_dtype)
        if kind == "relax.dequantize":
            def emit(bb, vmap, x=x, s=s, z=z, out=out):
                shifted = relax.op.subtract(relax.op.astype(vmap.get(x, x), out), relax.const(z, out))
                return relax.op.multiply(shifted, relax.const(s, out))
        else:
            info = np.iinfo(out)

            def emit(bb, vmap, x=x, s=s, z=z, out=out, lo=float(info.min), hi=float(info.max)):
                x = vmap.get(x, x)
                dt = _dtype(x)
                q = relax.op.add(relax.op.round(relax.op.divide(x, relax.const(s, dt))), relax.const(z, dt))
                # (minimum and maximum, not clip: ConvertLayout has no rule for clip either)
                q = relax.op.maximum(relax.op.minimum(q, relax.const(hi, dt)), relax.const(lo, dt))
                return relax.op.astype(q, out)
        plan[b.var] = emit
    return plan


def Int8Convs(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`int8_convs` as a Relax module pass."""
    return module_pass("Int8Convs", lambda mod: int8_convs(mod, log=log))


def _filter_frsc(call) -> np.ndarray | None:
    """The constant int8 filter of an NHWC conv as ``[F, R, S, C]`` (HWIO or OHWI), or None."""
    w = call.args[1]
    if not isinstance(w, RelaxConstant) or _dtype(w) != "int8":
        return None
    layout = str(call.attrs.kernel_layout)
    w = const_numpy(w)
    if layout == "HWIO":
        return w.transpose(3, 0, 1, 2)
    return w if layout == "OHWI" else None


def int8_convs_as_gemms(mod, *, log: RewriteLog):
    """Every NHWC uint8 x int8 -> int32 conv (:func:`int8_convs`' after the layout change) as im2col rows by the
    filter as a ``[K, F]`` constant: the VNNI GEMM. Where F is not a multiple of 16 the conv is left as it is."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan = {}
    for b in bindings:
        call = b.value
        if op_name(call) != "relax.nn.conv2d" or _dtype(call) != "int32" or _dtype(call.args[0]) != "uint8":
            continue
        at = call.attrs
        w = _filter_frsc(call)
        xs, ys = tensor_shape(call.args[0].ty), tensor_shape(b.var.ty)
        if w is None or (str(at.data_layout), str(at.out_layout)) != ("NHWC", "NHWC") or int(at.groups) != 1 \
                or xs is None or ys is None or w.shape[0] % 16:
            continue
        f, r, s, c = w.shape
        k = r * s * c
        pointwise = (r, s) == (1, 1) and all(int(v) == 1 for v in at.strides) and not any(int(v) for v in at.padding)
        kpad = k if pointwise and k % 4 == 0 else -(-k // 4) * 4
        if pointwise and kpad != k:
            continue
        w_mat = np.zeros((kpad, f), np.int8)
        w_mat[:k] = w.reshape(f, k).T
        geometry = dict(oh=ys[1], ow=ys[2], r=r, s=s, kpad=kpad, stride=[int(v) for v in at.strides],
                        dilation=[int(v) for v in at.dilation], pad=[int(v) for v in at.padding[:2]])

        def emit(bb, vmap, x=call.args[0], geometry=geometry, w_mat=w_mat, ys=ys, pointwise=pointwise, c=c):
            x = vmap.get(x, x)
            if pointwise:
                rows = bb.emit(relax.op.reshape(x, [-1, c]))
            else:
                rows = bb.emit_te(_im2col, x, **geometry, primfunc_name_hint="im2col")
            gemm = bb.emit(relax.op.matmul(rows, relax.const(w_mat), out_dtype="int32"))
            return relax.op.reshape(gemm, ys)

        plan[b.var] = emit
    return replaced(mod, plan, log, f"{len(plan)} quantized convs run as uint8 im2col rows x int8 filters (VNNI GEMMs)")


def Int8ConvsAsGemms(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`int8_convs_as_gemms` as a Relax module pass."""
    return module_pass("Int8ConvsAsGemms", lambda mod: int8_convs_as_gemms(mod, log=log))
