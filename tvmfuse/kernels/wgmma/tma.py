"""The warp-specialized wgmma kernel whose tiles a producer warpgroup loads by TMA, stages handed over by
mbarriers."""
from __future__ import annotations

from tvmfuse.kernels.wgmma.config import WgmmaConfig, SMS, pixel_tile
from tvmfuse.kernels.wgmma.config import tiles_m as m_tiles_of
from tvmfuse.kernels.wgmma.layout import _pixel_origin, _tile_coords
from tvmfuse.kernels.wgmma.mma import _mma_and_store
from tvmfuse.kernels.wgmma.ptx import _indent, _ptx
from tvmfuse.kernels.wgmma.spec import GemmSpec


def tma_maps(spec: GemmSpec, cfg: WgmmaConfig) -> dict[str, dict]:
    """The TMA tensor maps of A and B, in the CUDA driver's order (innermost dimension first): ``dims`` (elements),
    ``strides`` (bytes, of every dimension but the first), ``box`` (elements of one load) and where the block's
    loads of K step ``j`` start, ``coords(pid_m, pid_n, j)`` -> a list of (element offset of the load in the
    stage's tile, [c0, c1, ..]) as TVMScript (``bz``: the batch index).

    A is 3-D ``[batch, rows, K]``, one ``[block_m, 64]`` box per step (batch 1 where it folds into the rows or is
    not batched); a conv's A is its NHWC input, 4-D, one ``[1, bh, bw, 64]`` box of input pixels per patch and
    step (the patch's output pixels shifted by the step's filter tap, 64 of its channels; :func:`pixel_tile`):
    padding and patches past the last image read outside the input, which TMA fills with zeros. B is ``[batch, N,
    K]`` (K-major, one ``[block_n, 64]`` box) or ``[batch, K, N]`` (one ``[64, 64]`` box per 64 columns). Each box
    lands in shared memory 128-byte swizzled: row ``r``'s 16-byte chunk ``c`` at chunk ``r * 8 + (c ^ r % 8)``,
    :func:`tile_layout`'s layout of the tile. Rows past the tensor read as zero. A TF32 kernel's fp32 operands
    are mapped as fp16 tensors of twice the K (:meth:`GemmSpec.halves`): the same bytes."""
    spec = spec.halves()
    BM, BN = cfg.block_m, cfg.block_n
    M, N, K = spec.rows, spec.n, spec.k
    a_rows, a_batch = (spec.m, spec.grid_batch) if spec.a_batched and not spec.fold_batch else (M, 1)
    b_batch = spec.grid_batch if spec.b_batched else 1
    az = "bz" if a_batch > 1 else "0"
    bz = "bz" if b_batch > 1 else "0"
    a = {"dims": [K, a_rows, a_batch], "strides": [2 * K, 2 * K * a_rows], "box": [64, BM, 1],
         "coords": lambda pm, pn, j: [(0, [f"{j} * 64", f"{pm} * {BM}", az])]}
    if spec.conv is not None:
        g = spec.conv
        bh, bw = pixel_tile(spec)
        cpt = g.c // 64   # K steps per filter tap
        (dh, dw), (pt, pl) = g.dilation, g.pad

        def conv_coords(pm, pn, j):
            out = []
            for q in range(BM // 64):   # the block's patches, one box each, 64 rows of the tile apart
                n, oh, ow = _pixel_origin(spec, f"({pm} * {BM // 64} + {q})")
                out.append((q * 64 * 64, [f"{j} % {cpt} * 64", f"{ow} + {j} // {cpt} % {g.s} * {dw} - {pl}",
                                          f"{oh} + {j} // {cpt} // {g.s} * {dh} - {pt}", n]))
            return out
        a = {"dims": [g.c, g.w, g.h, g.n], "strides": [2 * g.c, 2 * g.c * g.w, 2 * g.c * g.w * g.h],
             "box": [64, bw, bh, 1], "coords": conv_coords}
    if spec.b_kmajor:
        b = {"dims": [K, N, b_batch], "strides": [2 * K, 2 * K * N], "box": [64, BN, 1],
             "coords": lambda pm, pn, j: [(0, [f"{j} * 64", f"{pn} * {BN}", bz])]}
    else:
        b = {"dims": [N, K, b_batch], "strides": [2 * N, 2 * N * K], "box": [64, 64, 1],
             "coords": lambda pm, pn, j: [(nb * 64 * 64, [f"{pn} * {BN} + {nb * 64}", f"{j} * 64", bz])
                                          for nb in range(BN // 64)]}
    return {"a": a, "b": b}


def encode_map(name: str, buf: str, m: dict) -> str:
    """The host statements that encode tensor map ``{name}map`` of buffer ``buf`` (``m``: its ``dims``, ``strides``
    and ``box``, innermost first; fp16 elements, 128-byte swizzle), which a kernel takes as ``T.address_of``."""
    rank = len(m["dims"])
    args = [f"{name}map", f"{buf}.data", *map(str, m["dims"]), *map(str, m["strides"]), *map(str, m["box"]),
            *["1"] * rank]
    return (f"{name}map: T.let[T.handle('tensormap')] = T.tvm_stack_alloca('tensormap', 1)\n"
            f"T.evaluate(T.tensormap_encode_tiled({', '.join(args)}, descriptor_dtype='float16', "
            f"rank={rank}, swizzle=3))\n")


def tma_source(spec: GemmSpec, cfg: WgmmaConfig, params: list[str], a: str, b: str, store: str,
               sms: int = SMS) -> str:
    """TVMScript of the warp-specialized TMA kernel (:func:`gemm_source`'s arguments; a GEMM, or a stride-1 conv
    whose output pixels tile well, :func:`pixel_tile`).

    The host encodes A's and B's tensor maps (:func:`tma_maps`, 128-byte swizzle) before the launch; the kernel
    takes them by value (``const __grid_constant__ CUtensorMap``). Warpgroups ``0 .. warpgroups - 1`` compute;
    one thread of the last warpgroup produces. Stage ``s`` has two mbarriers: ``full[s]`` (the producer's arrival
    with the stage's byte count; TMA completes the bytes) and ``empty[s]`` (every computing thread arrives once the
    wgmma batch that read the stage is done). The producer waits for ``empty`` before refilling a stage; the
    computing warpgroups wait for ``full`` before their wgmmas, and no thread waits for the whole block inside the
    loop. The n-th completion of a barrier has phase parity ``n % 2``. A persistent kernel (``persistent`` 1)
    launches ``sms`` blocks (the target GPU's SMs; :data:`SMS`, the H200's, where none is known), each walking
    tiles ``bx, bx + grid, ..``; its barriers' phases run on across
    them, so the producer loads the next tile while the computing warpgroups store this one."""
    BM, BN, BK, S, F = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.inflight
    NC = 128 * cfg.warpgroups   # computing threads
    tiles_m, tiles_n, kt = m_tiles_of(spec, cfg), spec.n // BN, spec.k // BK
    tiles = tiles_m * tiles_n
    # blocks, and tiles per block: block bx takes tiles bx, bx + grid, ..; the barriers' phases run on across them
    # (step g = it * kt + k of the block's it-th tile)
    grid = min(tiles, int(sms)) if cfg.persistent else tiles
    per_block = -(-tiles // grid)
    pid_m, pid_n = _tile_coords(spec, cfg, f"(bx + it * {grid})")
    a_tile, b_tile = BM * BK, BN * BK
    sb_at = S * a_tile
    wgmmas, stored = _mma_and_store(spec, cfg, store, pid_m, pid_n, sb_at, step="g")
    maps = tma_maps(spec, cfg)
    bars = 2 * S * (a_tile + b_tile)   # byte offset of the mbarriers: full[0..S), then empty[0..S)

    def full(s: str) -> str:
        return f"smem_base + T.uint32({bars} + ({s}) * 8)"

    def empty(s: str) -> str:
        return f"smem_base + T.uint32({bars + 8 * S} + ({s}) * 8)"

    encode = "".join(encode_map(name, buf, maps[name]) for name, buf in (("a", a), ("b", b)))
    loads = _ptx("tvmfuse_mbar_expect_tx", full("s"), str(2 * (a_tile + b_tile)))
    for name, at in (("a", "0"), ("b", str(sb_at))):
        tile = a_tile if name == "a" else b_tile
        for off, coords in maps[name]["coords"](pid_m, pid_n, "k"):
            dst = f"smem_base + T.uint32(({at} + s * {tile} + {off}) * 2)"
            loads += _ptx(f"tvmfuse_tma_load_{len(coords)}d", dst, f"T.address_of({name}map)", *coords, full("s"))
    init = "".join(_ptx("tvmfuse_mbar_init", full(str(s)), "1") + _ptx("tvmfuse_mbar_init", empty(str(s)), str(NC))
                   for s in range(S)) + _ptx("tvmfuse_mbar_init_fence")
    # the stage read F steps ago is released once this step's wait leaves at most F batches in flight
    release = _ptx("tvmfuse_mbar_arrive_if", empty(f"(g + {S - F}) % {S}"), f"T.Cast('int32', g >= {F})")
    # two computing warpgroups: 384 threads leave 168 registers each, which spilled the 128 accumulators of a
    # 64 x 256 tile; the producer's registers go to them (one computing warpgroup has 255 already)
    take, give = ((_ptx("tvmfuse_regs_take").strip(), _ptx("tvmfuse_regs_give").strip()) if cfg.warpgroups == 2
                  else ("T.evaluate(0)", "T.evaluate(0)"))
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
{_indent(encode, 4)}    for bz in T.thread_binding({spec.grid_batch}, thread="blockIdx.y"):
        for bx in T.thread_binding({grid}, thread="blockIdx.x"):
            for tx in T.thread_binding({cfg.threads}, thread="threadIdx.x"):
                smem = T.alloc_buffer(({S * (a_tile + b_tile) + 8 * S},), "float16", scope="shared.dyn", align=1024)
                acc = T.alloc_buffer(({cfg.m_tiles * BN // 2},), "float32", scope="local")
                smem_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(smem[0]))
                if tx == 0:
                    # a store TVM's shared-memory planner sees, at the buffer's last element (the last mbarrier,
                    # initialized next): it drops an allocation only ever addressed (descriptors, TMA, mbarriers)
                    # and sizes one to its highest access, and the launch got no dynamic shared memory
                    smem[{S * (a_tile + b_tile) + 8 * S - 1}] = T.float16(0)
{_indent(init, 20)}                T.tvm_storage_sync("shared")
                if tx < {NC}:
                    {take}
                    for it in T.serial({per_block}):
                        if bx + it * {grid} < {tiles}:
                            for i in T.unroll({cfg.m_tiles * BN // 2}):
                                acc[i] = T.float32(0)
                            for ko in T.serial({kt}):
                                g: T.let[T.int32] = it * {kt} + ko
                                {_ptx("tvmfuse_mbar_wait", full(f"g % {S}"), f"g // {S} % 2").strip()}
                                T.evaluate(T.ptx.wgmma.fence.sync.aligned())
{_indent(wgmmas, 32)}                                T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
                                T.evaluate(T.ptx.wgmma.wait_group.sync.aligned({F}))
                                {release.strip()}
                            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
{_indent(stored, 28)}                else:
                    {give}
                    if tx == {NC}:
                        for it in T.serial({per_block}):
                            if bx + it * {grid} < {tiles}:
                                for k in T.serial({kt}):
                                    g: T.let[T.int32] = it * {kt} + k
                                    s: T.let[T.int32] = g % {S}
                                    if g >= {S}:
                                        {_ptx("tvmfuse_mbar_wait", empty("s"), f"(g // {S} + 1) % 2").strip()}
{_indent(loads, 36)}"""
