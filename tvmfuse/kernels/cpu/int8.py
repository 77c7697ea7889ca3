"""Quantized GEMMs on x86's VNNI dot product: uint8 activations by int8 weights into int32 sums.

``vpdpbusd`` multiplies 64 uint8 by 64 int8 values and adds each group of 4 products into one of 16 int32 lanes: 4
times the multiply-adds of an fp32 FMA vector. The kernel (``schedule_int8_gemm``) tiles the GEMM into blocks of up
to 8 activation rows by 2 x 16 output columns, walks the reduction 4 at a time, and computes each 16 x 4 step with
one ``vpdpbusd``; the weight is packed once, at compile time, as ``[N / 16, K / 4, 16, 4]`` (a layout rewrite block,
like the fp32 GEMMs' packed weights). BERT-base's quantized FFN GEMM (128 x 768 x 3072): 1.78 ms as an int32 GEMM,
0.42 ms on VNNI with its GELU epilogue, exact. The planner hands it this form (``plan/rewrites/int8_gemm.py``).

TVM 0.27's own VNNI intrinsic declares ``vpdpbusd``'s operands as 16 x int32, which its LLVM rejects (the
intrinsic takes 64 x int8 now); this module registers one with the current signature.
"""
from __future__ import annotations

from tvmfuse._tvm import tvm  # noqa: F401 - TVM loaded the project's way before tvm.s_tir below

INTRIN = "tvmfuse_dot_16x4_vnni"


def _register() -> None:
    """Register ``INTRIN``: on import, since a tuning record's trace names it and replaying one (the database's
    best, a builder process) needs it before any schedule here ran."""
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.x86 import dot_product_16x4_u8i8i32_desc
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
             c: T.Buffer((16,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            four = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), c.vload([0], dtype="int32x16"),
                T.reinterpret(T.broadcast(four, 16), dtype="int8x64"), b.vload([0, 0], dtype="int8x64"),
                dtype="int32x16")

    try:
        TensorIntrin.register(INTRIN, dot_product_16x4_u8i8i32_desc, impl)
    except Exception:  # noqa: BLE001 - registered already (the module reloaded)
        pass


_register()


def is_int8_gemm(sch, block) -> bool:
    """A block summing uint8 x int8 products into int32 (``matmul(a_u8, w_i8, out_dtype=int32)``)."""
    stmt = sch.get(block)
    dtypes = {str(r.source.dtype) for r in stmt.reads}
    return {"uint8", "int8"} <= dtypes and all(str(w.source.dtype) == "int32" for w in stmt.writes)


def _pick(extent: int, options) -> int:
    return next(o for o in options if extent % o == 0)


def default_tiles(rows: int, cols: int) -> tuple[int, int]:
    """The untuned kernel's register block for ``rows`` x ``cols`` outputs: (rows, 16-column vectors), each
    dividing its axis."""
    # (7: a 7 x 7 image's 49 pixels, which no other tile divides: one row a tile read the weight once a row)
    return _pick(rows, (8, 7, 6, 5, 4, 3, 2, 1)), _pick(cols // 16, (2, 1))


def schedule_int8_gemm(sch, block, cores: int, rows=None, vectors=None) -> None:
    """Tile ``block`` (spatial loops ..., N and one reduction K; N a multiple of 16, K of 4) onto VNNI: ``rows`` x
    ``vectors`` 16-column vectors a register block (ints or a sketch's sampled values; None: :func:`default_tiles`);
    raises where it cannot."""
    loops = sch.get_loops(block)
    *spatial, n, k = loops
    n_ext, k_ext = int(sch.get(n).extent), int(sch.get(k).extent)
    if n_ext % 16 or k_ext % 4:
        raise ValueError(f"N {n_ext} or K {k_ext} not a multiple of 16 or 4")
    stmt = sch.get(block)
    w_index = next(i for i, r in enumerate(stmt.reads) if str(r.source.dtype) == "int8")
    # the weight packed [N / 16, K / 4, 16, 4], once, at compile time (a layout-rewrite block, as RewriteLayout
    # makes for the fp32 GEMMs: the build's SplitLayoutRewritePreproc folds it)
    packed = sch.cache_read(block, w_index, "global")
    sch.annotate(packed, "meta_schedule.layout_rewrite_preproc", True)
    sch.transform_layout(block, ("read", w_index),
                         lambda kk, nn: (nn // 16, kk // 4, nn % 16, kk % 4))
    # the rows' last axis is tiled; the batch axes before it stay loops of their own (fused with it, their div and
    # mod bindings keep tensorize from blockizing the 16 x 4 step)
    *batch, m = spatial
    mr, nb = default_tiles(int(sch.get(m).extent), n_ext)
    mr, nb = mr if rows is None else rows, nb if vectors is None else vectors
    mo, mi = sch.split(m, [None, mr])
    no, nbl, ni = sch.split(n, [None, nb, 16])
    ko, ki = sch.split(k, [None, 4])
    sch.reorder(no, *batch, mo, ko, mi, nbl, ni, ki)
    sch.parallel(sch.fuse(no, *batch, mo))
    init = sch.decompose_reduction(block, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ni, INTRIN)
    sch.unroll(mi)
    sch.unroll(nbl)


def schedule_int8_kernel(sch, block, cores: int, lanes: int, rows=None, vectors=None) -> None:
    """The quantized GEMM ``block`` on VNNI (:func:`schedule_int8_gemm`) and the kernel's elementwise epilogue
    after it (the zero point's share, the scales, the bias: parallel, ``lanes`` fp32 a vector)."""
    from tvmfuse.kernels.cpu.schedule import pointwise_block
    from tvmfuse.kernels.sketch import REDUCE, iter_types

    schedule_int8_gemm(sch, block, cores, rows, vectors)
    for epilogue in sch.get_output_blocks(sch.get_sblock("root")):
        if REDUCE not in iter_types(sch, epilogue):
            pointwise_block(sch, epilogue, lanes, cores)
