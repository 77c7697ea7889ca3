"""The tensor-core template for GEMM and conv kernels with a fused epilogue (fp16 in, fp32 accumulate).

MetaSchedule's stock tensor-core rule gave no usable candidate for our fp16 kernels in TVM 0.27: its
sketches either staged a whole K panel in shared memory (over any limit) or merged fp16 and fp32
dynamic shared buffers, which ``LowerIntrin`` rejects ("tvm_access_ptr element type must match").
This template builds the kernel the way CUTLASS-style kernels are built, with every size a
MetaSchedule decision:

1. Normalize the multiply-accumulate block to ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` (``reindex`` +
   ``transform_layout``; a conv becomes an implicit GEMM over its im2col indices) and pad I, J, K to
   whole tiles.
2. Tile: a thread block computes ``(warps_m * frags_m * 16) x (warps_n * frags_n * 16)`` outputs; each
   warp ``frags_m x frags_n`` 16x16 accumulator fragments; the K loop advances ``k_frags * 16`` per step.
3. A and B tiles go through dynamic shared memory with vectorized 16-byte loads in their global order,
   software-pipelined against the tensor-core work: double buffering through registers, or 3-4 stages
   filled by ``cp.async`` (one sketch each).
4. The wmma 16x16x16 fp16 -> fp32 intrinsics do the multiply-accumulate; the accumulators are staged
   per warp and the whole epilogue (cast, bias, activation, residual) is inlined into the one store.
"""
from __future__ import annotations

from tvmfuse.kernels.gemv.config import MAX_ROWS as GEMV_ROWS
from tvmfuse.kernels.gemv.kernel import schedule as gemv_sketch
from tvmfuse.kernels.knobs import Knob, names_in, sample
from tvmfuse.kernels.wgmma.sketch import schedule as wgmma_sketch

