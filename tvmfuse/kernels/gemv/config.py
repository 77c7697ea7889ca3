"""The GEMV template's configs: the knobs as data, which of them fit a kernel, the default per shape, and the
annotations a tuned sketch records them under."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from tvmfuse.kernels.wgmma.config import SMS   # the SM count, named once for the GEMM templates
from tvmfuse.kernels.wgmma.spec import GemmSpec

ANNOTATION = "tvmfuse.gemv_config"
CANDIDATES = "tvmfuse.gemv_candidates"
SPEC = "tvmfuse.gemv_spec"
# the template takes GEMMs of at most this many rows (decode: a few tokens). Its CUDA-core kernel's multiply-adds
# run on fp32 CUDA cores: each weight element read costs ``rows`` of them, and on the H200 (about 33.5 T FMA/s, 2.1 T
# fp16 weight elements/s at the copy ceiling) the two meet at about 16 rows; its tensor-core kernel holds M in two
# n8 tiles of an m16n8k16 mma; its 16 rows are where the CUDA-core kernel stops
MAX_ROWS = 16
# The tensor-core kernel (an fp16 [K, N] weight) holds up to 64 rows a block, eight n8 tiles, and the template takes
# such GEMMs up to that: at 64 rows a weight element is 64 multiply-adds, 64 flops a byte against mma.sync's ~157 on
# the H200 (660 T flops / 4.2 TB/s), so the weight's stream is still the time, and what matters is keeping every SM
# streaming. wgmma's GEMM (tvmfuse.kernels.wgmma) gives a block a whole K panel of a 64-128 x 64-256 output tile,
# with no K split: at M <= 64 it has N / block_n blocks (32-64 for N = 4096), fewer than the 132 SMs; this kernel
# splits K over blocks until they fill the SMs. Past 64 rows its accumulators (4 registers a tile) and x's pieces
# (each warp along N copies them again from L2) grow with M while wgmma's shared tiles do not.
MMA_ROWS = 64
# An fp32 GEMM of up to this many rows is taken too where it is small (at most SMALL_OUTPUTS outputs): the CUDA-core
# kernel in groups of MAX_ROWS rows (adjacent blocks, the weight tile read again from L2), its K split over the SMs.
# Such a GEMM has no tensor-core template, and dlight's matmul rule tiles its outputs 32 x 64 a block with K whole:
# a 1x1 conv of MobileNetV2 or ResNet-50 at batch 1 (64-256 pixels, 64-512 channels) ran in 2-16 blocks on the
# H200's 132 SMs. Past half a wave of those tiles, dlight's reuse of each operand across a block is worth more
SMALL_ROWS = 256
SMALL_OUTPUTS = 32 * 64 * SMS // 2
_VECTOR_BYTES = 16     # one 128-bit load per vector
# per-thread register words a config may ask for (accumulators + vectors in flight + x); above it ptxas spills
_REGISTER_WORDS = 160
_SHARED_BYTES = 32 * 1024   # the [K, N] kernel's cross-warp partial sums, per group of rows
# the tensor-core kernel's cp.async ring a block (its warps' partials reuse it; dynamic shared memory): two blocks'
# rings and the 1 KB the GPU reserves a block fit an SM's 227 KB
_RING_SHARED = 112 * 1024
STAGES = (1, 2, 3, 4)   # the tensor-core kernel's pipeline stages (1: no shared-memory ring)


@dataclass(frozen=True)
class GemvConfig:
    """One GEMV kernel. For a ``[K, N]`` weight: ``threads`` threads a block, ``threads_n`` of them along N
    (each a vector of ``lanes`` columns), the rest along K; for ``[N, K]``: ``threads // 32`` warps a block,
    each reading ``threads_n`` columns along K, a vector of ``lanes`` K elements a lane. ``split``: thread
    blocks along K (their partial sums reduced by a second kernel, which applies the epilogue), ``rows``: rows
    of M a block holds in registers (fewer than M: more blocks, adjacent in the launch, each reading the weight
    tile again, from L2 where it is still there), ``unroll``: vectors each thread loads before it multiplies (loads in flight).

    ``mma`` (1; a [K, N] fp16 weight only): the products on tensor cores (``mma.sync`` m16n8k16, the weight tile
    the A operand, its rows N, and M zero-padded to one or two n8 tiles the B operand), so a weight element costs
    no fp32 multiply-add per row of M. The knobs then read: ``threads_n`` warps along N a block (the others along
    K, their partials summed through shared memory), each warp ``8 * lanes`` columns (a lane a vector of ``lanes``
    columns, ``lanes / 2`` m16 tiles); ``unroll``: k16 steps a lane loads before its mmas (four vectors a step).

    ``stages`` (tensor-core kernel only): 1, each step's weight loaded straight into registers (ptxas issues the
    loads just before the step's mmas, so a warp has one step in flight; the next iteration is prefetched into
    L2); 2-4, a ring of that many iterations (``unroll`` k16 steps each) of a lane's weight vectors and x halves in
    shared memory, filled by ``cp.async`` ``stages - 1`` iterations ahead of the mmas, so that many iterations'
    bytes are in flight a warp whatever ptxas schedules.

    ``xs`` (tensor-core kernel at ``stages`` 1, K a multiple of 8): x's tile of an iteration (every row of the block,
    ``16 * unroll`` K elements) copied once by ``cp.async`` into shared memory by the ``threads_n`` warps that share
    its K range, double-buffered a named barrier apart, so each warp reads its x fragments there instead of from
    L2: a warp's own x loads are ``rows / (8 * lanes)`` of its weight bytes (a whole weight byte a byte at 64 rows
    of 4 lanes), the block's shared tile ``1 / threads_n`` of that.
    """

    lanes: int = 8
    threads: int = 256
    threads_n: int = 32
    split: int = 1
    rows: int = 1
    unroll: int = 4
    mma: int = 0
    stages: int = 1
    xs: int = 0

    @property
    def name(self) -> str:
        name = f"v{self.lanes} t{self.threads} n{self.threads_n} s{self.split} m{self.rows} u{self.unroll}"
        # c: tensor cores, p: their pipeline's stages, x: x staged in shared memory (a name without them: the
        # CUDA-core kernel)
        return name + f" p{self.stages} c1" + (" x1" if self.xs else "") if self.mma else name


def parse_config(name: str) -> GemvConfig:
    """The config :attr:`GemvConfig.name` names (``"v8 t256 n32 s4 m1 u4"``, ``"v8 t256 n1 s1 m16 u4 p3 c1"``)."""
    f = dict((part[0], int(part[1:])) for part in name.split())
    return GemvConfig(lanes=f["v"], threads=f["t"], threads_n=f["n"], split=f["s"], rows=f["m"], unroll=f["u"],
                      mma=f.get("c", 0), stages=f.get("p", 1), xs=f.get("x", 0))


def dtype_bytes(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]


def mma_tiles(cfg: GemvConfig) -> tuple[int, int]:
    """(m16 tiles of N a warp, n8 tiles of M) of a tensor-core config: a lane's vector of ``lanes`` columns is
    two rows of each of ``lanes / 2`` tiles; M's rows, zero-padded, fill one n8 tile or two."""
    return cfg.lanes // 2, -(-cfg.rows // 8)


