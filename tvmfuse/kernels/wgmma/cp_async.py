"""The wgmma kernel whose tiles every thread copies by ``cp.async`` (and the entry point that picks the TMA
kernel for a TMA config)."""
from __future__ import annotations

from tvmfuse.kernels.ksplit import split_sum
from tvmfuse.kernels.wgmma.config import (WgmmaConfig, _a_predicated, _b_predicated, k_steps, kernel_shared_bytes,
                                          small_offset, tiles_n)
from tvmfuse.kernels.wgmma.layout import _a_read, _all, _batch_offsets, _tile_coords, tile_layout
from tvmfuse.kernels.wgmma.mma import _mma_and_store, a_fragments, promote
from tvmfuse.kernels.wgmma.ptx import (_ROUND_TF32_SOURCE, _SPLIT_TF32_SOURCE, _ZFILL_SOURCE, ROUND_TF32, SPLIT_TF32,
                                       ZFILL, _indent)
from tvmfuse.kernels.wgmma.spec import GemmSpec
from tvmfuse.kernels.wgmma.tma import tma_source


def tile_reads(spec: GemmSpec, cfg: WgmmaConfig, a: str, b: str, pid_m: str, pid_n: str, step: str) -> list:
    """How K step ``step`` of tile (``pid_m``, ``pid_n``) fills A's and B's shared tiles (``spec`` in 16-bit
    units): for each, (the source buffer, the tile's elements, the tile layout's ``chunk`` function, and
    ``glob(outer, k)``: the chunk's source as (a predicate, None where it always holds; its flat offset)). Rows
    past M (a partial last tile row), columns past N (a partial last tile column) and K past its end (a partial
    last step, in A and B alike: a zero times what lies past the end of the other could be 0 * inf) read as
    zeros."""
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    M, N, K = spec.rows, spec.n, spec.k
    tail = M % BM != 0
    k_inside = (lambda k: f"{step} * {BK} + {k} < {K}") if K % BK else (lambda k: None)
    _, b_batch = _batch_offsets(spec)

    def b_read(o: str, k: str) -> tuple[str | None, str]:
        col = f"{pid_n} * {BN} + {o}"
        pred = _all(([f"{col} < {N}"] if N % BN else []) + [p for p in (k_inside(k),) if p])
        if spec.b_kmajor:
            return pred, f"{b_batch} + ({col}) * {K} + {step} * {BK} + {k}"
        return pred, f"{b_batch} + ({step} * {BK} + {k}) * {N} + {col}"

    return [(a, BM * BK, tile_layout(cfg.swizzle, True, BM, BK)[0],
             lambda o, k: _a_read(spec, f"({pid_m} * {BM} + {o})", f"{step} * {BK}", k, tail, k_inside(k))),
            (b, BN * BK, tile_layout(cfg.swizzle, spec.b_kmajor, BN, BK)[0], b_read)]


