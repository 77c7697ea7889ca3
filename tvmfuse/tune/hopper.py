"""A Hopper GEMM TIR template: ``wgmma.mma_async`` on operands staged by ``cp.async``, epilogue on the accumulators.

tvmfuse's first GEMM template (``tvmfuse.tune.tensorcore``) schedules the fused kernel onto ``mma.sync``
through MetaSchedule's tensorize; on an H200 that stops near half of cuBLAS, because Hopper's full
tensor-core rate is reached only by the warpgroup-wide, asynchronous ``wgmma``. No TVM 0.27 schedule
primitive or tensor intrinsic emits it, so this module writes the kernel itself, as TVMScript, for the
planner's GEMM kernels whose shape it fits (:func:`gemm_spec`):

* a thread block computes a ``block_m x block_n`` tile of ``C = A·B`` with ``warpgroups`` warpgroups (128
  threads each), each owning ``64 * m_tiles`` rows: per 16-deep K slice it issues ``m_tiles``
  ``wgmma.mma_async.m64n{block_n}k16`` (fp16 in, fp32 accumulate in registers);
* A and B tiles, ``block_k`` deep, go through dynamic shared memory in ``stages`` buffers filled by
  ``cp.async`` (16-byte copies), ``stages - 1`` tiles ahead of the tensor cores. The tiles are stored as
  wgmma's canonical "no swizzle" layouts, 8 x 16-byte core matrices of 128 contiguous bytes (A and a
  K-major B: K-major; a ``[K, N]`` B: N-major, read transposed by the instruction), and each warp's copies
  fill whole core matrices, so neither the copies nor the tensor cores meet bank conflicts;
* the operands are named by 64-bit shared-memory matrix descriptors encoded here (start address, the
  byte offsets between core matrices along K and along M/N; checked on the H200 by
  ``benchmarks/wgmma_gemm.py``);
* an NHWC conv is the same kernel as an implicit GEMM (:class:`ConvGeometry`): each K step's A tile is one
  filter tap's 64 channels of the rows' input pixels, gathered by the same copies, padding zero-filled; rows
  may end in a partial tile (predicated copies and stores);
* thread blocks are launched in groups of ``raster`` tile rows, so a group's B tiles stay in L2;
* the fused kernel's epilogue (the cast, bias, activation, residual that follow the multiply in the
  planner's PrimFunc) is applied to each accumulator before the one store to global memory.

MetaSchedule samples a config among :func:`configs` (an index annotated on the PrimFunc's root block, as
the flash template does); the builder swaps the PrimFunc for the kernel it names (:func:`expand`).
Needs ``sm_90a`` (``wgmma`` is an arch-specific instruction).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from tvmfuse.tune.tirtext import BINARY, FUNCS, expr_text

ANNOTATION = "tvmfuse.wgmma_config"
SMS = 132   # streaming multiprocessors of an H100 / H200 SXM: a persistent kernel's blocks
CANDIDATES = "tvmfuse.wgmma_candidates"
SPEC = "tvmfuse.wgmma_spec"

# A 16-byte cp.async to a shared address that reads nothing and writes 16 zero bytes where ``valid`` is 0
# (PTX's src-size operand): a predicated copy without a branch. TVM 0.27's raw cp.async op takes no predicate
# from TVMScript, so this is a function of our own (``T.cuda.func_call`` with its source; fp16 elements).
ZFILL = "tvmfuse_cp_async_zfill"
_ZFILL_SOURCE = f"""
__forceinline__ __device__ void {ZFILL}(unsigned int dst, void* src, int src_off, int valid) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"((const char*)src + (long long)src_off * 2), "r"(valid * 16));
}}
"""


@dataclass(frozen=True)
class ConvGeometry:
    """An NHWC conv read as an implicit GEMM: input ``[n, h, w, c]``, filter ``[f, r, s, c]`` (OHWI), output
    ``[n, oh, ow, f]``. GEMM row ``(n, oh, ow)``, column ``f``, K ``(r, s, c)`` in the filter's order, so the
    filter is a K-major B as stored; A's element ``(row, k)`` is the input at ``(n, oh * stride - pad + r *
    dilation, ...)``, zero outside it. ``c`` is a multiple of the K step (64): each K step has one ``(r, s)``
    and reads 64 contiguous channels of a pixel, whole 16-byte copies."""

    n: int
    h: int
    w: int
    c: int
    oh: int
    ow: int
    r: int
    s: int
    stride: tuple[int, int]
    pad: tuple[int, int]        # top, left (bottom / right padding: reads past the input, zero like the rest)
    dilation: tuple[int, int]

    @property
    def padded(self) -> bool:
        """Whether some window reads outside the input (needs the zero fill)."""
        (sh, sw), (pt, pl), (dh, dw) = self.stride, self.pad, self.dilation
        return (pt > 0 or pl > 0 or (self.oh - 1) * sh + (self.r - 1) * dh - pt >= self.h
                or (self.ow - 1) * sw + (self.s - 1) * dw - pl >= self.w)


@dataclass(frozen=True)
class GemmSpec:
    """What the template needs of a planner GEMM kernel: ``out[b, i, j] = epilogue(sum_k A[b?, i, k] B[b?, .])``.

    ``batch``: the output's leading dims; A may carry them or not (``a_batched``), B likewise. With B shared by
    the batch and A batched, the batch folds into the rows (``rows = prod(batch) * m``).
    ``b_kmajor``: B stored ``[.., N, K]`` (weights of a Linear, transB); else ``[.., K, N]``.
    """

    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a_batched: bool
    b_batched: bool
    b_kmajor: bool
    conv: ConvGeometry | None = None   # A is a conv's input read as im2col rows (implicit GEMM)

    @property
    def fold_batch(self) -> bool:
        return self.a_batched and not self.b_batched

    @property
    def rows(self) -> int:
        return self.m * math.prod(self.batch) if self.fold_batch else self.m

    @property
    def grid_batch(self) -> int:
        return 1 if self.fold_batch else math.prod(self.batch)

    @property
    def a_elements(self) -> int:
        """A's size in elements (a conv's: its input's)."""
        if self.conv is not None:
            g = self.conv
            return g.n * g.h * g.w * g.c
        return (self.grid_batch * self.m if self.a_batched else self.rows) * self.k

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "batch": list(self.batch)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GemmSpec":
        d = json.loads(text)
        conv = d.get("conv")
        if conv is not None:
            conv = ConvGeometry(**{k: tuple(v) if isinstance(v, list) else v for k, v in conv.items()})
        return cls(**{**d, "batch": tuple(d["batch"]), "conv": conv})


@dataclass(frozen=True)
class WgmmaConfig:
    warpgroups: int = 2   # warpgroups per block (128 threads each)
    m_tiles: int = 1      # 64-row wgmma tiles per warpgroup
    block_n: int = 128    # columns per block (wgmma's N)
    block_k: int = 64     # K per stage
    stages: int = 4       # shared-memory buffers (cp.async runs stages - 1 tiles ahead)
    raster: int = 8       # tile rows launched together (B tiles reused from L2)
    swizzle: int = 128    # shared tiles in wgmma's 128-byte swizzled layout (needs block_k 64), or 0: no swizzle
    inflight: int = 1     # wgmma batches left running at the end of a K step (1: the next step's issue overlaps)
    tma: int = 0          # 1: tiles loaded by TMA from a producer warpgroup, stages handed over by mbarriers
    persistent: int = 0   # 1 (TMA only): one block per SM walks the tiles; the next tile's loads run during the
    #                       epilogue of this one

    @property
    def block_m(self) -> int:
        return 64 * self.m_tiles * self.warpgroups

    @property
    def threads(self) -> int:
        """Threads per block: the computing warpgroups, plus the producer warpgroup of a TMA kernel."""
        return 128 * (self.warpgroups + (1 if self.tma else 0))

    @property
    def name(self) -> str:
        return (f"g{self.warpgroups} m{self.m_tiles} n{self.block_n} k{self.block_k} s{self.stages} "
                f"r{self.raster} z{self.swizzle} f{self.inflight}" + (" t1" if self.tma else "")
                + (" p1" if self.persistent else ""))

    def shared_bytes(self) -> int:
        """The tiles' stages, and a TMA kernel's two mbarriers (8 bytes each) per stage."""
        return 2 * self.stages * self.block_k * (self.block_m + self.block_n) + (16 * self.stages if self.tma else 0)


