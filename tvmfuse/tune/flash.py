"""A flash-attention TIR template on tensor cores: the planner's attention group without N×N scores.

The planner's attention PrimFunc (``tvmfuse.plan.attention``) is correct everywhere but scalar: one
query row per thread. On CUDA targets with fp16 inputs this module writes the same computation as a
FlashAttention-2 style kernel, with its tiles as parameters (:class:`FlashConfig`):

* a thread block owns ``16 * m_tiles * warps`` query rows of one (batch, head); each warp owns
  ``16 * m_tiles`` of them. With one 16-row tile per warp its Q fragments are loaded once into registers;
  with two, the block's Q tile is staged in shared memory and reloaded by ``ldmatrix`` at each step, and
  every K and V fragment feeds both tiles (half the shared-memory reads per ``mma``);
* the keys are walked ``block_n`` at a time: the K and V tiles go through shared memory (rows padded
  by 16 bytes, so every ``ldmatrix`` phase hits 32 distinct banks), optionally double-buffered by
  ``cp.async`` so the next tile's copy overlaps this tile's tensor-core work;
* ``S = Q·Kᵀ`` runs as ``mma.sync.m16n8k16`` (fp16 in, fp32 accumulate) into registers; the online
  softmax (running row max and sum, base-2 exponent) works on those registers, with two lane shuffles
  for the row max; ``P`` is converted to fp16 in place, and since an m16n8 accumulator has the layout of
  the A operand's half, it feeds ``O += P·V`` without leaving registers;
* ``O`` stays in registers, is rescaled per row as the max moves, and is divided by the row sum once,
  at the store.

On Hopper (``sm_90a``) a config may instead be a wgmma kernel (``FlashConfig.wgmma``, names ending ``" h"``):
each warpgroup computes ``S`` for 64 query rows with ``wgmma`` from 128-byte-swizzled Q and K tiles, and
feeds ``P`` from its registers to the ``O += P·V`` wgmma; the softmax and the store are the same code.

The scores exist only as one warp's ``16 * m_tiles`` x ``block_n`` registers at a time. Rows and keys must
be whole tiles (:func:`tvmfuse.plan.attention.tiled_gpu_misfit`); the planner keeps other attention
unfused on GPUs. Tuning picks a config among
:func:`configs` (MetaSchedule samples its index; the builder expands it, see :func:`expand`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec

# On the planner's attention PrimFunc's root block: the candidate configs (names, ";"-joined: a constant of the
# trace, so a record keeps the list it was sampled from) and the sampled index into them.
ANNOTATION = "tvmfuse.flash_config"
CANDIDATES = "tvmfuse.flash_candidates"
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FlashConfig:
    warps: int = 4        # warps per block
    block_n: int = 64     # keys per step
    stages: int = 1       # 1: one K/V buffer, plain loads; 2: two buffers filled by cp.async
    m_tiles: int = 1      # 16-row tiles per warp: 1 keeps Q in registers; 2 stages Q in shared memory and
    #                       uses each K/V fragment for both tiles (half the shared-memory reads per mma)
    wgmma: bool = False   # Hopper (sm_90a): each warpgroup's 64 rows by wgmma from 128-byte-swizzled shared tiles
    #                       (Q, K and V by cp.async), P fed to the PV wgmma from registers (m_tiles 1)
    overlap: bool = False  # (wgmma, 2 stages) the next step's Q·Kᵀ runs on the tensor cores during this step's
    #                        softmax, and this step's P·V during the next step's loads and waits

    @property
    def block_m(self) -> int:
        return 16 * self.warps * self.m_tiles

    @property
    def name(self) -> str:
        return (f"w{self.warps} m{self.m_tiles} n{self.block_n} s{self.stages}"
                + (" hp" if self.overlap else " h" if self.wgmma else ""))

    def shared_bytes(self, spec: AttentionSpec) -> int:
        if self.wgmma:   # unpadded (swizzled) tiles, Q staged too
            return 2 * (self.stages * self.block_n * (spec.head_dim + spec.head_dim_v) + self.block_m * spec.head_dim)
        k_tile = self.block_n * (spec.head_dim + 8) if spec.k_rows else spec.head_dim * (self.block_n + 8)
        v_tile = self.block_n * (spec.head_dim_v + 8)
        q_tile = self.block_m * (spec.head_dim + 8) if self.m_tiles > 1 else 0
        return 2 * (self.stages * (k_tile + v_tile) + q_tile)


def configs(spec: AttentionSpec, *, warps=(4, 8), m_tiles=(1, 2), block_n=(32, 64, 128), stages=(1, 2),
            max_shared_bytes: int = 100 * 1024, wgmma=(False,), overlap=(False,)) -> list[FlashConfig]:
    """The tile configs (from the given choices) that divide ``spec``'s sequences and fit its registers and
    ``max_shared_bytes`` of (dynamic) shared memory. 100 KB leaves room for two blocks on an H200 SM (228 KB).
    """
    out = []
    for m in m_tiles if False in tuple(wgmma) else ():
        for w in warps:
            for n in block_n:
                for st in stages:
                    c = FlashConfig(int(w), int(n), int(st), int(m))
                    # one thread's scores, P and O (and Q, in registers with one tile) within ~200 of its 255
                    # registers; measured with ptxas: the configs kept here build without spills (164-251)
                    regs = c.m_tiles * (c.block_n // 2 + c.block_n // 4 + spec.head_dim_v // 2)
                    regs += spec.head_dim // 4 if c.m_tiles == 1 else 4 * c.m_tiles
                    if (spec.seq_q % c.block_m == 0 and spec.seq_k % c.block_n == 0 and regs <= 200
                            and c.shared_bytes(spec) <= max_shared_bytes):
                        out.append(c)
    if True in tuple(wgmma) and spec.head_dim % 64 == 0 and spec.head_dim_v % 64 == 0 and spec.head_dim_v <= 256:
        for w in warps:
            for n in block_n:
                for st in stages:
                    c = FlashConfig(int(w), int(n), int(st), 1, True)
                    # scores (n / 2), P packed (n / 4) and O (dv / 2) fp32 registers per thread
                    regs = c.block_n // 2 + c.block_n // 4 + spec.head_dim_v // 2
                    if (c.warps in (4, 8) and c.block_n in (64, 128) and regs <= 160
                            and spec.seq_q % c.block_m == 0 and spec.seq_k % c.block_n == 0
                            and c.shared_bytes(spec) <= max_shared_bytes):
                        out.append(c)
        # overlapped: two score accumulators (n registers), two K/V stages, key steps taken in pairs
        if True in tuple(overlap):
            for w in warps:
                for n in block_n:
                    c = FlashConfig(int(w), int(n), 2, 1, True, True)
                    regs = c.block_n + c.block_n // 4 + spec.head_dim_v // 2
                    if (c.warps in (4, 8) and c.block_n in (64, 128) and regs <= 160
                            and spec.seq_q % c.block_m == 0 and spec.seq_k % (2 * c.block_n) == 0
                            and c.shared_bytes(spec) <= max_shared_bytes):
                        out.append(c)
    return out


def parse_config(name: str) -> FlashConfig:
    """The config :attr:`FlashConfig.name` names (``"w4 m2 n32 s1"``)."""
    parts = name.split()
    fields = dict((part[0], int(part[1:])) for part in parts if part not in ("h", "hp"))
    return FlashConfig(warps=fields["w"], block_n=fields["n"], stages=fields["s"], m_tiles=fields["m"],
                       wgmma="h" in parts or "hp" in parts, overlap="hp" in parts)


def default_config(spec: AttentionSpec, wgmma: bool = False) -> FlashConfig:
    """The config an untuned build uses: the fastest measured at the anchor size, where it fits (``wgmma``: on
    Hopper, ``sm_90a``, the wgmma configs first).

    H200, B4 H32 S4096 D128 (BENCHMARKS.md): wgmma w4 m1 n64 s1 2236 us, w8 m1 n64 s2 2295 us;
    mma.sync w4 m2 n32 3628 us, w8 m1 n128 3878 us, w4 m1 n32 4359 us.
    """
    if wgmma:
        options = configs(spec, wgmma=(True,))
        for want in (FlashConfig(4, 64, 1, 1, True), FlashConfig(8, 64, 2, 1, True)):
            if want in options:
                return want
    options = configs(spec)
    for want in (FlashConfig(4, 32, 1, 2), FlashConfig(8, 128, 1, 1)):
        if want in options:
            return want
    return options[0]


def annotated_config(func) -> FlashConfig | None:
    """The config a tuned schedule annotated on ``func``'s root block (None: not a flash schedule)."""
    from tvmfuse.tune.annotations import root_annotations

    notes = root_annotations(func, ANNOTATION, CANDIDATES)
    return None if notes is None else config_at(str(notes[CANDIDATES]), int(notes[ANNOTATION]))