def gemm_source(spec: GemmSpec, cfg: WgmmaConfig, params: list[str], a: str, b: str,
                store: str, sms: int | None = None, rounded: tuple = ()) -> str:
    """TVMScript of the kernel: ``params`` the function's parameter declarations, ``a`` / ``b`` the names of the
    A and B buffers among them, ``store`` the store of one accumulator, a format string with the fields
    ``{bz}`` (flattened batch index), ``{row}``, ``{col}`` (output row within the batch and column) and
    ``{acc}`` (the fp32 accumulator). A TF32 kernel (fp32 operands) is generated as an fp16 one of twice the K
    (:meth:`GemmSpec.halves`): the same bytes move, its wgmmas differ, and each thread rounds the tiles it copied to
    TF32 but those of the operands named in ``rounded`` (``"a"``, ``"b"``: rounded at compile time). A ``float32x3``
    kernel's threads split each chunk they copied into its TF32 parts instead, the small ones into a second set of
    stages :func:`small_offset` past the first, and each K step issues three wgmmas (:func:`_mma_and_store`)."""
    spec = spec.halves()
    if cfg.tma:
        return tma_source(spec, cfg, params, a, b, store, **({} if sms is None else {"sms": sms}))
    if cfg.split > 1 and (spec.grid_batch != 1 or "{acc0}" in store):
        raise ValueError(f"wgmma: a K split takes an unbatched GEMM or conv with one output a product ({cfg.name})")
    BM, BN, BK, S, MT, NT = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.m_tiles, cfg.threads
    M, N, K = spec.rows, spec.n, spec.k
    tiles_m, tn, kt = -(-M // BM), tiles_n(spec, cfg), k_steps(spec, cfg)
    F, D = cfg.inflight, cfg.split
    # a K split: block kz takes `per` K steps from kz * per (the last ones fewer, or none), `kt` of them here
    per = -(-kt // D)
    k0, count = ("", str(kt)) if D == 1 else (f"kz * {per} + ", f"T.max(T.min({per}, {kt} - kz * {per}), 0)")
    pid_m, pid_n = _tile_coords(spec, cfg)
    a_tile, b_tile = BM * BK, BN * BK
    a_chunk, _ = tile_layout(cfg.swizzle, True, BM, BK)
    b_chunk, _ = tile_layout(cfg.swizzle, spec.b_kmajor, BN, BK)
    # predicated copies in the main loop: branch-free
    zfill = bool(F) and (_a_predicated(spec, cfg) or _b_predicated(spec, cfg))
    # One shared allocation: A's stages at 0, B's at sb_at. (With two, TVM's shared-memory planner sees no use of
    # A's tiles in the main loop when its only accesses there are the zero-filling copies and the descriptors, and
    # lays B's tiles over A's: wrong results at 3 stages with a batch in flight on the H200.)
    sb_at = S * a_tile

    def shared_at(dst: int, slot: str, tile: int, off: str) -> str:
        """A chunk's shared-memory index (16-bit units): operand ``dst``'s stages, stage ``slot``, offset ``off``."""
        return f"{dst} + ({slot}) * {tile} + {off}" if dst else f"({slot}) * {tile} + {off}"

    def copies(slot: str, step: str, branch: bool = False) -> str:
        out = ""
        for dst, (src, tile, chunk, glob) in zip((0, sb_at), tile_reads(spec, cfg, a, b, pid_m, pid_n, step)):
            o, k, off = chunk(f"(it * {NT} + tx)")
            pred, at = glob(o, k)
            at_smem = shared_at(dst, slot, tile, off)
            # (the source offset counts the source's own elements: a TF32 kernel's fp32 operands halve it)
            src_at = at if spec.dtype == "float16" else f"({at}) // 2"
            copy = f"T.evaluate(T.s_tir.cp_async_raw('float16', smem.data, {at_smem}, {src}.data, {src_at}, 16))"
            if pred is not None and zfill and not branch:
                # 16 zero bytes where the element is not read, without a branch (with a batch in flight ptxas
                # serializes the wgmmas around one, C7514); the source offset is 0 there
                copy = (f"T.evaluate(T.cuda.func_call({ZFILL!r}, smem_base + T.uint32(({at_smem}) * 2), "
                        f"{src}.data, T.Select({pred}, {at}, 0), T.Cast('int32', {pred}), "
                        f"source_code={_ZFILL_SOURCE!r}))")
            elif pred is not None:   # 16 zero bytes where nothing is read (a conv's padding, past M, N or K)
                copy = (f"if {pred}:\n    {copy}\nelse:\n    for v in T.vectorized(8):\n"
                        f"        smem[{at_smem} + v] = T.float16(0)")
            out += f"for it in T.unroll({tile // 8 // NT}):\n{_indent(copy, 4)}"
        return out

    lo = small_offset(spec, cfg)

    def round_copied(slot: str) -> str:
        """TF32: the 16-byte chunks this thread copied into stage ``slot``, rounded in place once its copies have
        landed (a thread sees its own cp.async writes after its wait; the barrier after orders them for the
        wgmmas); ``float32x3``: split into their TF32 parts, the small ones ``lo`` further on."""
        out = ""
        for dst, tile, chunk in [t for name, t in (("a", (0, a_tile, a_chunk)), ("b", (sb_at, b_tile, b_chunk)))
                                 if (spec.x3 or name not in rounded) and not (name == "a" and cfg.a_regs)]:
            at_smem = shared_at(dst, slot, tile, chunk(f"(it * {NT} + tx)")[2])
            at = f"smem_base + T.uint32(({at_smem}) * 2)"
            call = (f"T.evaluate(T.cuda.func_call({SPLIT_TF32!r}, {at}, {at} + T.uint32({lo * 2}), "
                    f"source_code={_SPLIT_TF32_SOURCE!r}))" if spec.x3 else
                    f"T.evaluate(T.cuda.func_call({ROUND_TF32!r}, {at}, source_code={_ROUND_TF32_SOURCE!r}))")
            out += f"for it in T.unroll({tile // 8 // NT}):\n{_indent(call, 4)}"
        return out

    if spec.x3 and F:
        raise ValueError(f"wgmma: an x3 kernel sums each K step's products once they are done: no batch in flight "
                         f"({cfg.name})")
    # (x3: a K step's products, summed into acc once done)
    second = _indent(f'acc2 = T.alloc_buffer(({MT * BN // 2},), "float32", scope="local")\n'
                     f'for i in T.unroll({MT * BN // 2}):\n    acc2[i] = T.float32(0)\n', 16) if spec.x3 else ""
    # (A from registers: a thread's fragments of a K step, both parts, read through the stages' fp32 view)
    fragments = ""
    if cfg.a_regs:
        fragments, n_regs = a_fragments(spec, cfg), MT * BK // 16 * 4
        second += _indent(f'abig = T.alloc_buffer(({n_regs},), "uint32", scope="local")\n'
                          f'asmall = T.alloc_buffer(({n_regs},), "uint32", scope="local")\n'
                          f'smf = T.decl_buffer(({kernel_shared_bytes(spec, cfg) // 4},), "float32", data=smem.data, '
                          f'scope="shared.dyn")\n', 16)
    # a K split's blocks store fp32 partials; the sum's kernel applies the epilogue (`store`)
    partial = f"part[(kz * {M} + {{row}}) * {N} + {{col}}] = {{acc}}"
    wgmmas, stored = _mma_and_store(spec, cfg, store if D == 1 else partial, pid_m, pid_n, sb_at, small=lo)
    # Loads run L = S - 1 - F tiles ahead: a stage is refilled once the wgmma batches that read it are done
    # (with F batches left in flight at a step's end, the stage read F + 1 steps ago; the barrier at the top
    # of each step orders every warpgroup's wait before anyone's refill). One cp.async group per tile.
    L = S - 1 - F
    # (with fewer K steps than that, the missing tiles' groups are committed empty, so the waits keep counting)
    # (The prologue keeps the branches: outside the loop they serialize nothing, and TVM's shared-memory planner
    # needs a cp.async into sa that it recognizes, or it leaves sa out of the merged allocation.)
    def first(s_: int) -> str:   # the prologue's copy of step s_ of the block's
        if D == 1:
            return copies(str(s_), str(s_), branch=True) if s_ < kt else ""
        return f"if {s_} < {count}:\n" + _indent(copies(str(s_), f"({k0}{s_})", branch=True), 4)

    prologue = "".join(first(s_) + "T.evaluate(T.ptx.cp.async_.commit_group())\n" for s_ in range(L))
    tf32 = spec.tf32 and (spec.x3 or set(rounded) != {"a", "b"})
    base = ('smem_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(smem[0]))\n'
            if zfill or tf32 else "")
    # x3: each thread splits the tile it copied for step ko + 1 while step ko's wgmmas run (the split is, by count,
    # a third of the step's shared-memory traffic, serial before the wgmmas otherwise); the stage it rewrites is not
    # the one being read (ko % S), and past the last step it rewrites a stage no wgmma reads again: no branch.
    # TF32 rounds the step's own tile before its wgmmas, as a batch in flight may still read the next stage.
    ahead = spec.x3
    rounding = round_copied(f"ko % {S}") if tf32 and not ahead else ""
    landed = f"T.evaluate(T.ptx.cp.async_.wait_group({L - 1}))\n"
    if ahead:
        prologue += landed + round_copied("0")
        top, after = "", landed + round_copied(f"(ko + 1) % {S}")
    else:
        top, after = landed + rounding, ""
    if F:   # no branch while a batch is in flight across the step: ptxas serializes the wgmmas around one
        #     (C7514). Past the last tile the refill copies tile kt - 1 again, into a stage no later step reads
        last = f"{kt - 1}" if D == 1 else f"{count} - 1"
        refill = copies(f"(ko + {L}) % {S}", f"({k0}T.min(ko + {L}, {last}))")
    else:
        refill = f"if ko + {L} < {count}:\n" + _indent(copies(f"(ko + {L}) % {S}", f"({k0}ko + {L})"), 4)
    # (a staged epilogue's fp32 tile: the same shared memory as the stages, viewed as floats)
    staging = (f'{" " * 16}sacc = T.decl_buffer(({BM * cfg.staged_stride},), "float32", data=smem.data, '
               f'scope="shared.dyn")\n' if cfg.staged else "")
    # (a split GEMM is unbatched: nothing reads `bz`, so it has none; an assigned `bz = 0` would be a buffer that
    # TVMScript allocates in device memory and the host then writes: a segfault at launch)
    grid = (f'for bz in T.thread_binding({spec.grid_batch}, thread="blockIdx.y"):\n' if D == 1 else
            f'part = T.alloc_buffer(({D * M * N},), "float32")\n'
            f'for kz in T.thread_binding({D}, thread="blockIdx.y"):\n')
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
{_indent(grid, 4)}        for bx in T.thread_binding({tiles_m * tn}, thread="blockIdx.x"):
            for tx in T.thread_binding({NT}, thread="threadIdx.x"):
                smem = T.alloc_buffer(({kernel_shared_bytes(spec, cfg) // 2},), "float16", scope="shared.dyn",
                                      align=1024)
                acc = T.alloc_buffer(({MT * BN // 2},), "float32", scope="local")
{second}{staging}{_indent(base, 16)}                for i in T.unroll({MT * BN // 2}):
                    acc[i] = T.float32(0)
{_indent(prologue, 16)}                for ko in T.serial({count}):
{_indent(top, 20)}                    T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
                    T.tvm_storage_sync("shared")
{_indent(fragments, 20)}                    T.evaluate(T.ptx.wgmma.fence.sync.aligned())
{_indent(wgmmas, 20)}                    T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
{_indent(refill, 20)}                    T.evaluate(T.ptx.cp.async_.commit_group())
{_indent(after, 20)}                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned({F}))
{_indent(promote(spec, cfg), 20)}                T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_indent(stored, 16)}{_indent(split_sum(M, N, D, store) if D > 1 else '', 4)}"""