_MICRO = 16
_WARP = 32


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _pad_multiple(extent: int, cap: int) -> int:
    """Pad an axis to a multiple of 16 x (the largest power-of-two tile product that fits it, <= cap)."""
    return _MICRO * min(cap, max(1, _next_pow2(-(-extent // _MICRO))))


def template_gemm_tensorcore(sch, space, info: dict) -> list:
    """Schedule ``sch`` (one fused GEMM/conv kernel) on tensor cores; raises if the kernel does not fit.

    One sketch per value of the ``pipeline_stages`` knob (a structural choice, not a sampled number):
    2 = double buffering through registers; 3 or more = that many shared-memory stages filled by
    ``cp.async`` (asynchronous global->shared copies, Ampere and later); times one per value of
    ``intrinsics``: ``wmma`` (16x16x16 fragments, opaque layout, rows of the shared tiles padded) or ``mma``
    (``ldmatrix`` into TVM's warp-register layout + ``mma.sync`` m16n8k16, the instructions CUTLASS's sm80
    kernels use, shared tiles XOR-swizzled by TVM's ``InjectPermutedLayout`` where their rows allow).
    """
    stages = [int(v) for v in space.knobs["pipeline_stages"].values] if "pipeline_stages" in space.knobs else [2]
    kinds = [str(v) for v in space.knobs["intrinsics"].values] if "intrinsics" in space.knobs else ["wmma"]
    error = None
    s = sch.copy()
    gemv = gemv_sketch(s, space) if info.get("target_kind", "cuda") == "cuda" else None
    if gemv is not None and gemv.rows <= GEMV_ROWS:
        return [s]   # at most 16 rows (tvmfuse.kernels.gemv): the weight streamed once, no tile of padding rows
    # 17-64 rows of an fp16 [K, N] weight: the GEMV template's tensor-core kernel and, on sm_90a, wgmma's K split
    # (the untuned kernel there, wgmma.config.skinny_config: 1.1-1.5x faster at 32 and 64 rows, on the H100) are
    # both searched, and the measurements choose
    sketches = [s] if gemv is not None else []
    if "wgmma" in kinds:   # Hopper's wgmma template (tvmfuse.kernels.wgmma) where it fits
        kinds = [k for k in kinds if k != "wgmma"]
        if info.get("target_arch") == "sm_90a":
            s = sch.copy()
            spec = wgmma_sketch(s, space, info.get("sm_count"))
            if spec is not None:
                # no mma sketches beside it: a GEMM's wgmma kernel measured on the H200 at 2x them, and mma.sync
                # reaches about half of Hopper's wgmma peak. Convs ran beside them until their wgmma kernel had run:
                # every config of six drawn convs' spaces (40-418 each) built, ran and checked on the H100, and
                # ResNet-50, MobileNetV2 and EfficientNet-B0 run on it untuned. Beside them, a model-guided search
                # of a conv spent most of its trials on the mma sketches (benchmarks/search_replay.py)
                return sketches + [s]
    for kind, n in [(kind, n) for kind in kinds for n in stages]:
        s = sch.copy()
        try:
            _schedule(s, space, n, kind)
        except Exception as err:  # noqa: BLE001 - a pipeline depth this kernel cannot take: the others may
            error = err
            continue
        sketches.append(s)
    if not sketches:
        raise error
    return sketches


def _mma_group(out_dtype: str, trans_b: bool) -> dict:
    """``ldmatrix`` + ``mma.sync`` m16n8k16 intrinsics (TVM's), with a store into static shared memory (not
    among TVM's registered ones)."""
    from tvm.s_tir.tensor_intrin.cuda import get_mma_intrin_group

    from tvmfuse._tvm import register_mma_store

    group = get_mma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                 out_dtype=out_dtype, trans_a=False, trans_b=trans_b)
    return {**group, "store": register_mma_store(out_dtype)}


def _ldmatrix_layout(*idx):
    """A warp buffer's [.., rows, cols] -> [.., rows / 16, cols / 16, lane, element] (ldmatrix's 32 x 8)."""
    from tvm.s_tir.tensor_intrin.cuda import shared_16x16_to_ldmatrix_32x8_layout

    *lead, i, j = idx
    return (*lead, i // _MICRO, j // _MICRO, *shared_16x16_to_ldmatrix_32x8_layout(i % _MICRO, j % _MICRO))


def _schedule(sch, space, stages: int, intrinsics: str = "wmma") -> None:
    from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                             get_reduction_blocks)
    from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group


    root = sch.get_sblock("root")
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(root))
    if not reductions:
        raise ValueError("gemm template: no single multiply-accumulate block")
    main = reductions[0]
    stmt = sch.get(main)
    in_dtypes = {str(r.source.dtype) for r in stmt.reads}
    out_dtype = str(stmt.writes[0].source.dtype)
    if in_dtypes != {"float16"} or out_dtype not in ("float32", "float16"):
        raise ValueError(f"gemm template: needs fp16 inputs (got {sorted(in_dtypes)} -> {out_dtype})")

    # B as stored: contiguous along K (weights [N, K], conv filters) or along N (x @ W with W [K, N]). Shared
    # memory keeps B's global order so the global loads are coalesced 16-byte vectors, not gathers.
    reduce_vars = {str(iv.var.name) for iv in stmt.iter_vars if int(iv.iter_type) == 2}
    b_last = stmt.reads[1].region[-1].min
    b_k_contiguous = bool(names_in(b_last) & reduce_vars)

    knobs = space.knobs
    warps_m_k, warps_n_k = knobs["warps_m"], knobs["warps_n"]
    frags_m_k, frags_n_k = knobs["frags_m"], knobs["frags_n"]
    k_frags_k, vec_k = knobs["k_frags"], knobs["vector_lanes"]

    # 1. normalize to C[S, I, J] += A[S, I, K] * B[S, J, K]
    reindex_a = sch.reindex(main, ("read", 0))
    reindex_b = sch.reindex(main, ("read", 1))
    reindex_c = sch.reindex(main, ("write", 0))
    maps = get_index_map(sch.get(main))
    if maps is None:
        raise ValueError("gemm template: not a matmul-like access pattern")
    mm_map, a_map, b_map, c_map = maps
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    if not b_k_contiguous:
        sch.transform_layout(reindex_b, ("write", 0), lambda b, j, k: (b, k, j))
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, mm_map)
    _, i, j, k = sch.get_loops(main)
    extents = [int(sch.get(lp).extent) for lp in (i, j, k)]
    # tile products are powers of two up to 16 fragments (4 warps x 4 fragments); padding to those keeps
    # every split perfect, so tensorize never sees a predicate
    cap_i = max(int(w) for w in warps_m_k.values) * max(int(f) for f in frags_m_k.values)
    cap_j = max(int(w) for w in warps_n_k.values) * max(int(f) for f in frags_n_k.values)
    cap_k = max(int(v) for v in k_frags_k.values)
    pads = [_pad_multiple(extents[0], cap_i), _pad_multiple(extents[1], cap_j), _pad_multiple(extents[2], cap_k)]
    sch.pad_einsum(main, [1, *pads])
    fit_i, fit_j, fit_k = (p // _MICRO for p in pads)
    row_tiles_min = max(1, -(-extents[0] // pads[0]) * pads[0] // _MICRO // cap_i)  # block rows at the biggest tile

    def fitting(knob: Knob, limit: int) -> Knob:
        return knob.filtered(lambda v: int(v) <= limit)

    warps_m_k = fitting(warps_m_k, fit_i)
    frags_m_k = fitting(frags_m_k, fit_i // max(int(v) for v in warps_m_k.values))
    warps_n_k = fitting(warps_n_k, fit_j)
    frags_n_k = fitting(frags_n_k, fit_j // max(int(v) for v in warps_n_k.values))
    k_frags_k = fitting(k_frags_k, fit_k)

    batch, i, j, k = sch.get_loops(main)
    i, i_in = sch.split(i, [None, _MICRO])
    j, j_in = sch.split(j, [None, _MICRO])
    k, k_in = sch.split(k, [None, _MICRO])
    sch.reorder(i, j, k, i_in, j_in, k_in)
    inner = main
    outer = sch.blockize(i_in)

    # 2. tiles: [grid, warps, fragments per warp] on I and J, [steps, fragments per step] on K
    wm, fm = sample(sch, warps_m_k), sample(sch, frags_m_k)
    wn, fn = sample(sch, warps_n_k), sample(sch, frags_n_k)
    kf = sample(sch, k_frags_k)
    i0, i1, i2 = sch.split(i, [None, wm, fm])
    j0, j1, j2 = sch.split(j, [None, wn, fn])
    k0, k1 = sch.split(k, [None, kf])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(batch, "blockIdx.z")
    # block rasterization: consecutive blocks walk `group` tile rows down before moving right, so the blocks
    # in flight share B's column tiles in L2 instead of streaming all of B once per row of tiles
    group_k = knobs.get("raster_group", Knob("raster_group", (1,), (1.0,)))
    # the group must divide the tile rows whatever the tile: those counts are row_tiles_min x a power of two,
    # so it must divide row_tiles_min (a partial group is a predicate around the tensorized body, which
    # tensorize rejects: ResNet-50's 7x7 convs, 32 x 7 x 7 = 7 tile rows of 256, failed with group 4)
    group = sample(sch, group_k.filtered(lambda v: row_tiles_min % int(v) == 0))
    i0o, i0i = sch.split(i0, [None, group])
    sch.reorder(i0o, j0, i0i)
    sch.bind(sch.fuse(i0o, j0, i0i), "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    # 3. A and B through dynamic shared memory, vectorized, pipelined against the mma loop
    vec = sample(sch, vec_k)

    mma = intrinsics == "mma"
    # the permuted layout needs rows of 32 or more fp16 elements: A's rows are the K step (32 or 64); B's are
    # too when B is K-contiguous, else they are the block's N tile, which can be 16 (B then keeps padding)
    permuted = (mma, mma and b_k_contiguous)

    def to_shared(index: int):
        cache = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(cache, k0)
        fused = sch.fuse(*sch.get_loops(cache)[-2:])
        # the same decisions as the warp grid, so the copy's threadIdx.y matches the block's (wm * wn warps)
        _, ty_m, ty_n, tx, lanes = sch.split(fused, [None, wm, wn, _WARP, vec])
        sch.bind(sch.fuse(ty_m, ty_n), "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(lanes)
        if permuted[index]:  # ldmatrix reads through TVM's XOR-permuted layout (InjectPermutedLayout), unpadded
            sch.annotate(cache, "permuted_layout", f"g2s_{'AB'[index]}")
        else:  # pad rows: no bank conflicts on wmma fragment loads
            sch.storage_align(cache, 0, axis=-2, factor=16, offset=8)
        if stages == 2:  # global -> registers -> shared, the next tile's loads in flight during the mma loop
            sch.annotate(cache, "tirx.manifest_shared_memory_local_stage", 1)
            sch.annotate(cache, "double_buffer_scope", 0)
        return cache

    a_s = to_shared(0)
    b_s = to_shared(1)
    auto_inline_producers(sch, a_s)  # the im2col / reindex / padding copies read straight from global memory
    auto_inline_producers(sch, b_s)

    a_frag = sch.cache_read(outer, 0, "warp" if mma else "wmma.matrix_a")
    b_frag = sch.cache_read(outer, 1, "warp" if mma else "wmma.matrix_b")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)

    # 4. accumulators -> shared staging, one 16x16 fragment per warp at a time -> the epilogue, applied
    #    once, at the only global store. The staging buffer is static "shared": TVM 0.27's StorageRewrite
    #    would otherwise reuse the dead fp16 A/B tiles for it and break the wmma access pointers.
    acc_shared = sch.cache_write(outer, 0, "shared")
    sch.storage_align(acc_shared, 0, -2, 16, 4)
    acc = sch.cache_write(outer, 0, "warp" if mma else "wmma.accumulator")
    sch.reverse_compute_at(acc, warp)
    si, sj = sch.get_loops(acc)[-2:]
    si0, si1 = sch.split(si, [None, _MICRO])
    sj0, sj1 = sch.split(sj, [None, _MICRO])
    sch.reorder(si0, sj0, si1, sj1)
    sch.reverse_compute_at(acc_shared, sj0)
    init = sch.decompose_reduction(outer, k0)
    init_inner = sch.get_child_blocks(init)[0]

    if stages == 2:
        sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
    else:  # `stages - 1` tiles in flight through cp.async while the oldest one is multiplied
        # the K-step body, once the inner (fragment) pipeline is expanded: copy A, copy B, then the inner
        # prologue, steady loop and epilogue, which all read the tile the copies filled `stages - 1` steps ago
        last = stages - 1
        sch.annotate(k0, "software_pipeline_order", [0, 1, 2, 3, 4])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, last, last, last])
        sch.annotate(k0, "software_pipeline_async_stages", [0])
    sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])

    if mma:
        group = _mma_group(out_dtype, b_k_contiguous)
        sch.transform_layout(a_frag, ("write", 0), _ldmatrix_layout)
        sch.transform_layout(b_frag, ("write", 0), _ldmatrix_layout)
        sch.transform_layout(acc, ("read", 0), _ldmatrix_layout)
    else:
        group = get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared", in_dtype="float16",
                                      out_dtype=out_dtype, trans_b=b_k_contiguous)
    deferred = []  # ldmatrix tiles of permuted buffers: blockized after the epilogue is inlined (see below)
    for index, (frag, intrin) in enumerate(((a_frag, group["load_a"]), (b_frag, group["load_b"]))):
        fi, fj = sch.get_loops(frag)[-2:]
        fi0, fi1 = sch.split(fi, [None, _MICRO])
        fj0, fj1 = sch.split(fj, [None, _MICRO])
        sch.reorder(fi0, fj0, fi1, fj1)
        sch.unroll(fi0)
        sch.unroll(fj0)
        if permuted[index]:
            deferred.append(("AB"[index], fi1, intrin))
        else:
            sch.tensorize(fi1, intrin)
    sch.tensorize(sch.get_loops(init_inner)[-2], group["init"])
    sch.tensorize(sch.get_loops(acc)[-2], group["store"])
    sch.tensorize(sch.get_loops(inner)[-3], group["compute"])

    auto_inline_consumer_chain(sch, acc_shared)
    # the matching side of the permuted layout, each 16x16 ldmatrix tile as an annotated block (blockizing it
    # earlier makes the root scope stop being a stage pipeline, and the epilogue could no longer be inlined)
    for name, loop, intrin in deferred:
        tile = sch.blockize(loop)
        sch.annotate(tile, "permuted_layout", f"s2l_{name}")
        sch.tensorize(tile, intrin)
    fused = sch.fuse(*sch.get_loops(acc_shared)[-2:])
    _, tx, lanes = sch.split(fused, [None, _WARP, sample(sch, knobs["store_lanes"])])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lanes)
