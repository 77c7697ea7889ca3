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
  ``scripts/wgmma_probe.py``);
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

ANNOTATION = "tvmfuse.wgmma_config"
CANDIDATES = "tvmfuse.wgmma_candidates"
SPEC = "tvmfuse.wgmma_spec"
_EPILOGUE = "tvmfuse_wgmma_epilogue"   # placeholder extern the generated store calls; replaced by the epilogue


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

    @property
    def fold_batch(self) -> bool:
        return self.a_batched and not self.b_batched

    @property
    def rows(self) -> int:
        return self.m * math.prod(self.batch) if self.fold_batch else self.m

    @property
    def grid_batch(self) -> int:
        return 1 if self.fold_batch else math.prod(self.batch)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "batch": list(self.batch)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GemmSpec":
        d = json.loads(text)
        return cls(**{**d, "batch": tuple(d["batch"])})


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

    @property
    def block_m(self) -> int:
        return 64 * self.m_tiles * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def name(self) -> str:
        return (f"g{self.warpgroups} m{self.m_tiles} n{self.block_n} k{self.block_k} s{self.stages} "
                f"r{self.raster} z{self.swizzle} f{self.inflight}")

    def shared_bytes(self) -> int:
        return 2 * self.stages * self.block_k * (self.block_m + self.block_n)


def parse_config(name: str) -> WgmmaConfig:
    """The config :attr:`WgmmaConfig.name` names (``"g2 m1 n128 k64 s4 r8 z128 f1"``)."""
    f = dict((part[0], int(part[1:])) for part in name.split())
    return WgmmaConfig(warpgroups=f["g"], m_tiles=f["m"], block_n=f["n"], block_k=f["k"], stages=f["s"],
                       raster=f["r"], swizzle=f.get("z", 128), inflight=f.get("f", 1))


def configs(spec: GemmSpec, *, warpgroups=(2, 1), m_tiles=(1, 2), block_n=(128, 256, 64), block_k=(64,),
            stages=(4, 3, 5), raster=(8, 1), swizzle=(128, 0), inflight=(1, 0),
            max_shared_bytes: int = 227 * 1024) -> list[WgmmaConfig]:
    """The configs (from the given choices) whose tiles divide ``spec`` and fit registers and shared memory."""
    out = []
    for g in warpgroups:
        for mt in m_tiles:
            for n in block_n:
                for kb in block_k:
                    for st in stages:
                        for r, z, f in [(r, z, f) for r in raster for z in swizzle for f in inflight]:
                            c = WgmmaConfig(int(g), int(mt), int(n), int(kb), int(st), int(r), int(z), int(f))
                            tiles_m = spec.rows // c.block_m if spec.rows % c.block_m == 0 else 0
                            if (tiles_m and spec.n % c.block_n == 0 and spec.k % c.block_k == 0
                                    and spec.k // c.block_k >= c.stages - 1 and tiles_m % c.raster == 0
                                    and c.stages - c.inflight >= 2 and (c.swizzle == 0 or c.block_k == 64)
                                    and c.m_tiles * c.block_n // 2 <= 128   # fp32 accumulators per thread
                                    and c.shared_bytes() <= max_shared_bytes):
                                out.append(c)
    return out


def default_config(spec: GemmSpec) -> WgmmaConfig:
    options = configs(spec)
    for want in (WgmmaConfig(2, 1, 128, 64, 4, 8), WgmmaConfig(2, 1, 128, 64, 4, 1)):
        if want in options:
            return want
    return options[0]


# ----------------------------------------------------------------------------------------- the kernel
def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" if line.strip() else "\n" for line in text.splitlines())


def _desc(buf: str, offset: str, lbo: int, sbo: int, swizzle: int) -> str:
    """A wgmma shared-memory matrix descriptor for ``buf[offset]``: the start address, the leading and stride
    byte offsets (16-byte units; their meaning depends on the layout, see the PTX ISA's "Shared Memory Matrix
    Layout") and the swizzle mode (bits 62-63: 0 none, 1 128-byte)."""
    addr = (f"T.Cast('uint64', T.call_extern('uint32', '__cvta_generic_to_shared', "
            f"T.address_of({buf}[{offset}])))")
    const = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | ((1 if swizzle == 128 else 0) << 62)
    return f"(((({addr}) & T.uint64(0x3FFFF)) >> T.uint64(4)) | T.uint64({const}))"


