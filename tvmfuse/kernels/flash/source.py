"""The flash kernel as TVMScript for a spec and a config (``mma.sync``, or on Hopper ``wgmma``), and its swap for a
tuned sketch's annotation."""
from __future__ import annotations

import math

from tvmfuse.kernels.annotations import swap_kernels
from tvmfuse.kernels.flash.config import FlashConfig, annotated_config, default_config, spec_of
from tvmfuse.kernels.flash.simt import SimtConfig, simt_source
from tvmfuse.kernels.wgmma.config import SMS
from tvmfuse.kernels.flash.softmax import (_flat, _indent, _normalize_and_store, _online_softmax, batch_indices,
                                           key_loop, key_steps, kt_vector, kv_index, kv_tile_copies, query_read,
                                           tile_scores)
from tvmfuse.kernels.flash.tma import tma_body
from tvmfuse.kernels.flash.wgmma_tiles import _overlap_body, _wgmma_parts
from tvmfuse.plan.attention import AttentionSpec


def expand(mod):
    """``mod`` with every flash-annotated attention PrimFunc replaced by the flash kernel it selects."""
    def flash(gv, func):
        cfg = annotated_config(func)
        return flash_kernel(func, cfg) if cfg is not None and spec_of(func) is not None else None

    return swap_kernels(mod, flash)


def flash_kernel(func, cfg: FlashConfig | SimtConfig | None = None, wgmma: bool = False, sm_count: int = SMS):
    """The flash kernel for the planner's attention PrimFunc ``func`` (its global symbol kept); without ``cfg``,
    the default tiles (``wgmma``: Hopper's where they fit; the CUDA-core kernel where no tensor-core one does)."""
    spec = spec_of(func)
    kernel = flash_primfunc(spec, cfg or default_config(spec, wgmma, sm_count))
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    return kernel.with_attr("global_symbol", symbol) if symbol is not None else kernel


