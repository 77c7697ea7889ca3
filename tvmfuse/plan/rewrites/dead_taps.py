"""Convs whose dilated taps only ever read padding keep the taps that reach the input.

DeepLab's atrous pyramid (ASPP) runs 3 x 3 convs of dilation 12, 24 and 36 over the backbone's last feature map;
at 8 x 8 pixels (a 128 x 128 image, output stride 16) every tap but the centre lands in the zero padding for every
output pixel, so each conv is a 1 x 1 conv computed nine times over. Tap ``k`` of a spatial axis reads input
positions ``o * stride + k * dilation - pad_begin`` for the outputs ``o``: it is live where that range meets the
input. Live taps are a contiguous run (both bounds move one way with ``k``); the conv becomes one over that run's
slice of the (constant) filter, its padding shortened by the dead taps' reach on each side, which leaves the
output's size and every value unchanged.
"""
from __future__ import annotations

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import main_bindings, module_pass, op_name, replaced
from tvmfuse.plan.tags import RewriteLog


def live_taps(size: int, out: int, taps: int, stride: int, dilation: int, pad_begin: int) -> tuple[int, int]:
    """``(first, last)`` taps of one spatial axis that read an input position for some output position."""
    live = [k for k in range(taps)
            if k * dilation - pad_begin <= size - 1 and (out - 1) * stride + k * dilation - pad_begin >= 0]
    return (live[0], live[-1]) if live else (0, taps - 1)


def _trimmed(call, y_shape):
    """(filter slice per axis, new padding) for an NCHW / OIHW conv2d with a constant filter, or None."""
    if op_name(call) != "relax.nn.conv2d" or not isinstance(call.args[1], RelaxConstant):
        return None
    at = call.attrs
    if (str(at.data_layout), str(at.kernel_layout)) != ("NCHW", "OIHW"):
        return None
    x_shape = tensor_shape(call.args[0].ty)
    if x_shape is None or y_shape is None:
        return None
    w = const_numpy(call.args[1])
    pads = [int(p) for p in at.padding]          # top, left, bottom, right
    keep, padding = [], [0, 0, 0, 0]
    for axis in range(2):
        taps, stride, dilation = int(w.shape[2 + axis]), int(at.strides[axis]), int(at.dilation[axis])
        first, last = live_taps(int(x_shape[2 + axis]), int(y_shape[2 + axis]), taps, stride, dilation,
                                pads[axis])
        begin, end = pads[axis] - first * dilation, pads[2 + axis] - (taps - 1 - last) * dilation
        if begin < 0 or end < 0:   # the live taps start inside the input: it would need cropping, left alone
            return None
        keep.append((first, last + 1))
        padding[axis], padding[2 + axis] = begin, end
    if all(k == (0, int(w.shape[2 + i])) for i, k in enumerate(keep)):
        return None
    return keep, padding


def trim_dead_taps(mod, *, log: RewriteLog):
    """Every NCHW conv2d with a constant OIHW filter whose edge taps read only padding runs on its live taps."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan, shown = {}, []
    for b in bindings:
        found = _trimmed(b.value, tensor_shape(b.var.ty))
        if found is None:
            continue
        (h0, h1), (w0, w1) = found[0]
        call, padding = b.value, found[1]
        full = const_numpy(call.args[1])
        w = full[:, :, h0:h1, w0:w1].copy()
        dilation = [int(d) if (h1 - h0, w1 - w0)[i] > 1 else 1 for i, d in enumerate(call.attrs.dilation)]
        shown.append(f"{w.shape[2]}x{w.shape[3]} of {full.shape[2]}x{full.shape[3]}")

        def emit(bb, vmap, call=call, w=w, padding=padding, dilation=dilation):
            at = call.attrs
            return relax.op.nn.conv2d(vmap.get(call.args[0], call.args[0]), relax.const(w), strides=at.strides,
                                      padding=padding, dilation=dilation, groups=int(at.groups),
                                      data_layout="NCHW", kernel_layout="OIHW", out_layout=str(at.out_layout),
                                      out_dtype=None if str(at.out_dtype) in ("", "None", "void") else
                                      str(at.out_dtype))

        plan[b.var] = emit
    return replaced(mod, plan, log, f"{len(plan)} dilated convs run on the taps that reach the input "
                                    f"({', '.join(shown)}): the others read only padding")


def TrimDeadTaps(*, log: RewriteLog) -> tvm.transform.Pass:
    """:func:`trim_dead_taps` as a Relax module pass."""
    return module_pass("TrimDeadTaps", lambda mod: trim_dead_taps(mod, log=log))
