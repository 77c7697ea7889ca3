"""The Hopper flash kernels' pieces: Q, K and V in 128-byte-swizzled shared tiles, S = QKᵀ and O += PV by
``wgmma``, and the overlapped variant that keeps the tensor cores busy across the softmax."""
from __future__ import annotations

import re

from tvmfuse.kernels.flash.config import FlashConfig
from tvmfuse.kernels.flash.softmax import (_flat, _indent, _normalize_and_store, _online_softmax, _score, key_steps,
                                           kv_index)
from tvmfuse.kernels.wgmma.layout import desc, tile_layout
from tvmfuse.kernels.wgmma.ptx import wgmma_issue
from tvmfuse.plan.attention import AttentionSpec


class _WgmmaTiles:
    """The Hopper kernels' shared tiles: one buffer ``hs`` holding Q (``block_m x d``) at 0, then ``slots`` K tiles
    and ``slots`` V tiles (each a multiple of 1024 bytes, the swizzle atom), all in wgmma's 128-byte swizzled
    layouts (:func:`tvmfuse.kernels.wgmma.layout.tile_layout`) and filled by 16-byte ``cp.async`` copies. One buffer
    because TVM's shared-memory planner does not see the wgmma descriptors' reads: as separate buffers it merged them and
    let K overwrite Q."""

    def __init__(self, spec: AttentionSpec, cfg: FlashConfig, bidx: list[str], slots: int):
        self.spec, self.cfg, self.bidx, self.kvidx = spec, cfg, bidx, kv_index(spec, bidx)
        D, DV, BN, BM = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m
        self.q_tile, self.k_tile, self.v_tile = BM * D, BN * D, BN * DV
        self.q_chunk, self.q_desc = tile_layout(128, True, BM, D)
        # K as stored: rows of keys (K-major for S = Q·Kᵀ) or [d, key] (N-major, read transposed)
        self.k_chunk, self.k_desc = tile_layout(128, spec.k_rows, BN, D)
        self.v_chunk, self.v_desc = tile_layout(128, False, DV, BN)
        self.q_base, self.k_base = 0, self.q_tile
        self.v_base = self.q_tile + slots * self.k_tile
        self.elems = self.q_tile + slots * (self.k_tile + self.v_tile)
        kvb = spec.kv_batch
        self.shapes = ((*spec.batch, spec.seq_q, D),
                       (*kvb, spec.seq_k, D) if spec.k_rows else (*kvb, D, spec.seq_k),
                       (*kvb, spec.seq_k, DV))

    def _copy(self, base: int, src: str, shape, tile_elems: int, chunk, index, slot: str) -> str:
        batch = self.bidx if src == "q" else self.kvidx
        nt = 32 * self.cfg.warps
        o, kx, off = chunk(f"(it * {nt} + tx)")
        return (f"for it in T.unroll({tile_elems // 8 // nt}):\n"
                f"    T.evaluate(T.s_tir.cp_async_raw('float16', hs.data, {base} + ({slot}) * {tile_elems} + {off}, "
                f"{src}.data, {_flat(shape, [*batch, *index(o, kx)])}, 16))\n")

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

    def pv_wgmma(self, pf: str | None, slot: str) -> str:
        """P (``pf``, fp16, packed into ``pu`` as the register A operand; None: ``pu`` holds it packed already)
        times V(slot) into ``oacc``, committed as one wgmma group."""
        BN, DV, SB = self.cfg.block_n, self.spec.head_dim_v, self.cfg.block_n // 2
        out = pack_p(pf, SB) if pf is not None else ""
        out += "T.evaluate(T.ptx.wgmma.fence.sync.aligned())\n"
        oaccs = ", ".join(f"oacc[{i}]" for i in range(DV // 2))
        for kv in range(BN // 16):
            v_off, v_lbo, v_sbo = self.v_desc(kv)
            out += wgmma_issue(DV, oaccs, ", ".join(f"pu[{kv * 4 + r}]" for r in range(4)),
                               desc("hs", f"{self.v_base} + ({slot}) * {self.v_tile} + {v_off}", v_lbo, v_sbo, 128),
                               "1, 1, 1")
        return out + "T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())\n"


def warpgroup_registers(scores: int, pf: int | None, ob: int) -> str:
    """A Hopper kernel's per-thread registers: ``scores`` fp32 scores, ``pf`` fp16 P values (None: none, P packed
    straight into ``pu``), P packed in pairs, O, and each of its two rows' max, sum, step max and rescale factor."""
    half = f'pf = T.alloc_buffer(({pf},), "float16", scope="local")\n' if pf is not None else ""
    sb = pf if pf is not None else scores
    return (f'sacc = T.alloc_buffer(({scores},), "float32", scope="local")\n{half}'
            f'pu = T.alloc_buffer(({sb // 2},), "uint32", scope="local")\n'
            f'oacc = T.alloc_buffer(({ob},), "float32", scope="local")\n'
            + "".join(f'{r} = T.alloc_buffer((2,), "float32", scope="local")\n'
                      for r in ("mrow", "lrow", "red", "alpha")))


def pack_p(src: str, n: int, pin: bool = False, rounded: bool = False) -> str:
    """P's ``n`` fp16 values (``src[i]``; ``rounded``: fp32 values, rounded to fp16) packed in pairs into ``pu``, the
    A operand's registers (``pin``: each passed through ``tvmfuse_pin``, so nvcc computes it before the next volatile
    asm, the wgmma fence, and ptxas injects no warpgroup.arrive)."""
    value = f"T.Cast('float16', {src}[{{i}}])" if rounded else f"{src}[{{i}}]"
    half = "T.Cast('uint32', T.call_pure_extern('uint16', '__half_as_ushort', " + value + "))"
    packed = f"{half.format(i='u * 2')} | ({half.format(i='u * 2 + 1')} << T.uint32(16))"
    if pin:
        packed = (f"T.cuda.func_call('tvmfuse_pin', {packed}, source_code=_TMA_SOURCE['tvmfuse_pin'], "
                  "return_type='uint32')")
    return f"for u in T.unroll({n // 2}):\n    pu[u] = {packed}\n"


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
    nsteps = key_steps(spec, cfg.block_m, cfg.block_n)
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
    nsteps = key_steps(spec, cfg.block_m, BN, multiple=2)   # causal: up to the diagonal, in whole pairs
    tiles = _WgmmaTiles(spec, cfg, bidx, 2)
    j = "(jj * 2 + par)"
    score = _score(spec, bidx, row, f"{j} * {BN} + i // 4 * 8 + {tig} * 2 + i % 2", f"sacc[par * {SB} + i]")
    visible = ("T.evaluate(T.ptx.fence.proxy.async_.shared__cta())\n"   # cp.async writes, seen by wgmma's async proxy
               "T.tvm_storage_sync('shared')\n")
    commit = "T.evaluate(T.ptx.cp.async_.commit_group())\n"

    def step(first: bool) -> str:
        """One key step; ``first``: the even step of its pair, whose successor always exists (the steps are taken
        in pairs), so it issues the next ``S`` and loads the next V unguarded."""
        def guard(cond: str, body: str) -> str:
            return body if first and cond == "1" else f"if {j} + {cond} < {nsteps}:\n" + _indent(body, 4)

        return ("T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))\n"
                "T.tvm_storage_sync('shared')\n"
                + guard("2", tiles.k_copy(f"{j} + 2", "par"))
                + guard("1", tiles.v_copy(f"{j} + 1", "1 - par"))
                + commit + "T.evaluate(T.ptx.cp.async_.wait_group(1))\n" + visible
                + guard("1", f"for i in T.unroll({SB}):\n    sacc[(1 - par) * {SB} + i] = T.float32(0)\n"
                        + tiles.s_wgmma("sacc", "1 - par", offset=f"(1 - par) * {SB} + "))
                + _online_softmax(1, SB, OB, score, f"sacc[par * {SB} + i]")
                + tiles.pv_wgmma("pf", "par"))

    if spec.causal:
        # a causal tile's pairs end at its diagonal, a count known only at run time. With that count as the loop's
        # extent ptxas could not prove the wgmma pipeline safe across the loop and serialized it (C7514/C7515); a
        # constant extent with the pairs past the diagonal skipped by a uniform branch keeps it asynchronous. The
        # two steps of a pair are written out, the even one's guards dropped: its successor always exists (TVM
        # proves that itself for a constant count, not here)
        pair = "".join(re.sub(r"\bpar\b", str(p), step(p == 0)) for p in (0, 1))
        loop = (f"for jj in T.serial({spec.seq_k // BN // 2}):\n"
                + _indent(f"if jj * 2 < {nsteps}:\n" + _indent(pair, 4), 4))
    else:
        pair = "for par in T.unroll(2):\n" + _indent(step(False), 4)
        loop = f"for jj in T.serial({nsteps} // 2):\n" + _indent(pair, 4)
    return f"""hs = T.alloc_buffer(({tiles.elems},), "float16", scope="shared.dyn", align=1024)
{warpgroup_registers(2 * SB, SB, OB)}{tiles.q_copy()}{tiles.k_copy("0", "0")}{tiles.v_copy("0", "0")}{commit}{tiles.k_copy("1", "1")}{commit}for i in T.unroll({OB}):
    oacc[i] = T.float32(0)
for h in T.unroll(2):
    mrow[h] = T.float32(-1e30)
    lrow[h] = T.float32(0)
for i in T.unroll({SB}):
    sacc[i] = T.float32(0)
T.evaluate(T.ptx.cp.async_.wait_group(1))
{visible}{tiles.s_wgmma("sacc", "0")}{loop}T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_normalize_and_store(1, OB, out_at)}"""
