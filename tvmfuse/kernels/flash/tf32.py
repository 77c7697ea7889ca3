"""Flash attention in TF32 on the tensor cores (``--precision tf32``): fp32 inputs, ``mma.sync.m16n8k8`` on TF32
operands, fp32 accumulation and softmax.

The planner marks fp32 attention for it under ``--precision tf32`` (``AttentionSpec.tf32``); in plain fp32 the
CUDA-core kernel (:mod:`tvmfuse.kernels.flash.simt`) keeps fp32's precision. The kernel is the fp16 ``mma.sync``
kernel's (:func:`tvmfuse.kernels.flash.source.flash_source`) with 32-bit operands:

* a warp owns 16 query rows; their Q fragments (``m16k8``, four registers a slice of 8 head dims) stay in registers;
* each step stages ``block_n`` keys of K and V in shared memory, fp32, rows padded so the fragment reads of a warp
  hit 32 distinct banks (4 floats where keys are rows, 8 where K comes transposed, ``[d, key]``); with 2 stages the
  next step's tiles come by ``cp.async`` while this one computes;
* ``S = Q·Kᵀ`` accumulates in the m16n8 layout of the fp16 kernel, so the online softmax and the store are its code
  (:mod:`tvmfuse.kernels.flash.softmax`);
* ``O += P·V``: an m16n8 accumulator holds columns ``2t, 2t + 1`` of its lane's rows where the A operand of
  ``m16n8k8`` wants columns ``t, t + 4``. The kernel relabels the 8 keys of each slice instead of moving P between
  lanes: A's key ``t`` is key ``2t`` and A's key ``t + 4`` is key ``2t + 1``, so P's registers feed the mma in place
  (``pf`` holds them in A's order) and V's fragment reads rows ``2t`` and ``2t + 1``.

Every operand is rounded to TF32 first (to nearest, ties away from zero: what ``cvt.rna.tf32.f32`` gives and what
cuBLAS and cuDNN read). The tensor core itself truncates the low 13 bits, a bias every product shares
(:data:`tvmfuse.kernels.wgmma.ptx.ROUND_TF32` says what it did to a ResNet-50). Q and P are rounded in registers;
K and V on their way into shared memory (single stage) or in place after the thread's ``cp.async`` copies land.
"""
from __future__ import annotations

from tvmfuse.kernels.flash.softmax import (_flat, _indent, _normalize_and_store, _online_softmax, batch_indices,
                                           key_loop, key_steps, kt_vector, kv_index, kv_tile_copies, query_read,
                                           tile_scores)
from tvmfuse.kernels.wgmma.ptx import _ROUND_TF32_SOURCE, ROUND_TF32
from tvmfuse.plan.attention import AttentionSpec

REGISTERS = 200   # fp32 registers Q's fragments, the scores, P and O may take (of 255): with the addresses and the
#                   fragments in flight, the kept configs build without spills (ptxas, sm_90a)
# the same for an x3 kernel, whose splits keep more in flight: head dim 80 at 64 keys a step (196 counted) spilled
# at one stage and took 254 registers at two; every config counted at most 188 built without spills (164-196 used)
X3_REGISTERS = 190


def rna(x: str) -> str:
    """TIR for fp32 ``x`` rounded to TF32's 10-bit mantissa, to nearest, ties away from zero (adding half a unit of
    the 13 dropped bits carries into the mantissa; infinities stay infinite)."""
    return (f"T.reinterpret((T.reinterpret({x}, dtype='uint32') + T.uint32(4096)) & T.uint32(4294959104), "
            f"dtype='float32')")


# The fragments of ``mma.sync.m16n8k8`` on TF32 for lane ``4 g + t`` (PTX ISA), as index expressions:
def q_element(r, g, t) -> tuple[str, str]:
    """A's register ``r``: (row of the 16, column of the 8: a head dim of Q·Kᵀ's slice)."""
    return f"{g} + {r % 2 * 8}", f"{t} + {r // 2 * 4}"


def k_element(h, g, t) -> tuple[str, str]:
    """B's register ``h`` for Q·Kᵀ: (key of the 8, head dim of the slice)."""
    return f"{g}", f"{t} + {4 * h}"


def v_element(h, g, t) -> tuple[str, str]:
    """B's register ``h`` for P·V: (key of the slice, column of the 8). A's column ``t + 4h`` stands for key
    ``2t + h``: the keys an m16n8 accumulator holds in lane ``t`` (see the module's docstring)."""
    return f"{t} * 2 + {h}", f"{g}"


