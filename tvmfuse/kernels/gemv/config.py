"""The GEMV template's configs: the knobs as data, which of them fit a kernel, the default per shape, and the
annotations a tuned sketch records them under."""
from __future__ import annotations

from dataclasses import dataclass

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
    of M a block holds in registers (more rows: more blocks, adjacent in the launch so the weight they share is
    read from L2), ``unroll``: vectors each thread loads before it multiplies (loads in flight)."""

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


def default_config(spec: GemmSpec, dtype: str, sms: int = SMS) -> GemvConfig | None:
    """The config an untuned build runs, by rule: 16-byte vectors (narrower where the contiguous axis needs),
    256 threads, 4 vectors in flight a thread; [K, N]: a warp's 32 threads along N (512 contiguous bytes a
    row), 8 warps along K; [N, K]: 4 columns a warp; rows in registers up to 64 accumulators a thread, the
    rest of M in adjacent blocks; then the smallest K split (up to 16) that gives two blocks an SM."""
    vec = _VECTOR_BYTES // dtype_bytes(dtype)
    contiguous = spec.k if spec.b_kmajor else spec.n
    while contiguous % vec:
        vec //= 2
    unroll = 2 if spec.b_kmajor else 4
    per_thread = 4 if spec.b_kmajor else vec        # accumulators per row
    rows = max(1, min(spec.rows, 64 // per_thread))
    base = GemvConfig(vec, 256, 4 if spec.b_kmajor else 32, 1, rows, unroll)
    if spec.b_kmajor and spec.n < 4 or not spec.b_kmajor and spec.n < 32 * vec:
        base = GemvConfig(vec, 256, 1 if spec.b_kmajor else max(1, spec.n // vec), 1, rows, unroll)
        if not spec.b_kmajor and 256 % base.threads_n:
            base = GemvConfig(vec, 256, 1, 1, rows, unroll)
    while base.rows > 1 and register_words(spec, base, dtype) > _REGISTER_WORDS:
        base = GemvConfig(base.lanes, base.threads, base.threads_n, 1, max(1, base.rows // 2), base.unroll)
    best = None
    for s in _SPLITS:
        c = GemvConfig(base.lanes, base.threads, base.threads_n, s, base.rows, base.unroll)
        if not fits_shape(spec, c, dtype):
            break
        best = c
        if blocks(spec, c) >= 2 * sms:
            break
    if best is None:   # an odd small shape the rule's base misses: the first config that fits
        return next(iter(configs(spec, dtype)), None)
    return best