def warps_k(cfg: GemvConfig) -> int:
    """Warps along K a block of a tensor-core config."""
    return cfg.threads // 32 // cfg.threads_n


def blocks(spec: GemmSpec, cfg: GemvConfig) -> int:
    """Thread blocks of the main kernel."""
    if cfg.mma:
        cols = cfg.threads_n * 8 * cfg.lanes
    elif spec.b_kmajor:
        cols = (cfg.threads // 32) * cfg.threads_n
    else:
        cols = cfg.threads_n * cfg.lanes
    return -(-spec.n // cols) * -(-spec.rows // cfg.rows) * cfg.split


def k_step(spec: GemmSpec, cfg: GemvConfig) -> int:
    """K elements a block's threads consume per main-loop iteration."""
    if cfg.mma:
        return 16 * cfg.unroll * warps_k(cfg)
    if spec.b_kmajor:
        return 32 * cfg.lanes * cfg.unroll
    return (cfg.threads // cfg.threads_n) * cfg.unroll


def register_words(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """32-bit registers a thread's accumulators, weight vectors and x values take (an estimate)."""
    per_word = 4 // dtype_bytes(dtype)
    if cfg.mma:
        # fp32 accumulators of its tiles, one k16 step's 4 weight vectors, A's words and x's: ptxas issues a step's
        # loads just before its mmas whatever ``unroll`` (sm_90a, CUDA 13.0: 76 registers at v8 m16 u4 and u2, 44 at
        # v4 m16 u8), so a step, not ``unroll`` of them, is what a lane holds
        tn, t8 = mma_tiles(cfg)
        if cfg.stages > 1:
            # the ring's: ptxas reads up to two steps from shared memory ahead of their mmas, and holds about 8 more
            # (the ring's and the copies' addresses, the loop's state; sm_90a, CUDA 13.0: 40-132 registers at 1-16
            # rows, within the bounds tests/kernels/test_gemv.py checks on ten ring configs)
            return 4 * tn * t8 + min(cfg.unroll, 2) * (2 * cfg.lanes + 2 * t8) + 4 * tn + 8
        return 4 * tn * t8 + 2 * cfg.lanes + 4 * tn + 2 * t8
    if spec.b_kmajor:
        acc = cfg.rows * cfg.threads_n
        w = cfg.unroll * cfg.threads_n * cfg.lanes // per_word
        x = cfg.unroll * cfg.rows * cfg.lanes // per_word
    else:
        acc = cfg.rows * cfg.lanes
        w = cfg.unroll * cfg.lanes // per_word
        x = cfg.rows * -(-cfg.unroll // per_word)
    return acc + w + x


def fits_shape(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> bool:
    """Whether ``cfg`` takes ``spec``: whole vectors along the weight's contiguous axis, a K split every block
    of which has work, registers under the spill line, threads a block that a warp divides."""
    contiguous = spec.k if spec.b_kmajor else spec.n
    if cfg.mma and not _fits_mma(spec, cfg, dtype):
        return False
    if cfg.stages != 1 and not cfg.mma:
        return False   # the CUDA-core kernel has no ring
    if contiguous % cfg.lanes or cfg.lanes * dtype_bytes(dtype) > _VECTOR_BYTES or cfg.threads % 32:
        return False
    if cfg.rows > spec.rows or register_words(spec, cfg, dtype) > _REGISTER_WORDS:
        return False
    if registers(spec, cfg, dtype) > _SM_REGISTERS // cfg.threads:
        return False   # the kernel's launch bound (its threads) gives ptxas no more: it would spill (512 threads: 128)
    if cfg.rows > MAX_ROWS and not cfg.mma:
        return False   # the CUDA-core kernel's multiply-adds past 16 rows outlast the stream
    if cfg.mma:
        pass   # _fits_mma took its warps
    elif spec.b_kmajor:
        if cfg.threads_n > spec.n:
            return False
    elif cfg.threads % cfg.threads_n or cfg.threads_n * cfg.lanes > spec.n * 2 or cfg.threads_n == 1:
        # one thread along N (the space's threads_n = 1 is the tensor-core kernel's one warp along N): a warp reads
        # one vector of 32 rows, and at 16 rows the 256-512 K threads' sums spilled (ptxas, sm_90a)
        return False
    # every split block has at least one whole K step (a split of less is all launch and reduction), and a
    # split is offered only where half of it leaves the SMs short of blocks (more is only a bigger reduction)
    if spec.k // k_step(spec, cfg) < cfg.split:
        return False
    half = replace(cfg, split=cfg.split // 2)
    return cfg.split == 1 or blocks(spec, half) < 4 * SMS


def _fits_mma(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> bool:
    """The tensor-core kernel's own limits: a [K, N] fp16 weight (mma.sync's f16 operands; an [N, K] weight keeps
    the CUDA-core kernel), at most eight n8 tiles of M (:data:`MMA_ROWS`), 2-8 lanes (1-4 m16 tiles a warp), whole
    warps along N and K, a warp's columns not more than twice N, its shared memory under the caps."""
    if spec.b_kmajor or dtype != "float16" or cfg.lanes not in (2, 4, 8) or cfg.rows > MMA_ROWS:
        return False
    warps = cfg.threads // 32
    if cfg.threads % 32 or warps % cfg.threads_n or cfg.threads_n * 8 * cfg.lanes > 2 * spec.n:
        return False
    # the ring's x copies are 8 bytes (four halves of a row at K offsets 4t): aligned only where 4 divides K
    if cfg.stages not in STAGES or (cfg.stages > 1 and spec.k % 4):
        return False
    # the staged x tile: 16-byte copies of x's rows, beside the prefetching kernel only (the ring copies x itself)
    if cfg.xs and (cfg.stages != 1 or spec.k % 8):
        return False
    return partial_bytes(cfg) <= _SHARED_BYTES and shared_bytes(spec, cfg) <= _RING_SHARED


_SPLITS = (1, 2, 4, 8, 16)   # the default's splits: among every space's (the space file's gemv_split too)


def configs(spec: GemmSpec, dtype: str, *, lanes=(8, 4, 2, 1), threads=(256, 128, 512), threads_n=(32, 8, 16, 1, 2, 4),
            split=_SPLITS, rows=(1, 2, 4, 8, 16, 32, 64), unroll=(4, 2, 8, 1), mma=(0, 1),
            stages=STAGES, xs=(0, 1)) -> list[GemvConfig]:
    """The configs (from the given choices) that fit ``spec`` (:func:`fits_shape`); the rows of a block are
    capped at the kernel's (``min(rows, M)``, so a 3-row GEMM gets a 3-row config). The CUDA-core configs come
    first, then the tensor-core ones (``mma``, each at the ``stages`` given and with and without ``xs`` where it
    fits; the CUDA-core kernel at 1, without)."""
    out, seen = [], set()
    for c_ in mma:
        for p in (sorted({int(x) for x in stages}) if c_ else (1,)):
            for x_ in (sorted({int(x) for x in xs}) if c_ else (0,)):
                for v, t, n, s, m, u in [(v, t, n, s, m, u) for v in lanes for t in threads for n in threads_n
                                         for s in split for m in sorted({min(int(r), spec.rows) for r in rows})
                                         for u in unroll]:
                    c = GemvConfig(int(v), int(t), int(n), int(s), int(m), int(u), int(c_), p, x_)
                    if c not in seen and fits_shape(spec, c, dtype):
                        seen.add(c)
                        out.append(c)
    return out


# The per-SM limits of the GPUs the template builds for (sm_80 to sm_90): 64 K 32-bit registers, 2048 threads and 32
# blocks resident, 227 KB of shared memory (sm_80: 163 KB; the template's blocks take at most 32 KB)
_SM_REGISTERS, _SM_THREADS, _SM_BLOCKS, _SM_SHARED = 65536, 2048, 32, 227 * 1024
# bytes an SM keeps in flight to stream at the HBM rate (Little's law): its share of an H100 / H200's 3.4-4.8 TB/s
# (26-36 bytes a ns an SM) times a DRAM latency under load of about 1.5-2 us
_INFLIGHT_PER_SM = 64 * 1024
# a K split's second kernel: its launch after the first (about 2 us on the H200, between two dependent kernels
# of a stream) counted as the weight bytes the first kernel streams meanwhile (4.3 TB/s x 2 us)
_LAUNCH_BYTES = 8 << 20
# [K, N]: bytes of a weight row a warp's threads along N read together; 64 bytes: two whole 32-byte sectors, the
# HBM's burst (narrower rows fetch sectors in other rows per load: more DRAM row activations a byte)
_MIN_SEGMENT = 64
# the default's threads_n: the space file's gemv_threads_n, so a tuned search can reach the untuned kernel (a
# tensor-core config's warps along N: 1 to 8)
_DEFAULT_N = (2, 4, 8, 32)
_DEFAULT_N_MMA = (1, 2, 4, 8)
# The tensor-core default's blocks: 4 warps, a step or two an iteration. What the cost below does not see (a block's
# cross-warp sum of partials grows with its warps along K and M's tiles; a deeper unroll prefetches further ahead
# than L2 keeps the rows) made larger blocks and unrolls slower on the H200 at every shape measured (
# 8, 16, 24 and 32 rows against 11008 x 4096, 4096 x 11008 and 5120 x 13824 fp16 weights, 72-config sweeps at 16
# and 32 rows): the fastest config of each was a 128-thread one, and u2 beat u8 at the same split (31.9 against
# 43.5 us at 16 rows, 37.8 against 46.8 at 32). The space still offers the others to the search.
_MMA_THREADS = (128,)
# the default's staged x tile (``xs``), weighed by x's reads from L2 (:func:`x_read_bytes`)
_DEFAULT_XS = (0, 1)
_MMA_UNROLL = (2, 4)
# The multiply-adds, counted as the weight bytes the HBM streams in their time (the rule adds them to the stream:
# in the kernels measured they did not hide under it). CUDA cores: one fp32 multiply-add a weight element and row
# of M, with the conversions of fp16 operands to fp32 around it. The H200 (fp16, the CUDA-core defaults):
# 16 rows against a 4096 x 11008 weight took 59.8 us over the weight's 21.3 us at the copy ceiling (721 M
# multiply-adds), 8 rows of 11008 x 4096 22.4 us over it (361 M): 0.35 and 0.26 byte-times a multiply-add, 0.3
# here (2.3x its peak rate's 0.13: 33.5 T multiply-adds a second, 4.2 TB/s). Tensor cores: mma.sync's m16n8k16
# fp16 at about 330 T multiply-adds a second on Hopper (two thirds of wgmma's dense peak), 0.013 byte-times,
# 0.02 here; it multiplies M's padding too (8 or 16 columns). Unmeasured: the benchmark times both kernels.
_FMA_BYTES = 0.3
_MMA_FMA_BYTES = 0.02
# The tensor-core kernel streams its weight less efficiently than the CUDA-core one: at one row, where the
# multiply-adds cost neither kernel anything, its untuned config took 1.44x the CUDA-core kernel's time against a
# 4096 x 11008 fp16 weight (38.1 vs 26.4 us) and 2.1x against 4096 x 4096 (14.7 vs 6.9 us) on the H200; at 16
# rows it took half the CUDA-core kernel's (41.4 vs 81 us). Its weight term is stretched by the smaller factor.
# Those were the kernel without a ring (stages 1); the ring's kernel (stages 2-4) is stretched further
# (:data:`_RING_STREAM`). The rule keeps 1-2 rows on CUDA cores, whose multiply-adds there cost less than the factor.
_MMA_STREAM = 1.45


# The prefetching tensor-core kernel's loads of a step hit L2 (the rows were prefetched an iteration earlier): an
# L2 hit under load takes about a third of an HBM read's latency on Hopper, so a step's bytes count three times.
# The H200 (4096 x 11008 fp16 weights): 172 blocks of 4 warps took 41.5 us at 16 rows and 43.0 at 32
# (the rule: 32 KB an SM, twice the copy time, 42 us), 344 blocks 32.2 us at 16 rows (64 KB: the copy time and
# the overheads); 64 blocks of 8 warps at 8 rows of an 11008 x 4096 weight 53.9 us (24 KB an SM: 2.7x, 57 us).
_PREFETCH_GAIN = 3
# The ring's kernel (stages 2-4) streamed its weight more slowly than the prefetching one (stages 1) at equal
# bytes in flight: on the H200, 16 and 32 rows against a 4096 x 11008 fp16 weight (72 configs each),
# its configs' median time was 1.35x and 1.29x the prefetching configs' (each byte also takes a shared-memory
# write and read; each lane waits on its own copies). Its weight term is stretched by this too.
_RING_STREAM = 1.3


def registers(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """Registers ptxas gives a thread of ``cfg``'s kernel (an estimate): :func:`register_words` and a quarter more
    for addresses, loop counters and fp32 copies of x, in the 8-register units the GPU allocates: within about 10%
    of ``ptxas -v`` on this template's kernels of 8 and 16 rows, above it on one row (ptxas reuses the load
    registers), so the rule's occupancy errs low, never high."""
    w = register_words(spec, cfg, dtype)
    return -(-(w + w // 4 + 2) // 8) * 8


def shared_bytes(spec: GemmSpec, cfg: GemvConfig) -> int:
    """Shared memory of a block: the [K, N] kernel's partials of a group of rows and their sums (source's
    ``red``, ``rout``); the tensor-core kernel's ring or staged x tiles, which its warps' partials reuse."""
    if cfg.mma:
        if cfg.xs:
            return 2 * x_tile_halves(cfg)
        return 2 * ring_halves(cfg) if cfg.stages > 1 else partial_bytes(cfg)
    if spec.b_kmajor or cfg.threads == cfg.threads_n:
        return 0
    tk, cb = cfg.threads // cfg.threads_n, cfg.threads_n * cfg.lanes
    return (tk + 1) * max(1, min(cfg.rows, _SHARED_BYTES // (tk * cb * 4))) * cb * 4   # partials and sums


def partial_bytes(cfg: GemvConfig) -> int:
    """The tensor-core kernel's partials of the warps along K past the first, a lane's accumulators each."""
    tn, t8 = mma_tiles(cfg)
    return (warps_k(cfg) - 1) * cfg.threads_n * 4 * tn * t8 * 32 * 4


def x_stride(cfg: GemvConfig) -> int:
    """fp16 elements a row of the staged x tile takes: an iteration's ``16 * unroll`` K elements, padded so that rows
    start 32 or 96 bytes apart modulo 128: the four rows a half warp's 8-byte reads cover (lanes 4g .. 4g + 3 read
    32 bytes of row g) then fall in distinct banks."""
    chunk = 16 * cfg.unroll
    return chunk if chunk * 2 % 128 in (32, 96) else chunk + 16


def x_tile_halves(cfg: GemvConfig) -> int:
    """fp16 elements of the staged x tiles (``xs``): two buffers, per group of warps along N sharing a K range, of
    M's rows padded to whole n8 tiles; or the warps' partials where they are larger (they reuse its memory after
    the loop)."""
    if not cfg.xs:
        return 0
    return max(2 * warps_k(cfg) * 8 * mma_tiles(cfg)[1] * x_stride(cfg), partial_bytes(cfg) // 2)


def ring_bytes(cfg: GemvConfig) -> int:
    """The tensor-core kernel's cp.async ring (``stages`` > 1): per stage, lane and k16 step, its four weight
    vectors and x's four halves of each n8 tile of M."""
    if cfg.stages == 1:
        return 0
    return cfg.threads * cfg.stages * cfg.unroll * (4 * cfg.lanes + 4 * mma_tiles(cfg)[1]) * 2


def ring_halves(cfg: GemvConfig) -> int:
    """fp16 elements of the tensor-core kernel's shared allocation with a ring: the ring, or the warps' partials
    where they are larger (they reuse its memory after the loop)."""
    return max(ring_bytes(cfg), partial_bytes(cfg)) // 2


def resident_blocks(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """Blocks of the main kernel an SM holds at once (threads, registers, blocks and shared memory an SM)."""
    shared = shared_bytes(spec, cfg)
    return min(_SM_THREADS // cfg.threads, _SM_REGISTERS // (registers(spec, cfg, dtype) * cfg.threads),
               _SM_BLOCKS, _SM_SHARED // shared if shared else _SM_BLOCKS)


def inflight_bytes(spec: GemmSpec, cfg: GemvConfig, dtype: str, sms: int = SMS) -> float:
    """Weight bytes an SM has in flight on average over the main kernel: each resident thread's loads of a step
    (``unroll`` vectors of its columns), the blocks of a wave spread over the SMs, each SM's up to its share of the
    stream, a partial last wave counted at its share (its SMs mostly idle)."""
    res = resident_blocks(spec, cfg, dtype)
    if res == 0:
        return 0.0
    nb = blocks(spec, cfg)
    waves = -(-nb // (res * sms))
    if cfg.mma and cfg.stages > 1:   # the ring's iterations past the one the mmas read: `unroll` k16 steps each
        per_thread = (cfg.stages - 1) * cfg.unroll * 4 * cfg.lanes * dtype_bytes(dtype)
    elif cfg.mma:
        # a step's 4 vectors a lane: ptxas issues them just before the step's mmas whatever `unroll`, so a warp has
        # one step in flight; but the kernel prefetched them into L2 an iteration earlier, so they come at L2's
        # latency, not HBM's: counted as that many HBM-latency bytes (:data:`_PREFETCH_GAIN`)
        per_thread = _PREFETCH_GAIN * 4 * cfg.lanes * dtype_bytes(dtype)
    else:
        per_thread = cfg.unroll * (1 if not spec.b_kmajor else cfg.threads_n) * cfg.lanes * dtype_bytes(dtype)
    # a wave's blocks spread over the SMs (some SMs one block more); an SM counts up to its share of the stream
    # (:data:`_INFLIGHT_PER_SM`), so the SMs a small grid leaves idle stream nothing: 64 blocks of an 8 x 11008 x
    # 4096 GEMV held 147 KB each and took 2.5x the copy time on the H200, the stream of 64 SMs, not 132
    per_block = cfg.threads * per_thread
    wave = nb / waves
    lo = int(wave // sms)
    extra = wave - lo * sms   # SMs with lo + 1 blocks
    held = (sms - extra) * min(lo * per_block, _INFLIGHT_PER_SM) + extra * min((lo + 1) * per_block, _INFLIGHT_PER_SM)
    return held / sms


def streamed_bytes(spec: GemmSpec, cfg: GemvConfig, dtype: str, sms: int = SMS) -> float:
    """The default rule's cost of ``cfg``, in bytes at the HBM rate: the weight (once: every row of M in the
    block that reads a weight tile; once more a tile of rows beyond the first where M exceeds ``rows``),
    stretched where its SMs keep less than :data:`_INFLIGHT_PER_SM` in flight (latency, not bandwidth, then
    paces the stream), plus a K split's fp32 partials (written and read) and its second kernel's launch, and the
    tensor-core kernel's reads of x from L2 (:func:`x_read_bytes`)."""
    weight = spec.n * spec.k * dtype_bytes(dtype) * -(-spec.rows // cfg.rows)
    flight = inflight_bytes(spec, cfg, dtype, sms)
    if flight <= 0:
        return float("inf")
    stream = (_MMA_STREAM * (_RING_STREAM if cfg.stages > 1 else 1.0)) if cfg.mma else 1.0
    cost = (weight * max(1.0, _INFLIGHT_PER_SM / flight) * stream + _multiply_add_bytes(spec, cfg)
            + x_read_bytes(spec, cfg, dtype))
    if cfg.split > 1:
        cost += _LAUNCH_BYTES + 2 * 4 * cfg.split * spec.rows * spec.n
    return cost


def x_read_bytes(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> float:
    """The tensor-core kernel's reads of x from L2, counted as weight bytes (both pass the L2): a warp reads its n8
    tiles' x halves for its ``8 * lanes`` columns, ``rows / (8 * lanes)`` of its weight bytes; with ``xs`` a group
    of ``threads_n`` warps reads them once. On the H100 (4096 x 11008 fp16): at 64 rows of 4 lanes (x twice the
    weight) the unstaged default took 73.3 us and 2 warps along N sharing a staged tile 64.6; at 16 and 32 rows of 8
    lanes (a quarter, a half) the staged tiles were no faster (40.6 against 38.2 us, 45.1 against 45.0)."""
    if not cfg.mma:
        return 0.0
    weight = spec.n * spec.k * dtype_bytes(dtype) * -(-spec.rows // cfg.rows)
    return weight * mma_tiles(cfg)[1] / cfg.lanes / (cfg.threads_n if cfg.xs else 1)


def _multiply_add_bytes(spec: GemmSpec, cfg: GemvConfig) -> float:
    """A config's multiply-adds counted as weight bytes streamed meanwhile (:data:`_FMA_BYTES`)."""
    row_tiles = -(-spec.rows // cfg.rows)
    if cfg.mma:
        return _MMA_FMA_BYTES * spec.n * spec.k * row_tiles * 8 * mma_tiles(cfg)[1]
    return _FMA_BYTES * spec.n * spec.k * spec.rows


@lru_cache(maxsize=256)   # a pure function of its arguments, asked per kernel by fits, the sketch and the build
def default_config(spec: GemmSpec, dtype: str, sms: int = SMS, mma: tuple = (0, 1)) -> GemvConfig | None:
    """The config an untuned build runs, by a rule over the shape and the GPU's SM count (``sms``).

    Every row of M (up to :data:`MAX_ROWS`, :data:`MMA_ROWS` on tensor cores) is held by the block that reads a
    weight tile, so the weight leaves
    HBM once: tiles of fewer rows are separate blocks, which the GPU runs in an order of its choosing, so the
    second tile's read of a weight tile finds it in L2 only when the L2 outlives the gap (it did not for an
    11008 x 4096 fp16 weight, 90 MB, on the H200's 50 MB L2: 16 rows in two 8-row tiles took 2.4x one row's
    time). Within that, the configs that fit (16-byte vectors or narrower, each thread's registers under the spill
    line, [K, N] rows read :data:`_MIN_SEGMENT` bytes at a time) are costed by :func:`streamed_bytes`: the bytes
    an SM keeps in flight (registers bound them: more rows, more fp32 accumulators, fewer loads in flight), whole
    waves of blocks, and a K split's launch and partials; the cheapest wins, ties to fewer split blocks, then to
    wider vectors (fewer x conversions a multiply-add), then fewer threads along K (a shorter reduction). The
    multiply-adds count too (:data:`_FMA_BYTES`): a CUDA-core config's grow with M (at 8-16 rows longer than the
    stream), a tensor-core config's (fp16 [K, N] weights) are a few percent at any M, but it streams its weight
    more slowly (:data:`_MMA_STREAM`): it wins from a few rows on.
    ``mma``: the kernels to choose from (0 CUDA cores, 1 tensor cores). Nothing in it is fitted to a benchmark
    shape; the multiply-adds' rate is the H200's."""
    vec = _VECTOR_BYTES // dtype_bytes(dtype)
    lanes = tuple(v for v in (8, 4, 2) if v <= vec)   # lanes and unroll: the space file's values too
    # past 16 rows only the tensor-core kernel holds every row in one block
    kinds = tuple(tc for tc in mma if tc or spec.rows <= MAX_ROWS or dtype == "float32") or mma
    cands = [c for tc in kinds for c in configs(spec, dtype, lanes=lanes,
                                              threads=_MMA_THREADS if tc else (128, 256, 512),
                                              threads_n=_DEFAULT_N_MMA if tc else _DEFAULT_N, split=_SPLITS,
                                              rows=(min(spec.rows, MMA_ROWS if tc else MAX_ROWS),),
                                              unroll=_MMA_UNROLL if tc else (8, 4, 2), mma=(tc,), stages=STAGES,
                                              xs=_DEFAULT_XS)]
    segment = min(_MIN_SEGMENT, spec.n * dtype_bytes(dtype))

    def row_bytes(c: GemvConfig) -> int:   # contiguous bytes of a weight row a warp reads together
        return 8 * c.lanes * dtype_bytes(dtype) if c.mma else c.threads_n * c.lanes * dtype_bytes(dtype)

    wide = [c for c in cands if spec.b_kmajor or row_bytes(c) >= segment]
    cands = wide or cands

    # costs within 10% of the cheapest are a tie (finer than the rule's estimates): then the fewer split blocks, the
    # wider vectors, ..., a tensor-core config's shorter unroll (see _MMA_UNROLL), the shallower ring (less shared
    # memory, more blocks an SM)
    costs = {c: streamed_bytes(spec, c, dtype, sms) for c in cands}
    cheapest = min(costs.values(), default=0.0)

    def key(c: GemvConfig):
        tk = warps_k(c) if c.mma else 1 if spec.b_kmajor else c.threads // c.threads_n
        return (costs[c] > 1.1 * cheapest, c.split, -c.lanes, tk, c.threads, c.unroll if c.mma else -c.unroll,
                c.threads_n, c.mma, c.stages, costs[c])

    best = min(cands, key=key, default=None)
    if best is None:   # an odd small shape none of the rule's candidates take: the first config that fits
        return next(iter(configs(spec, dtype, mma=mma)), None)
    return best
