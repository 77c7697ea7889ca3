"""TVMScript of the GEMV kernels: the weight streamed once with 16-byte loads, x reused across the rows held in
registers, the epilogue applied once on the final sum; a second kernel sums a K split's partials.

``emulate``: the same program with its threads as serial loops (each thread's registers a slice of an array,
the warp shuffles as the butterfly they compute, each phase between two barriers a loop over the block's
threads), which builds for any target, so the CPU checks the index arithmetic, the K split and its tails, the
cross-thread reductions and the epilogue numerically.
"""
from __future__ import annotations

from tvmfuse.kernels.gemv.config import (_SHARED_BYTES, GemvConfig, dtype_bytes, mma_tiles, ring_halves, warps_k,
                                         x_stride, x_tile_halves)
from tvmfuse.kernels.ksplit import split_sum
from tvmfuse.kernels.wgmma.spec import GemmSpec

_SHFL = "T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), {v}, {m}, 32, 32)"


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + ln + "\n" if ln.strip() else "\n" for ln in text.splitlines())


class _Frame:
    """What the two layouts share: loop words (serial in the emulation), per-thread register arrays, the
    block's thread loops around a phase."""

    def __init__(self, emulate: bool, ty: int, tx: int):
        self.emulate, self.ty, self.tx = emulate, ty, tx
        self.unroll = "T.serial" if emulate else "T.unroll"
        self.vec = "T.serial" if emulate else "T.vectorized"
        self.allocs = ""

    def local(self, name: str, size: int, dtype: str) -> str:
        """Allocate a register array; the prefix that indexes this thread's slice of it."""
        per = self.ty * self.tx if self.emulate else 1
        scope = "" if self.emulate else ", scope='local'"
        self.allocs += f"{name} = T.alloc_buffer(({per * size},), '{dtype}'{scope})\n"
        return f"(ty * {self.tx} + tx) * {size} + " if self.emulate else ""

    def threads(self, code: str) -> str:
        """``code`` as every thread of the block runs it (one phase between barriers)."""
        if not self.emulate:
            return code
        return f"for ty in T.serial({self.ty}):\n    for tx in T.serial({self.tx}):\n" + _indent(code, 8)

    def sync(self) -> str:
        return "" if self.emulate else "T.tvm_storage_sync('shared')\n"


