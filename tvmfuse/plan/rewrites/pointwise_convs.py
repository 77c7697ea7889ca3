"""1x1 NHWC convs as GEMMs where no conv template takes them: fp32, or a few output pixels."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import channels_last_convs, main_bindings, module_pass, replaced
from tvmfuse.plan.tags import RewriteLog


def pointwise_convs_as_gemms(mod, *, log: RewriteLog, max_rows: int = 64, template_dtypes=("float16",)):
    """1x1 convs (stride 1, no padding, one group; NHWC activations, OHWI filters) whose input is not of a
    ``template_dtypes`` type, or that have at most ``max_rows`` output pixels, as a GEMM
    with the filter a [C, F] constant (its transpose folded at compile time): ``matmul(x, W)`` on the NHWC input,
    its leading dims the GEMM's rows, so nothing is reshaped (a reshape of an input that other ops read too stayed a
    copy kernel of its own).

    Such a conv is a GEMM already; as a conv it found no GPU schedule that fits it. The tensor-core conv template
    takes fp16 only, so an fp32 conv ran dlight's matmul rule, which tiles the pixels by 64-128 rows: MobileNetV2
    (1 x 3 x 64 x 64, fp32) on the H200 ran its 1x1 convs of 2 x 2 pixels (960 -> 160 channels) in 3 thread blocks,
    44.7 us each. As GEMMs they are the GEMM class's: the gemv template (at most 16 rows; 64 on fp16 tensor cores)
    streams the filter over every SM, dlight's matmul and the wgmma template take the rest, and the epilogue
    (bias, ReLU6, residual) fuses as any GEMM's."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan, rows_of = {}, {}
    for b, x, _, ys, weight in channels_last_convs(bindings):
        at = b.value.attrs
        f, r, s, c = weight.shape
        if (r, s) != (1, 1) or any(int(v) != 1 for v in at.strides) or any(int(v) != 0 for v in at.padding):
            continue
        pixels = ys[0] * ys[1] * ys[2]
        if str(x.ty.dtype) in template_dtypes and pixels > max_rows:
            continue
        rows_of[b.var] = pixels

        def emit(bb, vmap, x=x, w_mat=np.ascontiguousarray(weight.reshape(f, c).T), out_dtype=str(b.var.ty.dtype)):
            return relax.op.matmul(vmap.get(x, x), relax.const(w_mat), out_dtype=out_dtype)

        plan[b.var] = emit
    pixels = ", ".join(sorted({str(n) for n in rows_of.values()}, key=int))
    return replaced(mod, plan, log, f"{len(plan)} 1x1 convs run as GEMMs ({pixels} pixels): no conv template takes them")


def PointwiseConvsAsGemms(*, log: RewriteLog, max_rows: int = 64, template_dtypes=("float16",)) -> tvm.transform.Pass:
    """:func:`pointwise_convs_as_gemms` as a Relax module pass."""
    return module_pass("PointwiseConvsAsGemms", lambda mod: pointwise_convs_as_gemms(
        mod, log=log, max_rows=max_rows, template_dtypes=template_dtypes))