def parse_config(name: str) -> WgmmaConfig:
    """The config :attr:`WgmmaConfig.name` names (``"g2 m1 n128 k64 s4 r8 z128 f1"``)."""
    f = dict((part[0], int(part[1:])) for part in name.split())
    return WgmmaConfig(warpgroups=f["g"], m_tiles=f["m"], block_n=f["n"], block_k=f["k"], stages=f["s"],
                       raster=f["r"], swizzle=f.get("z", 128), inflight=f.get("f", 1), tma=f.get("t", 0),
                       persistent=f.get("p", 0))


def configs(spec: GemmSpec, *, warpgroups=(2, 1), m_tiles=(1, 2), block_n=(128, 256, 64), block_k=(64,),
            stages=(3, 4, 5), raster=(8, 1), swizzle=(128,), inflight=(0, 1), tma=(0,), persistent=(0,),
            max_shared_bytes: int = 227 * 1024) -> list[WgmmaConfig]:
    """The configs (from the given choices) whose tiles divide ``spec``'s columns and K (rows may end in a
    partial tile) and fit registers and shared memory. TMA configs (``tma`` 1) only with 128-byte swizzled tiles,
    TMA's layout, and for a conv only where its output pixels tile well (:func:`pixel_tile`)."""
    out = []
    for g in warpgroups:
        for mt in m_tiles:
            for n in block_n:
                for kb in block_k:
                    for st in stages:
                        for r, z, f, t, p in [(r, z, f, t, p) for r in raster for z in swizzle for f in inflight
                                              for t in tma for p in persistent]:
                            c = WgmmaConfig(int(g), int(mt), int(n), int(kb), int(st), int(r), int(z), int(f),
                                            int(t), int(p))
                            if c.tma and spec.conv is not None and pixel_tile(spec) is None:
                                continue
                            tiles_m = _tiles_m(spec, c)   # a partial last tile row is predicated
                            if (spec.n % c.block_n == 0 and spec.k % c.block_k == 0
                                    and (spec.conv is None or spec.conv.c % c.block_k == 0)
                                    and (spec.k // c.block_k >= c.stages - 1 or c.stages == min(int(x) for x in stages))
                                    and tiles_m % c.raster == 0
                                    # cp.async: a batch in flight holds a stage: at 3 stages that left two and
                                    # ran 1.24x slower on the H200; at 4 it matched or beat f0.
                                    # TMA: the producer refills a stage as soon as it is released; a batch
                                    # in flight gave wrong results (rel. err. 1-2e-2 on every shape but one,
                                    # H200, cause not found), so TMA kernels wait for their batch
                                    and (c.stages - c.inflight >= 2 + c.inflight if not c.tma
                                         else c.inflight == 0)
                                    and (not c.tma or c.swizzle == 128)
                                    and (c.tma or not c.persistent)
                                    and (c.swizzle == 0 or c.block_k == 64)
                                    and c.m_tiles * c.block_n // 2 <= 128   # fp32 accumulators per thread
                                    and c.shared_bytes() <= max_shared_bytes):
                                out.append(c)
    return out


def _a_predicated(spec: GemmSpec, cfg: WgmmaConfig) -> bool:
    """Whether A's copies zero-fill (a padded conv window, rows past the last whole tile)."""
    return (spec.conv is not None and spec.conv.padded) or spec.rows % cfg.block_m != 0


def pixel_tile(spec: GemmSpec) -> tuple[int, int] | None:
    """A conv's TMA patch: ``(bh, bw)`` output rows and columns of one image, 64 pixels (one wgmma m-tile; a block
    takes ``block_m / 64`` consecutive patches, numbered image by image, row by row). The shape that covers the
    fewest pixels past the output (ties: the wider); None where the conv is strided (a strided box needs TMA's
    traversal strides, not built), its channels are no multiple of 64, or the patches cover more than 15% more
    pixels than the output has (56 x 56: 8 x 8 patches, none idle; 28 x 28: 4 x 16, 14% idle; 14 x 14: none)."""
    g = spec.conv
    if g is None or g.stride != (1, 1) or g.c % 64:
        return None
    best = None
    for bw in (64, 32, 16, 8, 4, 2, 1):
        bh = 64 // bw
        covered = -(-g.oh // bh) * bh * -(-g.ow // bw) * bw
        if best is None or covered < best[0]:
            best = (covered, bh, bw)
    if best[0] * 20 > g.oh * g.ow * 23:
        return None
    return best[1], best[2]


def _patches(spec: GemmSpec) -> int:
    """A TMA conv's patches (:func:`pixel_tile`), all images."""
    g = spec.conv
    bh, bw = pixel_tile(spec)
    return g.n * -(-g.oh // bh) * -(-g.ow // bw)


def _tiles_m(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """Tile rows: of ``block_m / 64`` patches of output pixels for a TMA conv (the last tile's past the output read
    zeros and store nothing), else of ``block_m`` GEMM rows (the last one partial where they do not divide)."""
    if cfg.tma and spec.conv is not None:
        return -(-_patches(spec) // (cfg.block_m // 64))
    return -(-spec.rows // cfg.block_m)


def default_config(spec: GemmSpec) -> WgmmaConfig:
    """The fastest measured where it fits (H200, BENCHMARKS.md): 128x256 tiles by TMA, 4 stages (8192^3 GEMM 1623-1758
    us, 0.95-0.99x cuBLAS; the 3x3 conv 362 us, 0.86x cuDNN), then 256x128 (1757 / 371 us), then
    128x128 (410 us, the conv); else by cp.async: 128x256 tiles, 3 stages (the GEMM 1996-2025 us, the conv 482-490),
    then 256x128, then 128x128."""
    # (an untuned build runs unchecked, so a conv takes the TMA kernel only as run and checked on the H200: stride
    # 1, no dilation, 8 x 8 and partial 2 x 32 patches)
    tma = (0, 1) if spec.conv is None or spec.conv.dilation == (1, 1) else (0,)
    options = configs(spec, tma=tma)
    whole = [c for c in options if spec.rows % c.block_m == 0]   # tiles without a predicated last row first
    options = whole + [c for c in options if c not in whole]
    # (warpgroups, m_tiles, block_n, tma, stages) in order, TMA only at the tile shapes run on the H200; each at the
    # deepest pipeline that fits the K steps and the widest raster group that divides the tile rows
    for g, mt, n, t, stages in ((2, 1, 256, 1, (4, 3)), (2, 2, 128, 1, (4, 3)), (2, 1, 128, 1, (4, 3)),
                                (2, 1, 256, 0, (3,)), (2, 2, 128, 0, (3,)), (2, 1, 128, 0, (3,))):
        for st in stages:
            for raster in (8, 4, 1):
                cfg = WgmmaConfig(g, mt, n, 64, st, raster, 128, 0, t)
                if cfg in options:
                    return cfg
    return options[0]


# ----------------------------------------------------------------------------------------- the kernel
def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" if line.strip() else "\n" for line in text.splitlines())


def desc(buf: str, offset: str, lbo: int, sbo: int, swizzle: int) -> str:
    """A wgmma shared-memory matrix descriptor for ``buf[offset]``: the start address, the leading and stride
    byte offsets (16-byte units; their meaning depends on the layout, see the PTX ISA's "Shared Memory Matrix
    Layout") and the swizzle mode (bits 62-63: 0 none, 1 128-byte)."""
    addr = (f"T.Cast('uint64', T.call_extern('uint32', '__cvta_generic_to_shared', "
            f"T.address_of({buf}[{offset}])))")
    const = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | ((1 if swizzle == 128 else 0) << 62)
    return f"(((({addr}) & T.uint64(0x3FFFF)) >> T.uint64(4)) | T.uint64({const}))"


def wgmma_issue(n: int, accs: str, a: str, b: str, flags: str) -> str:
    """One ``wgmma.mma_async.m64n{n}k16`` (fp16 in, fp32 accumulate) statement: ``accs`` the accumulators, ``a``
    a descriptor or four A registers, ``b`` B's descriptor, ``flags`` the trailing scale/transpose immediates."""
    return (f"T.evaluate(T.ptx.wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16({accs}, {a}, {b}, "
            f"T.ptx.pred(1), {flags}))\n")


def tile_layout(swizzle: int, kmajor: bool, outer: int, kext: int):
    """How a ``[outer, kext]`` (K-major) or ``[kext, outer]`` (MN-major) fp16 tile sits in shared memory for wgmma.

    Returns ``(chunk, desc)``: ``chunk(c)`` -> (outer index, k index, element offset) expressions for the
    tile's 16-byte chunk ``c`` (consecutive chunks: consecutive 16 bytes of one global row, so a warp's
    copies are coalesced, and eight consecutive threads fill one 128-byte line of shared memory: no bank
    conflicts); ``desc(kk)`` -> (element offset of K slice ``kk`` (16 deep), LBO, SBO) for the descriptor.
    With the 128-byte swizzle the K-major extent, or the MN-major ``outer``, must be a multiple of 64.
    """
    if swizzle == 128:   # 8-row x 128-byte atoms, each 16-byte chunk XOR-ed with its row within the atom
        if kmajor:       # K in blocks of 64 (one 128-byte atom row), each block [outer, 64]; atoms 1024 B apart
            nkb = kext // 64

            def chunk(c):
                r, kc = f"({c} // {8 * nkb})", f"({c} % 8)"
                kb = f"({c} // 8 % {nkb})"
                return (r, f"{kb} * 64 + {kc} * 8" if nkb > 1 else f"{kc} * 8",
                        (f"{kb} * {outer * 64} + " if nkb > 1 else "") + f"{r} * 64 + T.bitwise_xor({kc}, {r} % 8) * 8")
            return chunk, lambda kk: (kk // 4 * outer * 64 + kk % 4 * 16, 16, 1024)
        # MN-major: row = k, 64 MN values per atom row; atoms along K 1024 bytes apart, 64-wide MN blocks
        # kext * 128 bytes apart
        per_row = outer // 8

        def chunk(c):
            k, nc = f"({c} // {per_row})", f"({c} % {per_row})"
            off = f"{nc} // 8 * {kext * 64} + {k} * 64 + T.bitwise_xor({nc} % 8, {k} % 8) * 8"
            return f"{nc} * 8", k, off
        return chunk, lambda kk: (kk * 2 * 512, kext * 128, 1024)
    # no swizzle: 8 x 16-byte core matrices of 128 contiguous bytes, chunk c at element c * 8
    if kmajor:   # c = (row // 8) * K + (k // 8) * 8 + row % 8; core matrices along K 128 B apart, along M K*16
        def chunk(c):
            return f"({c} // {kext} * 8 + {c} % 8)", f"({c} // 8 % {kext // 8} * 8)", f"{c} * 8"
        return chunk, lambda kk: (kk * 128, 128, kext * 16)

    def chunk(c):   # c = (k // 8) * outer + (n // 8) * 8 + k % 8; along K outer * 16 B apart, along N 128 B
        return f"({c} // 8 % {outer // 8} * 8)", f"({c} // {outer} * 8 + {c} % 8)", f"{c} * 8"
    return chunk, lambda kk: (kk * 2 * outer * 8, outer * 16, 128)


def _batch_offsets(spec: GemmSpec) -> tuple[str, str]:
    """Flat element offsets of batch ``bz`` in A and in B (0 where not batched, or where the batch folds into
    the rows)."""
    return (f"bz * {spec.m * spec.k}" if spec.a_batched and not spec.fold_batch else "0",
            f"bz * {spec.n * spec.k}" if spec.b_batched else "0")


def _a_read(spec: GemmSpec, row: str, kbase: str, kin: str, tail: bool) -> tuple[str | None, str]:
    """A's element (``row``, ``kbase + kin``) as (a predicate, None where it always holds; its flat offset in A),
    for ``kbase`` a multiple of 64 and ``kin`` below 64. False on rows past ``spec.rows`` (``tail``: a partial
    last tile row) and, for a conv, on window taps outside the input: the element is zero there."""
    conds = [f"{row} < {spec.rows}"] if tail else []
    if spec.conv is None:
        a_batch, _ = _batch_offsets(spec)
        return _all(conds), f"{a_batch} + {row} * {spec.k} + {kbase} + {kin}"
    g = spec.conv
    (sh, sw), (pt, pl), (dh, dw) = g.stride, g.pad, g.dilation
    rs = f"({kbase}) // {g.c}"   # the K step's filter tap (r, s): c is a multiple of 64
    ih = f"({row} // {g.ow} % {g.oh} * {sh} + {rs} // {g.s} * {dh} - {pt})"
    iw = f"({row} % {g.ow} * {sw} + {rs} % {g.s} * {dw} - {pl})"
    if g.padded:
        conds += [f"0 <= {ih}", f"{ih} < {g.h}", f"0 <= {iw}", f"{iw} < {g.w}"]
    pixel = f"({row} // {g.oh * g.ow} * {g.h} + {ih}) * {g.w} + {iw}"
    return _all(conds), f"({pixel}) * {g.c} + ({kbase}) % {g.c} + {kin}"


def _all(conds: list[str]) -> str | None:
    """TVMScript of the conjunction of ``conds`` (None for none)."""
    if not conds:
        return None
    return conds[0] if len(conds) == 1 else f"T.And({conds[0]}, {_all(conds[1:])})"


def _tile_coords(spec: GemmSpec, cfg: WgmmaConfig, tile: str = "bx") -> tuple[str, str]:
    """The tile row and column (``pid_m``, ``pid_n``) of tile number ``tile``: groups of ``raster`` tile rows walk
    the columns together."""
    R, tiles_n = cfg.raster, spec.n // cfg.block_n
    return (f"({tile} // {R * tiles_n} * {R} + {tile} % {R * tiles_n} % {R})",
            f"({tile} % {R * tiles_n} // {R})")


def _pixel_origin(spec: GemmSpec, patch: str) -> tuple[str, str, str]:
    """(image, first output row, first output column) of a TMA conv's patch number ``patch``."""
    g = spec.conv
    bh, bw = pixel_tile(spec)
    ph, pw = -(-g.oh // bh), -(-g.ow // bw)
    return f"({patch} // {ph * pw})", f"({patch} // {pw} % {ph} * {bh})", f"({patch} % {pw} * {bw})"


def _mma_and_store(spec: GemmSpec, cfg: WgmmaConfig, store: str, pid_m: str, pid_n: str,
                   sb_at: int, step: str = "ko") -> tuple[str, str]:
    """TVMScript of one K step's wgmmas (stage ``step % stages``; A's stages at element 0 of ``smem``, B's at
    ``sb_at``) and of the stores of the accumulators (rows past the last predicated)."""
    BM, BN, BK, S, MT = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.m_tiles
    a_tile, b_tile = BM * BK, BN * BK
    _, a_desc = tile_layout(cfg.swizzle, True, BM, BK)
    _, b_desc = tile_layout(cfg.swizzle, spec.b_kmajor, BN, BK)
    wg = "(tx // 128)"
    wgmmas = ""
    for kk in range(BK // 16):
        for t in range(MT):
            accs = ", ".join(f"acc[{t * BN // 2 + i}]" for i in range(BN // 2))
            a_off, a_lbo, a_sbo = a_desc(kk)
            b_off, b_lbo, b_sbo = b_desc(kk)
            # warpgroup g's m-tile t: rows (g * MT + t) * 64 of the block tile, 64 * BK elements each
            da = desc("smem", f"{step} % {S} * {a_tile} + ({wg} * {MT} + {t}) * {64 * BK} + {a_off}", a_lbo, a_sbo,
                       cfg.swizzle)
            db = desc("smem", f"{sb_at} + {step} % {S} * {b_tile} + {b_off}", b_lbo, b_sbo, cfg.swizzle)
            wgmmas += wgmma_issue(BN, accs, da, db, f"1, 1, 0, {0 if spec.b_kmajor else 1}")

    # accumulators i = 2 * p + v (v = 0, 1) are two adjacent columns of one row: stored as one 4-byte vector
    lane, warp = "(tx % 32)", "(tx % 128 // 32)"
    within = f"{warp} * 16 + {lane} // 4 + p % 2 * 8"   # row within the warpgroup's m-tile t
    col = f"{pid_n} * {BN} + p // 2 * 8 + {lane} % 4 * 2 + v"
    if cfg.tma and spec.conv is not None:   # m-tile t is one bh x bw patch of output pixels
        n, oh, ow = _pixel_origin(spec, f"({pid_m} * {BM // 64} + {wg} * {MT} + t)")
        bh, bw = pixel_tile(spec)
        g = spec.conv
        y, x = f"({oh} + ({within}) // {bw})", f"({ow} + ({within}) % {bw})"
        row = f"({n} * {g.oh} + {y}) * {g.ow} + {x}"
        pred = _all(([f"{n} < {g.n}"] if _patches(spec) % (BM // 64) else [])
                    + ([f"{y} < {g.oh}"] if g.oh % bh else []) + ([f"{x} < {g.ow}"] if g.ow % bw else []))
    else:
        row = f"{pid_m} * {BM} + ({wg} * {MT} + t) * 64 + {within}"
        pred = f"{row} < {spec.rows}" if spec.rows % BM else None
    stored = store.format(bz="bz", row=f"({row})", col=f"({col})", acc=f"acc[t * {BN // 2} + p * 2 + v]")
    if pred is not None:
        stored = f"if {pred}:\n    {stored}"
    stores = (f"for t in T.unroll({MT}):\n    for p in T.unroll({BN // 4}):\n        for v in T.vectorized(2):\n"
              + _indent(stored, 12))
    return wgmmas, stores


def gemm_source(spec: GemmSpec, cfg: WgmmaConfig, params: list[str], a: str, b: str,
                store: str) -> str:
    """TVMScript of the kernel: ``params`` the function's parameter declarations, ``a`` / ``b`` the names of the
    A and B buffers among them, ``store`` the store of one accumulator, a format string with the fields
    ``{bz}`` (flattened batch index), ``{row}``, ``{col}`` (output row within the batch and column) and
    ``{acc}`` (the fp32 accumulator)."""
    if cfg.tma:
        return tma_source(spec, cfg, params, a, b, store)
    BM, BN, BK, S, MT, NT = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.m_tiles, cfg.threads
    M, N, K = spec.rows, spec.n, spec.k
    tiles_m, tiles_n, kt = -(-M // BM), N // BN, K // BK
    tail = M % BM != 0   # the last tile row reads zeros past row M and stores nothing there
    F = cfg.inflight
    pid_m, pid_n = _tile_coords(spec, cfg)
    a_tile, b_tile = BM * BK, BN * BK
    _, b_batch = _batch_offsets(spec)
    a_chunk, _ = tile_layout(cfg.swizzle, True, BM, BK)
    b_chunk, _ = tile_layout(cfg.swizzle, spec.b_kmajor, BN, BK)
    zfill = bool(F) and _a_predicated(spec, cfg)   # A's predicated copies in the main loop: branch-free
    # One shared allocation: A's stages at 0, B's at sb_at. (With two, TVM's shared-memory planner sees no use of
    # A's tiles in the main loop when its only accesses there are the zero-filling copies and the descriptors, and
    # lays B's tiles over A's: wrong results at 3 stages with a batch in flight on the H200.)
    sb_at = S * a_tile

    def copies(slot: str, step: str, branch: bool = False) -> str:
        out = ""
        for dst, src, tile, chunk, glob in (
                (0, a, a_tile, a_chunk, lambda o, k: _a_read(spec, f"({pid_m} * {BM} + {o})", f"{step} * {BK}", k,
                                                                tail)),
                (sb_at, b, b_tile, b_chunk,
                 (lambda o, k: (None, f"{b_batch} + ({pid_n} * {BN} + {o}) * {K} + {step} * {BK} + {k}"))
                 if spec.b_kmajor else
                 (lambda o, k: (None, f"{b_batch} + ({step} * {BK} + {k}) * {N} + {pid_n} * {BN} + {o}")))):
            o, k, off = chunk(f"(it * {NT} + tx)")
            pred, at = glob(o, k)
            at_smem = f"{dst} + ({slot}) * {tile} + {off}" if dst else f"({slot}) * {tile} + {off}"
            copy = f"T.evaluate(T.s_tir.cp_async_raw('float16', smem.data, {at_smem}, {src}.data, {at}, 16))"
            if pred is not None and zfill and not branch:
                # 16 zero bytes where the element is not read, without a branch (with a batch in flight ptxas
                # serializes the wgmmas around one, C7514); the source offset is 0 there
                copy = (f"T.evaluate(T.cuda.func_call({ZFILL!r}, smem_base + T.uint32(({at_smem}) * 2), "
                        f"{src}.data, T.Select({pred}, {at}, 0), T.Cast('int32', {pred}), "
                        f"source_code={_ZFILL_SOURCE!r}))")
            elif pred is not None:   # 16 zero bytes where the element is not read (a conv's padding, rows past M)
                copy = (f"if {pred}:\n    {copy}\nelse:\n    for v in T.vectorized(8):\n"
                        f"        smem[{at_smem} + v] = T.float16(0)")
            out += f"for it in T.unroll({tile // 8 // NT}):\n{_indent(copy, 4)}"
        return out

    wgmmas, stored = _mma_and_store(spec, cfg, store, pid_m, pid_n, sb_at)
    # Loads run L = S - 1 - F tiles ahead: a stage is refilled once the wgmma batches that read it are done
    # (with F batches left in flight at a step's end, the stage read F + 1 steps ago; the barrier at the top
    # of each step orders every warpgroup's wait before anyone's refill). One cp.async group per tile.
    L = S - 1 - F
    # (with fewer K steps than that, the missing tiles' groups are committed empty, so the waits keep counting)
    # (The prologue keeps the branches: outside the loop they serialize nothing, and TVM's shared-memory planner
    # needs a cp.async into sa that it recognizes, or it leaves sa out of the merged allocation.)
    prologue = "".join((copies(str(s_), str(s_), branch=True) if s_ < kt else "")
                       + "T.evaluate(T.ptx.cp.async_.commit_group())\n" for s_ in range(L))
    base = 'smem_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(smem[0]))\n' if zfill else ""
    if F:   # no branch while a batch is in flight across the step: ptxas serializes the wgmmas around one
        #     (C7514). Past the last tile the refill copies tile kt - 1 again, into a stage no later step reads
        refill = copies(f"(ko + {L}) % {S}", f"T.min(ko + {L}, {kt - 1})")
    else:
        refill = f"if ko + {L} < {kt}:\n" + _indent(copies(f"(ko + {L}) % {S}", f"(ko + {L})"), 4)
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
    for bz in T.thread_binding({spec.grid_batch}, thread="blockIdx.y"):
        for bx in T.thread_binding({tiles_m * tiles_n}, thread="blockIdx.x"):
            for tx in T.thread_binding({NT}, thread="threadIdx.x"):
                smem = T.alloc_buffer(({S * (a_tile + b_tile)},), "float16", scope="shared.dyn", align=1024)
                acc = T.alloc_buffer(({MT * BN // 2},), "float32", scope="local")
{_indent(base, 16)}                for i in T.unroll({MT * BN // 2}):
                    acc[i] = T.float32(0)
{_indent(prologue, 16)}                for ko in T.serial({kt}):
                    T.evaluate(T.ptx.cp.async_.wait_group({L - 1}))
                    T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
                    T.tvm_storage_sync("shared")
                    T.evaluate(T.ptx.wgmma.fence.sync.aligned())
{_indent(wgmmas, 20)}                    T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
{_indent(refill, 20)}                    T.evaluate(T.ptx.cp.async_.commit_group())
                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned({F}))
                T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_indent(stored, 16)}"""


# The TMA kernel's PTX, as device functions of our own (``T.cuda.func_call`` with this source): mbarriers in
# shared memory (32-bit shared addresses), a wait that spins on try_wait inside the asm (its labels are local to
# the braces), an arrive predicated without a branch, and the 3-D and 4-D tiled TMA loads that complete on an
# mbarrier. The wait and the arrive, which run between wgmmas, take no "memory" clobber (volatile asm statements
# keep their order among themselves, wgmmas included; a clobber tells the compiler the asm may read the
# accumulator array). Dropping it was tried against the wrong results of TMA kernels with a batch in flight (H200)
# and did not change them; those kernels are not offered (:func:`configs`).
_TMA_SOURCE = {
    "tvmfuse_mbar_init": r"""
__forceinline__ __device__ void tvmfuse_mbar_init(unsigned int bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
""",
    "tvmfuse_mbar_init_fence": r"""
__forceinline__ __device__ void tvmfuse_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
""",
    "tvmfuse_mbar_expect_tx": r"""
__forceinline__ __device__ void tvmfuse_mbar_expect_tx(unsigned int bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
""",
    "tvmfuse_mbar_arrive_if": r"""
__forceinline__ __device__ void tvmfuse_mbar_arrive_if(unsigned int bar, int pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}"
               :: "r"(bar), "r"(pred));
}
""",
    "tvmfuse_mbar_wait": r"""
__forceinline__ __device__ void tvmfuse_mbar_wait(unsigned int bar, int parity) {
  asm volatile("{\n.reg .pred p;\nTVMFUSE_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra.uni TVMFUSE_WAIT;\n}" :: "r"(bar), "r"(parity));
}
""",
    # Hopper's warpgroup register reallocation: the producer gives registers back, the computing warpgroups take
    # them (two computing warpgroups: 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536)
    "tvmfuse_regs_take": r"""
__forceinline__ __device__ void tvmfuse_regs_take() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
}
""",
    "tvmfuse_regs_give": r"""
__forceinline__ __device__ void tvmfuse_regs_give() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
}
""",
    "tvmfuse_tma_load_4d": r"""
__forceinline__ __device__ void tvmfuse_tma_load_4d(unsigned int dst, unsigned long long map, int c0, int c1, int c2,
                                                    int c3, unsigned int bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
""",
    "tvmfuse_tma_load_3d": r"""
__forceinline__ __device__ void tvmfuse_tma_load_3d(unsigned int dst, unsigned long long map, int c0, int c1, int c2,
                                                    unsigned int bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
""",
}


def _ptx(fn: str, *args: str) -> str:
    """A statement calling one of :data:`_TMA_SOURCE`'s functions (TVM emits a function's source once per name)."""
    return f"T.evaluate(T.cuda.func_call({', '.join([repr(fn), *args])}, source_code=_TMA_SOURCE[{fn!r}]))\n"


def tma_maps(spec: GemmSpec, cfg: WgmmaConfig) -> dict[str, dict]:
    """The TMA tensor maps of A and B, in the CUDA driver's order (innermost dimension first): ``dims`` (elements),
    ``strides`` (bytes, of every dimension but the first), ``box`` (elements of one load) and where the block's
    loads of K step ``j`` start, ``coords(pid_m, pid_n, j)`` -> a list of (element offset of the load in the
    stage's tile, [c0, c1, ..]) as TVMScript (``bz``: the batch index).

    A is 3-D ``[batch, rows, K]``, one ``[block_m, 64]`` box per step (batch 1 where it folds into the rows or is
    not batched); a conv's A is its NHWC input, 4-D, one ``[1, bh, bw, 64]`` box of input pixels per patch and
    step (the patch's output pixels shifted by the step's filter tap, 64 of its channels; :func:`pixel_tile`):
    padding and patches past the last image read outside the input, which TMA fills with zeros. B is ``[batch, N,
    K]`` (K-major, one ``[block_n, 64]`` box) or ``[batch, K, N]`` (one ``[64, 64]`` box per 64 columns). Each box
    lands in shared memory 128-byte swizzled: row ``r``'s 16-byte chunk ``c`` at chunk ``r * 8 + (c ^ r % 8)``,
    :func:`tile_layout`'s layout of the tile. Rows past the tensor read as zero."""
    BM, BN = cfg.block_m, cfg.block_n
    M, N, K = spec.rows, spec.n, spec.k
    a_rows, a_batch = (spec.m, spec.grid_batch) if spec.a_batched and not spec.fold_batch else (M, 1)
    b_batch = spec.grid_batch if spec.b_batched else 1
    az = "bz" if a_batch > 1 else "0"
    bz = "bz" if b_batch > 1 else "0"
    a = {"dims": [K, a_rows, a_batch], "strides": [2 * K, 2 * K * a_rows], "box": [64, BM, 1],
         "coords": lambda pm, pn, j: [(0, [f"{j} * 64", f"{pm} * {BM}", az])]}
    if spec.conv is not None:
        g = spec.conv
        bh, bw = pixel_tile(spec)
        cpt = g.c // 64   # K steps per filter tap
        (dh, dw), (pt, pl) = g.dilation, g.pad

        def conv_coords(pm, pn, j):
            out = []
            for q in range(BM // 64):   # the block's patches, one box each, 64 rows of the tile apart
                n, oh, ow = _pixel_origin(spec, f"({pm} * {BM // 64} + {q})")
                out.append((q * 64 * 64, [f"{j} % {cpt} * 64", f"{ow} + {j} // {cpt} % {g.s} * {dw} - {pl}",
                                          f"{oh} + {j} // {cpt} // {g.s} * {dh} - {pt}", n]))
            return out
        a = {"dims": [g.c, g.w, g.h, g.n], "strides": [2 * g.c, 2 * g.c * g.w, 2 * g.c * g.w * g.h],
             "box": [64, bw, bh, 1], "coords": conv_coords}
    if spec.b_kmajor:
        b = {"dims": [K, N, b_batch], "strides": [2 * K, 2 * K * N], "box": [64, BN, 1],
             "coords": lambda pm, pn, j: [(0, [f"{j} * 64", f"{pn} * {BN}", bz])]}
    else:
        b = {"dims": [N, K, b_batch], "strides": [2 * N, 2 * N * K], "box": [64, 64, 1],
             "coords": lambda pm, pn, j: [(nb * 64 * 64, [f"{pn} * {BN} + {nb * 64}", f"{j} * 64", bz])
                                          for nb in range(BN // 64)]}
    return {"a": a, "b": b}


def tma_source(spec: GemmSpec, cfg: WgmmaConfig, params: list[str], a: str, b: str, store: str) -> str:
    """TVMScript of the warp-specialized TMA kernel (:func:`gemm_source`'s arguments; a GEMM, or a stride-1 conv
    whose output pixels tile well, :func:`pixel_tile`).

    The host encodes A's and B's tensor maps (:func:`tma_maps`, 128-byte swizzle) before the launch; the kernel
    takes them by value (``const __grid_constant__ CUtensorMap``). Warpgroups ``0 .. warpgroups - 1`` compute;
    one thread of the last warpgroup produces. Stage ``s`` has two mbarriers: ``full[s]`` (the producer's arrival
    with the stage's byte count; TMA completes the bytes) and ``empty[s]`` (every computing thread arrives once the
    wgmma batch that read the stage is done). The producer waits for ``empty`` before refilling a stage; the
    computing warpgroups wait for ``full`` before their wgmmas, and no thread waits for the whole block inside the
    loop. The n-th completion of a barrier has phase parity ``n % 2``. A persistent kernel (``persistent`` 1)
    launches :data:`SMS` blocks, each walking tiles ``bx, bx + grid, ..``; its barriers' phases run on across
    them, so the producer loads the next tile while the computing warpgroups store this one."""
    BM, BN, BK, S, F = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.inflight
    NC = 128 * cfg.warpgroups   # computing threads
    tiles_m, tiles_n, kt = _tiles_m(spec, cfg), spec.n // BN, spec.k // BK
    tiles = tiles_m * tiles_n
    # blocks, and tiles per block: block bx takes tiles bx, bx + grid, ..; the barriers' phases run on across them
    # (step g = it * kt + k of the block's it-th tile)
    grid = min(tiles, SMS) if cfg.persistent else tiles
    per_block = -(-tiles // grid)
    pid_m, pid_n = _tile_coords(spec, cfg, f"(bx + it * {grid})")
    a_tile, b_tile = BM * BK, BN * BK
    sb_at = S * a_tile
    wgmmas, stored = _mma_and_store(spec, cfg, store, pid_m, pid_n, sb_at, step="g")
    maps = tma_maps(spec, cfg)
    bars = 2 * S * (a_tile + b_tile)   # byte offset of the mbarriers: full[0..S), then empty[0..S)

    def full(s: str) -> str:
        return f"smem_base + T.uint32({bars} + ({s}) * 8)"

    def empty(s: str) -> str:
        return f"smem_base + T.uint32({bars + 8 * S} + ({s}) * 8)"

    encode = ""
    for name, buf in (("a", a), ("b", b)):
        m = maps[name]
        rank = len(m["dims"])
        args = [f"{name}map", f"{buf}.data", *map(str, m["dims"]), *map(str, m["strides"]), *map(str, m["box"]),
                *["1"] * rank]
        encode += (f"{name}map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)\n"
                   f"T.evaluate(T.tensormap_encode_tiled({', '.join(args)}, descriptor_dtype='float16', "
                   f"rank={rank}, swizzle=3))\n")
    loads = _ptx("tvmfuse_mbar_expect_tx", full("s"), str(2 * (a_tile + b_tile)))
    for name, at in (("a", "0"), ("b", str(sb_at))):
        tile = a_tile if name == "a" else b_tile
        for off, coords in maps[name]["coords"](pid_m, pid_n, "k"):
            dst = f"smem_base + T.uint32(({at} + s * {tile} + {off}) * 2)"
            loads += _ptx(f"tvmfuse_tma_load_{len(coords)}d", dst, f"T.address_of({name}map)", *coords, full("s"))
    init = "".join(_ptx("tvmfuse_mbar_init", full(str(s)), "1") + _ptx("tvmfuse_mbar_init", empty(str(s)), str(NC))
                   for s in range(S)) + _ptx("tvmfuse_mbar_init_fence")
    # the stage read F steps ago is released once this step's wait leaves at most F batches in flight
    release = _ptx("tvmfuse_mbar_arrive_if", empty(f"(g + {S - F}) % {S}"), f"T.Cast('int32', g >= {F})")
    # two computing warpgroups: 384 threads leave 168 registers each, which spilled the 128 accumulators of a
    # 64 x 256 tile; the producer's registers go to them (one computing warpgroup has 255 already)
    take, give = ((_ptx("tvmfuse_regs_take").strip(), _ptx("tvmfuse_regs_give").strip()) if cfg.warpgroups == 2
                  else ("T.evaluate(0)", "T.evaluate(0)"))
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
{_indent(encode, 4)}    for bz in T.thread_binding({spec.grid_batch}, thread="blockIdx.y"):
        for bx in T.thread_binding({grid}, thread="blockIdx.x"):
            for tx in T.thread_binding({cfg.threads}, thread="threadIdx.x"):
                smem = T.alloc_buffer(({S * (a_tile + b_tile) + 8 * S},), "float16", scope="shared.dyn", align=1024)
                acc = T.alloc_buffer(({cfg.m_tiles * BN // 2},), "float32", scope="local")
                smem_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(smem[0]))
                if tx == 0:
                    # a store TVM's shared-memory planner sees, at the buffer's last element (the last mbarrier,
                    # initialized next): it drops an allocation only ever addressed (descriptors, TMA, mbarriers)
                    # and sizes one to its highest access, and the launch got no dynamic shared memory
                    smem[{S * (a_tile + b_tile) + 8 * S - 1}] = T.float16(0)
{_indent(init, 20)}                T.tvm_storage_sync("shared")
                if tx < {NC}:
                    {take}
                    for it in T.serial({per_block}):
                        if bx + it * {grid} < {tiles}:
                            for i in T.unroll({cfg.m_tiles * BN // 2}):
                                acc[i] = T.float32(0)
                            for ko in T.serial({kt}):
                                g: T.let[T.int32] = it * {kt} + ko
                                {_ptx("tvmfuse_mbar_wait", full(f"g % {S}"), f"g // {S} % 2").strip()}
                                T.evaluate(T.ptx.wgmma.fence.sync.aligned())
{_indent(wgmmas, 32)}                                T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
                                T.evaluate(T.ptx.wgmma.wait_group.sync.aligned({F}))
                                {release.strip()}
                            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_indent(stored, 28)}                else:
                    {give}
                    if tx == {NC}:
                        for it in T.serial({per_block}):
                            if bx + it * {grid} < {tiles}:
                                for k in T.serial({kt}):
                                    g: T.let[T.int32] = it * {kt} + k
                                    s: T.let[T.int32] = g % {S}
                                    if g >= {S}:
                                        {_ptx("tvmfuse_mbar_wait", empty("s"), f"(g // {S} + 1) % 2").strip()}
{_indent(loads, 36)}"""


def reference_source(spec: GemmSpec, params: list[str], a: str, b: str, store: str) -> str:
    """TVMScript of a scalar twin of :func:`gemm_source` for any target: the same flat A/B addressing (batch
    folding included) and the same ``store``, one output element per iteration. Built for the CPU, it checks
    a kernel's spec and epilogue translation numerically where wgmma cannot run."""
    M, N, K = spec.rows, spec.n, spec.k
    _, b_batch = _batch_offsets(spec)
    b_at = f"{b_batch} + col * {K} + kk" if spec.b_kmajor else f"{b_batch} + kk * {N} + col"
    tail = M % 64 != 0   # rows run on to a whole 64-row tile, through the kernel's predicates
    pred, a_at = _a_read(spec, "row", "kk // 64 * 64", "kk % 64", tail)
    mac = f"acc[0] = acc[0] + T.Cast('float32', af[{a_at}]) * T.Cast('float32', bf[{b_at}])"
    if pred is not None:
        mac = f"if {pred}:\n    {mac}"
    stored = store.format(bz="bz", row="row", col="col", acc="acc[0]")
    if tail:
        stored = f"if row < {M}:\n    {stored}"
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True}})
    acc = T.alloc_buffer((1,), "float32")
    af = T.decl_buffer(({spec.a_elements},), "float16", data={a}.data)
    bf = T.decl_buffer(({(spec.grid_batch if spec.b_batched else 1) * N * K},), "float16", data={b}.data)
    for bz, row, col in T.grid({spec.grid_batch}, {-(-M // 64) * 64}, {N}):
        acc[0] = T.float32(0)
        for kk in range({K}):
{_indent(mac, 12)}{_indent(stored, 8)}"""


def reference_for(func):
    """The scalar twin (:func:`reference_source`) of ``func``'s wgmma kernel, its parameters as the kernel's."""
    spec, info = analyze(func)
    return parse(reference_source(spec, _param_decls(func), f"p{info['a']}", f"p{info['b']}", info["store"]))


def parse(source: str):
    from tvmfuse._tvm import tvm
    from tvm.script import tirx as T

    return tvm.script.parse(source, extra_vars={"T": T, "_TMA_SOURCE": _TMA_SOURCE})


# ------------------------------------------------------------------------ the planner's GEMM kernels
class Misfit(ValueError):
    """The kernel is not a GEMM this template takes (the reason is the message)."""


def _script(expr, env: dict, buffers: dict, acc) -> str:
    """TVMScript text of an epilogue expression: variables through ``env`` (name -> text), loads of a function
    parameter through ``buffers`` (buffer -> parameter name), and the load ``acc`` = (buffer, [vars]) of the
    GEMM's result as ``{acc}``. Raises :class:`Misfit` on anything else."""
    def load(node, rec):
        src = _name(node)
        if src == acc[0]:
            if [str(i) for i in node.indices] != acc[1]:
                raise Misfit("the epilogue reads the product at other indices")
            return "{acc}"
        name = buffers.get(src)
        if name is None:
            raise Misfit(f"the epilogue reads an intermediate buffer ({src})")
        return f"{name}[{', '.join(rec(i) for i in node.indices)}]"

    def var(node):
        if node.name not in env:
            raise Misfit(f"unknown variable {node.name}")
        return env[node.name]

    return expr_text(expr, load, var, lambda why: Misfit(f"the epilogue {why}"))


def _name(node) -> str:
    """The buffer a load reads or a store writes, by name (TVM 0.27 loads name a ``source``, stores a ``buffer``)."""
    for field in ("source", "buffer"):
        if hasattr(node, field):
            return str(getattr(node, field).name)
    raise Misfit(f"not a load or store: {type(node).__name__}")


def _param_buffers(func) -> list:
    """The buffers of ``func``'s parameters (TVM 0.27: the parameters are typed buffers; earlier: buffer_map)."""
    return [func.buffer_map[p] if hasattr(func, "buffer_map") else p for p in func.params]


def _param_decls(func) -> list[str]:
    """TVMScript declarations of ``func``'s parameters, renamed ``p0, p1, ..`` (the names a store refers to)."""
    return [f"p{n}: T.Buffer({tuple(int(d) for d in buf.shape)!r}, '{buf.dtype}')"
            for n, buf in enumerate(_param_buffers(func))]


def _reduction_blocks(sch) -> list:
    return [b for b in sch.get_child_blocks(sch.get_sblock("root"))
            if any(int(iv.iter_type) == 2 for iv in sch.get(b).iter_vars)]


def _extents(block) -> list[int]:
    return [int(iv.dom.extent) for iv in block.iter_vars]


def analyze(func) -> tuple[GemmSpec, dict]:
    """The :class:`GemmSpec` of a planner GEMM PrimFunc (its elementwise intermediates inlined), and what the
    kernel generator needs besides: ``a`` / ``b`` (parameter indices of A and B) and ``store`` (the epilogue's
    store, with the fields of :func:`gemm_source`'s ``store``). Raises :class:`Misfit`."""
    from tvmfuse._tvm import tvm
    from tvmfuse.tune.sketch import inline_all_but_outputs

    sch = tvm.s_tir.Schedule(func)
    reductions = _reduction_blocks(sch)
    if len(reductions) != 1:
        raise Misfit("needs exactly one reduction block")
    main_name = sch.get(reductions[0]).name_hint
    inline_all_but_outputs(sch, keep=(main_name,))
    func = sch.mod["main"]
    bufs = _param_buffers(func)
    params = {str(buf.name): i for i, buf in enumerate(bufs)}
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    main = next(b for b in blocks if b.name_hint == main_name)
    rest = [b for b in blocks if b.name_hint != main_name]
    if main.init is None or type(main.body).__name__ != "BufferStore":
        raise Misfit("the reduction is not an initialized accumulation")
    spatial = [iv for iv in main.iter_vars if int(iv.iter_type) == 0]
    red = [iv for iv in main.iter_vars if int(iv.iter_type) == 2]
    conv = len(red) == 3 and len(spatial) == 4   # an NHWC conv: (n, oh, ow, f) x (r, s, c)
    if not conv and len(red) != 1 or len(spatial) < 2 or len(spatial) + len(red) != len(main.iter_vars):
        raise Misfit("needs spatial dims and one reduction dim (a conv: four and three)")
    c_store = main.body
    c = _name(c_store)
    names = [str(iv.var.name) for iv in spatial]
    if [str(i) for i in c_store.indices] != names or str(c_store.buffer.dtype) != "float32":
        raise Misfit("needs an fp32 accumulator indexed by the spatial dims")
    value = c_store.value
    if type(value).__name__ != "Add" or type(value.b).__name__ != "Mul":
        raise Misfit("the reduction is not a multiply-accumulate")
    ext = [int(iv.dom.extent) for iv in spatial]
    if conv:
        spec, x, y = _conv_spec(value.b, names, red, ext, bufs, params)
        oh, ow = ext[1], ext[2]
        out_idx = ["{row}" + f" // {oh * ow}", "{row}" + f" // {ow} % {oh}", "{row}" + f" % {ow}", "{col}"]
    else:
        spec, x, y = _gemm_spec(value.b, names, red[0], ext, bufs, params)
        out_idx = _gemm_out_index(spec)
    pname = {name: f"p{n}" for name, n in params.items()}
    reindexed = False
    if not rest:
        if c not in params:
            raise Misfit("no output")
        store = f"{pname[c]}[{', '.join(out_idx)}] = {{acc}}"
    else:
        if len(rest) != 1 or type(rest[0].body).__name__ != "BufferStore":
            raise Misfit("the epilogue is not one elementwise block")
        epi = rest[0]
        out = _name(epi.body)
        if out not in params or any(int(iv.iter_type) != 0 for iv in epi.iter_vars):
            raise Misfit("the epilogue does not store a parameter elementwise")
        evars = [str(iv.var.name) for iv in epi.iter_vars]
        reads = {tuple(str(i) for i in ld.indices) for ld in _loads(epi.body.value) if _name(ld) == c}
        if len(reads) != 1:
            raise Misfit("the epilogue reads the product at more than one index")
        (read,) = reads
        if list(read) == evars and _extents(epi) == ext:   # elementwise: the product's index is the output's
            env = dict(zip(evars, [f"({e})" for e in out_idx]))
        else:   # a reshape / transpose of the product (heads split off, NHWC back to NCHW): invert the read
            env = _inverted_env(epi, c, out_idx, math.prod(ext))
            reindexed = True
        expr = _script(epi.body.value, env, pname, (c, list(read)))
        store = f"{pname[out]}[{', '.join(_script(i, env, pname, (c, list(read))) for i in epi.body.indices)}] = {expr}"
    return spec, {"a": params[_name(x)], "b": params[_name(y)], "store": store, "reindexed": reindexed}


def _fp16_param(e, bufs, params):
    """The fp16 parameter load ``e`` is (through a cast), or :class:`Misfit`."""
    if type(e).__name__ == "Cast":
        e = e.value
    if type(e).__name__ not in ("TensorLoad", "BufferLoad") or _name(e) not in params:
        raise Misfit("the operands are not parameters")
    if str(bufs[params[_name(e)]].dtype) != "float16":
        raise Misfit("the operands are not fp16")
    return e


def _gemm_spec(mul, names, red, ext, bufs, params):
    """(spec, A's load, B's load) of a (batched) GEMM's multiply ``mul`` over the spatial ``names``."""
    x, y = _fp16_param(mul.a, bufs, params), _fp16_param(mul.b, bufs, params)
    *batch, i, j = names
    k = str(red.var.name)
    idx = lambda e: [str(t) for t in e.indices]  # noqa: E731
    if i in idx(y):
        x, y = y, x
    ax, bx = idx(x), idx(y)
    if ax[-2:] != [i, k] or ax[:-2] not in ([], batch):
        raise Misfit(f"A is not [.., rows, K] ({ax})")
    if bx[-2:] == [k, j]:
        b_kmajor = False
    elif bx[-2:] == [j, k]:
        b_kmajor = True
    else:
        raise Misfit(f"B is not [.., K, N] or [.., N, K] ({bx})")
    if bx[:-2] not in ([], batch):
        raise Misfit("B is batched over part of the batch")
    spec = GemmSpec(batch=tuple(ext[:len(batch)]), m=ext[-2], n=ext[-1], k=int(red.dom.extent),
                    a_batched=bool(batch) and len(ax) > 2, b_batched=bool(batch) and len(bx) > 2,
                    b_kmajor=b_kmajor)
    if spec.b_batched and not spec.a_batched:
        raise Misfit("B batched but A shared")
    b_dims = [spec.n, spec.k] if b_kmajor else [spec.k, spec.n]
    for load, dims in ((x, [*spec.batch[:len(ax) - 2], spec.m, spec.k]), (y, [*spec.batch[:len(bx) - 2], *b_dims])):
        if [int(d) for d in bufs[params[_name(load)]].shape] != dims:
            raise Misfit(f"{_name(load)}'s shape is not its loads' extents")
    return spec, x, y


def _conv_spec(mul, names, red, ext, bufs, params):
    """(spec, the input's load, the filter's load) of an NHWC conv's multiply ``mul``: the output ``(n, oh, ow,
    f)`` over ``names``, the filter read ``[f, r, s, c]`` and the input ``[n, oh * sh + r * dh - pt, ow * sw + s *
    dw - pl, c]``, zero-padded through an ``if_then_else`` where a window leaves the input."""
    from tvm import sym

    from tvmfuse._tvm import tvm

    loads = []
    for e in (mul.a, mul.b):
        e = e.value if type(e).__name__ == "Cast" else e
        guarded = type(e).__name__ == "Call" and str(getattr(e.op, "name", "")).endswith(".if_then_else")
        if guarded:   # the padding, inlined: if_then_else(inside the input, the load, 0)
            zero = e.args[2]
            if type(zero).__name__ not in ("FloatImm", "IntImm") or float(zero.value) != 0.0:
                raise Misfit("the conv pads with a nonzero value")
            e = e.args[1]
        loads.append((_fp16_param(e, bufs, params), guarded))
    n, oh, ow, f = names
    r, s_, c = (str(iv.var.name) for iv in red)
    idx = lambda e: [str(t) for t in e.indices]  # noqa: E731
    if idx(loads[0][0]) == [f, r, s_, c]:
        loads.reverse()
    (x, guarded), (y, _) = loads
    if idx(y) != [f, r, s_, c]:
        raise Misfit(f"the filter is not read [f, r, s, c] (OHWI) ({idx(y)})")
    if len(x.indices) != 4 or idx(x)[0] != n or idx(x)[3] != c:
        raise Misfit(f"the input is not read [n, .., .., c] (NHWC) ({idx(x)})")
    geo = []
    for index, out_var, tap in ((x.indices[1], oh, r), (x.indices[2], ow, s_)):
        free = {str(v.name): v for v in tvm.tirx.analysis.undefined_vars(index, [])}
        if set(free) != {out_var, tap}:
            raise Misfit("the input's spatial index is not stride * out + dilation * tap + offset")
        coef = sym.detect_linear_equation(index, [free[out_var], free[tap]])
        if len(coef) != 3 or not all(type(k).__name__ == "IntImm" for k in coef):
            raise Misfit("the input's spatial index is not linear")
        stride, dilation, offset = (int(k.value) for k in coef)
        if stride < 1 or dilation < 1 or offset > 0:
            raise Misfit("a conv window this template does not take")
        geo.append((stride, dilation, -offset))
    (sh, dh, pt), (sw, dw, pl) = geo
    in_shape = [int(d) for d in bufs[params[_name(x)]].shape]
    f_shape = [int(d) for d in bufs[params[_name(y)]].shape]
    ks = [int(iv.dom.extent) for iv in red]
    if f_shape != [ext[3], *ks] or in_shape[0] != ext[0] or in_shape[3] != ks[2]:
        raise Misfit("the conv's buffers are not its loads' extents")
    g = ConvGeometry(n=ext[0], h=in_shape[1], w=in_shape[2], c=ks[2], oh=ext[1], ow=ext[2], r=ks[0], s=ks[1],
                     stride=(sh, sw), pad=(pt, pl), dilation=(dh, dw))
    if g.padded and not guarded:
        raise Misfit("the conv reads outside its input without padding")
    if g.c % 64:
        raise Misfit(f"the conv's input channels ({g.c}) are not a multiple of 64")
    # a 1x1 conv of stride 1 reads its NHWC input as a [rows, channels] matrix, row for row: a GEMM (whose A tiles
    # TMA loads at any image size, where the conv's pixel patches leave 14x14 and 7x7 images to cp.async)
    pointwise = (g.r, g.s, g.stride, g.pad, g.h, g.w) == (1, 1, (1, 1), (0, 0), g.oh, g.ow)
    spec = GemmSpec(batch=(), m=g.n * g.oh * g.ow, n=ext[3], k=g.r * g.s * g.c, a_batched=False, b_batched=False,
                    b_kmajor=True, conv=None if pointwise else g)
    return spec, x, y


def _gemm_out_index(spec: GemmSpec) -> list[str]:
    """The product's index of (bz, row, col) as format strings: rows fold the batch when B is shared."""
    nb = len(spec.batch)
    flat, inner_rows = ("{row}" + f" // {spec.m}", "{row}" + f" % {spec.m}") if spec.fold_batch else ("{bz}", "{row}")
    bidx = []
    for d in range(nb):
        inner = math.prod(spec.batch[d + 1:])
        e = f"({flat}) // {inner}" if inner > 1 else f"({flat})"
        bidx.append(f"{e} % {spec.batch[d]}" if d else e)
    return [*bidx, inner_rows, "{col}"]


def _loads(expr) -> list:
    """Every buffer load in an expression (the node kinds :func:`_script` translates)."""
    kind = type(expr).__name__
    if kind in ("TensorLoad", "BufferLoad"):
        return [expr] + [ld for i in expr.indices for ld in _loads(i)]
    children = {"Cast": ("value",), "Not": ("a",), "Select": ("condition", "true_value", "false_value")}.get(
        kind, ("a", "b") if kind in BINARY or kind in FUNCS or kind in ("And", "Or") else ())
    out = [ld for f in children for ld in _loads(getattr(expr, f))]
    if kind == "Call":
        out += [ld for a in expr.args for ld in _loads(a)]
    return out


def _inverted_env(epi, c: str, out_idx: list[str], size: int) -> dict:
    """The epilogue's iteration variables as TVMScript of the product's index (``out_idx``: batch dims, row,
    column), when the epilogue reads the product through a bijective index map (a reshape or transpose)."""
    from tvmfuse._tvm import tvm

    read = next(ld for ld in _loads(epi.body.value) if _name(ld) == c)
    ext = _extents(epi)
    if math.prod(ext) != size:
        raise Misfit("the epilogue's iteration space is not the product's")
    try:
        inverse = tvm.tirx.function.IndexMap([iv.var for iv in epi.iter_vars], list(read.indices), None).inverse(ext)
    except Exception as err:  # noqa: BLE001 - TVM raises when the map is not bijective
        raise Misfit(f"the epilogue's read of the product is not invertible ({str(err).strip()[:80]})") from None
    if len(inverse.initial_indices) != len(out_idx):
        raise Misfit("the epilogue's read of the product has another rank")
    penv = {str(v.name): f"({e})" for v, e in zip(inverse.initial_indices, out_idx)}
    evars = [str(iv.var.name) for iv in epi.iter_vars]
    return {name: f"({_script(e, penv, {}, ('', []))})" for name, e in zip(evars, inverse.final_indices)}


def kernel_for(func, spec: GemmSpec, a: int, b: int, store: str, cfg: WgmmaConfig):
    """The wgmma kernel of ``func`` (its parameters, in order, renamed ``p0, p1, ..``; its global symbol kept)."""
    kernel = parse(gemm_source(spec, cfg, _param_decls(func), f"p{a}", f"p{b}", store))
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    return kernel.with_attr("global_symbol", symbol) if symbol is not None else kernel


def untuned_config(func, target) -> tuple[GemmSpec, dict, WgmmaConfig] | None:
    """(spec, {a, b, store, ..}, config) of the kernel an untuned build on ``target`` runs for the GEMM or conv
    ``func``: :func:`default_config`'s. None where the target is not sm_90a or the kernel does not fit.

    An untuned build has no kernel check, so this covers the paths run and checked on the H200:
    GEMMs; padded 3x3 convs and a 7x7 conv whose rows end in a partial tile (16 configs, all correct, the
    untuned conv case's dlight schedule took 8992 us against 490 us); epilogues that split heads (BERT's Q/K/V
    projections, checked in the pipeline: dlight 180-184 us, wgmma 14-22 us)."""
    if not supports(target):
        return None
    try:
        spec, info = analyze(func)
    except Exception:  # noqa: BLE001 - as schedule(): anything analyze() cannot take keeps the default path
        return None
    if not configs(spec, tma=(0, 1)):
        return None
    return spec, info, default_config(spec)


def default_kernel(func, target):
    """The kernel :func:`untuned_config` names (its parameters and global symbol ``func``'s), or None."""
    found = untuned_config(func, target)
    if found is None:
        return None
    spec, info, cfg = found
    return kernel_for(func, spec, info["a"], info["b"], info["store"], cfg)


def annotated(func):
    """(spec, {a, b, store}, config) a tuned schedule annotated on ``func``'s root block, or None."""
    from tvmfuse.tune.annotations import chosen, root_annotations

    notes = root_annotations(func, SPEC, CANDIDATES, ANNOTATION)
    if notes is None:
        return None
    info = json.loads(str(notes[SPEC]))
    return (GemmSpec.from_json(json.dumps(info["spec"])), info,
            parse_config(chosen(notes[CANDIDATES], notes[ANNOTATION], "wgmma")))


def expand(mod):
    """``mod`` with every wgmma-annotated GEMM PrimFunc replaced by the kernel its annotation selects."""
    from tvmfuse.tune.annotations import swap_kernels

    def wgmma(gv, func):
        found = annotated(func)
        if found is None:
            return None
        spec, info, cfg = found
        return kernel_for(func, spec, info["a"], info["b"], info["store"], cfg)

    return swap_kernels(mod, wgmma)


def supports(target) -> bool:
    """wgmma needs an arch-specific Hopper target (``sm_90a``)."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"


_KNOBS = ("warpgroups", "m_tiles", "block_n", "stages", "raster", "inflight", "tma", "persistent")


def schedule(sch, space) -> GemmSpec | None:
    """The wgmma sketch of a GEMM or conv kernel (``sch``, modified in place): its intermediates inlined, one
    config of :func:`configs` sampled (the ``wgmma_*`` knobs give the choices and priors) and annotated on the
    root block with the kernel's spec, and a plain thread binding that any GPU check accepts (the builder swaps
    the whole PrimFunc for the annotated kernel, see :func:`expand`). Returns the spec, None if the kernel
    does not fit."""
    from tvmfuse.tune.knobs import sample_option
    from tvmfuse.tune.sketch import inline_all_but_outputs, bind_placeholder

    try:
        spec, info = analyze(sch.mod["main"])
    except Exception:  # noqa: BLE001 - Misfit, or a kernel shape analyze() did not foresee: decline, and the
        return None    # GEMM space keeps its mma/wmma sketches rather than failing as a whole
    knobs = {k: space.knobs.get(f"wgmma_{k}") for k in _KNOBS}
    options = configs(spec, **{k: v.values for k, v in knobs.items() if v is not None},
                      max_shared_bytes=int(space.extra.get("wgmma_max_shared_bytes", 227 * 1024)))
    if not options:
        return None
    root = sch.get_sblock("root")
    index = sample_option(sch, options, knobs)
    sch.annotate(root, SPEC, json.dumps({"spec": json.loads(spec.to_json()), **info}, sort_keys=True))
    sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
    sch.annotate(root, ANNOTATION, index)
    inline_all_but_outputs(sch, keep=(sch.get(_reduction_blocks(sch)[0]).name_hint,))
    bind_placeholder(sch)
    return spec
