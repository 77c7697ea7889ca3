"""The wgmma template's tile configs: the knobs as data, which of them fit a kernel, the default per shape, and
the annotations a tuned sketch records them under."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tvmfuse.kernels.wgmma.spec import GemmSpec

ANNOTATION = "tvmfuse.wgmma_config"
SMS = 132   # an H100 / H200 SXM's SMs: a persistent kernel's blocks where the target's are not known (device_figures)
CANDIDATES = "tvmfuse.wgmma_candidates"
SPEC = "tvmfuse.wgmma_spec"


@dataclass(frozen=True)
class WgmmaConfig:
    warpgroups: int = 2   # warpgroups per block (128 threads each)
    m_tiles: int = 1      # 64-row wgmma tiles per warpgroup
    block_n: int = 128    # columns per block (wgmma's N)
    block_k: int = 64     # K per stage, in 16-bit units (128 bytes of a row: 64 fp16, 32 TF32)
    stages: int = 4       # shared-memory buffers (cp.async runs stages - 1 tiles ahead)
    raster: int = 8       # tile rows launched together (B tiles reused from L2)
    swizzle: int = 128    # shared tiles in wgmma's 128-byte swizzled layout (needs block_k 64), or 0: no swizzle
    inflight: int = 1     # wgmma batches left running at the end of a K step (1: the next step's issue overlaps)
    tma: int = 0          # 1: tiles loaded by TMA from a producer warpgroup, stages handed over by mbarriers
    persistent: int = 0   # 1 (TMA only): one block per SM walks the tiles; the next tile's loads run during the
    #                       epilogue of this one
    staged: int = 0       # 1 (cp.async only): the accumulators pass through shared memory, so that each warp stores
    #                       whole 128-byte lines of the output (0: each thread stores its fragment's pairs, a warp
    #                       writing 16 bytes of each of 8 rows)
    split: int = 1        # K split over this many blocks (cp.async GEMMs whose tiles leave SMs idle: a skinny M
    #                       against a long K): each stores fp32 partials, a second kernel sums them and applies the
    #                       epilogue
    a_regs: int = 0       # 1 (float32x3, cp.async, 128-byte swizzle): each thread reads its A fragments from shared
    #                       memory into registers and splits them there, the wgmmas take A from registers: A's small
    #                       parts neither written to nor read from shared memory (by count, the x3 kernel's
    #                       shared-memory traffic, not its tensor cores, bounds it). The H100: 7-8% faster at 4
    #                       stages on 4096 x 768 x 3072 and 4096^3, as accurate; searched, not the default (a ragged
    #                       M tile not yet run)

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
                + (" p1" if self.persistent else "") + (" e1" if self.staged else "")
                + (f" d{self.split}" if self.split > 1 else "") + (" a1" if self.a_regs else ""))

    @property
    def staged_stride(self) -> int:
        """Floats a row of the staged accumulator tile takes: 8 past the tile's columns, so that the 8 rows a warp's
        fragment covers start 8 or 24 banks apart (its 8-byte stores then hit each bank once a half warp)."""
        return self.block_n + 8

    def shared_bytes(self) -> int:
        """The tiles' stages, and a TMA kernel's two mbarriers (8 bytes each) per stage; a staged epilogue's fp32
        tile reuses the stages' memory once the main loop is done, and may need more."""
        tiles = 2 * self.stages * self.block_k * (self.block_m + self.block_n) + (16 * self.stages if self.tma else 0)
        return max(tiles, 4 * self.block_m * self.staged_stride) if self.staged else tiles