def config_at(candidates: str, index: int) -> FlashConfig:
    """Config ``index`` of the ``;``-joined candidate names a record carries."""
    from tvmfuse.tune.annotations import chosen

    return parse_config(chosen(candidates, index, "flash"))


def spec_of(func) -> AttentionSpec | None:
    attrs = func.attrs
    if attrs is None or SPEC_ATTR not in attrs:
        return None
    return AttentionSpec.from_json(str(attrs[SPEC_ATTR]))


def expand(mod):
    """``mod`` with every flash-annotated attention PrimFunc replaced by the flash kernel it selects."""
    from tvmfuse.tune.annotations import swap_kernels

    def flash(gv, func):
        cfg = annotated_config(func)
        return flash_kernel(func, cfg) if cfg is not None and spec_of(func) is not None else None

    return swap_kernels(mod, flash)


def flash_kernel(func, cfg: FlashConfig | None = None, wgmma: bool = False):
    """The flash kernel for the planner's attention PrimFunc ``func`` (its global symbol kept); without ``cfg``,
    the default tiles (``wgmma``: Hopper's where they fit)."""
    spec = spec_of(func)
    kernel = flash_primfunc(spec, cfg or default_config(spec, wgmma))
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    return kernel.with_attr("global_symbol", symbol) if symbol is not None else kernel