def _layout(cfg: WgmmaConfig, kmajor: bool, outer: int):
    """How a ``[outer, BK]`` (K-major) or ``[BK, outer]`` (MN-major) tile sits in shared memory.

    Returns ``(chunk, desc)``: ``chunk(c)`` -> (outer index, k index, element offset) expressions for the
    tile's 16-byte chunk ``c`` (consecutive chunks: consecutive 16 bytes of one global row, so a warp's
    copies are coalesced, and eight consecutive threads fill one 128-byte line of shared memory: no bank
    conflicts); ``desc(kk)`` -> (element offset of K slice ``kk`` (16 deep), LBO, SBO) for the descriptor.
    """
    BK = cfg.block_k
    if cfg.swizzle == 128:   # 8-row x 128-byte atoms, each 16-byte chunk XOR-ed with its row within the atom
        if kmajor:           # row = outer index (64 K values = 128 bytes); atoms along M/N 1024 bytes apart
            def chunk(c):
                r, kc = f"({c} // 8)", f"({c} % 8)"
                return r, f"{kc} * 8", f"{r} * 64 + T.bitwise_xor({kc}, {r} % 8) * 8"
            return chunk, lambda kk: (kk * 16, 16, 1024)
        # MN-major: row = k, 64 MN values per atom row; atoms along K 1024 bytes apart, 64-wide MN blocks
        # BK * 128 bytes apart
        per_row = outer // 8

        def chunk(c):
            k, nc = f"({c} // {per_row})", f"({c} % {per_row})"
            off = f"{nc} // 8 * {BK * 64} + {k} * 64 + T.bitwise_xor({nc} % 8, {k} % 8) * 8"
            return f"{nc} * 8", k, off
        return chunk, lambda kk: (kk * 2 * 512, BK * 128, 1024)
    # no swizzle: 8 x 16-byte core matrices of 128 contiguous bytes, chunk c at element c * 8
    if kmajor:   # c = (row // 8) * BK + (k // 8) * 8 + row % 8; core matrices along K 128 B apart, along M BK*16
        def chunk(c):
            return f"({c} // {BK} * 8 + {c} % 8)", f"({c} // 8 % {BK // 8} * 8)", f"{c} * 8"
        return chunk, lambda kk: (kk * 128, 128, BK * 16)

    def chunk(c):   # c = (k // 8) * outer + (n // 8) * 8 + k % 8; along K outer * 16 B apart, along N 128 B
        return f"({c} // 8 % {outer // 8} * 8)", f"({c} // {outer} * 8 + {c} % 8)", f"{c} * 8"
    return chunk, lambda kk: (kk * 2 * outer * 8, outer * 16, 128)