# P's score element ``i`` (the m16n8 accumulator's: row g or g + 8 by ``i % 4 // 2``, key ``2t + i % 2`` of slice
# ``i // 4``) is A's register ``i % 2 * 2 + i % 4 // 2`` of that slice: rows in A's order, keys relabelled as above
P_SLOT = "i // 4 * 4 + i % 2 * 2 + i % 4 // 2"


def k_stride(spec: AttentionSpec, block_n: int) -> int:
    """A shared K tile's row in floats: keys as rows (``head_dim`` + 4: the 8 keys of a fragment read start 4 banks
    apart) or head dims as rows (``block_n`` + 8: the 4 head dims read start 8 banks apart)."""
    return spec.head_dim + 4 if spec.k_rows else block_n + 8


def shared_bytes(spec: AttentionSpec, cfg) -> int:
    k_tile = cfg.block_n * k_stride(spec, cfg.block_n) if spec.k_rows else spec.head_dim * k_stride(spec, cfg.block_n)
    return 4 * cfg.stages * (k_tile + cfg.block_n * (spec.head_dim_v + 4))


def registers(spec: AttentionSpec, cfg) -> int:
    """Q's fragments, the scores, P (in A's order) and O: fp32 registers a thread keeps across a step; with ``x3``
    also Q's small parts (its split does not change across key steps: nvcc keeps both), a slice's A fragment split
    in two (8) and a B fragment's (4). (``plan.attention.X3_HEAD_DIMS`` is the planner's side of this count.)"""
    return spec.head_dim // 2 + cfg.block_n + spec.head_dim_v // 2 + (spec.head_dim // 2 + 12 if spec.x3 else 0)


def register_cap(spec: AttentionSpec) -> int:
    return X3_REGISTERS if spec.x3 else REGISTERS