# ----------------------------------------------------------------------------------------- the kernel
def _flat(shape: tuple[int, ...], idx: list[str]) -> str:
    """Row-major flattened offset of ``idx`` (expressions) into a buffer of ``shape``."""
    terms = []
    for k, e in enumerate(idx):
        stride = math.prod(shape[k + 1:])
        terms.append(f"({e}) * {stride}" if stride != 1 else f"({e})")
    return " + ".join(terms)


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" if line.strip() else "\n" for line in text.splitlines())


def flash_source(spec: AttentionSpec, cfg: FlashConfig) -> str:
    """TVMScript of the flash kernel for ``spec`` with tiles ``cfg``."""
    D, DV, BN, BM, NT = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m, 32 * cfg.warps
    nb, stages = len(spec.batch), cfg.stages
    # blockIdx.y walks the flattened batch dims; these are its per-dim indices
    bidx, rest = [], "by"
    for k in range(nb):
        inner = math.prod(spec.batch[k + 1:])
        bidx.append(f"({rest}) // {inner}" if inner > 1 else rest)
        rest = f"({rest}) % {inner}" if inner > 1 else rest
    warp, lane = "(tx // 32)", "(tx % 32)"
    g, tig = f"({lane} // 4)", f"({lane} % 4)"
    q_shape = (*spec.batch, spec.seq_q, D)
    k_shape = (*spec.batch, spec.seq_k, D) if spec.k_rows else (*spec.batch, D, spec.seq_k)
    v_shape = (*spec.batch, spec.seq_k, DV)
    o_shape = (*spec.batch, spec.seq_q, DV)
    buf = lambda name, shp, dt="float16": f"{name}: T.Buffer({tuple(shp)!r}, '{dt}')"  # noqa: E731
    params = [buf("q", q_shape), buf("k", k_shape), buf("v", v_shape)]
    M, SB, OB = cfg.m_tiles, BN // 2, DV // 2   # per m-tile: score and output accumulator elements per thread
    row = f"bx * {BM} + {warp} * {16 * M} + mt * 16 + {g} + i % 4 // 2 * 8"   # query row of element i of tile mt
    if spec.mask_shape is not None:
        params.append(buf("mask", spec.mask_shape, spec.mask_dtype))
    params.append(buf("out", o_shape))
    score = _score(spec, bidx, row, f"j * {BN} + i // 4 * 8 + {tig} * 2 + i % 2", f"sacc[mt * {SB} + i]")

    # shared tiles (rows padded by 8 halves = 16 bytes); with 2 stages, two of each
    k_rows, k_cols = (BN, D) if spec.k_rows else (D, BN)
    k_tile, v_tile = k_rows * (k_cols + 8), BN * (DV + 8)

    def loads(step: str, slot: str) -> str:
        """Copy step ``step``'s K and V tiles into shared slot ``slot`` (16-byte vectors)."""
        out = ""
        for dst, src, shp, rows, cols, tile, key_axis in (("ks", "k", k_shape, k_rows, k_cols, k_tile,
                                                           0 if spec.k_rows else 1),
                                                          ("vs", "v", v_shape, BN, DV, v_tile, 0)):
            vec = cols // 8
            n = rows * vec
            # a tile of n 16-byte vectors over NT threads; where they do not split evenly (a 32x48 tile is 192
            # vectors for 128 threads) the last round is guarded
            rounds, guard = -(-n // NT), n % NT != 0
            r, c = f"(it * {NT} + tx) // {vec}", f"(it * {NT} + tx) % {vec} * 8"
            src_rc = [r, c]
            src_rc[key_axis] = f"({step}) * {BN} + {src_rc[key_axis]}"
            sh = f"{slot} * {tile} + ({r}) * {cols + 8} + {c}"
            if stages == 1:
                body = (f"for e in T.vectorized(8):\n"
                        f"    {dst}[{sh} + e] = {src}[{', '.join([*bidx, src_rc[0], src_rc[1] + ' + e'])}]\n")
            else:
                body = (f"T.evaluate(T.s_tir.cp_async_raw('float16', {dst}.data, {sh}, {src}.data, "
                        f"{_flat(shp, [*bidx, *src_rc])}, 16))\n")
            if guard:
                body = f"if it * {NT} + tx < {n}:\n" + _indent(body, 4)
            out += f"for it in T.unroll({rounds}):\n" + _indent(body, 4)
        return out

    kslot, vslot = (f"j % 2 * {k_tile} + ", f"j % 2 * {v_tile} + ") if stages > 1 else ("", "")
    if spec.k_rows:   # ks[key, d]: the B operand's columns are its rows: plain ldmatrix
        k_ld = (f"T.ptx_legacy.ldmatrix(False, 4, '.b16', kf.data, 0, ks.access_ptr('r'), {kslot}"
                f"(np * 16 + {lane} % 8 + {lane} // 16 * 8) * {D + 8} + kk * 16 + {lane} // 8 % 2 * 8, "
                f"dtype='float16')")
    else:             # ks[d, key]: transposed ldmatrix
        k_ld = (f"T.ptx_legacy.ldmatrix(True, 4, '.b16', kf.data, 0, ks.access_ptr('r'), {kslot}"
                f"(kk * 16 + {lane} % 8 + {lane} // 8 % 2 * 8) * {BN + 8} + np * 16 + {lane} // 16 * 8, "
                f"dtype='float16')")
    v_ld = (f"T.ptx_legacy.ldmatrix(True, 4, '.b16', vf.data, 0, vs.access_ptr('r'), {vslot}"
            f"(kv * 16 + {lane} % 8 + {lane} // 8 % 2 * 8) * {DV + 8} + dp * 16 + {lane} // 16 * 8, "
            f"dtype='float16')")
    mma = ("T.ptx_legacy.mma('m16n8k16', 'row', 'col', 'fp16', 'fp16', 'fp32', {a}.data, {ao}, {b}.data, {bo}, "
           "{c}.data, {co}, False, dtype='float32')")
    nsteps = spec.seq_k // BN
    q_col = f"kk * 16 + i // 4 * 8 + {tig} * 2 + i % 2"
    # every step ends with a barrier (drain): nobody overwrites a tile another warp still reads
    sync = "T.tvm_storage_sync('shared')\n"
    drain = sync
    if stages == 1:
        prologue, fill = "", loads("j", "0") + sync
    else:   # the next step's tiles are in flight while this step computes
        prologue = loads("0", "0") + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
        fill = (f"if j + 1 < {nsteps}:\n" + _indent(loads("j + 1", "(j + 1) % 2"), 4)
                + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
                + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + sync)
    if M == 1:   # this warp's 16 query rows as A fragments, straight from global memory, kept in registers
        q_init = (f"for kk in T.unroll({D // 16}):\n"
                  f"    for i in T.unroll(8):\n"
                  f"        qf[kk * 8 + i] = q[{', '.join([*bidx, row.replace('mt * 16 + ', ''), q_col])}]\n")
        q_frag = ""
        q_off = "kk * 8"
    else:        # the block's Q tile in shared memory; each step's A fragments reloaded by ldmatrix
        vec = D // 8
        q_init = (f"for it in T.unroll({BM * vec // NT}):\n"
                  f"    for e in T.vectorized(8):\n"
                  f"        qs[(it * {NT} + tx) // {vec} * {D + 8} + (it * {NT} + tx) % {vec} * 8 + e] = "
                  f"q[{', '.join([*bidx, f'bx * {BM} + (it * {NT} + tx) // {vec}', f'(it * {NT} + tx) % {vec} * 8 + e'])}]\n"
                  f"T.tvm_storage_sync('shared')\n")
        q_frag = (f"for mt in T.unroll({M}):\n"
                  f"    T.evaluate(T.ptx_legacy.ldmatrix(False, 4, '.b16', qf.data, mt * 8, qs.access_ptr('r'), "
                  f"({warp} * {16 * M} + mt * 16 + {lane} % 16) * {D + 8} + kk * 16 + {lane} // 16 * 8, "
                  f"dtype='float16'))\n")
        q_off = "mt * 8"
    allocs = f"""ks = T.alloc_buffer(({stages * k_tile},), "float16", scope="shared.dyn", align=16)
vs = T.alloc_buffer(({stages * v_tile},), "float16", scope="shared.dyn", align=16)
{f'qs = T.alloc_buffer(({BM * (D + 8)},), "float16", scope="shared.dyn", align=16)' if M > 1 else ''}
qf = T.alloc_buffer(({D // 2 if M == 1 else 8 * M},), "float16", scope="local")
kf = T.alloc_buffer((8,), "float16", scope="local")
vf = T.alloc_buffer((8,), "float16", scope="local")
pf = T.alloc_buffer(({M * SB},), "float16", scope="local")
"""
    s_block = f"""for kk in T.unroll({D // 16}):
{_indent(q_frag, 4)}    for np in T.unroll({BN // 16}):
        T.evaluate({k_ld})
        for mt in T.unroll({M}):
            T.evaluate({mma.format(a="qf", ao=q_off, b="kf", bo=0, c="sacc", co=f"mt * {SB} + np * 8")})
            T.evaluate({mma.format(a="qf", ao=q_off, b="kf", bo=4, c="sacc", co=f"mt * {SB} + np * 8 + 4")})
"""
    pv_block = f"""# P (an m16n8 accumulator pair has the A operand's layout) times V
for kv in T.unroll({BN // 16}):
    for dp in T.unroll({DV // 16}):
        T.evaluate({v_ld})
        for mt in T.unroll({M}):
            T.evaluate({mma.format(a="pf", ao=f"mt * {SB} + kv * 8", b="vf", bo=0, c="oacc", co=f"mt * {OB} + dp * 8")})
            T.evaluate({mma.format(a="pf", ao=f"mt * {SB} + kv * 8", b="vf", bo=4, c="oacc", co=f"mt * {OB} + dp * 8 + 4")})
"""
    out_at = f"out[{', '.join([*bidx, row, f'i // 4 * 8 + {tig} * 2 + i % 2'])}]"
    if cfg.overlap:
        return _kernel(spec, cfg, params, _overlap_body(spec, cfg, bidx, row, tig, out_at))
    if cfg.wgmma:
        allocs, q_init, prologue, fill, s_block, pv_block = _wgmma_parts(spec, cfg, bidx, q_shape, k_shape, v_shape)
    body = f"""
{allocs}sacc = T.alloc_buffer(({M * SB},), "float32", scope="local")
oacc = T.alloc_buffer(({M * OB},), "float32", scope="local")
mrow = T.alloc_buffer(({2 * M},), "float32", scope="local")
lrow = T.alloc_buffer(({2 * M},), "float32", scope="local")
red = T.alloc_buffer(({2 * M},), "float32", scope="local")
alpha = T.alloc_buffer(({2 * M},), "float32", scope="local")
{q_init}for i in T.unroll({M * OB}):
    oacc[i] = T.float32(0)
for h in T.unroll({2 * M}):
    mrow[h] = T.float32(-1e30)
    lrow[h] = T.float32(0)
{prologue}for j in T.serial({nsteps}):
{_indent(fill, 4)}    for i in T.unroll({M * SB}):
        sacc[i] = T.float32(0)
{_indent(s_block, 4)}{_indent(_online_softmax(M, SB, OB, score, f'sacc[mt * {SB} + i]'), 4)}{_indent(pv_block, 4)}{_indent(drain, 4)}{_normalize_and_store(M, OB, out_at)}"""
    return _kernel(spec, cfg, params, body)


def _kernel(spec: AttentionSpec, cfg: FlashConfig, params: list[str], body: str) -> str:
    return f"""
@T.prim_func(private=True, s_tir=True)
def flash_attention({', '.join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True, "tvmfuse.kernel": "attention_flash"}})
    for by in T.thread_binding({math.prod(spec.batch)}, thread="blockIdx.y"):
        for bx in T.thread_binding({spec.seq_q // cfg.block_m}, thread="blockIdx.x"):
            for tx in T.thread_binding({32 * cfg.warps}, thread="threadIdx.x"):
{_indent(body, 16)}"""


_SHFL = "T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), {v}, {m}, 32, 32)"


def _online_softmax(M: int, SB: int, OB: int, score: str, acc: str) -> str:
    """One key step of the online softmax on the score accumulators ``acc`` (an element expression of ``mt`` and
    ``i``; ``score`` its scaled, masked value): the running row max and sum, P in ``pf`` (fp16), O rescaled."""
    return f"""# online softmax on the registers: element i of tile mt is in row g (i % 4 < 2) or g + 8 of its 16
for h in T.unroll({2 * M}):
    red[h] = T.float32(-1e30)
for mt in T.unroll({M}):
    for i in T.unroll({SB}):
        {acc} = {score}
        red[mt * 2 + i % 4 // 2] = T.max(red[mt * 2 + i % 4 // 2], {acc})
for h in T.unroll({2 * M}):
    red[h] = T.max(red[h], {_SHFL.format(v="red[h]", m=1)})
    red[h] = T.max(red[h], {_SHFL.format(v="red[h]", m=2)})
    red[h] = T.max(mrow[h], red[h])
    alpha[h] = T.exp2(mrow[h] - red[h])
    mrow[h] = red[h]
    lrow[h] = lrow[h] * alpha[h]
for mt in T.unroll({M}):
    for i in T.unroll({SB}):
        {acc} = T.exp2({acc} - mrow[mt * 2 + i % 4 // 2])
        lrow[mt * 2 + i % 4 // 2] = lrow[mt * 2 + i % 4 // 2] + {acc}
        pf[mt * {SB} + i] = T.Cast("float16", {acc})
    for i in T.unroll({OB}):
        oacc[mt * {OB} + i] = oacc[mt * {OB} + i] * alpha[mt * 2 + i % 4 // 2]
"""


def _normalize_and_store(M: int, OB: int, out_at: str) -> str:
    """The rows' sums across their four lanes, and O / sum stored (``out_at``: the output element of ``mt``, ``i``)."""
    return f"""for h in T.unroll({2 * M}):
    lrow[h] = lrow[h] + {_SHFL.format(v="lrow[h]", m=1)}
    lrow[h] = lrow[h] + {_SHFL.format(v="lrow[h]", m=2)}
    lrow[h] = T.float32(1) / lrow[h]
for mt in T.unroll({M}):
    for i in T.unroll({OB}):
        {out_at} = T.Cast("float16", oacc[mt * {OB} + i] * lrow[mt * 2 + i % 4 // 2])
"""


def _score(spec: AttentionSpec, bidx: list[str], row: str, col: str, acc: str) -> str:
    """The score of accumulator element ``acc`` (query ``row``, key ``col``) in base 2: log2(e) * (scale * s +
    mask), or log2(e) * scale * (s + mask) when the mask comes first."""
    mask = None
    if spec.mask_shape is not None:
        nb = len(spec.batch)
        full, full_ext = [*bidx, row, col], [*spec.batch, spec.seq_q, spec.seq_k]
        off = nb + 2 - len(spec.mask_shape)
        mask = "mask[" + ", ".join("0" if d == 1 and full_ext[off + i] != 1 else full[off + i]
                                   for i, d in enumerate(spec.mask_shape)) + "]"
        if spec.mask_dtype != "float32":
            mask = f"T.Cast('float32', {mask})"
    scale = 1.0 if spec.scale is None else float(spec.scale)
    if mask is None:
        return f"{acc} * T.float32({scale * _LOG2E!r})"
    if spec.scale_first:
        score = f"({acc} * T.float32({scale!r}) + {mask}) * T.float32({_LOG2E!r})"
    else:
        score = f"({acc} + {mask}) * T.float32({scale * _LOG2E!r})"
    # a mask of float32's lowest value (-3.4e38) overflows to -inf in base 2: clamp to the running max's
    # start, so a row masked everywhere gets softmax's uniform weights, as the reference does, not 0 / 0
    return f"T.max({score}, T.float32(-1e30))"


def flash_primfunc(spec: AttentionSpec, cfg: FlashConfig):
    from tvm.script import tirx as T  # noqa: F401  (the template's T)

    from tvmfuse.plan.attention import _parse

    return _parse(flash_source(spec, cfg), {"T": T})


class _WgmmaTiles:
    """The Hopper kernels' shared tiles: one buffer ``hs`` holding Q (``block_m x d``) at 0, then ``slots`` K tiles
    and ``slots`` V tiles (each a multiple of 1024 bytes, the swizzle atom), all in wgmma's 128-byte swizzled
    layouts (``tvmfuse.tune.hopper.tile_layout``) and filled by 16-byte ``cp.async`` copies. One buffer because
    TVM's shared-memory planner does not see the wgmma descriptors' reads: as separate buffers it merged them and
    let K overwrite Q."""

    def __init__(self, spec: AttentionSpec, cfg: FlashConfig, bidx: list[str], slots: int):
        from tvmfuse.tune.hopper import tile_layout

        self.spec, self.cfg, self.bidx = spec, cfg, bidx
        D, DV, BN, BM = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m
        self.q_tile, self.k_tile, self.v_tile = BM * D, BN * D, BN * DV
        self.q_chunk, self.q_desc = tile_layout(128, True, BM, D)
        # K as stored: rows of keys (K-major for S = Q·Kᵀ) or [d, key] (N-major, read transposed)
        self.k_chunk, self.k_desc = tile_layout(128, spec.k_rows, BN, D)
        self.v_chunk, self.v_desc = tile_layout(128, False, DV, BN)
        self.q_base, self.k_base = 0, self.q_tile
        self.v_base = self.q_tile + slots * self.k_tile
        self.elems = self.q_tile + slots * (self.k_tile + self.v_tile)
        self.shapes = ((*spec.batch, spec.seq_q, D),
                       (*spec.batch, spec.seq_k, D) if spec.k_rows else (*spec.batch, D, spec.seq_k),
                       (*spec.batch, spec.seq_k, DV))

    def _copy(self, base: int, src: str, shape, tile_elems: int, chunk, index, slot: str) -> str:
        nt = 32 * self.cfg.warps
        o, kx, off = chunk(f"(it * {nt} + tx)")
        return (f"for it in T.unroll({tile_elems // 8 // nt}):\n"
                f"    T.evaluate(T.s_tir.cp_async_raw('float16', hs.data, {base} + ({slot}) * {tile_elems} + {off}, "
                f"{src}.data, {_flat(shape, [*self.bidx, *index(o, kx)])}, 16))\n")

    def q_copy(self) -> str:
        return self._copy(self.q_base, "q", self.shapes[0], self.q_tile, self.q_chunk,
                          lambda o, kx: [f"bx * {self.cfg.block_m} + {o}", kx], "0")

    def k_copy(self, step: str, slot: str) -> str:
        BN = self.cfg.block_n
        index = ((lambda o, kx: [f"({step}) * {BN} + {o}", kx]) if self.spec.k_rows
                 else (lambda o, kx: [kx, f"({step}) * {BN} + {o}"]))
        return self._copy(self.k_base, "k", self.shapes[1], self.k_tile, self.k_chunk, index, slot)

    def v_copy(self, step: str, slot: str) -> str:
        BN = self.cfg.block_n
        return self._copy(self.v_base, "v", self.shapes[2], self.v_tile, self.v_chunk,
                          lambda o, kx: [f"({step}) * {BN} + {kx}", o], slot)

    def s_wgmma(self, acc: str, slot: str, offset: str = "") -> str:
        """``acc[offset + (0 .. block_n / 2)] += Q·K(slot)ᵀ`` for this warpgroup's 64 rows, committed as one wgmma
        group (``offset``: an expression followed by `` + ``, or nothing)."""
        from tvmfuse.tune.hopper import desc, wgmma_issue

        BN, SB = self.cfg.block_n, self.cfg.block_n // 2
        accs = ", ".join(f"{acc}[{offset}{i}]" for i in range(SB))
        out = "T.evaluate(T.ptx.wgmma.fence.sync.aligned())\n"
        for kk in range(self.spec.head_dim // 16):
            q_off, q_lbo, q_sbo = self.q_desc(kk)
            k_off, k_lbo, k_sbo = self.k_desc(kk)
            out += wgmma_issue(BN, accs,
                               desc("hs", f"{self.q_base} + (tx // 128) * {64 * 64} + {q_off}", q_lbo, q_sbo, 128),
                               desc("hs", f"{self.k_base} + ({slot}) * {self.k_tile} + {k_off}", k_lbo, k_sbo, 128),
                               f"1, 1, 0, {0 if self.spec.k_rows else 1}")
        return out + "T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())\n"

    def pv_wgmma(self, pf: str, slot: str) -> str:
        """P (``pf``, fp16, packed into ``pu`` as the register A operand) times V(slot) into ``oacc``, committed
        as one wgmma group."""
        from tvmfuse.tune.hopper import desc, wgmma_issue

        BN, DV, SB = self.cfg.block_n, self.spec.head_dim_v, self.cfg.block_n // 2
        half = "T.Cast('uint32', T.call_pure_extern('uint16', '__half_as_ushort', " + pf + "[{i}]))"
        out = (f"for u in T.unroll({SB // 2}):\n"
               f"    pu[u] = {half.format(i='u * 2')} | ({half.format(i='u * 2 + 1')} << T.uint32(16))\n"
               "T.evaluate(T.ptx.wgmma.fence.sync.aligned())\n")
        oaccs = ", ".join(f"oacc[{i}]" for i in range(DV // 2))
        for kv in range(BN // 16):
            v_off, v_lbo, v_sbo = self.v_desc(kv)
            out += wgmma_issue(DV, oaccs, ", ".join(f"pu[{kv * 4 + r}]" for r in range(4)),
                               desc("hs", f"{self.v_base} + ({slot}) * {self.v_tile} + {v_off}", v_lbo, v_sbo, 128),
                               "1, 1, 1")
        return out + "T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())\n"


def _wgmma_parts(spec: AttentionSpec, cfg: FlashConfig, bidx: list[str], q_shape, k_shape, v_shape):
    """The parts of :func:`flash_source` that differ on Hopper (``cfg.wgmma``, not ``cfg.overlap``): shared tiles
    in wgmma's 128-byte swizzled layouts filled by ``cp.async`` (:class:`_WgmmaTiles`); ``S = Q·Kᵀ`` as one
    warpgroup's ``wgmma.mma_async.m64n{block_n}k16`` per 16-deep slice of the head dim (Q and K from shared
    memory); P packed to fp16 pairs in registers, the A operand of ``O += P·V`` (``wgmma`` with A from registers, V
    read N-major from shared memory). Each warp's accumulators have the m16n8 layout the softmax code expects."""
    S = cfg.stages
    tiles = _WgmmaTiles(spec, cfg, bidx, S)

    def loads(step: str, slot: str) -> str:
        return tiles.k_copy(step, slot) + tiles.v_copy(step, slot)

    ready = ("T.evaluate(T.ptx.fence.proxy.async_.shared__cta())\n"   # cp.async writes, seen by wgmma's async proxy
             "T.tvm_storage_sync('shared')\n")
    allocs = f"""hs = T.alloc_buffer(({tiles.elems},), "float16", scope="shared.dyn", align=1024)
pf = T.alloc_buffer(({cfg.block_n // 2},), "float16", scope="local")
pu = T.alloc_buffer(({cfg.block_n // 4},), "uint32", scope="local")
"""
    q_init = tiles.q_copy() + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
    nsteps = spec.seq_k // cfg.block_n
    if S == 1:
        prologue = ""
        fill = (loads("j", "0") + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
                + "T.evaluate(T.ptx.cp.async_.wait_group(0))\n" + ready)
    else:
        prologue = loads("0", "0") + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
        fill = (f"if j + 1 < {nsteps}:\n" + _indent(loads("j + 1", "(j + 1) % 2"), 4)
                + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
                + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + ready)
    slot = "0" if S == 1 else "j % 2"
    wait = "T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))\n"
    return allocs, q_init, prologue, fill, tiles.s_wgmma("sacc", slot) + wait, tiles.pv_wgmma("pf", slot) + wait


def _overlap_body(spec: AttentionSpec, cfg: FlashConfig, bidx: list[str], row: str, tig: str, out_at: str) -> str:
    """The Hopper kernel with the tensor cores kept busy across the softmax (``cfg.overlap``; FlashAttention-3's
    intra-warpgroup pipelining). Key steps go in pairs so the two score accumulators ``sacc[0:n/2]`` and
    ``sacc[n/2:n]`` take turns with static register indices. Step ``j`` (``par = j % 2``):

    1. wait for this warpgroup's wgmmas (``S_j`` and ``P_{j-1}·V_{j-1}``), then a barrier: every warpgroup is done
       with ``K_j`` and ``V_{j-1}``;
    2. copy ``K_{j+2}`` into ``K_j``'s slot and ``V_{j+1}`` into ``V_{j-1}``'s (one cp.async group), wait for the
       previous group (``K_{j+1}``, ``V_j``) and make it visible to the async proxy;
    3. issue ``S_{j+1} = Q·K_{j+1}ᵀ`` into the other accumulator; it runs while
    4. the softmax of ``S_j`` makes P and rescales O (O is not in flight: step 1 waited for it);
    5. issue ``O += P·V_j``, which runs during the next step's copies and waits.
    """
    BN, SB, OB = cfg.block_n, cfg.block_n // 2, spec.head_dim_v // 2
    nsteps = spec.seq_k // BN
    tiles = _WgmmaTiles(spec, cfg, bidx, 2)
    j = "(jj * 2 + par)"
    score = _score(spec, bidx, row, f"{j} * {BN} + i // 4 * 8 + {tig} * 2 + i % 2", f"sacc[par * {SB} + i]")
    visible = ("T.evaluate(T.ptx.fence.proxy.async_.shared__cta())\n"   # cp.async writes, seen by wgmma's async proxy
               "T.tvm_storage_sync('shared')\n")
    commit = "T.evaluate(T.ptx.cp.async_.commit_group())\n"
    step = ("T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))\n"
            "T.tvm_storage_sync('shared')\n"
            f"if {j} + 2 < {nsteps}:\n" + _indent(tiles.k_copy(f"{j} + 2", "par"), 4)
            + f"if {j} + 1 < {nsteps}:\n" + _indent(tiles.v_copy(f"{j} + 1", "1 - par"), 4)
            + commit + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + visible
            + f"if {j} + 1 < {nsteps}:\n"
            + _indent(f"for i in T.unroll({SB}):\n    sacc[(1 - par) * {SB} + i] = T.float32(0)\n"
                      + tiles.s_wgmma("sacc", "1 - par", offset=f"(1 - par) * {SB} + "), 4)
            + _online_softmax(1, SB, OB, score, f"sacc[par * {SB} + i]")
            + tiles.pv_wgmma("pf", "par"))
    return f"""hs = T.alloc_buffer(({tiles.elems},), "float16", scope="shared.dyn", align=1024)
sacc = T.alloc_buffer(({2 * SB},), "float32", scope="local")
pf = T.alloc_buffer(({SB},), "float16", scope="local")
pu = T.alloc_buffer(({SB // 2},), "uint32", scope="local")
oacc = T.alloc_buffer(({OB},), "float32", scope="local")
mrow = T.alloc_buffer((2,), "float32", scope="local")
lrow = T.alloc_buffer((2,), "float32", scope="local")
red = T.alloc_buffer((2,), "float32", scope="local")
alpha = T.alloc_buffer((2,), "float32", scope="local")
{tiles.q_copy()}{tiles.k_copy("0", "0")}{tiles.v_copy("0", "0")}{commit}{tiles.k_copy("1", "1")}{commit}for i in T.unroll({OB}):
    oacc[i] = T.float32(0)
for h in T.unroll(2):
    mrow[h] = T.float32(-1e30)
    lrow[h] = T.float32(0)
for i in T.unroll({SB}):
    sacc[i] = T.float32(0)
T.evaluate(T.ptx.cp.async_.wait_group(1))
{visible}{tiles.s_wgmma("sacc", "0")}for jj in T.serial({nsteps // 2}):
    for par in T.unroll(2):
{_indent(step, 8)}T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_normalize_and_store(1, OB, out_at)}"""
