"""Output channels padded to whole vectors: a GEMM or channels-last conv with a constant weight whose output width
no vector divides computes on a zero-padded weight, and a slice keeps the real channels."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, module_pass, op_name, rebuild_main
from tvmfuse.plan.tags import RewriteLog


def _padded_weight(call, lanes: int, most_waste: float):
    """The weight of ``call`` (a conv2d in NHWC with an HWIO filter and one group, or a matmul by a 2-D
    constant) with its output axis (the last) zero-padded to a multiple of ``lanes``, or None where it needs
    none or the padding would add more than ``most_waste`` of the work."""
    name = op_name(call)
    if name == "relax.nn.conv2d":
        at = call.attrs
        if (str(at.data_layout), str(at.kernel_layout), str(at.out_layout)) != ("NHWC", "HWIO", "NHWC") \
                or int(at.groups) != 1:
            return None
    elif name != "relax.matmul":
        return None
    if len(call.args) < 2 or not isinstance(call.args[1], RelaxConstant):
        return None
    w = const_numpy(call.args[1])
    if name == "relax.matmul" and w.ndim != 2:
        return None
    n = int(w.shape[-1])
    padded = -(-n // lanes) * lanes
    if n % lanes == 0 or n < lanes or padded - n > most_waste * n:
        return None
    return np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, padded - n)])


def pad_output_channels(mod, *, log: RewriteLog, lanes: int, most_waste: float = 0.125):
    """GEMMs by a constant ``[K, N]`` weight and NHWC convs with a constant HWIO filter whose ``N`` output channels
    no ``lanes``-wide vector divides (1000 classes, 72 or 120 channels) run on the weight zero-padded to the next
    multiple of ``lanes`` (padded at compile time), followed by a slice of the first ``N`` channels; taken where
    the padding adds at most ``most_waste`` of the work.

    The CPU default tiles a contraction's output channels by whole vectors where they divide the axis, else by
    half or quarter vectors, and a width of no power of two (40 or 24 lanes) LLVM legalises through the stack.
    SqueezeNet's 512 -> 1000 1x1 conv at 3x3 pixels ran 8-lane tiles at half the FMA rate (47 us, onnxruntime's
    27); on the padded weight its tiles are whole 16-lane vectors. The slice fuses into the kernel as its
    epilogue, so the padded channels are computed in registers and never stored."""
    bindings = main_bindings(mod)
    if bindings is None or lanes <= 1:
        return mod
    plan, widths = {}, []
    for b in bindings:
        call = b.value
        shape = tensor_shape(b.var.ty)
        if shape is None:
            continue
        weight = _padded_weight(call, lanes, most_waste)
        if weight is None:
            continue
        n = int(shape[-1])
        widths.append(n)

        def emit(bb, vmap, call=call, weight=weight, n=n, rank=len(shape)):
            args = [vmap.get(a, a) for a in call.args]
            full = bb.emit(relax.Call(call.op, [args[0], relax.const(weight), *args[2:]], call.attrs,
                                      call.ty_args))
            return relax.op.strided_slice(full, axes=[rank - 1], begin=[0], end=[n])

        plan[b.var] = emit
    if not plan:
        return mod
    shown = ", ".join(sorted({str(n) for n in widths}, key=int))
    log.notes.append(f"{len(plan)} GEMMs / convs of {shown} output channels run on weights padded to whole "
                     f"{lanes}-lane vectors, their extra channels sliced off in the kernel")
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))


def PadOutputChannels(*, log: RewriteLog, lanes: int, most_waste: float = 0.125) -> tvm.transform.Pass:
    """:func:`pad_output_channels` as a Relax module pass."""
    return module_pass("PadOutputChannels", lambda mod: pad_output_channels(
        mod, log=log, lanes=lanes, most_waste=most_waste))