def gemm_source(spec: GemmSpec, cfg: WgmmaConfig, params: list[str], a: str, b: str,
                store: str) -> str:
    """TVMScript of the kernel: ``params`` the function's parameter declarations, ``a`` / ``b`` the names of the
    A and B buffers among them, ``store`` the store of one accumulator, a format string with the fields
    ``{bz}`` (flattened batch index), ``{row}``, ``{col}`` (output row within the batch and column) and
    ``{acc}`` (the fp32 accumulator)."""
    BM, BN, BK, S, MT, NT = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.m_tiles, cfg.threads
    M, N, K = spec.rows, spec.n, spec.k
    tiles_m, tiles_n, kt = M // BM, N // BN, K // BK
    R, F = cfg.raster, cfg.inflight
    # tile coordinates: groups of R tile rows walk the columns together
    pid_m = f"(bx // {R * tiles_n} * {R} + bx % {R * tiles_n} % {R})"
    pid_n = f"(bx % {R * tiles_n} // {R})"
    a_tile, b_tile = BM * BK, BN * BK
    # flat element offsets of the batch in A and B (0 where not batched, or where the batch folds into rows)
    a_batch = f"bz * {spec.m * K}" if spec.a_batched and not spec.fold_batch else "0"
    b_batch = f"bz * {N * K}" if spec.b_batched else "0"
    a_chunk, a_desc = _layout(cfg, True, BM)
    b_chunk, b_desc = _layout(cfg, spec.b_kmajor, BN)

    def copies(slot: str, step: str) -> str:
        out = ""
        for dst, src, tile, chunk, glob in (
                ("sa", a, a_tile, a_chunk, lambda o, k: f"{a_batch} + ({pid_m} * {BM} + {o}) * {K} + {step} * {BK} + {k}"),
                ("sb", b, b_tile, b_chunk,
                 (lambda o, k: f"{b_batch} + ({pid_n} * {BN} + {o}) * {K} + {step} * {BK} + {k}") if spec.b_kmajor
                 else (lambda o, k: f"{b_batch} + ({step} * {BK} + {k}) * {N} + {pid_n} * {BN} + {o}"))):
            o, k, off = chunk(f"(it * {NT} + tx)")
            out += (f"for it in T.unroll({tile // 8 // NT}):\n"
                    f"    T.evaluate(T.s_tir.cp_async_raw('float16', {dst}.data, {slot} * {tile} + {off}, "
                    f"{src}.data, {glob(o, k)}, 16))\n")
        return out

    wg = "(tx // 128)"
    wgmmas = ""
    for kk in range(BK // 16):
        for t in range(MT):
            accs = ", ".join(f"acc[{t * BN // 2 + i}]" for i in range(BN // 2))
            a_off, a_lbo, a_sbo = a_desc(kk)
            b_off, b_lbo, b_sbo = b_desc(kk)
            # warpgroup g's m-tile t: rows (g * MT + t) * 64 of the block tile, 64 * BK elements each
            da = _desc("sa", f"ko % {S} * {a_tile} + ({wg} * {MT} + {t}) * {64 * BK} + {a_off}", a_lbo, a_sbo,
                       cfg.swizzle)
            db = _desc("sb", f"ko % {S} * {b_tile} + {b_off}", b_lbo, b_sbo, cfg.swizzle)
            wgmmas += (f"T.evaluate(T.ptx.wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.f16.f16({accs}, {da}, {db}, "
                       f"T.ptx.pred(1), 1, 1, 0, {0 if spec.b_kmajor else 1}))\n")

    lane, warp = "(tx % 32)", "(tx % 128 // 32)"
    row = (f"{pid_m} * {BM} + ({wg} * {MT} + t) * 64 + {warp} * 16 + {lane} // 4 + i % 4 // 2 * 8")
    col = f"{pid_n} * {BN} + i // 4 * 8 + {lane} % 4 * 2 + i % 2"
    stored = store.format(bz="bz", row=f"({row})", col=f"({col})", acc=f"acc[t * {BN // 2} + i]")
    # Loads run L = S - 1 - F tiles ahead: a stage is refilled once the wgmma batches that read it are done
    # (with F batches left in flight at a step's end, the stage read F + 1 steps ago; the barrier at the top
    # of each step orders every warpgroup's wait before anyone's refill). One cp.async group per tile.
    L = S - 1 - F
    prologue = "".join(copies(str(s_), str(s_)) + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
                       for s_ in range(L))
    refill = copies(f"(ko + {L}) % {S}", f"(ko + {L})")
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
    for bz in T.thread_binding({spec.grid_batch}, thread="blockIdx.y"):
        for bx in T.thread_binding({tiles_m * tiles_n}, thread="blockIdx.x"):
            for tx in T.thread_binding({NT}, thread="threadIdx.x"):
                sa = T.alloc_buffer(({S * a_tile},), "float16", scope="shared.dyn", align=1024)
                sb = T.alloc_buffer(({S * b_tile},), "float16", scope="shared.dyn", align=1024)
                acc = T.alloc_buffer(({MT * BN // 2},), "float32", scope="local")
                for i in T.unroll({MT * BN // 2}):
                    acc[i] = T.float32(0)
{_indent(prologue, 16)}                for ko in T.serial({kt}):
                    T.evaluate(T.ptx.cp.async_.wait_group({L - 1}))
                    T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
                    T.tvm_storage_sync("shared")
                    T.evaluate(T.ptx.wgmma.fence.sync.aligned())
{_indent(wgmmas, 20)}                    T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
                    if ko + {L} < {kt}:
{_indent(refill, 24)}                    T.evaluate(T.ptx.cp.async_.commit_group())
                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned({F}))
                T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
                for t in T.unroll({MT}):
                    for i in T.unroll({BN // 2}):
                        {stored}
"""


def parse(source: str):
    from tvmfuse._tvm import tvm
    from tvm.script import tirx as T

    return tvm.script.parse(source, extra_vars={"T": T})