def small_offset(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """A ``float32x3`` kernel's second set of stages (its operands' small TF32 parts), in 16-bit units past the
    first (A's stages then B's, laid out alike): the first set's size; 0 for other kernels. With A from registers
    (``a_regs``) B's small stages alone, right after B's: as far past B's stages as B's tiles take."""
    if not spec.x3:
        return 0
    return cfg.stages * cfg.block_k * (cfg.block_n if cfg.a_regs else cfg.block_m + cfg.block_n)


def kernel_shared_bytes(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """The shared memory ``cfg``'s kernel of ``spec`` allocates: :meth:`WgmmaConfig.shared_bytes`, and for a
    ``float32x3`` kernel a second set of stages (:func:`small_offset`) beside the first (B's alone with ``a_regs``)."""
    small = small_offset(spec, cfg)   # (the small stages end as far past it as the first set's end)
    return max(cfg.shared_bytes(), 2 * (small + cfg.stages * cfg.block_k * (cfg.block_m + cfg.block_n)) if small else 0)


def parse_config(name: str) -> WgmmaConfig:
    """The config :attr:`WgmmaConfig.name` names (``"g2 m1 n128 k64 s4 r8 z128 f1"``)."""
    f = dict((part[0], int(part[1:])) for part in name.split())
    return WgmmaConfig(warpgroups=f["g"], m_tiles=f["m"], block_n=f["n"], block_k=f["k"], stages=f["s"],
                       raster=f["r"], swizzle=f.get("z", 128), inflight=f.get("f", 1), tma=f.get("t", 0),
                       persistent=f.get("p", 0), staged=f.get("e", 0), split=f.get("d", 1), a_regs=f.get("a", 0))


def configs(spec: GemmSpec, *, warpgroups=(2, 1), m_tiles=(1, 2), block_n=(128, 256, 64), block_k=(64,),
            stages=(3, 4, 5), raster=(8, 1), swizzle=(128,), inflight=(0, 1), tma=(0,), persistent=(0,),
            staged=(0,), split=(1,), a_regs=(0,), max_shared_bytes: int = 227 * 1024,
            sm_count: int = SMS) -> list[WgmmaConfig]:
    """The configs (from the given choices) that fit ``spec``'s registers and shared memory. Rows may end in a
    partial tile; so may columns and K where the operands' rows stay 16-byte aligned (:func:`ragged_fits`: a
    1x1 conv of 24 or 96 channels, a classifier of 1000 classes), in the cp.async kernel, whose copies zero-fill
    past the end. TMA configs (``tma`` 1) only on whole tiles of columns and K, with 128-byte swizzled tiles,
    TMA's layout, and for a conv only where its output pixels tile well (:func:`pixel_tile`). K counts 16-bit
    units (``block_k`` 64: 128 bytes of a row, 32 TF32 elements); TF32 takes a K-major B only, and no TMA."""
    tf32 = spec.dtype != "float16"
    if tf32 and not spec.b_kmajor:
        return []
    spec = spec.halves()
    # (partial tiles of columns or K only where no tile width makes them whole: a shape some width tiles keeps its
    # space)
    ragged = ragged_fits(spec) and (spec.n % 64 != 0 or spec.k % 64 != 0
                                    or spec.conv is not None and spec.conv.c % 64 != 0)
    out = []
    # (a partial tile column: a wider tile of as many tile columns as a narrower one adds only dead columns; N 40
    # takes 64, not 128 or 256, whose idle accumulators also made ptxas serialize a conv's wgmmas, C7514)
    widths = [int(n) for n in block_n]
    widths = [n for n in widths if spec.n % n == 0
              or not any(w < n and -(-spec.n // w) == -(-spec.n // n) for w in widths)]
    if ragged and spec.b_kmajor and spec.n < max(widths):
        # a narrow N (a 1x1 conv's 24 or 144 channels): also one tile column of N rounded up to 16 or 32 (whole
        # 16-byte chunks a thread of one or two warpgroups), so A is read once, not once per 64 columns (K-major B
        # only: an N-major tile's swizzle takes multiples of 64)
        widths += [w for w in (-(-spec.n // 16) * 16, -(-spec.n // 32) * 32) if w not in widths]
    for g in warpgroups:
        for mt in m_tiles:
            for n in widths:
                # (B's 16-byte chunks split evenly over the block's threads: 96 x 32 does not over 256)
                for kb in [kb for kb in block_k if n * int(kb) // 8 % (128 * int(g)) == 0]:
                    for st in stages:
                        for r, z, f, t, p, e, ar in [(r, z, f, t, p, e, ar) for r in raster for z in swizzle
                                                     for f in inflight for t in tma for p in persistent
                                                     for e in staged for ar in a_regs]:
                            c = WgmmaConfig(int(g), int(mt), int(n), int(kb), int(st), int(r), int(z), int(f),
                                            int(t), int(p), int(e), a_regs=int(ar))
                            if c.tma and (spec.conv is not None and pixel_tile(spec) is None or tf32):
                                # (TF32: a TMA tile lands without passing a thread that could round it to
                                # TF32, and wgmma truncates; the cp.async kernel rounds, see ptx.ROUND_TF32)
                                continue
                            rows = tiles_m(spec, c)   # a partial last tile row is predicated
                            if ((whole_tiles(spec, c) or ragged and not c.tma)
                                    and (k_steps(spec, c) >= c.stages - 1 or c.stages == min(int(x) for x in stages))
                                    and rows % c.raster == 0
                                    # cp.async: a batch in flight holds a stage: at 3 stages that left two and
                                    # ran 1.24x slower on the H200; at 4 it matched or beat f0.
                                    # TMA: the producer refills a stage as soon as it is released; a batch
                                    # in flight gave wrong results (rel. err. 1-2e-2 on every shape but one,
                                    # H200, cause not found), so TMA kernels wait for their batch
                                    and (c.stages - c.inflight >= 2 + c.inflight if not c.tma
                                         else c.inflight == 0)
                                    and (not c.tma or c.swizzle == 128 and c.block_n % 64 == 0)
                                    and (c.tma or not c.persistent)
                                    and not (c.tma and c.staged)
                                    and (c.swizzle == 0 or c.block_k == 64)
                                    # fp32 accumulators per thread (x3: twice, a K step's own)
                                    and c.m_tiles * c.block_n // 2 * (2 if spec.x3 else 1) <= 128
                                    and not (spec.x3 and c.inflight)   # (x3: a step's sum is read once done)
                                    # (A from registers: x3 cp.async kernels of 128-byte swizzled K steps of 64)
                                    and (not c.a_regs or spec.x3 and not c.tma and c.swizzle == 128
                                         and c.block_k == 64)
                                    and kernel_shared_bytes(spec, c) <= max_shared_bytes):
                                out.append(c)
    return out + [replace(c, split=int(d)) for c in out for d in split
                  if int(d) > 1 and splits(spec, c, int(d), sm_count)]


def splits(spec: GemmSpec, cfg: WgmmaConfig, d: int, sm_count: int = SMS) -> bool:
    """Whether ``cfg`` (a K split of 1) may split K over ``d`` blocks: a cp.async GEMM or conv kernel (no batch,
    TMA or persistent loop) whose tiles leave SMs idle, that ``d`` does not take past two blocks an SM, each split
    at least two K steps and as many as the pipeline's prologue fills."""
    blocks = tiles_m(spec, cfg) * tiles_n(spec, cfg)
    per = -(-k_steps(spec, cfg) // d)
    return (not cfg.tma and not cfg.persistent and spec.grid_batch == 1
            and blocks < sm_count and blocks * d <= 2 * sm_count and per >= max(2, cfg.stages - 1))


def ragged_fits(spec: GemmSpec) -> bool:
    """Whether the cp.async kernel takes ``spec`` (in 16-bit units, :meth:`GemmSpec.halves`) with a partial last
    tile of columns or K: its copies move 16-byte chunks, so K must keep A's rows (and a K-major B's) 16-byte
    aligned, and an N-major B's columns too (an odd vocabulary's weight is K-major: ``plan.weights``); a conv's
    chunks must each lie in one pixel's channels (a K step may then span filter taps: 24 channels, 2.67 a step)."""
    return ((spec.k % 8 == 0 and (spec.b_kmajor or spec.n % 8 == 0))
            and (spec.conv is None or spec.conv.c % 8 == 0))


def whole_tiles(spec: GemmSpec, cfg: WgmmaConfig) -> bool:
    """Whether ``cfg``'s tiles divide ``spec``'s columns, K and (a conv's) channels: no zero-filled partial tile but
    a last row's."""
    h = spec.halves()
    return (h.n % cfg.block_n == 0 and h.k % cfg.block_k == 0
            and (h.conv is None or h.conv.c % cfg.block_k == 0))


def k_steps(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """K steps of ``cfg`` (``spec`` in 16-bit units), the last one partial where K is not a whole number of them."""
    return -(-spec.k // cfg.block_k)


def tiles_n(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """Tile columns of ``cfg``, the last one partial where the columns are not a whole number of tiles."""
    return -(-spec.n // cfg.block_n)


def _a_predicated(spec: GemmSpec, cfg: WgmmaConfig) -> bool:
    """Whether A's copies zero-fill (a padded conv window, rows past the last whole tile, K past its end)."""
    return ((spec.conv is not None and spec.conv.padded) or spec.rows % cfg.block_m != 0
            or spec.k % cfg.block_k != 0)


def _b_predicated(spec: GemmSpec, cfg: WgmmaConfig) -> bool:
    """Whether B's copies zero-fill (columns past the last whole tile, K past its end)."""
    return spec.n % cfg.block_n != 0 or spec.k % cfg.block_k != 0


def pixel_tile(spec: GemmSpec) -> tuple[int, int] | None:
    """A conv's TMA patch: ``(bh, bw)`` output rows and columns of one image, 64 pixels (one wgmma m-tile; a block
    takes ``block_m / 64`` consecutive patches, numbered image by image, row by row). The shape that covers the
    fewest pixels past the output (ties: the wider); None where the conv is strided (a strided box needs TMA's
    traversal strides, not built), its channels are no multiple of 64, or the patches cover more than 15% more
    pixels than the output has (56 x 56: 8 x 8 patches, none idle; 28 x 28: 4 x 16, 14% idle; 14 x 14: none)."""
    g = spec.halves().conv
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


def tiles_m(spec: GemmSpec, cfg: WgmmaConfig) -> int:
    """Tile rows: of ``block_m / 64`` patches of output pixels for a TMA conv (the last tile's past the output read
    zeros and store nothing), else of ``block_m`` GEMM rows (the last one partial where they do not divide)."""
    if cfg.tma and spec.conv is not None:
        return -(-_patches(spec) // (cfg.block_m // 64))
    return -(-spec.rows // cfg.block_m)


def default_config(spec: GemmSpec, sm_count: int = SMS, split: bool = True) -> WgmmaConfig:
    """The fastest measured where it fits (H200, BENCHMARKS.md): 128x256 tiles by TMA, 4 stages (8192^3 GEMM 1623-1758
    us, 0.95-0.99x cuBLAS; the 3x3 conv 362 us, 0.86x cuDNN), then 256x128 (1757 / 371 us), then
    128x128 (410 us, the conv); else by cp.async: 128x256 tiles, 3 stages (the GEMM 1996-2025 us, the conv 482-490),
    then 256x128, then 128x128 — unless the grid is too small for the GPU's ``sm_count`` SMs: a skinny GEMM's K
    split over them (:func:`skinny_config`; ``split`` False: none, a gated epilogue's), else the smaller tile that
    :func:`grid_time` finds faster (:func:`small_grid_config`)."""
    skinny = skinny_config(spec, sm_count) if split else None
    if skinny is not None:
        return skinny
    rule = _rule_config(spec)
    small = small_grid_config(spec, rule, sm_count)
    cfg = staged_default(spec, rule if small is None else small)
    return idle_split(spec, cfg, sm_count) if split else cfg


def idle_split(spec: GemmSpec, cfg: WgmmaConfig, sm_count: int = SMS) -> WgmmaConfig:
    """``cfg`` with its K split over the most blocks :func:`splits` allows (up to two an SM), each at least
    :data:`SPLIT_STEPS` K steps, where it is an fp16 cp.async conv whose tiles leave SMs idle, or such a GEMM whose
    tiles leave at least half of them idle; else ``cfg``. A block's own pipeline is all that hides its copies'
    latency (a conv's threads gather A), and idle SMs add no bandwidth. On the H100: ResNet-50's 3 x 3 conv at 7 x 7 x
    512, batch 32 (100 tiles of 64 x 128, benchmarks/wgmma_gemm.py): 57.8 us unsplit, 36.7 split 2 (cuDNN 18.7); at
    14 x 14 x 256 (196 tiles) no split was faster (31.2 against 35.7-46.6). GEMMs (whole spaces timed and the fastest
    checked, benchmarks/tables/): 320 x 128 x 9032 (10 tiles of 64 x 64) 38.9 us unsplit, 9.0 split 8, the space's
    best; 207 x 4968 x 7104 (78 tiles of 128 x 128) 61.5 against 59.5 split 3: a GEMM's gain fades as its tiles
    fill the SMs."""
    if cfg.tma or cfg.split > 1 or spec.dtype != "float16":
        return cfg
    if spec.conv is None and 2 * tiles_m(spec, cfg) * tiles_n(spec, cfg) > sm_count:
        return cfg
    return replace(cfg, split=_deepest_split(spec, cfg, sm_count, 2 * sm_count))


def _deepest_split(spec: GemmSpec, cfg: WgmmaConfig, sm_count: int, most_blocks: int) -> int:
    """The most blocks of :data:`SPLITS` that :func:`splits` lets ``cfg`` split K over, in at most ``most_blocks``
    blocks in all and at least :data:`SPLIT_STEPS` K steps each; 1 where none."""
    blocks, steps = tiles_m(spec, cfg) * tiles_n(spec, cfg), k_steps(spec, cfg)
    return max([d for d in SPLITS if splits(spec, cfg, d, sm_count) and blocks * d <= most_blocks
                and steps / d >= SPLIT_STEPS], default=1)


def staged_default(spec: GemmSpec, cfg: WgmmaConfig) -> WgmmaConfig:
    """``cfg`` with its accumulators staged through shared memory (``staged`` 1) where it is a cp.async fp16 GEMM
    config, N is at least 64 and the staged tile fits in the stages' memory (no block fewer an SM). The H100, cp.async,
    staged against not: 100352 x 144 x 24 26.4 against 42.6 us (cuBLAS 26.7), 401408 x 96 x 16 46.5 against
    99.0 (39.8), 25088 x 576 x 96 20.1 against 36.7 (17.2), 4096 x 1000 x 2048 28.5 against 34.6 (27.6); N 24
    in a 64-wide tile 13.5 against 12.8 (a warp's 64 columns are mostly past N). Convs and TF32 GEMMs keep their
    stores: an untuned build runs unchecked, and none of them has run staged on a GPU (the tuner may pick one; its
    records are checked)."""
    staged = replace(cfg, staged=1)
    if (cfg.tma or spec.conv is not None or spec.dtype != "float16" or spec.n < 64
            or staged.shared_bytes() > cfg.shared_bytes()):
        return cfg
    return staged


# A skinny GEMM (a decode step's few tokens against a weight) is its weight's bytes: one row of 128 x 256 tiles by
# cp.async, 4 stages, K split over as many blocks as fill the SMs once, each split at least SPLIT_STEPS K steps (the
# pipeline's depth and one). On the H100 (benchmarks/gemv_gpu.py, K splits beside the GEMV template's default, cuBLAS
# in the same run), M x 4096 x 11008: 32 rows 38.9 us split 3 against the GEMV's 43.8 (cuBLAS 33.0), 64 rows 42.8
# against 57.6 (33.4), where split 4 and 6 (more blocks than SMs) took 45.4-50.1; 64 x 4096 x 4096: 18.2 us split 6
# against 26.5 (18.1); 20 x 2048 x 5632: 10.1 us split 6 (5.3 K steps a split) against 12.5 split 3. At 16 rows 37.1
# against the GEMV's 37.6: the GEMV template keeps M <= 16 (gemv.config.MAX_ROWS)
SKINNY_ROWS = 64
SKINNY_TILES = (WgmmaConfig(2, 1, 256, 64, 4, 1, 128, 1), WgmmaConfig(2, 1, 128, 64, 4, 1, 128, 1))
SPLITS = (2, 3, 4, 6, 8)
SPLIT_STEPS = 5


def skinny_config(spec: GemmSpec, sm_count: int = SMS) -> WgmmaConfig | None:
    """The K-split config of a GEMM of at most :data:`SKINNY_ROWS` rows (fp16, unbatched, no conv) whose output
    tiles leave the GPU's ``sm_count`` SMs idle: the first of :data:`SKINNY_TILES` that fits, split over the most
    blocks that fit one wave, each at least :data:`SPLIT_STEPS` K steps; None where no split fits or the split
    grid fills under half the SMs (the GEMV template's or the small-grid rule's then)."""
    if spec.rows > SKINNY_ROWS or spec.conv is not None or spec.grid_batch != 1 or spec.dtype != "float16":
        return None
    options = configs(spec, stages=(4,), raster=(1,), inflight=(1,))
    tile = next((t for t in SKINNY_TILES if t in options), None)
    if tile is None:
        return None
    d = _deepest_split(spec, tile, sm_count, sm_count)
    # (a grid that still leaves half the SMs idle: a small weight, whose GEMV splits K finer)
    blocks = tiles_m(spec, tile) * tiles_n(spec, tile) * d
    return replace(tile, split=d) if d > 1 and 2 * blocks >= sm_count else None


def grid_time(spec: GemmSpec, cfg: WgmmaConfig, sm_count: int) -> float:
    """A relative time of ``cfg``'s grid: the waves of blocks over ``sm_count`` SMs times one block's tile, slowed
    where the tile is too small to feed the tensor cores from L2 (its FMAs per loaded element, block_m * block_n /
    (block_m + block_n), below 128 x 128's 64: a 64 x 64 tile loads twice the bytes per FMA)."""
    blocks = tiles_m(spec, cfg) * tiles_n(spec, cfg)
    tile = cfg.block_m * cfg.block_n
    efficiency = min(1.0, tile / (cfg.block_m + cfg.block_n) / 64)
    return -(-blocks // sm_count) * tile / efficiency


# smaller tiles for grids that leave SMs idle, by cp.async (the TMA kernels run on the H200 at the rule's shapes
# only): 128 x 64, 128 x 128 by one warpgroup, 64 x 128, 64 x 64
SMALL_TILES = ((2, 1, 64), (1, 2, 128), (1, 1, 128), (1, 1, 64))
# a conv's, whose every thread gathers its A tile's rows: one 64-row tile a warpgroup, 64 x 128 first. On the H100
# (ResNet-50's 3 x 3 convs at batch 32, every config of the space timed, benchmarks/wgmma_gemm.py), a warpgroup of
# two 64-row tiles ran 1.5-3x slower than one: 14^2 x 256 -> 256 took 60.6 us as 128 x 128 by one warpgroup, 31.4
# as 64 x 128; 7^2 x 512 -> 512 70.9 us as 128 x 64, 57.7 as 64 x 128; no m2 config was the fastest of any conv
CONV_SMALL_TILES = ((1, 1, 128), (2, 1, 64), (1, 1, 64))


# A small grid's GEMM tiles (about a block an SM: the block's own pipeline is what hides its copies' latency): the
# deepest of these stages its K steps and shared memory take, a batch in flight from 4 (f1). On the H100, over the
# whole spaces of 10 drawn GEMMs (benchmarks/search_replay.py), 3 stages and no batch in flight ran a median 1.26x
# the space's best; these stages (at most half the K steps), with the short-K rule of _rule_config, 1.14x (320 x 128
# x 9032: 44.4 -> 38.9 us at 5 stages, f1; 207 x 4968 x 7104: 72.1 -> 61.1). A conv keeps 3 (no such sweep of convs).
SMALL_GRID_STAGES = (5, 4, 3)


def small_grid_config(spec: GemmSpec, rule: WgmmaConfig, sm_count: int) -> WgmmaConfig | None:
    """A smaller tile than the ``rule``'s where :func:`grid_time` counts it at least 1.25x faster (ResNet-50 at
    batch 32 on 64 x 64 images: its 3 x 3 convs of 512 x 256 outputs are 4 blocks of 128 x 256 on 132 SMs,
    32 of 64 x 64), a GEMM's at :data:`SMALL_GRID_STAGES`; None where the rule's grid is as good (a large GEMM
    keeps its measured tiles)."""
    options = configs(spec, stages=SMALL_GRID_STAGES, inflight=(0, 1))
    # (a pipeline at most half the K steps deep: 1355 x 3456 x 448, 7 steps, took 17.0 us at 3 stages, 18.6 at 5)
    stages = [st for st in SMALL_GRID_STAGES if st <= max(3, k_steps(spec.halves(), rule) // 2)]
    stages = stages if spec.conv is None else (3,)
    best, best_time = None, grid_time(spec, rule, sm_count) / 1.25
    for g, mt, n in SMALL_TILES if spec.conv is None else CONV_SMALL_TILES:
        for raster in (8, 4, 1):
            cfg = next((c for c in (WgmmaConfig(g, mt, n, 64, st, raster, 128, int(st >= 4), 0) for st in stages)
                        if c in options), None)
            if cfg is not None:
                t = grid_time(spec, cfg, sm_count)
                if t < best_time:
                    best, best_time = cfg, t
                break
    return best


def _rule_config(spec: GemmSpec) -> WgmmaConfig:
    """The measured rule of :func:`default_config`, whatever the grid."""
    # (an untuned build runs unchecked, so a conv takes the TMA kernel only as run and checked on the H200: stride
    # 1, no dilation, 8 x 8 and partial 2 x 32 patches)
    tma = (0, 1) if spec.conv is None or spec.conv.dilation == (1, 1) else (0,)
    options = configs(spec, tma=tma)
    # (the widths run on a GPU untuned: a narrow N's exact tile column is the tuner's to try, each record checked)
    options = [c for c in options if c.block_n in (64, 128, 256)] or options
    if options:   # the tile widths that pad the columns least: all where they divide N (N 96: 64 or 128, not 256)
        least = min(tiles_n(spec, c) * c.block_n for c in options)
        options = [c for c in options if tiles_n(spec, c) * c.block_n == least]
    whole = [c for c in options if spec.rows % c.block_m == 0]   # tiles without a predicated last row first
    options = whole + [c for c in options if c not in whole]
    # (warpgroups, m_tiles, block_n, tma, stages) in order, TMA only at the tile shapes run on the H200; each at the
    # deepest pipeline that fits the K steps and the widest raster group that divides the tile rows
    for g, mt, n, t, stages in ((2, 1, 256, 1, (4, 3)), (2, 2, 128, 1, (4, 3)), (2, 1, 128, 1, (4, 3)),
                                (2, 1, 256, 0, (3,)), (2, 2, 128, 0, (3,)), (2, 1, 128, 0, (3,))):
        if mt > 1 and not t and spec.conv is not None:
            continue   # a conv by cp.async: one 64-row tile a warpgroup (CONV_SMALL_TILES)
        if t and spec.conv is None and spec.halves().k <= 4 * 64:
            # K of at most 4 steps: the GEMM is its output's stores, which the TMA kernel makes from its registers
            # (a warp 16 bytes of 8 rows) and the cp.async kernel through shared memory (staged_default): on the
            # H100, 1194 x 12288 x 128 took 40.4 us by TMA 128 x 256, 17.9-19.7 by cp.async, staged
            continue
        for st in stages:
            for raster in (8, 4, 1):
                cfg = WgmmaConfig(g, mt, n, 64, st, raster, 128, 0, t)
                if cfg in options:
                    return cfg
    return options[0]


def supports(target) -> bool:
    """wgmma needs an arch-specific Hopper target (``sm_90a``)."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"
