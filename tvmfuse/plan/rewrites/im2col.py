"""Narrow NHWC convs (a network's stem) and convs of a few output pixels as an im2col kernel and a GEMM."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import relax, tirx, tvm
from tvmfuse.plan.graph import tensor_bytes
from tvmfuse.plan.rewrites._common import CLEAN, channels_last_convs, main_bindings, module_pass, rebuild_main
from tvmfuse.plan.tags import RewriteLog, Tag


def _im2col(x, *, oh: int, ow: int, r: int, s: int, kpad: int, stride, dilation, pad, channels_first=False):
    """A conv's im2col rows as TE: ``[n * oh * ow, kpad]``, K in the filter's (r, s, c) order (``channels_first``:
    (c, r, s)), zero where a window leaves the NHWC input ``x`` and past ``r * s * c``."""
    from tvm import te

    n, h, w, c = (int(d) for d in x.shape)
    (sh, sw), (dh, dw), (pt, pl) = stride, dilation, pad

    def row(m, kk):
        tr, ts, ch = ((kk // s % r, kk % s, kk // (r * s)) if channels_first else
                      (kk // (s * c), kk // c % s, kk % c))
        hi = m // ow % oh * sh - pt + tr * dh
        wi = m % ow * sw - pl + ts * dw
        inside = tirx.all(kk < r * s * c, hi >= 0, hi < h, wi >= 0, wi < w)
        return tirx.if_then_else(inside, x[m // (oh * ow), hi, wi, ch], tirx.const(0, x.dtype))

    return te.compute((n * oh * ow, kpad), row, name="im2col")


def _pad_channels(x, *, channels: int):
    """An NHWC input ``x`` with its channels zero-padded to ``channels``, as TE (TOPI's pad: an injective op, which
    the planner fuses into the input's cast and transpose)."""
    from tvm import topi

    return topi.nn.pad(x, [0, 0, 0, 0], [0, 0, 0, channels - int(x.shape[3])], name="pad_channels")


def im2col_narrow_convs(mod, *, log: RewriteLog, limit_k: int = 512, allow_dtypes=("float16",), few_pixels: int = 0,
                        untemplated_pixels: int = 0, pad_dtypes=()):
    """NHWC convs with fewer than 16 input channels (an image's 1-4: a network's stem), as an im2col kernel and a
    GEMM.

    The tensor-core conv template reads each filter tap's channels 64 at a time (:mod:`tvmfuse.tune.hopper`), so a
    network's stem (3 channels, 7x7, stride 2) got a generic schedule: on the H200 ResNet-50 b32's
    stem took 242 us where cuDNN's first-layer kernel took 61 us, 11% of the model's time. Here the rows of A
    (one per output pixel; K = R*S*C taps x channels, zero-padded to a multiple of 64) are written by one
    injective kernel, and the conv becomes ``matmul(A, W)`` with the filter as a [K, F] constant: a GEMM the
    wgmma template takes, its epilogue fused as any GEMM's. Costs A's bytes (written once, read once): taken only
    where K, padded, is at most ``limit_k``, and only below 16 channels, where a tap's channels do not fill one
    tensor-core K step (wider convs that the template cannot take keep the other tensor-core template, untested
    against this), and for the input types in ``allow_dtypes`` (fp16: the wgmma template's). The plan accounts
    the three new nodes as the one conv they replace.

    A conv of at most ``few_pixels`` output pixels (a late stage at batch 1) is taken whatever its channels, type
    and K, and one of a type no conv template takes (fp32) up to ``untemplated_pixels``: its rows are a few hundred
    KB at most, and as a GEMM of that few rows it is the gemv template's, which streams the filter over every SM
    (split along K). As a conv it ran dlight's matmul rule in 4-16 thread blocks: ResNet-50 fp32 (1 x 3 x 64 x 64)
    untuned took 3.25 ms on the H200 against torch.compile's 0.86, 0.35 ms after. A 1x1 conv of stride 1 is left
    to :func:`pointwise_convs_as_gemms`.

    A conv of non-overlapping patches (kernel = stride, no padding: a ViT's or Swin's patch embedding) takes im2col
    rows at any K: they hold each input element once, in another order, and K stays exact (768 for 16x16x3); as a
    conv of 3 channels a ViT-B/16's went to dlight's CUDA-core schedule.

    Any other narrow conv whose input type is in ``pad_dtypes`` instead keeps its conv, on its input's channels
    zero-padded to whole 16-byte copies (8 fp16 or 4 fp32 channels; the filter padded alike at compile time),
    which the tensor-core conv template takes, each K step spanning filter taps. ResNet-50's stem at batch 32
    (3 channels, 7x7, stride 2, 112^2 outputs) wrote 154 MB of im2col rows (K 147 padded to 192) and read them
    back: 203 us for the rows, whose reads of an NCHW image were strided, and 72 us for the GEMM on the H100,
    where cuDNN's first-layer kernel took 60 us. Padded, the only extra bytes are the input's 8
    channels (26 MB at 224^2)."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod
    plan, names = {}, {}
    for b, x, xs, ys, weight in channels_last_convs(bindings):
        at = b.value.attrs
        f, r, s, c = weight.shape
        k = r * s * c
        kpad = -(-k // 64) * 64
        pixels = ys[0] * ys[1] * ys[2]
        gemm_already = (r, s) == (1, 1) and all(int(v) == 1 for v in at.strides) and not any(int(v) for v in at.padding)
        few = not gemm_already and (pixels <= few_pixels or (str(x.ty.dtype) not in allow_dtypes
                                                            and pixels <= untemplated_pixels))
        # non-overlapping patches (a ViT's 16x16 stride 16): the rows are the input's own elements, reordered
        patches = ((r, s) == tuple(int(v) for v in at.strides) and not any(int(v) for v in at.padding)
                   and all(int(v) == 1 for v in at.dilation) and (ys[1] * r, ys[2] * s) == (xs[1], xs[2]))
        if not few and (xs[3] >= 16 or str(x.ty.dtype) not in allow_dtypes or (kpad > limit_k and not patches)):
            continue
        if not few and not patches and str(x.ty.dtype) in pad_dtypes:
            per_copy = 16 // np.dtype(str(x.ty.dtype)).itemsize
            cpad = -(-c // per_copy) * per_copy
            if cpad != c:
                _pad_conv(b, x, weight, cpad, log, plan, names)
            continue
        # a narrow conv's input is an image, which the rows' kernel reads from the model's NCHW tensor (its layout
        # transpose fused in): K in (c, r, s) order puts adjacent taps of one channel, adjacent pixels of a row,
        # side by side. With the channels innermost adjacent threads read planes apart, and ResNet-50's stem rows
        # (154 MB) took 203 us on the H100, a quarter of the copy rate. A conv of 16 channels or more (one of a
        # few pixels) reads an NHWC activation, its channels contiguous: (r, s, c).
        narrow = xs[3] < 16
        w_mat = np.zeros((kpad, f), weight.dtype)
        w_mat[:k] = (weight.transpose(0, 3, 1, 2) if narrow else weight).reshape(f, k).T
        geometry = dict(oh=ys[1], ow=ys[2], r=r, s=s, kpad=kpad, stride=[int(v) for v in at.strides],
                        dilation=[int(v) for v in at.dilation], pad=[int(v) for v in at.padding[:2]],
                        channels_first=narrow)
        rows_name, gemm_name, out_name = (log.fresh(p) for p in ("im2col", "im2col_gemm", "im2col_out"))
        log.tags[gemm_name] = Tag("im2col", ("conv2d",), _conv_bytes(b, x, weight),
                                  note=f"conv as im2col rows (K {k} -> {kpad}) x GEMM")
        log.tags[rows_name] = log.tags[out_name] = Tag("im2col", (), 0)

        def emit(bb, vmap, x=x, geometry=geometry, w_mat=w_mat, out_dtype=str(b.var.ty.dtype), ys=ys,
                 rows_name=rows_name, gemm_name=gemm_name):
            rows = bb.emit_te(_im2col, vmap.get(x, x), **geometry, primfunc_name_hint="im2col", name_hint=rows_name)
            gemm = bb.emit(relax.op.matmul(rows, relax.const(w_mat), out_dtype=out_dtype), name_hint=gemm_name)
            return relax.op.reshape(gemm, ys)

        plan[b.var], names[b.var] = emit, out_name
        log.notes.append(f"conv {b.var.name} ({c} input channels, {r}x{s}"
                         + (f", {pixels} output pixels" if few else "")
                         + f") runs as im2col + GEMM (K {k} padded to {kpad})")
    if not plan:
        return mod
    return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set(), names))


def _conv_bytes(b, x, weight) -> int:
    """The model's conv as one kernel (its input, filter and output): the unfused baseline the plan accounts a
    rewritten conv as; the rows or the padding are the rewrite's own."""
    return tensor_bytes(x.ty) + weight.nbytes + tensor_bytes(b.var.ty)


def _pad_conv(b, x, weight, cpad: int, log: RewriteLog, plan: dict, names: dict) -> None:
    """Plan ``b``'s conv on its input's and filter's channels zero-padded to ``cpad``."""
    c = weight.shape[3]
    w_pad = np.pad(weight, [(0, 0), (0, 0), (0, 0), (0, cpad - c)])
    pad_name, out_name = log.fresh("pad_channels"), log.fresh("padded_conv")
    log.tags[pad_name] = Tag("pad_channels", (), 0)
    log.tags[out_name] = Tag("pad_channels", ("conv2d",), _conv_bytes(b, x, weight),
                             note=f"conv on channels padded {c} -> {cpad}")

    def emit(bb, vmap, call=b.value, x=x, w_pad=w_pad, pad_name=pad_name):
        xp = bb.emit_te(_pad_channels, vmap.get(x, x), channels=cpad, primfunc_name_hint="pad_channels",
                        name_hint=pad_name)
        return relax.Call(call.op, [xp, relax.const(w_pad), *call.args[2:]], call.attrs, call.ty_args)

    plan[b.var], names[b.var] = emit, out_name
    log.notes.append(f"conv {b.var.name} ({c} input channels) runs on its channels zero-padded to {cpad} "
                     f"(whole 16-byte copies for the conv template)")


def Im2colNarrowConvs(*, log: RewriteLog, limit_k: int = 512, allow_dtypes=("float16",),
                      few_pixels: int = 0, untemplated_pixels: int = 0, pad_dtypes=()
                      ) -> tvm.transform.Pass:
    """:func:`im2col_narrow_convs` as a Relax module pass."""
    return module_pass("Im2colNarrowConvs", lambda mod: im2col_narrow_convs(
        mod, log=log, limit_k=limit_k, allow_dtypes=allow_dtypes, few_pixels=few_pixels,
        untemplated_pixels=untemplated_pixels, pad_dtypes=pad_dtypes))