def tf32_source(spec: AttentionSpec, cfg, kernel) -> str:
    """TVMScript of the TF32 flash kernel for ``spec`` (fp32, ``tf32``) with tiles ``cfg`` (a
    :class:`~tvmfuse.kernels.flash.config.FlashConfig` of one 16-row tile per warp; ``kernel``: the grid wrapper,
    :func:`tvmfuse.kernels.flash.source._kernel`)."""
    D, DV, BN, BM, NT, S = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m, 32 * cfg.warps, cfg.stages
    bidx = batch_indices(spec)
    kvidx = kv_index(spec, bidx)
    warp, lane = "(tx // 32)", "(tx % 32)"
    g, t = f"({lane} // 4)", f"({lane} % 4)"
    kvb = spec.kv_batch
    q_shape, v_shape, o_shape = (*spec.batch, spec.seq_q, D), (*kvb, spec.seq_k, DV), spec.out_shape
    k_shape = (*kvb, spec.seq_k, D) if spec.k_rows else (*kvb, D, spec.seq_k)
    buf = lambda name, shp, dt="float32": f"{name}: T.Buffer({tuple(shp)!r}, '{dt}')"  # noqa: E731
    params = [buf("q", q_shape), buf("k", k_shape), buf("v", v_shape)]
    params += [buf(name, shape, dtype) for name, shape, dtype in spec.additive()]
    params.append(buf("out", o_shape))
    SB, OB = BN // 2, DV // 2   # score and output accumulator elements per thread
    row = f"bx * {BM} + {warp} * 16 + {g} + i % 4 // 2 * 8"   # query row of accumulator element i
    key = f"j * {BN} + i // 4 * 8 + {t} * 2 + i % 2"            # key of score element i
    KS, VS = k_stride(spec, BN), DV + 4
    # a ragged last query tile's rows past the end read zeros and are not stored; a ragged last key step's keys past
    # the end are zeros in shared memory and -inf as scores
    ragged_q = spec.seq_q % BM != 0
    k_rows, k_cols = (BN, D) if spec.k_rows else (D, BN)
    k_tile, v_tile = k_rows * KS, BN * VS

    shapes = {"k": k_shape, "v": v_shape}
    kv_tiles = (("ks", "k", k_rows, k_cols, KS, k_tile, 0 if spec.k_rows else 1, 4 if spec.k_rows else kt_vector(spec)),
                ("vs", "v", BN, DV, VS, v_tile, 0, 4))
    # x3: operands kept whole (fp32) and split into TF32 parts in registers, fragment by fragment
    rounded = (lambda x: x) if spec.x3 else rna
    copies = {
        # rounded on the way
        "load": lambda dst, at, src, index, width: (
            f"for e in T.vectorized({width}):\n"
            f"    {dst}[{at} + e] = {rounded(src + '[' + ', '.join([*kvidx, index[0], index[1] + ' + e']) + ']')}\n"),
        "copy": lambda dst, at, src, index, width: (
            f"T.evaluate(T.s_tir.cp_async_raw('float32', {dst}.data, {at}, {src}.data, "
            f"{_flat(shapes[src], [*kvidx, *index])}, 16))\n"),
        # the chunks this thread copied, rounded in place
        "round": lambda dst, at, src, index, width: (
            f"T.evaluate(T.cuda.func_call({ROUND_TF32!r}, {dst}_base + T.uint32(({at}) * 4), "
            f"source_code={_ROUND_TF32_SOURCE!r}))\n"),
    }

    def tiles(step: str, slot: str, mode: str) -> str:
        """Step ``step``'s K and V tiles into shared slot ``slot``, 16 bytes a thread a round (Kᵀ's may be
        narrower, :func:`kt_vector`): ``load`` (rounded on the way), ``copy`` (``cp.async``) or ``round`` (the
        chunks this thread copied, rounded in place)."""
        if mode == "round" and spec.x3:
            return ""
        return kv_tile_copies(spec, kv_tiles, step, slot, NT, BN, copies[mode],
                              None if mode == "round" else "T.float32(0)")

    sync = "T.tvm_storage_sync('shared')\n"
    nsteps = key_steps(spec, BM, BN)
    if S == 1:
        prologue, fill = "", tiles("j", "0", "load") + sync
    else:   # the next step's tiles are in flight while this step computes; each thread rounds what it copied
        prologue = tiles("0", "0", "copy") + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
        fill = (f"if j + 1 < {nsteps}:\n" + _indent(tiles("j + 1", "(j + 1) % 2", "copy"), 4)
                + "T.evaluate(T.ptx.cp.async_.commit_group())\n"
                + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + tiles("j", "j % 2", "round") + sync)
    kslot, vslot = (f"j % 2 * {k_tile} + ", f"j % 2 * {v_tile} + ") if S > 1 else ("", "")

    def k_at(h: int) -> str:
        n, d = k_element(h, g, t)
        return (f"{kslot}(np * 8 + {n}) * {KS} + kk * 8 + {d}" if spec.k_rows      # ks[key, d]
                else f"{kslot}(kk * 8 + {d}) * {KS} + np * 8 + {n}")            # ks[d, key]

    def v_at(h: int) -> str:
        n, c = v_element(h, g, t)
        return f"{vslot}(kv * 8 + {n}) * {VS} + dp * 8 + {c}"

    mma = ("T.ptx_legacy.mma('m16n8k8', 'row', 'col', 'tf32', 'tf32', 'fp32', {a}.data, {ao}, {b}.data, 0, "
           "{c}.data, {co}, False, dtype='float32')")

    def q_at(r: int) -> str:
        row_r, col = q_element(r, g, t)
        return query_read(spec, f"bx * {BM} + {warp} * 16 + {row_r}",
                          lambda at: "q[" + ", ".join([*bidx, at, f"kk * 8 + {col}"]) + "]", "T.float32(0)", ragged_q)

    q_init = (f"for kk in T.unroll({D // 8}):\n"
              + "".join(f"    qf[kk * 4 + {r}] = {rounded(q_at(r))}\n" for r in range(4)))
    if spec.x3:
        s_block, pv_block = (_x3_block(outer, inner, a, b, reads, acc, mma) for outer, inner, a, b, reads, acc in (
            (f"kk in T.unroll({D // 8})", f"np in T.unroll({BN // 8})", "qf[kk * 4", "kf",
             [f"ks[{k_at(0)}]", f"ks[{k_at(1)}]"], ("sacc", "np * 4")),
            (f"kv in T.unroll({BN // 8})", f"dp in T.unroll({DV // 8})", "pf[kv * 4", "vf",
             [f"vs[{v_at(0)}]", f"vs[{v_at(1)}]"], ("oacc", "dp * 4"))))
    else:
        s_block = f"""for kk in T.unroll({D // 8}):
    for np in T.unroll({BN // 8}):
        kf[0] = ks[{k_at(0)}]
        kf[1] = ks[{k_at(1)}]
        T.evaluate({mma.format(a="qf", ao="kk * 4", b="kf", c="sacc", co="np * 4")})
"""
        pv_block = f"""for kv in T.unroll({BN // 8}):
    for dp in T.unroll({DV // 8}):
        vf[0] = vs[{v_at(0)}]
        vf[1] = vs[{v_at(1)}]
        T.evaluate({mma.format(a="pf", ao="kv * 4", b="vf", c="oacc", co="dp * 4")})
"""
    p_store = f"pf[{P_SLOT}] = {rounded('sacc[i]')}"
    plain, score = tile_scores(spec, bidx, row, key, "sacc[i]", BM, BN)

    def step(sc: str) -> str:
        return (f"{_indent(fill, 4)}    for i in T.unroll({SB}):\n        sacc[i] = T.float32(0)\n"
                + _indent(s_block, 4) + _indent(_online_softmax(1, SB, OB, sc, "sacc[i]", p_store=p_store), 4)
                + _indent(pv_block, 4) + _indent(sync, 4))

    # the steps whose keys every row of the tile sees skip the mask
    keys = key_loop(spec, BM, BN, lambda masked: step(score if masked else plain))
    bases = ("" if S == 1 else
             'ks_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(ks[0]))\n'
             'vs_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(vs[0]))\n')
    out_at = f"out[{', '.join(spec.out_index(bidx, row, f'i // 4 * 8 + {t} * 2 + i % 2'))}]"
    body = f"""ks = T.alloc_buffer(({S * k_tile},), "float32", scope="shared.dyn", align=16)
vs = T.alloc_buffer(({S * v_tile},), "float32", scope="shared.dyn", align=16)
qf = T.alloc_buffer(({D // 2},), "float32", scope="local")
kf = T.alloc_buffer((2,), "float32", scope="local")
vf = T.alloc_buffer((2,), "float32", scope="local")
{_X3_BUFFERS if spec.x3 else ""}
pf = T.alloc_buffer(({SB},), "float32", scope="local")
sacc = T.alloc_buffer(({SB},), "float32", scope="local")
oacc = T.alloc_buffer(({OB},), "float32", scope="local")
mrow = T.alloc_buffer((2,), "float32", scope="local")
lrow = T.alloc_buffer((2,), "float32", scope="local")
red = T.alloc_buffer((2,), "float32", scope="local")
alpha = T.alloc_buffer((2,), "float32", scope="local")
{bases}{q_init}for i in T.unroll({OB}):
    oacc[i] = T.float32(0)
for h in T.unroll(2):
    mrow[h] = T.float32(-1e30)
    lrow[h] = T.float32(0)
{prologue}{keys}{_normalize_and_store(1, OB, out_at, "float32", f"{row} < {spec.seq_q}" if ragged_q else None)}"""
    return kernel(spec, cfg, params, body)