def flash_source(spec: AttentionSpec, cfg: FlashConfig) -> str:
    """TVMScript of the flash kernel for ``spec`` with tiles ``cfg`` (a TF32 spec: :mod:`tvmfuse.kernels.flash.tf32`'s
    kernel)."""
    if spec.tf32:
        from tvmfuse.kernels.flash.tf32 import tf32_source

        return tf32_source(spec, cfg, _kernel)
    D, DV, BN, BM, NT = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m, 32 * cfg.warps
    stages = cfg.stages
    bidx = batch_indices(spec)
    warp, lane = "(tx // 32)", "(tx % 32)"
    g, tig = f"({lane} // 4)", f"({lane} % 4)"
    q_shape = (*spec.batch, spec.seq_q, D)
    kvb = spec.kv_batch   # GQA: fewer K/V heads, each read by its group of query heads
    kvidx = kv_index(spec, bidx)
    k_shape = (*kvb, spec.seq_k, D) if spec.k_rows else (*kvb, D, spec.seq_k)
    v_shape = (*kvb, spec.seq_k, DV)
    o_shape = spec.out_shape
    buf = lambda name, shp, dt="float16": f"{name}: T.Buffer({tuple(shp)!r}, '{dt}')"  # noqa: E731
    params = [buf("q", q_shape), buf("k", k_shape), buf("v", v_shape)]
    M, SB, OB = cfg.m_tiles, BN // 2, DV // 2   # per m-tile: score and output accumulator elements per thread
    row = f"bx * {BM} + {warp} * {16 * M} + mt * 16 + {g} + i % 4 // 2 * 8"   # query row of element i of tile mt
    params += [buf(name, shape, dtype) for name, shape, dtype in spec.additive()]
    params.append(buf("out", o_shape))
    # (mma.sync configs) a ragged last query tile's rows past the end read zeros and are not stored; a ragged last
    # key step's keys past the end are zeros in shared memory and -inf as scores
    ragged_q = spec.seq_q % BM != 0
    plain, score = tile_scores(spec, bidx, row, f"j * {BN} + i // 4 * 8 + {tig} * 2 + i % 2", f"sacc[mt * {SB} + i]",
                               BM, BN)

    # shared tiles (rows padded by 8 halves = 16 bytes); with 2 stages, two of each
    k_rows, k_cols = (BN, D) if spec.k_rows else (D, BN)
    k_tile, v_tile = k_rows * (k_cols + 8), BN * (DV + 8)

    shapes = {"k": k_shape, "v": v_shape}
    kv_tiles = (("ks", "k", k_rows, k_cols, k_cols + 8, k_tile, 0 if spec.k_rows else 1,
                 8 if spec.k_rows else kt_vector(spec)),
                ("vs", "v", BN, DV, DV + 8, v_tile, 0, 8))

    def copy(dst: str, at: str, src: str, index: list[str], width: int) -> str:
        if stages == 1:
            return (f"for e in T.vectorized({width}):\n"
                    f"    {dst}[{at} + e] = {src}[{', '.join([*kvidx, index[0], index[1] + ' + e'])}]\n")
        # (16 bytes; Kᵀ's narrower vectors of at least 4 bytes, cp.async's least: the configs' rule)
        return (f"T.evaluate(T.s_tir.cp_async_raw('float16', {dst}.data, {at}, {src}.data, "
                f"{_flat(shapes[src], [*kvidx, *index])}, {2 * width}))\n")

    def loads(step: str, slot: str) -> str:
        """Copy step ``step``'s K and V tiles into shared slot ``slot`` (16-byte vectors; Kᵀ's may be narrower,
        :func:`kt_vector`)."""
        return kv_tile_copies(spec, kv_tiles, step, slot, NT, BN, copy, "T.float16(0)")

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
    nsteps = key_steps(spec, BM, BN)
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
        q_at = query_read(spec, row.replace('mt * 16 + ', ''), lambda r: f"q[{', '.join([*bidx, r, q_col])}]",
                          "T.float16(0)", ragged_q)
        q_init = (f"for kk in T.unroll({D // 16}):\n"
                  f"    for i in T.unroll(8):\n"
                  f"        qf[kk * 8 + i] = {q_at}\n")
        q_frag = ""
        q_off = "kk * 8"
    else:        # the block's Q tile in shared memory; each step's A fragments reloaded by ldmatrix
        vec = D // 8
        q_r = f"bx * {BM} + (it * {NT} + tx) // {vec}"
        qs_at = f"qs[(it * {NT} + tx) // {vec} * {D + 8} + (it * {NT} + tx) % {vec} * 8 + e]"
        q_copy = (f"for e in T.vectorized(8):\n"
                  f"    {qs_at} = q[{', '.join([*bidx, q_r, f'(it * {NT} + tx) % {vec} * 8 + e'])}]\n")
        if ragged_q:   # rows past the end: zeros
            q_copy = (f"if {q_r} < {spec.seq_q}:\n" + _indent(q_copy, 4)
                      + f"else:\n    for e in T.vectorized(8):\n        {qs_at} = T.float16(0)\n")
        q_init = f"for it in T.unroll({BM * vec // NT}):\n" + _indent(q_copy, 4) + "T.tvm_storage_sync('shared')\n"
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
    out_at = f"out[{', '.join(spec.out_index(bidx, row, f'i // 4 * 8 + {tig} * 2 + i % 2'))}]"
    if cfg.overlap:
        return _kernel(spec, cfg, params, _overlap_body(spec, cfg, bidx, row, tig, out_at))
    if cfg.tma:
        encode, body = tma_body(spec, cfg, out_at, row, tig)
        return _kernel(spec, cfg, params, body, prelude=encode)
    if cfg.wgmma:
        allocs, q_init, prologue, fill, s_block, pv_block = _wgmma_parts(spec, cfg, bidx, q_shape, k_shape, v_shape)

    def step(sc: str) -> str:
        """One key step's body with the score expression ``sc``."""
        return (f"{_indent(fill, 4)}    for i in T.unroll({M * SB}):\n        sacc[i] = T.float32(0)\n"
                + _indent(s_block, 4) + _indent(_online_softmax(M, SB, OB, sc, f"sacc[mt * {SB} + i]"), 4)
                + _indent(pv_block, 4) + _indent(drain, 4))

    # the steps whose keys every row of the tile sees skip the mask; only the diagonal ones and a ragged last one
    # apply it
    keys = key_loop(spec, BM, BN, lambda masked: step(score if masked else plain))
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
{prologue}{keys}{_normalize_and_store(M, OB, out_at, guard=f"{row} < {spec.seq_q}" if ragged_q else None)}"""
    return _kernel(spec, cfg, params, body)


def _kernel(spec: AttentionSpec, cfg: FlashConfig | SimtConfig, params: list[str], body: str,
            prelude: str = "") -> str:
    """The kernel's PrimFunc text: ``prelude`` (host statements: TMA tensor maps) before the grid of query tiles and
    heads, ``cfg.threads`` a block, ``body`` inside."""
    # (a CUDA-core kernel's last query tile may be ragged)
    tiles, heads, threads = -(-spec.seq_q // cfg.block_m), math.prod(spec.batch), cfg.threads
    if spec.causal:
        # a causal tile's work grows with its index: the heaviest launch first (blockIdx.y is the slower launch
        # order) so the last wave holds the light ones; blockIdx.x walks the heads, so the heads sharing a K/V head
        # (GQA) run side by side and meet in L2
        grid = (f"for byr in T.thread_binding({tiles}, thread=\"blockIdx.y\"):\n"
                f"    for by in T.thread_binding({heads}, thread=\"blockIdx.x\"):\n"
                f"        for tx in T.thread_binding({threads}, thread=\"threadIdx.x\"):\n"
                f"            bx: T.int32 = {tiles - 1} - byr\n")
    else:
        grid = (f"for by in T.thread_binding({heads}, thread=\"blockIdx.y\"):\n"
                f"    for bx in T.thread_binding({tiles}, thread=\"blockIdx.x\"):\n"
                f"        for tx in T.thread_binding({threads}, thread=\"threadIdx.x\"):\n")
    return f"""
@T.prim_func(private=True, s_tir=True)
def flash_attention({', '.join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True, "tvmfuse.kernel": "attention_flash"}})
{_indent(prelude, 4)}{_indent(grid, 4)}{_indent(body, 16)}"""


def flash_primfunc(spec: AttentionSpec, cfg: FlashConfig | SimtConfig):
    from tvm.script import tirx as T  # noqa: F401  (the template's T)

    from tvmfuse.plan.attention import _parse

    from tvmfuse.kernels.wgmma.ptx import _TMA_SOURCE

    src = simt_source(spec, cfg, _kernel) if isinstance(cfg, SimtConfig) else flash_source(spec, cfg)
    return _parse(src, {"T": T, "_TMA_SOURCE": _TMA_SOURCE})
