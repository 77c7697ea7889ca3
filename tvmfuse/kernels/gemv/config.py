"""The GEMV template's configs: the knobs as data, which of them fit a kernel, the default per shape, and the
annotations a tuned sketch records them under."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tvmfuse.kernels.wgmma.config import SMS   # the SM count, named once for the GEMM templates
from tvmfuse.kernels.wgmma.spec import GemmSpec

ANNOTATION = "tvmfuse.gemv_config"
CANDIDATES = "tvmfuse.gemv_candidates"
SPEC = "tvmfuse.gemv_spec"
# the template takes GEMMs of at most this many rows (decode: a few tokens). Its multiply-adds run on fp32 CUDA
# cores: each weight element read costs ``rows`` of them, and on the H200 (about 33.5 T FMA/s, 2.1 T fp16 weight
# elements/s at the copy ceiling) the two meet at about 16 rows; above that wgmma's tensor cores are faster
MAX_ROWS = 16
_VECTOR_BYTES = 16     # one 128-bit load per vector
# per-thread register words a config may ask for (accumulators + vectors in flight + x); above it ptxas spills
_REGISTER_WORDS = 160
_SHARED_BYTES = 32 * 1024   # the [K, N] kernel's cross-warp partial sums, per group of rows


@dataclass(frozen=True)
class GemvConfig:
    """One GEMV kernel. For a ``[K, N]`` weight: ``threads`` threads a block, ``threads_n`` of them along N
    (each a vector of ``lanes`` columns), the rest along K; for ``[N, K]``: ``threads // 32`` warps a block,
    each reading ``threads_n`` columns along K, a vector of ``lanes`` K elements a lane. ``split``: thread
    blocks along K (their partial sums reduced by a second kernel, which applies the epilogue), ``rows``: rows
    of M a block holds in registers (fewer than M: more blocks, adjacent in the launch, each reading the weight
    tile again, from L2 where it is still there), ``unroll``: vectors each thread loads before it multiplies (loads in flight)."""

    lanes: int = 8
    threads: int = 256
    threads_n: int = 32
    split: int = 1
    rows: int = 1
    unroll: int = 4

    @property
    def name(self) -> str:
        return f"v{self.lanes} t{self.threads} n{self.threads_n} s{self.split} m{self.rows} u{self.unroll}"


def parse_config(name: str) -> GemvConfig:
    """The config :attr:`GemvConfig.name` names (``"v8 t256 n32 s4 m1 u4"``)."""
    f = dict((part[0], int(part[1:])) for part in name.split())
    return GemvConfig(lanes=f["v"], threads=f["t"], threads_n=f["n"], split=f["s"], rows=f["m"], unroll=f["u"])


def dtype_bytes(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]


def blocks(spec: GemmSpec, cfg: GemvConfig) -> int:
    """Thread blocks of the main kernel."""
    if spec.b_kmajor:
        cols = (cfg.threads // 32) * cfg.threads_n
    else:
        cols = cfg.threads_n * cfg.lanes
    return -(-spec.n // cols) * -(-spec.rows // cfg.rows) * cfg.split


def k_step(spec: GemmSpec, cfg: GemvConfig) -> int:
    """K elements a block's threads consume per main-loop iteration."""
    if spec.b_kmajor:
        return 32 * cfg.lanes * cfg.unroll
    return (cfg.threads // cfg.threads_n) * cfg.unroll


def register_words(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """32-bit registers a thread's accumulators, weight vectors and x values take (an estimate)."""
    per_word = 4 // dtype_bytes(dtype)
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
    if contiguous % cfg.lanes or cfg.lanes * dtype_bytes(dtype) > _VECTOR_BYTES or cfg.threads % 32:
        return False
    if cfg.rows > spec.rows or register_words(spec, cfg, dtype) > _REGISTER_WORDS:
        return False
    if spec.b_kmajor:
        if cfg.threads_n > spec.n:
            return False
    elif cfg.threads % cfg.threads_n or cfg.threads_n * cfg.lanes > spec.n * 2:
        return False
    # every split block has at least one whole K step (a split of less is all launch and reduction), and a
    # split is offered only where half of it leaves the SMs short of blocks (more is only a bigger reduction)
    if spec.k // k_step(spec, cfg) < cfg.split:
        return False
    half = GemvConfig(cfg.lanes, cfg.threads, cfg.threads_n, cfg.split // 2, cfg.rows, cfg.unroll)
    return cfg.split == 1 or blocks(spec, half) < 4 * SMS


_SPLITS = (1, 2, 4, 8, 16)   # the default's splits: among every space's (the space file's gemv_split too)


def configs(spec: GemmSpec, dtype: str, *, lanes=(8, 4, 2, 1), threads=(256, 128, 512), threads_n=(32, 8, 16, 1, 2, 4),
            split=_SPLITS, rows=(1, 2, 4, 8, 16), unroll=(4, 2, 8, 1)) -> list[GemvConfig]:
    """The configs (from the given choices) that fit ``spec`` (:func:`fits_shape`); the rows of a block are
    capped at the kernel's (``min(rows, M)``, so a 3-row GEMM gets a 3-row config)."""
    out = []
    for v in lanes:
        for t in threads:
            for n in threads_n:
                for s in split:
                    for m in sorted({min(int(r), spec.rows) for r in rows}):
                        for u in unroll:
                            c = GemvConfig(int(v), int(t), int(n), int(s), int(m), int(u))
                            if c not in out and fits_shape(spec, c, dtype):
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
# the default's threads_n: the space file's gemv_threads_n, so a tuned search can reach the untuned kernel
_DEFAULT_N = (2, 4, 8, 32)


def registers(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """Registers ptxas gives a thread of ``cfg``'s kernel (an estimate): :func:`register_words` and a quarter more
    for addresses, loop counters and fp32 copies of x, in the 8-register units the GPU allocates: within about 10%
    of ``ptxas -v`` on this template's kernels of 8 and 16 rows, above it on one row (ptxas reuses the load
    registers), so the rule's occupancy errs low, never high."""
    w = register_words(spec, cfg, dtype)
    return -(-(w + w // 4 + 2) // 8) * 8


def shared_bytes(spec: GemmSpec, cfg: GemvConfig) -> int:
    """Shared memory of a block: the [K, N] kernel's partials of a group of rows and their sums (source's
    ``red``, ``rout``)."""
    if spec.b_kmajor or cfg.threads == cfg.threads_n:
        return 0
    tk, cb = cfg.threads // cfg.threads_n, cfg.threads_n * cfg.lanes
    return (tk + 1) * max(1, min(cfg.rows, _SHARED_BYTES // (tk * cb * 4))) * cb * 4   # partials and sums


def resident_blocks(spec: GemmSpec, cfg: GemvConfig, dtype: str) -> int:
    """Blocks of the main kernel an SM holds at once (threads, registers, blocks and shared memory an SM)."""
    shared = shared_bytes(spec, cfg)
    return min(_SM_THREADS // cfg.threads, _SM_REGISTERS // (registers(spec, cfg, dtype) * cfg.threads),
               _SM_BLOCKS, _SM_SHARED // shared if shared else _SM_BLOCKS)


def inflight_bytes(spec: GemmSpec, cfg: GemvConfig, dtype: str, sms: int = SMS) -> float:
    """Weight bytes an SM has in flight on average over the main kernel: each resident thread's loads of a step
    (``unroll`` vectors of its columns), the blocks of a wave spread over the SMs, a partial last wave counted
    at its share (its SMs mostly idle)."""
    res = resident_blocks(spec, cfg, dtype)
    if res == 0:
        return 0.0
    nb = blocks(spec, cfg)
    waves = -(-nb // (res * sms))
    cols = 1 if not spec.b_kmajor else cfg.threads_n
    return nb * cfg.threads * cfg.unroll * cols * cfg.lanes * dtype_bytes(dtype) / (waves * sms)


def streamed_bytes(spec: GemmSpec, cfg: GemvConfig, dtype: str, sms: int = SMS) -> float:
    """The default rule's cost of ``cfg``, in bytes at the HBM rate: the weight (once: every row of M in the
    block that reads a weight tile; once more a tile of rows beyond the first where M exceeds ``rows``),
    stretched where its SMs keep less than :data:`_INFLIGHT_PER_SM` in flight (latency, not bandwidth, then
    paces the stream), plus a K split's fp32 partials (written and read) and its second kernel's launch."""
    weight = spec.n * spec.k * dtype_bytes(dtype) * -(-spec.rows // cfg.rows)
    flight = inflight_bytes(spec, cfg, dtype, sms)
    if flight <= 0:
        return float("inf")
    cost = weight * max(1.0, _INFLIGHT_PER_SM / flight)
    if cfg.split > 1:
        cost += _LAUNCH_BYTES + 2 * 4 * cfg.split * spec.rows * spec.n
    return cost


@lru_cache(maxsize=256)   # a pure function of its arguments, asked per kernel by fits, the sketch and the build
def default_config(spec: GemmSpec, dtype: str, sms: int = SMS) -> GemvConfig | None:
    """The config an untuned build runs, by a rule over the shape and the GPU's SM count (``sms``).

    Every row of M (up to :data:`MAX_ROWS`) is held by the block that reads a weight tile, so the weight leaves
    HBM once: tiles of fewer rows are separate blocks, which the GPU runs in an order of its choosing, so the
    second tile's read of a weight tile finds it in L2 only when the L2 outlives the gap (it did not for an
    11008 x 4096 fp16 weight, 90 MB, on the H200's 50 MB L2: 16 rows in two 8-row tiles took 2.4x one row's
    time). Within that, the configs that fit (16-byte vectors or narrower, each thread's registers under the spill
    line, [K, N] rows read :data:`_MIN_SEGMENT` bytes at a time) are costed by :func:`streamed_bytes`: the bytes
    an SM keeps in flight (registers bound them: more rows, more fp32 accumulators, fewer loads in flight), whole
    waves of blocks, and a K split's launch and partials; the cheapest wins, ties to fewer split blocks, then to
    wider vectors (fewer x conversions a multiply-add), then fewer threads along K (a shorter reduction). Nothing
    in it is fitted to a benchmark shape."""
    rows = min(spec.rows, MAX_ROWS)
    vec = _VECTOR_BYTES // dtype_bytes(dtype)
    lanes = tuple(v for v in (8, 4, 2) if v <= vec)   # lanes and unroll: the space file's values too
    cands = configs(spec, dtype, lanes=lanes, threads=(128, 256, 512), threads_n=_DEFAULT_N,
                    split=_SPLITS, rows=(rows,), unroll=(8, 4, 2))
    segment = min(_MIN_SEGMENT, spec.n * dtype_bytes(dtype))
    wide = [c for c in cands if spec.b_kmajor or c.threads_n * c.lanes * dtype_bytes(dtype) >= segment]
    cands = wide or cands

    def key(c: GemvConfig):
        tk = 1 if spec.b_kmajor else c.threads // c.threads_n
        return (streamed_bytes(spec, c, dtype, sms), c.split, -c.lanes, tk, c.threads, -c.unroll, c.threads_n)

    best = min(cands, key=key, default=None)
    if best is None:   # an odd small shape none of the rule's candidates take: the first config that fits
        return next(iter(configs(spec, dtype)), None)
    return best