def _k_extent(tiles: int, split: int) -> tuple[int, str]:
    """(whole K steps a split block takes, the main loop's extent): the last blocks may take fewer."""
    per = -(-tiles // split)
    return per, str(per) if tiles % split == 0 else f"T.max(T.min({per}, {tiles} - bz * {per}), 0)"


def _kn_body(spec: GemmSpec, cfg: GemvConfig, dt: str, f: _Frame, out: str) -> str:
    """The [K, N] weight: threads along N a vector of columns each, the rest along K (U consecutive rows a
    thread and step), partial sums across the K threads through shared memory."""
    M, N, K = spec.rows, spec.n, spec.k
    V, TN, MR, U, S = cfg.lanes, cfg.threads_n, cfg.rows, cfg.unroll, cfg.split
    TK = cfg.threads // TN
    CB, step = TN * V, TK * U
    tiles = K // step
    per, ext = _k_extent(tiles, S)
    A = f.local("acc", MR * V, "float32")
    Wp = f.local("w", U * V, dt)
    Xp = f.local("xa", MR * U, dt)
    u_, v_ = f.unroll, f.vec
    xvec = v_ if K % U == 0 and U * dtype_bytes(dt) <= 16 and U & (U - 1) == 0 else u_
    col0 = f"(by * {TN} + tx) * {V}"
    colc = f"T.min({col0}, {N - V})"   # a block past N's end recomputes the last columns and stores nothing
    rowc = f"T.min(bx * {MR} + m, {M - 1})"
    kb = f"((bz * {per} + it) * {step} + ty * {U})"
    fma = (f"acc[{A}m * {V} + v] = acc[{A}m * {V} + v] + T.Cast('float32', {{x}}) * "
           f"T.Cast('float32', w[{Wp}{{wi}}])\n")
    code = f"for i in {u_}({MR * V}):\n    acc[{A}i] = T.float32(0)\n"
    code += (f"for it in T.serial({ext}):\n"
             f"    for u in {u_}({U}):\n        for v in {v_}({V}):\n"
             f"            w[{Wp}u * {V} + v] = b_f[({kb} + u) * {N} + {colc} + v]\n"
             f"    for m in {u_}({MR}):\n        for u in {xvec}({U}):\n"
             f"            xa[{Xp}m * {U} + u] = a_f[{rowc} * {K} + {kb} + u]\n"
             f"    for u in {u_}({U}):\n        for m in {u_}({MR}):\n            for v in {u_}({V}):\n"
             + _indent(fma.format(x=f"xa[{Xp}m * {U} + u]", wi=f"u * {V} + v"), 16))
    rem = K - tiles * step
    if rem:   # the rows past the last whole step: a row a thread along K, in the last split block
        kr = f"({tiles * step} + j * {TK} + ty)"
        code += (f"if bz == {S - 1}:\n    for j in T.serial({-(-rem // TK)}):\n        if {kr} < {K}:\n"
                 f"            for v in {v_}({V}):\n                w[{Wp}v] = b_f[{kr} * {N} + {colc} + v]\n"
                 f"            for m in {u_}({MR}):\n                for v in {u_}({V}):\n"
                 + _indent(fma.format(x=f"a_f[{rowc} * {K} + {kr}]", wi="v"), 20))
    code = f.threads(code)
    if TK > 1:
        # the K threads' partials summed by every thread of the block, a group of rows at a time: each thread
        # stores its partials, then sums TK of them for its share of the group's outputs (rows x CB columns over
        # the block's threads), and the first row of threads reads the sums back. A sum by the first row of
        # threads alone would cost each of them (TK - 1) x rows x lanes serial adds, which at 64-128 threads along
        # K and 16 rows is longer than the kernel's whole weight stream
        G = max(1, min(MR, _SHARED_BYTES // (TK * CB * 4)))
        T_ = TK * TN
        scope = "" if f.emulate else ", scope='shared'"
        # the sums go to a buffer of their own: written in place, TVM's sync pass would see the partials read and
        # written in one phase and ask for a barrier inside the thread's `if`
        f.allocs += (f"red = T.alloc_buffer(({TK * G * CB},), 'float32'{scope})\n"
                     f"rout = T.alloc_buffer(({G * CB},), 'float32'{scope})\n")
        Rp = f.local("rsum", 1, "float32")
        for g0 in range(0, MR, G):
            gl = min(G, MR - g0)
            code += f.threads(f"for mm in {u_}({gl}):\n    for v in {u_}({V}):\n"
                              f"        red[(ty * {G} + mm) * {CB} + tx * {V} + v] = acc[{A}({g0} + mm) * {V} + v]\n")
            code += f.sync()
            o = f"(j * {T_} + ty * {TN} + tx)"
            code += f.threads(f"for j in T.serial({-(-gl * CB // T_)}):\n    if {o} < {gl * CB}:\n"
                              f"        rsum[{Rp}0] = red[{o}]\n        for t in T.serial(1, {TK}):\n"
                              f"            rsum[{Rp}0] = rsum[{Rp}0] + red[t * {G * CB} + {o}]\n"
                              f"        rout[{o}] = rsum[{Rp}0]\n")
            code += f.sync()
            code += f.threads(f"if ty == 0:\n    for mm in {u_}({gl}):\n        for v in {u_}({V}):\n"
                              f"            acc[{A}({g0} + mm) * {V} + v] = rout[mm * {CB} + tx * {V} + v]\n")
            if g0 + G < MR:   # the next group's sums overwrite what the first row of threads reads here
                code += f.sync()
    row, col = f"(bx * {MR} + m)", f"({col0} + v)"
    stored = out.format(row=row, col=col, acc=f"acc[{A}m * {V} + v]")
    code += f.threads(f"if ty == 0:\n    for m in {u_}({MR}):\n        if {row} < {M} and {col0} < {N}:\n"
                      f"            for v in {u_}({V}):\n" + _indent(stored, 16))
    return code


def _nk_body(spec: GemmSpec, cfg: GemvConfig, dt: str, f: _Frame, out: str) -> str:
    """The [N, K] weight: a warp per group of columns, its lanes along K (a vector each, 32 contiguous vectors
    a warp and step), x's vectors reused across the columns, the partials summed by warp shuffles."""
    M, N, K = spec.rows, spec.n, spec.k
    V, CN, MR, U, S = cfg.lanes, cfg.threads_n, cfg.rows, cfg.unroll, cfg.split
    W = cfg.threads // 32
    step = 32 * V * U
    tiles = K // step
    per, ext = _k_extent(tiles, S)
    A = f.local("acc", MR * CN, "float32")
    Wp = f.local("w", U * CN * V, dt)
    Xp = f.local("xa", U * MR * V, dt)
    u_, v_ = f.unroll, f.vec
    colc = f"T.min((by * {W} + ty) * {CN} + c, {N - 1})"
    rowc = f"T.min(bx * {MR} + m, {M - 1})"

    def step_code(k: str, slots: int) -> str:   # loads of `slots` vectors a lane at K offset k(u), then FMAs
        return (f"for u in {u_}({slots}):\n    for c in {u_}({CN}):\n        for v in {v_}({V}):\n"
                f"            w[{Wp}(u * {CN} + c) * {V} + v] = b_f[{colc} * {K} + {k} + v]\n"
                f"    for m in {u_}({MR}):\n        for v in {v_}({V}):\n"
                f"            xa[{Xp}(u * {MR} + m) * {V} + v] = a_f[{rowc} * {K} + {k} + v]\n"
                f"for u in {u_}({slots}):\n    for m in {u_}({MR}):\n        for c in {u_}({CN}):\n"
                f"            for v in {u_}({V}):\n"
                f"                acc[{A}m * {CN} + c] = acc[{A}m * {CN} + c] + "
                f"T.Cast('float32', xa[{Xp}(u * {MR} + m) * {V} + v]) * "
                f"T.Cast('float32', w[{Wp}(u * {CN} + c) * {V} + v])\n")

    code = f"for i in {u_}({MR * CN}):\n    acc[{A}i] = T.float32(0)\n"
    kb = f"(bz * {per} + it) * {step} + (u * 32 + tx) * {V}"
    code += f"for it in T.serial({ext}):\n" + _indent(step_code(kb, U), 4)
    rem = K - tiles * step
    if rem:   # the vectors past the last whole step: one a lane, in the last split block
        kv = f"({tiles * step} + (j * 32 + tx) * {V})"
        code += (f"if bz == {S - 1}:\n    for j in T.serial({-(-rem // (32 * V))}):\n        if {kv} < {K}:\n"
                 + _indent(step_code(kv, 1), 12))
    code = f.threads(code)
    n_acc = MR * CN
    for m in (16, 8, 4, 2, 1):   # the warp's sum in every lane
        if f.emulate:
            f.allocs += "" if m != 16 else f"accx = T.alloc_buffer(({f.ty * 32 * n_acc},), 'float32')\n"
            partner = f"(ty * 32 + T.bitwise_xor(tx, {m})) * {n_acc} + "
            code += f.threads(f"for i in T.serial({n_acc}):\n    accx[{A}i] = acc[{A}i] + acc[{partner}i]\n")
            code += f.threads(f"for i in T.serial({n_acc}):\n    acc[{A}i] = accx[{A}i]\n")
        else:
            code += f"for i in {u_}({n_acc}):\n    acc[i] = acc[i] + {_SHFL.format(v='acc[i]', m=m)}\n"
    row, col = f"(bx * {MR} + m)", f"((by * {W} + ty) * {CN} + c)"
    stored = out.format(row=row, col=col, acc=f"acc[{A}m * {CN} + c]")
    code += f.threads(f"for m in {u_}({MR}):\n    for c in {u_}({CN}):\n"
                      f"        if (m * {CN} + c) % 32 == tx and {row} < {M} and {col} < {N}:\n"
                      + _indent(stored, 12))
    return code


# mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32's fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
# floating point type"): lane = 4 * groupID + threadID_in_group; a lane's A halves a0..a7 (four .f16x2 registers,
# the first element of a pair in the low 16 bits), B's b0..b3, C / D's c0..c3. As (lane, element) of a matrix
# element: A (16 x 16, row x k), B (16 x 8, k x col), C (16 x 8, row x col). The emulation's mma reads its operands
# through these maps; tests/kernels/test_gemv.py checks them against TVM's own mma layouts.
MMA_A = ("{row} % 8 * 4 + {k} % 8 // 2", "({row} // 8 + {k} // 8 * 2) * 2 + {k} % 2")
MMA_B = ("{col} * 4 + {k} % 8 // 2", "{k} // 8 * 2 + {k} % 2")
MMA_C = ("{row} % 8 * 4 + {col} // 2", "{row} // 8 * 2 + {col} % 2")
_MMA = "T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _mma_body(spec: GemmSpec, cfg: GemvConfig, dt: str, f: _Frame, out: str) -> str:
    """The [K, N] weight on tensor cores: D (N x M) = W^T (N x K) . x^T (K x M), an m16n8k16 mma a k16 step, an m16
    tile of columns and an n8 tile of M's rows (zero-padded: their columns of D are not stored).

    A lane (group g = lane / 4, t = lane % 4) of a warp loads, each k16 step, four vectors of ``lanes`` columns
    (8g .. 8g + lanes - 1 of the warp's 8 x lanes) at the rows k0 + 4t + s (s = 0..3): the warp's loads of a
    slot s cover four weight rows of 8 x lanes contiguous columns. The sum over K and the rows of D being any
    order of them, the mma's logical k (2t, 2t + 1, 2t + 8, 2t + 9 in a lane) is the weight's row k0 + 4t + s
    (s = 0, 1, 2, 3), and tile i's logical rows g and g + 8 are columns 8g + 2i and 8g + 2i + 1: a lane's A
    fragment is its own loads, two halves paired across rows (no exchange between lanes), and its B fragment
    x[m][k0 + 4t .. k0 + 4t + 3], one 8-byte load. The lane's D is then its own columns 8g .. 8g + lanes - 1
    at M's rows 2t, 2t + 1 (+ 8 in the second n8 tile)."""
    M, N, K = spec.rows, spec.n, spec.k
    V, TN, MR, U, S = cfg.lanes, cfg.threads_n, cfg.rows, cfg.unroll, cfg.split
    TK = warps_k(cfg)
    T8, NT = mma_tiles(cfg)
    chunk = 16 * U
    tiles = K // chunk
    per = -(-tiles // (S * TK))
    kz = f"(bz * {TK} + ty // {TN})"
    ext = str(per) if tiles % (S * TK) == 0 else f"T.max(T.min({per}, {tiles} - {kz} * {per}), 0)"
    n_acc = 4 * T8 * NT
    A = f.local("acc", n_acc, "float32")
    Wp = f.local("w", U * 4 * V, dt)
    Xp = f.local("xh", U * NT * 4, dt)
    Fp = f.local("afh", T8 * 8, dt)
    if not f.emulate:   # the fragments' 32-bit registers: views of the half arrays
        f.allocs += (f"xw = T.decl_buffer(({U * NT * 2},), 'uint32', data=xh.data, scope='local')\n"
                     f"afw = T.decl_buffer(({T8 * 4},), 'uint32', data=afh.data, scope='local')\n")
    u_, v_ = f.unroll, f.vec
    g, t = "(tx // 4)", "(tx % 4)"
    col0 = f"((by * {TN} + ty % {TN}) * 8 + {g}) * {V}"
    colc = f"T.min({col0}, {N - V})"   # a warp past N's end reads the last columns and stores nothing

    def row_of(j: str) -> str:   # x's row of this lane's B column in n8 tile j (padding columns: a real row)
        return _x_row(spec, cfg, f"{g} + {j} * 8")

    def loads(k: str, steps: int, masked: bool, staged: bool = False) -> str:
        """The weight vectors and x's halves of ``steps`` k16 steps at K offset ``k`` (of u, s). ``masked``:
        past K, the weight's row clamped (a real value) and x zero, so the product is 0. ``staged``: x's halves
        from iteration ``it``'s staged tile (``xs``)."""
        kw = f"T.min({k}, {K - 1})" if masked else f"({k})"
        xv = v_ if not masked and K % 4 == 0 else u_   # 8-byte x loads where aligned
        xload = f"a_f[{row_of('j')} * {K} + {kw}]"
        if staged:
            xload = f"xs[{x_at('it % 2', f'{g} + j * 8')} + u * 16 + {t} * 4 + s]"
        if masked:
            xload = f"T.if_then_else({k} < {K}, {xload}, T.{dt}(0))"
        return (f"for u in {u_}({steps}):\n    for s in {u_}(4):\n        for v in {v_}({V}):\n"
                f"            w[{Wp}(u * 4 + s) * {V} + v] = b_f[{kw} * {N} + {colc} + v]\n"
                f"    for j in {u_}({NT}):\n        for s in {xv}(4):\n"
                f"            xh[{Xp}(u * {NT} + j) * 4 + s] = {xload}\n")

    def build(u: str) -> str:   # A's halves of step u: register r of tile i pairs slots 2 (r // 2), + 1 at column 2i + r % 2
        return (f"for i in {u_}({T8}):\n    for r in {u_}(4):\n        for h in {u_}(2):\n"
                f"            afh[{Fp}i * 8 + r * 2 + h] = w[{Wp}({u} * 4 + r // 2 * 2 + h) * {V} + i * 2 + r % 2]\n")

    def mmas(u: str) -> str:
        if not f.emulate:
            code = ""
            for j in range(NT):
                for i in range(T8):
                    c = ", ".join(f"acc[{(j * T8 + i) * 4 + q}]" for q in range(4))
                    a = ", ".join(f"afw[{i * 4 + r}]" for r in range(4))
                    b = ", ".join(f"xw[({u} * {NT} + {j}) * 2 + {r}]" for r in range(2))
                    code += f"T.evaluate({_MMA}({c}, {a}, {b}, {c}))\n"
            return code
        # the mma as the hardware computes it: D[row][col] += sum over k of A[row][k] B[k][col], each operand
        # read from the lane (of this warp) and element the fragment layouts give
        row, col = f"({g} + q // 2 * 8)", f"({t} * 2 + q % 2)"
        la, ea = (x.format(row=row, k="kk") for x in MMA_A)
        lb, eb = (x.format(col=col, k="kk") for x in MMA_B)
        sa, sx = T8 * 8, U * NT * 4
        ai = f"(ty * 32 + {la}) * {sa} + i * 8 + {ea}"
        bi = f"(ty * 32 + {lb}) * {sx} + ({u} * {NT} + j) * 4 + {eb}"
        ci = f"(j * {T8} + i) * 4 + q"
        return (f"for j in T.serial({NT}):\n    for i in T.serial({T8}):\n        for q in T.serial(4):\n"
                f"            for kk in T.serial(16):\n"
                f"                acc[{A}{ci}] = acc[{A}{ci}] + T.Cast('float32', afh[{ai}]) * "
                f"T.Cast('float32', xh[{bi}])\n")

    def steps(k: str, n: int, masked: bool, guard: str, staged: bool = False) -> str:
        """Loads, then per step A's registers and the mmas. Emulated: each its own phase over the block's threads
        (the mma reads other lanes' fragments); ``guard``: the threads that take part."""
        if not f.emulate:
            return loads(k, n, masked, staged) + f"for u in {u_}({n}):\n" + _indent(build("u") + mmas("u"), 4)

        def grd(c: str) -> str:
            return f.threads(f"if {guard}:\n" + _indent(c, 4))

        return (grd(loads(k, n, masked, staged))
                + f"for u in T.serial({n}):\n" + _indent(grd(build("u")) + grd(mmas("u")), 4))

    x_at = _x_tile(cfg, dt, f) if cfg.xs else None

    code = f.threads(f"for a in {u_}({n_acc}):\n    acc[{A}a] = T.float32(0)\n")
    kb = f"({kz} * {per} + it) * {chunk} + u * 16 + {t} * 4 + s"
    if cfg.stages > 1:
        code += _mma_ring(spec, cfg, dt, f, Wp, Xp, kz, per, ext, colc, row_of, build, mmas)
    elif cfg.xs:
        guard = f"it < {ext}" if f.emulate else "True"
        code += _x_staged_loop(spec, cfg, f, kz, per, ext, x_at, steps(kb, U, False, guard, staged=True), colc)
    elif f.emulate:
        code += f"for it in T.serial({per}):\n" + _indent(steps(kb, U, False, f"it < {ext}"), 4)
    else:
        # the next iteration's weight rows prefetched into L2 first (_prefetch)
        body = _prefetch(spec, cfg, kz, per, colc) + steps(kb, U, False, "True")
        code += f"for it in T.serial({ext}):\n" + _indent(body, 4)
    rem = K - tiles * chunk
    if rem:   # the rows past the last whole chunk: k16 steps (the last one masked) of the last warp along K
        last = f"{kz} == {S * TK - 1}"
        kr = f"{tiles * chunk} + u * 16 + {t} * 4 + s"
        if f.emulate:
            code += steps(kr, -(-rem // 16), True, last)
        else:
            code += f"if {last}:\n" + _indent(steps(kr, -(-rem // 16), True, "True"), 4)
    if TK > 1:   # the warps along K past the first hand their partials to the first through shared memory
        if f.emulate or (cfg.stages == 1 and not cfg.xs):
            scope = "" if f.emulate else ", scope='shared'"
            f.allocs += f"red = T.alloc_buffer(({(TK - 1) * TN * n_acc * 32},), 'float32'{scope})\n"
        else:   # the ring's or x tiles' memory, read by no one after the loop (the barrier below orders the last reads
            # first); one dynamic allocation: a static one beside it past 48 KB in all fails at launch
            f.allocs += (f"red = T.decl_buffer(({(TK - 1) * TN * n_acc * 32},), 'float32', "
                         f"data={'xs' if cfg.xs else 'ring'}.data, scope='shared.dyn')\n")
        slot = f"((ty // {TN} - 1) * {TN} + ty % {TN}) * {n_acc}"
        code += f.sync() + f.threads(f"if ty >= {TN}:\n    for a in {u_}({n_acc}):\n"
                                     f"        red[({slot} + a) * 32 + tx] = acc[{A}a]\n")
        code += f.sync() + f.threads(
            f"if ty < {TN}:\n    for p in T.serial({TK - 1}):\n        for a in {u_}({n_acc}):\n"
            f"            acc[{A}a] = acc[{A}a] + red[((p * {TN} + ty) * {n_acc} + a) * 32 + tx]\n")
    # a lane's D: tile i's c(q) is column 8g + 2i + q // 2, M's row 2t + q % 2 + 8j of the block
    mloc = f"({t} * 2 + q % 2 + j * 8)"
    row, col = f"(bx * {MR} + {mloc})", f"({col0} + i * 2 + q // 2)"
    stored = out.format(row=row, col=col, acc=f"acc[{A}(j * {T8} + i) * 4 + q]")
    code += f.threads(f"if ty < {TN} and {col0} < {N}:\n    for j in {u_}({NT}):\n        for i in {u_}({T8}):\n"
                      f"            for q in {u_}(4):\n                if {mloc} < {MR} and {row} < {M}:\n"
                      + _indent(stored, 20))
    return code


def _x_row(spec: GemmSpec, cfg: GemvConfig, local: str) -> str:
    """x's row for the block's row ``local`` (past the block's rows or past M: a real row, whose products land in
    columns of D that are not stored)."""
    return f"T.min(bx * {cfg.rows} + T.min({local}, {cfg.rows - 1}), {spec.rows - 1})"


def _prefetch(spec: GemmSpec, cfg: GemvConfig, kz: str, per: int, colc: str) -> str:
    """The next iteration's weight rows of a lane prefetched into L2: ptxas issues a step's loads just before its
    mmas (the registers of ``unroll`` steps' loads are not held), so the prefetches are what keeps ``unroll`` steps
    a lane in flight; past the warp's last iteration they fetch the next warp's rows (clamped to K)."""
    U, t = cfg.unroll, "(tx % 4)"
    kn = f"T.min(({kz} * {per} + it + 1) * {16 * U} + u * 16 + {t} * 4 + s, {spec.k - 1})"
    return (f"for u in T.unroll({U}):\n    for s in T.unroll(4):\n"
            f"        T.evaluate(T.ptx['prefetch.global.L2'](T.address_of(b_f[{kn} * {spec.n} + {colc}])))\n")


def _x_tile(cfg: GemvConfig, dt: str, f: _Frame):
    """Allocate the staged x tiles (``xs``; dynamic shared memory on the GPU); returns ``x_at(slot, row)``, the
    index of a tile row's first element: per buffer ``slot`` (0, 1) and group of warps along N (``ty //
    threads_n``), M's rows padded to whole n8 tiles, each :func:`x_stride` elements."""
    XR, XS, TN, TK = 8 * mma_tiles(cfg)[1], x_stride(cfg), cfg.threads_n, warps_k(cfg)
    scope = "" if f.emulate else ", scope='shared.dyn', align=16"
    f.allocs += f"xs = T.alloc_buffer(({x_tile_halves(cfg)},), '{dt}'{scope})\n"
    if not f.emulate:
        f.allocs += 'xs_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(xs[0]))\n'
    return lambda slot, row: f"((({slot}) * {TK} + ty // {TN}) * {XR} + {row}) * {XS}"


def _x_staged_loop(spec: GemmSpec, cfg: GemvConfig, f: _Frame, kz: str, per: int, ext: str, x_at, step: str,
                   colc: str) -> str:
    """The tensor-core kernel's main loop with x staged (``xs``): the warps along N that share a K range (a group)
    copy iteration ``it + 1``'s x tile (M's rows, clamped to real ones past M, ``16 * unroll`` K elements each, in
    16-byte cp.async copies spread over the group's lanes) into the other buffer while iteration ``it``'s mmas read
    theirs; the group's named barrier (a warp's own sync where the group is one warp) orders the copies before the
    reads and the reads before the buffer's refill. Each group runs its own iteration count, so no barrier spans
    the block."""
    K, U, TN = spec.k, cfg.unroll, cfg.threads_n
    XR, CV = 8 * mma_tiles(cfg)[1], 2 * U   # tile rows, 16-byte vectors a row
    lanes = 32 * TN
    reps = -(-XR * CV // lanes)
    q = f"(r * {lanes} + ty % {TN} * 32 + tx)"
    row = _x_row(spec, cfg, f"{q} // {CV}")
    k0 = f"({kz} * {per} + {{it}}) * {16 * U} + {q} % {CV} * 8"

    def issue(it: str) -> str:
        copy = _cp_async(f, "xs", f"{x_at(f'({it}) % 2', f'{q} // {CV}')} + {q} % {CV} * 8", "a_f",
                         f"{row} * {K} + {k0.format(it=it)}", 8)
        body = copy if XR * CV % lanes == 0 else f"if {q} < {XR * CV}:\n" + _indent(copy, 4)
        return f"for r in {f.unroll}({reps}):\n" + _indent(body, 4)

    if f.emulate:   # the copies one phase over the block's threads, the loads and mmas after it
        return f"for it in T.serial({per}):\n" + _indent(f.threads(f"if it < {ext}:\n" + _indent(issue("it"), 4))
                                                          + step, 4)
    from tvmfuse.kernels.wgmma.ptx import _ptx

    sync = (_ptx("tvmfuse_bar_sync", f"1 + ty // {TN}", str(lanes)) if TN > 1
            else "T.evaluate(T.call_extern('void', '__syncwarp'))\n")
    commit = "T.evaluate(T.ptx.cp.async_.commit_group())\n"
    body = (f"if it + 1 < {ext}:\n" + _indent(issue("it + 1"), 4) + commit
            + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + sync
            + _prefetch(spec, cfg, kz, per, colc) + step + sync)
    return (f"if 0 < {ext}:\n" + _indent(issue("0"), 4) + commit + f"for it in T.serial({ext}):\n" + _indent(body, 4)
            + "T.evaluate(T.ptx.cp.async_.wait_group(0))\n")


# A 16-, 8- or 4-byte cp.async of fp16 elements to a 32-bit shared address (``.cg``, through L2 only, where the
# size allows it; ``.ca`` else): a function of our own (``T.cuda.func_call``), like the wgmma kernel's zero-fill copy
CP_ASYNC = "tvmfuse_gemv_cp_async{n}"
_CP_ASYNC_SOURCE = """
__forceinline__ __device__ void tvmfuse_gemv_cp_async{n}(unsigned int dst, void* src, int src_off) {{
  asm volatile("cp.async.{cache}.shared.global [%0], [%1], {n};"
               :: "r"(dst), "l"((const char*)src + (long long)src_off * 2) : "memory");
}}
"""


def _cp_async(f: _Frame, dst: str, at: str, src: str, at_src: str, elems: int) -> str:
    """A copy of ``elems`` fp16 elements from ``src`` at ``at_src`` to the shared ring ``dst`` at ``at``: a
    cp.async on the GPU; a plain copy in the emulation."""
    if f.emulate:
        return f"for v in T.serial({elems}):\n    {dst}[{at} + v] = {src}[{at_src} + v]\n"
    n = 2 * elems
    code = _CP_ASYNC_SOURCE.format(n=n, cache="cg" if n == 16 else "ca")
    return (f"T.evaluate(T.cuda.func_call({CP_ASYNC.format(n=n)!r}, {dst}_base + T.uint32(({at}) * 2), {src}.data, "
            f"{at_src}, source_code={code!r}))\n")


def _mma_ring(spec: GemmSpec, cfg: GemvConfig, dt: str, f: _Frame, Wp: str, Xp: str, kz: str, per: int, ext: str,
              colc: str, row_of, build, mmas) -> str:
    """The tensor-core kernel's main loop through a ring of ``stages`` iterations in shared memory: each lane copies
    (cp.async) its own weight vectors and x halves of iteration ``it + stages - 1`` while the mmas of iteration
    ``it`` run, one cp.async group an iteration. A lane reads back only what it copied itself, so its own
    ``wait_group`` orders the copy before the read (no barrier: the warps along K may run different iteration
    counts), and its refill of a slot comes after the mmas that read the slot's registers (they wait for them).
    Past the warp's last iteration the groups are committed empty, so the waits keep counting."""
    M, N, K = spec.rows, spec.n, spec.k
    V, U, P, W = cfg.lanes, cfg.unroll, cfg.stages, cfg.threads // 32
    NT = mma_tiles(cfg)[1]
    u_, v_ = f.unroll, f.vec
    t = "(tx % 4)"
    # dynamic shared memory: a ring may pass the 48 KB a block's static allocation takes (TVM's CUDA runtime raises
    # the kernel's limit at launch)
    scope = "" if f.emulate else ", scope='shared.dyn', align=16"
    # slot-major, the warp's 32 lanes' pieces contiguous: a warp's 16-byte reads of a piece take 512 bytes in a row
    # (no bank conflicts)
    # One allocation, x's pieces after the weight's, which the warps' partials reuse after the loop (ring_halves)
    wsize = P * U * 4 * W * 32 * V
    f.allocs += f"ring = T.alloc_buffer(({ring_halves(cfg)},), '{dt}'{scope})\n"
    if not f.emulate:
        f.allocs += 'ring_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(ring[0]))\n'
    w_at = f"((((({{slot}}) * {U} + u) * 4 + s) * {W} + ty) * 32 + tx) * {V}"
    x_at = f"{wsize} + ((((({{slot}}) * {U} + u) * {NT} + j) * {W} + ty) * 32 + tx) * 4"

    def issue(it: str) -> str:   # the copies of iteration `it` into its slot
        k0 = f"(({kz} * {per} + {it}) * {16 * U} + u * 16 + {t} * 4)"
        slot = f"({it}) % {P}"
        return (f"for u in {u_}({U}):\n    for s in {u_}(4):\n"
                + _indent(_cp_async(f, "ring", w_at.format(slot=slot), "b_f", f"({k0} + s) * {N} + {colc}", V), 8)
                + f"    for j in {u_}({NT}):\n"
                + _indent(_cp_async(f, "ring", x_at.format(slot=slot), "a_f", f"{row_of('j')} * {K} + {k0}", 4), 8))

    def read(u: str) -> str:   # step u of iteration it: the lane's registers from its slot
        slot = f"it % {P}"
        return (f"for s in {u_}(4):\n    for v in {v_}({V}):\n"
                f"        w[{Wp}({u} * 4 + s) * {V} + v] = ring[{w_at.format(slot=slot)} + v]\n"
                f"for j in {u_}({NT}):\n    for s in {v_}(4):\n"
                f"        xh[{Xp}({u} * {NT} + j) * 4 + s] = ring[{x_at.format(slot=slot)} + s]\n")

    commit = "" if f.emulate else "T.evaluate(T.ptx.cp.async_.commit_group())\n"
    wait = "" if f.emulate else f"T.evaluate(T.ptx.cp.async_.wait_group({P - 1}))\n"
    if f.emulate:   # each phase a loop over the block's threads (the mma reads other lanes' fragments)
        code = "".join(f.threads(f"if {q} < {ext}:\n" + _indent(issue(str(q)), 4)) for q in range(P - 1))
        body = (f.threads(f"if it + {P - 1} < {ext}:\n" + _indent(issue(f"it + {P - 1}"), 4))
                + f"for u in T.serial({U}):\n"
                + _indent(f.threads(f"if it < {ext}:\n" + _indent(read("u") + build("u"), 4))
                          + f.threads(f"if it < {ext}:\n" + _indent(mmas("u"), 4)), 4))
        return code + f"for it in T.serial({per}):\n" + _indent(body, 4)
    code = "".join(f"if {q} < {ext}:\n" + _indent(issue(str(q)), 4) + commit for q in range(P - 1))
    body = (f"if it + {P - 1} < {ext}:\n" + _indent(issue(f"it + {P - 1}"), 4) + commit + wait
            + f"for u in {u_}({U}):\n" + _indent(read("u") + build("u") + mmas("u"), 4))
    # (every group holding copies was waited for in the loop; the wait for all keeps that so for the partials that
    # reuse the ring)
    return code + f"for it in T.serial({ext}):\n" + _indent(body, 4) + "T.evaluate(T.ptx.cp.async_.wait_group(0))\n"


def gemv_source(spec: GemmSpec, cfg: GemvConfig, params: list[str], a: str, b: str, store: str, dtype: str,
                emulate: bool = False) -> str:
    """TVMScript of the GEMV kernel of ``spec`` under ``cfg``: ``params`` the PrimFunc's parameter declarations,
    ``a`` / ``b`` the names of A and the weight, ``store`` the epilogue's store (``{bz}``, ``{row}``, ``{col}``,
    ``{acc}`` fields, :func:`tvmfuse.kernels.wgmma.analyze`'s). With a K split the main kernel stores fp32
    partials and a second kernel sums them and applies ``store``."""
    M, N, K, S = spec.rows, spec.n, spec.k, cfg.split
    if cfg.mma:
        ty, tx = cfg.threads // 32, 32
        nb = -(-N // (cfg.threads_n * 8 * cfg.lanes))
    elif spec.b_kmajor:
        ty, tx = cfg.threads // 32, 32
        nb = -(-N // ((cfg.threads // 32) * cfg.threads_n))
    else:
        ty, tx = cfg.threads // cfg.threads_n, cfg.threads_n
        nb = -(-N // (cfg.threads_n * cfg.lanes))
    mb = -(-M // cfg.rows)
    f = _Frame(emulate, ty, tx)
    final = store.replace("{bz}", "0")
    out = final if S == 1 else "part[(bz * " + str(M) + " + {row}) * " + str(N) + " + {col}] = {acc}"
    body = (_mma_body if cfg.mma else _nk_body if spec.b_kmajor else _kn_body)(spec, cfg, dtype, f, out)
    views = (f"a_f = T.decl_buffer(({M * K},), '{dtype}', data={a}.data)\n"
             f"b_f = T.decl_buffer(({N * K},), '{dtype}', data={b}.data)\n")
    if S > 1:
        views += f"part = T.alloc_buffer(({S * M * N},), 'float32')\n"
    if emulate:
        main = f"for bx, by, bz in T.grid({mb}, {nb}, {S}):\n" + _indent(f.allocs + body, 4)
    else:
        main = (f"for bx in T.thread_binding({mb}, thread='blockIdx.x'):\n"
                f"    for by in T.thread_binding({nb}, thread='blockIdx.y'):\n"
                f"        for bz in T.thread_binding({S}, thread='blockIdx.z'):\n"
                f"            for ty in T.thread_binding({ty}, thread='threadIdx.y'):\n"
                f"                for tx in T.thread_binding({tx}, thread='threadIdx.x'):\n"
                + _indent(f.allocs + body, 20))
    if S > 1:   # the partials' sum, the epilogue on it: one output element a thread
        main += split_sum(M, N, S, store, emulate)
    attrs = '{"tirx.noalias": True}' if emulate else '{"tirx.noalias": True, "tirx.is_scheduled": True}'
    return (f"@T.prim_func(s_tir=True)\ndef main({', '.join(params)}):\n    T.func_attr({attrs})\n"
            + _indent(views + main, 4))

