"""One K step's wgmmas and the store of the accumulators: the part the cp.async and the TMA kernels share."""
from __future__ import annotations

from tvmfuse.kernels.wgmma.config import WgmmaConfig, _patches, pixel_tile
from tvmfuse.kernels.wgmma.layout import _all, _pixel_origin, desc, tile_layout
from tvmfuse.kernels.wgmma.ptx import (_FENCE_F32_SOURCE, _TF32_PARTS_SOURCE, FENCE_F32, TF32_PARTS, _indent,
                                       wgmma_issue)
from tvmfuse.kernels.wgmma.spec import GemmSpec


def _mma_and_store(spec: GemmSpec, cfg: WgmmaConfig, store: str, pid_m: str, pid_n: str,
                   sb_at: int, step: str = "ko", small: int = 0) -> tuple[str, str]:
    """TVMScript of one K step's wgmmas (stage ``step % stages``; A's stages at element 0 of ``smem``, B's at
    ``sb_at``) and of the stores of the accumulators (rows past the last predicated). ``spec`` in 16-bit units
    (:meth:`GemmSpec.halves`): each wgmma reads 32 bytes of K, 16 fp16 or 8 TF32 elements. A ``tf32x3`` kernel
    (its operands' small TF32 parts ``small`` elements past the big ones) issues three a slice, the small products
    first: ``a.B``, ``A.b``, ``A.B``, into a K step's own accumulators ``acc2``, which the first product of the step
    replaces and the kernel adds to ``acc`` once the step's wgmmas are done (:func:`promote`)."""
    BM, BN, BK, S, MT = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.m_tiles
    a_tile, b_tile = BM * BK, BN * BK
    _, a_desc = tile_layout(cfg.swizzle, True, BM, BK)
    _, b_desc = tile_layout(cfg.swizzle, spec.b_kmajor, BN, BK)
    wg = "(tx // 128)"
    wgmmas = ""
    for kk in range(BK // 16):
        for t in range(MT):
            accs = ", ".join(f"{'acc2' if spec.x3 else 'acc'}[{t * BN // 2 + i}]" for i in range(BN // 2))
            a_off, a_lbo, a_sbo = a_desc(kk)
            b_off, b_lbo, b_sbo = b_desc(kk)
            # warpgroup g's m-tile t: rows (g * MT + t) * 64 of the block tile, 64 * BK elements each
            a_at = f"{step} % {S} * {a_tile} + ({wg} * {MT} + {t}) * {64 * BK} + {a_off}"
            b_at = f"{sb_at} + {step} % {S} * {b_tile} + {b_off}"
            da, db = desc("smem", a_at, a_lbo, a_sbo, cfg.swizzle), desc("smem", b_at, b_lbo, b_sbo, cfg.swizzle)
            # scale A and B by 1; fp16 also says whether B is read transposed (TF32 reads K-major only)
            flags = "1, 1" if spec.tf32 else f"1, 1, 0, {0 if spec.b_kmajor else 1}"
            if cfg.a_regs:   # A's fragments from registers (:func:`a_fragments`), its parts split there
                da_lo, da = (", ".join(f"{part}[{(t * (BK // 16) + kk) * 4 + r}]" for r in range(4))
                             for part in ("asmall", "abig"))
            if spec.x3:
                da_lo = da_lo if cfg.a_regs else desc("smem", f"{small} + {a_at}", a_lbo, a_sbo, cfg.swizzle)
                db_lo = desc("smem", f"{small} + {b_at}", b_lbo, b_sbo, cfg.swizzle)
                wgmmas += wgmma_issue(BN, accs, da_lo, db, flags, spec.dtype, accumulate=kk > 0)
                wgmmas += wgmma_issue(BN, accs, da, db_lo, flags, spec.dtype)
            wgmmas += wgmma_issue(BN, accs, da, db, flags, spec.dtype)

    # accumulators i = 2 * p + v (v = 0, 1) are two adjacent columns of one row: stored as one 4-byte vector
    lane, warp = "(tx % 32)", "(tx % 128 // 32)"
    within = f"{warp} * 16 + {lane} // 4 + p % 2 * 8"   # row within the warpgroup's m-tile t
    acc = lambda v: f"acc[t * {BN // 2} + p * 2 + {v}]"  # noqa: E731 - column col + v of the pair
    if cfg.staged:
        return wgmmas, _staged_stores(spec, cfg, store, pid_m, pid_n, f"({wg} * {MT} + t) * 64 + {within}", acc)
    if cfg.tma and spec.conv is not None:   # m-tile t is one bh x bw patch of output pixels
        n, oh, ow = _pixel_origin(spec, f"({pid_m} * {BM // 64} + {wg} * {MT} + t)")
        bh, bw = pixel_tile(spec)
        g = spec.conv
        y, x = f"({oh} + ({within}) // {bw})", f"({ow} + ({within}) % {bw})"
        row = f"({n} * {g.oh} + {y}) * {g.ow} + {x}"
        conds = (([f"{n} < {g.n}"] if _patches(spec) % (BM // 64) else [])
                 + ([f"{y} < {g.oh}"] if g.oh % bh else []) + ([f"{x} < {g.ow}"] if g.ow % bw else []))
    else:
        row = f"{pid_m} * {BM} + ({wg} * {MT} + t) * 64 + {within}"
        conds = [f"{row} < {spec.rows}"] if spec.rows % BM else []
    pair = _pair_store(spec, BN, store, row, f"{pid_n} * {BN} + p // 2 * 8 + {lane} % 4 * 2", acc, conds)
    return wgmmas, f"for t in T.unroll({MT}):\n    for p in T.unroll({BN // 4}):\n" + _indent(pair, 8)


def _pair_store(spec: GemmSpec, BN: int, store: str, row: str, col: str, acc, conds: list) -> str:
    """TVMScript of the store of two adjacent columns ``col``, ``col + 1`` of ``row`` (``acc(v)`` reads the value of
    column ``col + v``) under ``conds``, and in a partial last tile column only those inside N: an even N's pairs
    whole, as one 4-byte vector; an odd N's rows leave a pair unaligned, so one column at a time. A gated store
    (``{acc0}``, ``{acc1}``: ``analysis.analyze(gated=True)``) makes one output of the pair."""
    pairs = spec.n % 2 == 0
    if spec.n % BN:
        conds = conds + [f"{col} < {spec.n}" if pairs else f"{col} + v < {spec.n}"]
    pred = _all(conds)
    if "{acc0}" in store:   # a gated GEMM's (g, u) pair: N is even
        stored = store.format(bz="bz", row=f"({row})", col=f"({col})", acc0=acc(0), acc1=acc(1))
        return stored if pred is None else f"if {pred}:\n" + _indent(stored, 4)
    stored = store.format(bz="bz", row=f"({row})", col=f"({col} + v)", acc=acc("v"))
    if pred is not None:   # (a store may be several lines: the values its epilogue uses twice come first)
        stored = f"if {pred}:\n" + _indent(stored, 4)
    # (a store's local buffers of shared values, vectorized, hold both columns' values: its stores stay half2)
    return f"for v in T.{'vectorized' if pairs else 'unroll'}(2):\n" + _indent(stored, 4)


def _staged_stores(spec: GemmSpec, cfg: WgmmaConfig, store: str, pid_m: str, pid_n: str, within: str,
                   acc) -> str:
    """The epilogue through shared memory (``staged`` 1, the cp.async kernel): every thread puts its accumulator
    pairs (``acc``, at tile row ``within``) into the fp32 tile ``sacc`` (rows :attr:`WgmmaConfig.staged_stride`
    floats apart), then the block reads it back a pair of adjacent columns a thread, consecutive threads along a
    row, and stores it: a warp writes 64 consecutive columns of one row (of a tile 64 or more wide). The stages are
    dead by then: the last copies (a batch in flight refills past the last tile) are waited for and every
    warpgroup's wgmmas are done before the barrier."""
    BM, BN, MT, NT, LD = cfg.block_m, cfg.block_n, cfg.m_tiles, cfg.threads, cfg.staged_stride
    lane = "(tx % 32)"
    put = (f"T.evaluate(T.ptx.cp.async_.wait_group(0))\nT.tvm_storage_sync(\"shared\")\n"
           f"for t in T.unroll({MT}):\n    for p in T.unroll({BN // 4}):\n        for v in T.vectorized(2):\n"
           f"            sacc[({within}) * {LD} + p // 2 * 8 + {lane} % 4 * 2 + v] = {acc('v')}\n"
           f"T.tvm_storage_sync(\"shared\")\n")
    e = f"(it * {NT} + tx)"   # the pair this thread stores: row e // (BN / 2), columns e % (BN / 2) * 2 and up
    r, c = f"{e} // {BN // 2}", f"{e} % {BN // 2} * 2"
    row = f"{pid_m} * {BM} + {r}"
    pair = _pair_store(spec, BN, store, row, f"{pid_n} * {BN} + {c}", lambda v: f"sacc[({r}) * {LD} + {c} + {v}]",
                       [f"{row} < {spec.rows}"] if spec.rows % BM else [])
    return put + f"for it in T.unroll({MT * BN // 4}):\n" + _indent(pair, 4)


def promote(spec: GemmSpec, cfg: WgmmaConfig) -> str:
    """A ``tf32x3`` kernel's K step summed into the kernel's accumulators once its wgmmas are done: on the CUDA cores,
    rounded to nearest. The tensor cores' fp32 sums of one TF32 product a K step stayed near fp32's (the TF32
    kernel), but three products a step across all of K drifted with K (fp64 against the kernel on the H100: 5.4e-6
    at K 768, 2.9e-5 at 4096; cuBLAS's fp32 GEMM 5e-7 and 1.1e-6), and a random-weight ResNet-50 in fp32 came 3.4e-4
    off onnxruntime's; each step's sum starts afresh, so the drift is a step's (32 of K), not K's."""
    if not spec.x3:
        return ""
    n = cfg.m_tiles * cfg.block_n // 2
    fence = f"T.evaluate(T.cuda.func_call({FENCE_F32!r}, acc2[i], source_code={_FENCE_F32_SOURCE!r}))"
    return f"for i in T.unroll({n}):\n    {fence}\n    acc[i] = acc[i] + acc2[i]\n"


def a_fragment_at(spec: GemmSpec, cfg: WgmmaConfig, step: str = "ko") -> str:
    """(``cfg.a_regs``) where thread ``tx``'s register ``r`` of m-tile ``t`` and K slice ``kk`` (8 fp32) lies in K step
    ``step``'s A stage, in floats of the stages' fp32 view: wgmma's register A layout of ``m64k8`` TF32 (CuTe's
    ``ALayout_64x8``: rows ``warp * 16 + lane / 4``, 8 below for odd ``r``; columns ``lane % 4``, 4 on from ``r`` 2),
    row ``i`` of an m-tile at ``i * 32`` floats, its 16-byte chunk ``c`` at chunk ``c ^ (i % 8)`` (the 128-byte
    swizzle, :func:`tile_layout`). ``spec`` in 16-bit units."""
    BK, S, MT = cfg.block_k, cfg.stages, cfg.m_tiles
    if not (spec.x3 and cfg.swizzle == 128 and BK == 64 and not cfg.tma):
        raise ValueError(f"wgmma: A from registers takes an x3 cp.async kernel of 128-byte swizzled tiles ({cfg.name})")
    wg, lane, warp = "(tx // 128)", "(tx % 32)", "(tx % 128 // 32)"
    row = f"({warp} * 16 + {lane} // 4 + r % 2 * 8)"
    kf = f"(kk * 8 + {lane} % 4 + r // 2 * 4)"
    return (f"{step} % {S} * {cfg.block_m * BK // 2} + ({wg} * {MT} + t) * {64 * BK // 2} + {row} * {BK // 2} + "
            f"T.bitwise_xor({kf} // 4, {row} % 8) * 4 + {kf} % 4")


def a_fragments(spec: GemmSpec, cfg: WgmmaConfig, step: str = "ko") -> str:
    """(``cfg.a_regs``, ``float32x3``) this thread's A fragments of K step ``step`` (:func:`a_fragment_at`), read
    from the stages' fp32 view ``smf`` and split into TF32 parts in registers ``abig`` / ``asmall``."""
    at, BK = a_fragment_at(spec, cfg, step), cfg.block_k

    # (each part through tvmfuse_pin, a volatile asm: computed before the wgmma fence, which is volatile too, so
    # ptxas sees no A register written after it)
    def part(small: int) -> str:
        value = (f"T.cuda.func_call({TF32_PARTS!r}, smf[{at}], {small}, source_code={_TF32_PARTS_SOURCE!r}, "
                 "return_type='uint32')")
        return f"T.cuda.func_call('tvmfuse_pin', {value}, source_code=_TMA_SOURCE['tvmfuse_pin'], return_type='uint32')"
    i = f"(t * {BK // 16} + kk) * 4 + r"
    return (f"for t in T.unroll({cfg.m_tiles}):\n    for kk in T.unroll({BK // 16}):\n        for r in T.unroll(4):\n"
            f"            abig[{i}] = {part(0)}\n            asmall[{i}] = {part(1)}\n")