# x3's split fragments: a slice's A (big, small) and a B fragment's
_X3_BUFFERS = "".join(f'{name} = T.alloc_buffer(({n},), "float32", scope="local")\n'
                      for name, n in (("ab", 4), ("asm", 4), ("bb", 2), ("bsm", 2)))


def _split(dst_big: str, dst_small: str, x: str) -> str:
    """TVMScript splitting fp32 ``x`` into its TF32 parts: ``big`` (``x`` rounded) and ``small`` (the rest, rounded)."""
    return f"{dst_big} = {rna(x)}\n{dst_small} = {rna(f'({x}) - {dst_big}')}\n"


def _x3_block(outer: str, inner: str, a: str, b: str, reads: list, acc: tuple, mma: str) -> str:
    """An x3 kernel's loop of ``m16n8k8`` products over ``outer`` (A's slices: registers ``a + r]``, r < 4, split once a
    slice) and ``inner`` (B's fragments: the two ``reads`` from shared memory, split each): three mmas into ``acc``
    (buffer, offset) a fragment, the small products first: ``a.B``, ``A.b``, ``A.B``."""
    split_a = "".join(_split(f"ab[{r}]", f"asm[{r}]", f"{a} + {r}]") for r in range(4))
    split_b = "".join(_split(f"bb[{h}]", f"bsm[{h}]", read) for h, read in enumerate(reads))
    mmas = "".join(f"T.evaluate({mma.format(a=x, ao='0', b=y, c=acc[0], co=acc[1])})\n"
                   for x, y in (("asm", "bb"), ("ab", "bsm"), ("ab", "bb")))
    return f"for {outer}:\n" + _indent(split_a, 4) + f"    for {inner}:\n" + _indent(split_b + mmas, 8)
