"""The schedule rules an untuned GPU kernel gets: dlight's, some declined where they compute a kernel wrong or
slowly, and tvmfuse's own for whole-tensor and short reductions. Each rule is named in the reports by its
``source``."""
from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import NamedTuple

from tvmfuse._tvm import dlight, tvm

def _pads(func) -> bool:
    """Whether a scheduled kernel stages a padded copy of a buffer (dlight names them ``*_pad*``). TVM 0.27 has no
    Python TIR visitor; the kernel's TVMScript names its allocations."""
    return re.search(r"\b\w*_pad\w* = T\.sblock_alloc_buffer", func.script()) is not None


def _index_preserving_epilogue(func) -> bool:
    """Whether every block after a kernel's last reduction is elementwise on the reduction's result: a spatial
    block whose writes, and whose reads of the kernel's own intermediates, index exactly its own iteration
    variables in order, all of the reduction result's shape (a bias read as ``c[j]`` or a residual is an input and
    may be indexed as it likes). A transposing or reshaping epilogue (heads merged back) is not."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    root = sch.get_sblock("root")
    blocks = [sch.get(b) for b in sch.get_child_blocks(root)]
    reductions = [i for i, b in enumerate(blocks) if any(int(iv.iter_type) != 0 for iv in b.iter_vars)]
    if not reductions:
        return False
    last = reductions[-1]
    shape = [int(d) for d in blocks[last].writes[0].source.shape]
    local = {str(b.writes[0].source.name) for b in blocks} - {str(p.name) for p in func.params}

    def identity(region, ivs) -> bool:
        return ([int(d) for d in region.source.shape] == shape and len(region.region) == len(ivs)
                and all(r.min.same_as(v) and int(r.extent) == 1 for r, v in zip(region.region, ivs)))

    for b in blocks[last + 1:]:
        ivs = [iv.var for iv in b.iter_vars]
        if any(int(iv.iter_type) != 0 for iv in b.iter_vars):
            return False
        if not all(identity(w, ivs) for w in b.writes):
            return False
        if not all(identity(r, ivs) for r in b.reads if str(r.source.name) in local):
            return False
    return True


def _lower(mod, target):
    """Run TIR's default lowering on ``mod`` for ``target`` (no code generation) and return the lowered module:
    raises where a schedule does not lower, which some rules find only there."""
    lower = tvm.tirx.get_tir_pipeline("default")   # TVM 0.27: (lowering pass, host and device finalizers)
    with target:
        return (lower[0] if isinstance(lower, tuple) else lower)(tvm.tirx.transform.BindTarget(target)(mod))


# a thread's largest local array an untuned schedule may ask for, in elements: the schedules that compute a
# kernel right keep a few tiles of accumulators (at most 145 floats across the zoo at serving batches); a cache
# whose region TVM could not bound to the thread's share is the whole tensor (a short reduction with ConvNeXt's
# reshaping epilogue at batch 32: 8192 floats a thread), which spills or which the GPU refuses to launch
MAX_LOCAL_ELEMENTS = 1024


def local_elements(lowered) -> int:
    """The largest local array of any thread of a lowered module, in elements. Read from its TVMScript
    (``T.alloc_local``): TVM 0.27 has no Python TIR visitor."""
    text, most = lowered.script(), 0
    for m in re.finditer(r"T\.alloc_local\(\(", text):
        depth, end = 1, m.end()
        while depth and end < len(text):   # the shape tuple: up to its closing parenthesis
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        n = 1
        for d in re.findall(r"\d+", re.sub(r"\b(?:T\.)?u?int(?:8|16|32|64)\b", "", text[m.end():end])):
            n *= int(d)
        most = max(most, n)
    return most


class UnpaddedMatmul(dlight.gpu.Matmul):
    """dlight's Matmul rule, declined where it pads a GEMM whose epilogue is not elementwise on its result.

    Where it pads (an attention head's 16 or 80 columns to its 64), it inlines the kernel's epilogue into the
    write-back of the padded tile and guards it with the epilogue's index instead of the padded one: a
    transposing epilogue (heads merged back, ``matmul + transpose + reshape``) then writes the padding over
    other heads' results (relative error 0.67 on the H200). The other rules compute such a kernel correctly. With
    an index-preserving epilogue (bias, activation, residual) the epilogue's index is the padded tile's own, so
    the guard is right; declining those too left a GEMM whose N and K no tile divides (7674 x 11355 x 3294 fp16)
    on dlight's Fallback, one thread an output: 1.97 s untuned on the H200, where a searched schedule took 4.4 ms.
    """

    def apply(self, func, target, tunable):
        sch = super().apply(func, target, tunable)
        if isinstance(sch, list):
            sch = sch[0] if sch else None
        if sch is None or (_pads(sch.mod["main"]) and not _index_preserving_epilogue(func)):
            return None
        # some epilogues (T5's fp16 clamp: cast, isinf, where) leave it reading a staging buffer it never
        # allocates, which only TIR lowering finds: lower it here (no code generation) and pass on a failure
        try:
            _lower(sch.mod, target)
        except Exception:  # noqa: BLE001 - the schedule does not lower: the next rule takes the kernel
            return None
        return sch


class NarrowMatmul(dlight.gpu.Matmul):
    """dlight's Matmul rule with a tile of 16 or 32 columns, for the GEMMs :class:`UnpaddedMatmul` declines because
    its 64-column tile pads them under a transposing epilogue: attention's ``P @ V`` with its heads merged back
    (16-64 columns a head), in fp32, where no flash template takes attention.

    Those went to dlight's GeneralReduction, a block a few outputs with K split over its threads: BERT fp32 at
    8 x 512 tokens spent 806 of its 986 us in that one kernel on the H200. A tile that divides every axis pads
    nothing, so the epilogue's guard is the output's own; a kernel that no candidate tile divides, or that none
    spreads over MIN_BLOCKS blocks, is left to the rules after this one. Candidates keep dlight's 4 x 4 outputs a
    thread and 16-deep K steps."""

    source = "narrow-matmul"   # the schedule's name in the reports
    # (threads along rows, along columns): row tiles of 128, 64, 32 at 32 and 16 columns
    THREADS = ((16, 8), (8, 8), (32, 4), (16, 4), (8, 4))
    # the largest tile that still launches this many blocks (about two an SM of a 132-SM H200; default_gpu_rules
    # scales it to the target's SMs) is taken; a kernel that no tile spreads that wide (one attention of 128
    # tokens: a few blocks a head) stays with the rules after this one, whose blocks of one output each keep the
    # SMs busy there (the batch-1 zoo rows were measured so)
    MIN_BLOCKS = 256

    def __init__(self, min_blocks: int = MIN_BLOCKS):
        super().__init__()
        self._config = None
        self.min_blocks = min_blocks

    def get_configs(self, target):
        return self._config or super().get_configs(target)

    def apply(self, func, target, tunable):
        base = super().get_configs(target)
        for rows, cols in self.THREADS:
            self._config = replace(base, block_size_x=rows, block_size_y=cols, vthread_x=1, vthread_y=1,
                                   micro_size_x=4, micro_size_y=4)
            try:
                sch = super().apply(func, target, tunable)
            finally:
                self._config = None
            if isinstance(sch, list):
                sch = sch[0] if sch else None
            if sch is None:
                return None
            if _pads(sch.mod["main"]):
                continue
            try:
                _lower(sch.mod, target)
            except Exception:  # noqa: BLE001 - this tile does not lower: the next one
                continue
            if _grid_blocks(sch.mod["main"]) >= self.min_blocks:
                return sch
        return None


class SimtTile(NamedTuple):
    """A :class:`SimtMatmul` block tile: threads along I and J, and each thread's outputs along I and J in
    ``v_i`` x ``v_j`` groups (virtual threads) a block's threads-width apart, so that threads side by side read
    neighbouring rows of the staged tiles."""

    thr_i: int
    thr_j: int
    out_i: int
    out_j: int
    v_i: int = 1
    v_j: int = 1

    @property
    def rows(self) -> int:
        return self.thr_i * self.out_i * self.v_i

    @property
    def cols(self) -> int:
        return self.thr_j * self.out_j * self.v_j

    def name(self) -> str:
        return f"{self.rows}x{self.cols} t{self.thr_i}x{self.thr_j} o{self.out_i}x{self.out_j} v{self.v_i}x{self.v_j}"


class SimtMatmul:
    """fp32 GEMMs on the CUDA cores (no template takes them outside ``--precision tf32``): dlight's Matmul
    normalization (``C[S, I, J] += A[S, I, K] * B[S, J, K]``) and its shared-memory staging, with a tile chosen
    for the GEMM at hand and partial tiles predicated instead of padded.

    dlight's rule keeps one 32 x 64 tile of 4 x 4 outputs a thread, whose shared-memory reads (two a multiply-add)
    bound a thread's FMA rate, and pads every axis to it: a GEMM whose epilogue moves heads (``matmul + reshape +
    transpose``) and whose rows no tile divides (ViT's 8 x 197 tokens) was then declined by
    :class:`UnpaddedMatmul` and :class:`NarrowMatmul` and fell to dlight's GeneralReduction, a block per few
    outputs (ViT-B fp32 batch 8: 634 ms against torch.compile's 9.1 on the H100). Here a partial tile computes
    under ``T.where`` guards on the GEMM's own indices, so any epilogue is written only where the GEMM is, and
    the first tile of ``tiles`` no wider than the GEMM whose blocks give ``min_blocks`` SMs ``THREADS_AN_SM``
    threads each is taken; a GEMM that no tile spreads that wide is left to the rules after (at batch 1 their blocks
    of one output each fill the SMs).

    The untuned rules place it after :class:`NarrowMatmul`, for the GEMMs the rules before it decline: its tiles
    have been built (nvcc) but not yet timed against dlight's on a GPU (``benchmarks/simt_gemm_gpu.py``), so the
    fp32 GEMMs dlight's Matmul takes keep it."""

    source = "simt-matmul"   # the schedule's name in the reports
    TILES = (SimtTile(16, 16, 4, 4, 2, 2), SimtTile(8, 16, 4, 4, 2, 2), SimtTile(16, 16, 4, 4), SimtTile(8, 16, 4, 4),
             SimtTile(16, 8, 4, 4), SimtTile(16, 4, 4, 4))
    K_STEP = 16
    # a tile is taken where its blocks give every SM (min_blocks of them) this many threads: fewer leave the SMs idle,
    # where the rules after it (blocks of one output each) keep them busy
    THREADS_AN_SM = 256
    # the smallest extent along I and J of a GEMM it takes (a GEMV goes on to dlight's GEMV rule)
    MIN_EXTENT = 16

    def __init__(self, min_blocks: int = 132, tiles: tuple = TILES, min_extent: int = MIN_EXTENT):
        self.min_blocks, self.tiles, self.min_extent = min_blocks, tiles, min_extent

    def apply(self, func, target, tunable):
        from tvm.s_tir.dlight.gpu.matmul import get_in_out_dtypes, get_reduction_blocks

        sch = tvm.s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(sch.get_sblock("root")))
        if not reductions or len(reductions) != 1:
            return None
        if tuple(get_in_out_dtypes(sch.get(reductions[0]))) != ("float32", "float32"):
            return None
        dims = None
        for tile in self.tiles:
            if dims is not None and (tile.rows > dims[1] or tile.cols > dims[2]):
                continue   # wider than the GEMM (a head's 64 columns under 128): most of each block idle
            try:
                found = simt_matmul(func, target, tile, self.K_STEP, self.min_extent)
            except Exception:  # noqa: BLE001 - this tile does not schedule or lower: the next one
                continue
            if found is None:
                return None
            sch, dims = found
            threads = _grid_blocks(sch.mod["main"]) * tile.thr_i * tile.thr_j
            if tile.rows <= dims[1] and tile.cols <= dims[2] and threads >= self.min_blocks * self.THREADS_AN_SM:
                return sch
        return None   # too small to fill the SMs with tiles: the rules after (a block an output) fill them better


def simt_matmul(func, target, tile: SimtTile, k_step: int = SimtMatmul.K_STEP,
                min_extent: int = SimtMatmul.MIN_EXTENT):
    """(:class:`SimtMatmul`'s schedule of ``func`` with ``tile``, the GEMM's extents (S, I, J, K)), or None where
    ``func`` is no GEMM it takes (an axis under ``min_extent``); raises where the schedule does not apply or lower."""
    from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                             get_reduction_blocks)

    sch = tvm.s_tir.Schedule(func)
    main = get_reduction_blocks(sch, sch.get_child_blocks(sch.get_sblock("root")))[0]
    if not get_index_map(sch.get(main)):
        return None
    reindexed = [sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)), sch.reindex(main, ("write", 0))]
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(reindexed[0], ("write", 0), a_map)
    sch.transform_layout(reindexed[1], ("write", 0), b_map)
    sch.transform_layout(reindexed[2], ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    batch, i, j, k = sch.get_loops(main)
    extents = tuple(int(sch.get(lp).extent) for lp in (batch, i, j, k))
    if min(extents[1:3]) < min_extent:
        return None
    bi, vi, ti, ii = sch.split(i, [None, tile.v_i, tile.thr_i, tile.out_i])
    bj, vj, tj, ij = sch.split(j, [None, tile.v_j, tile.thr_j, tile.out_j])
    ko, ki = sch.split(k, [None, k_step])
    sch.reorder(bj, bi, vj, vi, tj, ti, ko, ki, ii, ij)
    sch.bind(sch.fuse(batch, bj), "blockIdx.y")
    sch.bind(bi, "blockIdx.x")
    sch.bind(vj, "vthread.y")
    sch.bind(vi, "vthread.x")
    sch.bind(tj, "threadIdx.y")
    sch.bind(ti, "threadIdx.x")
    sch.annotate(ti, ann_key="pragma_auto_unroll_max_step", ann_val=256)
    sch.annotate(ti, ann_key="pragma_unroll_explicit", ann_val=1)
    store = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(store, ti, preserve_unit_loops=True)
    for index in (0, 1):   # the K step's A and B tiles staged in shared memory by the block's threads together
        stage = sch.cache_read(main, index, "shared")
        auto_inline_producers(sch, stage)
        depth = len(sch.get_loops(stage))
        sch.compute_at(stage, ko, preserve_unit_loops=True)
        loops = sch.get_loops(stage)[-depth:]
        if _contiguous_outer(sch.get(stage)):
            loops[-2], loops[-1] = loops[-1], loops[-2]
            sch.reorder(*loops)
        _, tj_, ti_ = sch.split(sch.fuse(*loops), [None, tile.thr_j, tile.thr_i])   # side by side: coalesced
        sch.bind(tj_, "threadIdx.y")
        sch.bind(ti_, "threadIdx.x")
        sch.storage_align(stage, 0, axis=1, factor=32, offset=1)
    auto_inline_consumer_chain(sch, store)
    sch.decompose_reduction(main, ko)
    _lower(sch.mod, target)
    return sch, extents


def _contiguous_outer(stage) -> bool:
    """Whether a staging block's source is contiguous along its outer axis (the row or column index) rather than
    its inner one (K): a weight ``W[k, n]`` staged as ``B[n, k]``. Its loops are then swapped, so threads side by
    side read side by side in global memory."""
    src = stage.reads[0].region
    outer, inner = (iv.var for iv in stage.iter_vars[-2:])
    last = src[-1].min

    def uses(expr, var) -> bool:
        return var.same_as(expr) or any(uses(c, var) for c in _children(expr))

    return uses(last, outer) and not uses(last, inner)


def _children(expr) -> list:
    return [getattr(expr, f) for f in ("a", "b", "value") if hasattr(expr, f)]


def launch_extents(func) -> dict:
    """A scheduled kernel's thread tags and their largest extents (``{"blockIdx.x": 512, "threadIdx.x": 128}``),
    from its TVMScript's ``thread_binding`` loops and ``launch_thread`` statements (TVM 0.27 has no Python TIR
    visitor). A kernel launched twice (a split K, then its sum) gives each tag's largest."""
    text, extents = func.script(), {}
    found = re.findall(r'thread_binding\((?:0, )?(?:T\.int64\()?(\d+)\)?, thread="(\w+\.\w)"\)', text)
    found += [(n, tag) for tag, n in re.findall(r'launch_thread\("(\w+\.\w)", (?:T\.int64\()?(\d+)', text)]
    for n, tag in found:
        extents[tag] = max(extents.get(tag, 1), int(n))
    return extents


def _grid_blocks(func) -> int:
    """The thread blocks a scheduled kernel launches: the product of its ``blockIdx`` extents."""
    return functools.reduce(lambda a, b: a * b,
                            (n for tag, n in launch_extents(func).items() if tag.startswith("blockIdx")), 1)


@functools.lru_cache(maxsize=64)   # (the three reduction rules ask it of one kernel in turn)
def _guarded_epilogue(func) -> bool:
    """Whether a kernel's blocks after its last reduction write through a condition on their index (an im2col
    epilogue padding a 10-channel GEMV result to the next GEMM's 64 columns): dlight's GEMV rule wrote such a
    kernel wrong on the H200 (EfficientNet-B0 fp16's squeeze-excitation, relative error 0.72). Read from the
    TVMScript: TVM 0.27 has no Python TIR visitor."""
    text = func.script()
    last = max(text.rfind('R"'), text.rfind("T.axis.reduce"))
    return last >= 0 and "T.if_then_else(" in text[last:]


class _NoGuardedEpilogue:
    """A dlight reduction rule, declined for a kernel with a guarded epilogue (see ``_guarded_epilogue``):
    dlight's Fallback computes those correctly, an output element a thread."""

    def __init__(self, rule):
        self.rule = rule

    def apply(self, func, target, tunable):
        return None if _guarded_epilogue(func) else self.rule.apply(func, target, tunable)

    def __getattr__(self, name):
        return getattr(self.rule, name)


class WholeReduction:
    """A kernel whose one reduction reduces a whole tensor to one element (T5's "is any element infinite" flag,
    a global max or sum), with scalar epilogues: one thread block, each of its threads accumulates a strided
    slice in a register (consecutive threads read consecutive elements), the block's threads then meet in a
    cross-thread reduction (warp shuffles), and thread 0 computes the epilogues.

    dlight's reduction rules need an output axis to spread over threads: given none they reduced the whole
    tensor in one thread with its accumulator in global memory (T5 fp16 at 2 x 128 tokens: 227 ms a call for
    16384 elements on the H200). One block reads at a fraction of HBM's bandwidth; these flags are small
    beside the GEMMs around them."""

    max_threads = 1024
    source = "whole-reduction"   # the schedule's name in the reports

    @classmethod
    def takes(cls, func, target) -> bool:
        """Whether the untuned build gives ``func`` this schedule (the first of :func:`default_gpu_rules`)."""
        with target:
            return cls().apply(func, target, False) is not None

    def apply(self, func, target, tunable):
        sch = tvm.s_tir.Schedule(func)
        root = sch.get_sblock("root")
        blocks = sch.get_child_blocks(root)
        kinds = [[int(iv.iter_type) for iv in sch.get(b).iter_vars] for b in blocks]
        reducing = [i for i, k in enumerate(kinds) if any(t != 0 for t in k)]
        if len(reducing) != 1 or not _one_element(sch.get(blocks[reducing[0]]).writes[0].source):
            return None
        red = blocks[reducing[0]]
        if any(not all(_one_element(w.source) for w in sch.get(b).writes) for b in blocks[reducing[0] + 1:]):
            return None
        try:
            for b in reversed(blocks[:reducing[0]]):   # elementwise producers: computed where they are read
                sch.compute_inline(b)
            for b in sch.get_child_blocks(root)[1:-1]:   # scalar intermediates of the epilogue
                try:
                    sch.compute_inline(b)
                except Exception:  # noqa: BLE001 - an epilogue block that stays a block of its own
                    pass
            loops = sch.get_loops(red)
            size = functools.reduce(lambda a, b: a * b, (int(sch.get(lp).extent) for lp in loops), 1)
            threads = max(32, min(self.max_threads, 1 << (size - 1).bit_length()))
            strided, lane = sch.split(sch.fuse(*loops) if len(loops) > 1 else loops[0], [None, threads])
            sch.reorder(lane, strided)
            sch.bind(lane, "threadIdx.x")
            block = sch.add_unit_loop(lane)
            sch.bind(block, "blockIdx.x")
            if sch.get(red).writes[0].source.same_as(next(
                    (b for b in sch.get(root).alloc_buffers if b.same_as(sch.get(red).writes[0].source)), None)):
                sch.set_scope(red, 0, "local")   # an intermediate: the reduced value stays in the threads
            for b in sch.get_child_blocks(root)[1:]:
                sch.reverse_compute_at(b, block)
            _lower(sch.mod, target)
        except Exception:  # noqa: BLE001 - a kernel this schedule does not fit: the next rule takes it
            return None
        return sch


class ShortReduction:
    """A kernel whose every reduction sums at most ``max_elements`` elements an output (a depthwise conv's 3x3
    window, a GEMM over 16-64 channels): one output a thread, blocks of ``threads``, the sum in a register, the
    epilogue computed by the same thread (a kernel whose epilogue's indices do not allow it goes to the next rule).

    dlight's rules spread a reduction over a block's threads: a depthwise 3x3 conv of MobileNetV2 (1 x 3 x 64 x 64,
    fp32) took one 256-thread block per output element for its 9 products (36864 blocks, 31 us on the H200), and a
    GEMM over 16 channels the same; its Fallback keeps the accumulator in global memory."""

    max_elements = 64
    threads = 256
    source = "short-reduction"   # the schedule's name in the reports
    few_outputs = 1 << 18   # about 8 waves of 256-thread blocks over the H200's 132 SMs (scaled to the target's)

    def __init__(self, max_outputs: int | None = None, vector: int = 1):
        # vector > 1: a thread takes that many adjacent outputs along the innermost output axis, its loads and stores
        # one vector each where they are contiguous (a channels-last depthwise conv with HWIO filters: a tap's
        # input and filter channels side by side); an axis it does not divide keeps one output a thread. On the
        # H100 (benchmarks/short_reduction_gpu.py, EfficientNet-B0 fp16 batch 32) 4 lanes ran its 12 depthwise
        # convs 1.0-2.0x faster than 1 (72.4 -> 36.2 us at 112^2 x 32), its 11 kernels of [32, 1, 1, C] outputs
        # 0.65-1.4x (those few-output kernels keep 1); 8 lanes failed at run time. OHWI filters, 50 bytes apart a tap
        # across the lanes, had made 4 lanes up to 2.6x slower
        self.max_outputs, self.vector = max_outputs, vector

    def apply(self, func, target, tunable):
        from tvm.s_tir.dlight.analysis import normalize_prim_func
        from tvm.s_tir.dlight.base import try_inline

        sch = tvm.s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reducing = [b for b in infos if "R" in b.dom_kind()]
        if not reducing or any(_reduced_elements(sch, b) > self.max_elements or "O" in b.dom_kind()
                               for b in reducing):
            return None
        if self.max_outputs is not None and any(_outputs(sch, b) > self.max_outputs for b in reducing):
            return None
        try:
            infos = try_inline(sch, infos)
            pending, stores = [], []
            for info in infos:
                block, kinds = info.block_rv, info.dom_kind()
                loops = sch.get_loops(block)
                s_loops = [lp for lp, k in zip(loops, kinds) if k == "S"] or [sch.add_unit_loop(block)]
                r_loops = [lp for lp, k in zip(loops, kinds) if k == "R"]
                if pending and not r_loops:
                    # the epilogue by the thread that holds its sum (indices that do not line up raise: the
                    # sum would need a global buffer of the kernel's own, which CUDA cannot allocate)
                    sch.reverse_compute_at(block, pending[-1][0])
                    if pending[-1][1] > 1:
                        sch.vectorize(sch.get_loops(block)[-1])
                    continue
                lanes = self.vector if int(sch.get(s_loops[-1]).extent) % self.vector == 0 else 1
                vec = []
                if lanes > 1:
                    s_loops[-1], lane = sch.split(s_loops[-1], [None, lanes])
                    vec = [lane]
                sch.reorder(*s_loops, *r_loops, *vec)
                bx, tx = sch.split(sch.fuse(*s_loops), [None, self.threads])
                sch.bind(bx, "blockIdx.x")
                sch.bind(tx, "threadIdx.x")
                for lane in vec:
                    sch.vectorize(lane)
                if r_loops:
                    acc = sch.cache_write(block, 0, "local")
                    sch.reverse_compute_at(acc, tx)
                    if vec:
                        sch.vectorize(sch.get_loops(acc)[-1])
                    sch.decompose_reduction(block, r_loops[0])
                    pending.append((tx, lanes))
                    stores.append(acc)
            root = sch.get(sch.get_sblock("root"))
            for acc in stores:   # a sum the epilogue reads: from the register, never stored (CUDA has no global scratch)
                if any(b.same_as(sch.get(acc).writes[0].source) for b in root.alloc_buffers):
                    sch.compute_inline(acc)
            _lower(sch.mod, target)
        except Exception:  # noqa: BLE001 - a kernel this schedule does not fit: the next rule takes it
            return None
        return sch


def _extent_product(sch, info, kind: str) -> int:
    """The product of a block's loop extents of ``kind`` ("S" spatial, "R" reduction); huge when not constant."""
    n = 1
    for lp, k in zip(sch.get_loops(info.block_rv), info.dom_kind()):
        if k == kind:
            extent = sch.get(lp).extent
            if not isinstance(extent, (int, tvm.tirx.IntImm)):
                return 1 << 62
            n *= int(extent)
    return n


def _reduced_elements(sch, info) -> int:
    """The elements one output of a block sums."""
    return _extent_product(sch, info, "R")


def _outputs(sch, info) -> int:
    """The outputs a block computes."""
    return _extent_product(sch, info, "S")


def _one_element(buffer) -> bool:
    return all(isinstance(d, (int, tvm.tirx.IntImm)) and int(d) == 1 for d in buffer.shape)


# the SMs of the GPU the rules' thresholds were measured on (the H200)
MEASURED_SMS = 132


def default_gpu_rules(sm_count: int = MEASURED_SMS) -> tuple:
    """dlight's default GPU schedule rules, in the order an untuned build applies them, their thresholds in waves
    over ``sm_count`` SMs (the target's: ``tvmfuse.target.device_figures``)."""
    scale = sm_count / MEASURED_SMS
    # a short reduction one output a thread: first where its outputs are few (a GEMM over 16-64 channels of a few
    # pixels, which dlight's matmul tiles into 1-8 blocks), after the matmul rule where they are many (its tiles
    # reuse each operand across a block; one output a thread reads both operands K times an output)
    # (many outputs: 4 a thread, see ShortReduction's vector)
    return (WholeReduction(), ShortReduction(max_outputs=round(ShortReduction.few_outputs * scale)),
            UnpaddedMatmul(), ShortReduction(vector=4), NarrowMatmul(round(NarrowMatmul.MIN_BLOCKS * scale)),
            SimtMatmul(sm_count), _NoGuardedEpilogue(dlight.gpu.GEMV()),
            _NoGuardedEpilogue(dlight.gpu.Reduction()), _NoGuardedEpilogue(dlight.gpu.GeneralReduction()),
            dlight.gpu.Fallback())


def reference_schedule(mod, target, *, is_gpu: bool):
    """The schedule kernels are checked against: TVM's plain lowering on CPUs; on GPUs dlight's Fallback
    alone (every output element by one thread, reductions in order), simple enough to trust where the
    tiling rules are not (see UnpaddedMatmul)."""
    if not is_gpu:
        return tvm.s_tir.Schedule(mod)
    with target:
        sch = dlight.gpu.Fallback().apply(mod["main"], target, False)
    return sch[0] if isinstance(sch, list) else sch


def default_schedule(mod, target, *, is_gpu: bool, sm_count: int = MEASURED_SMS):
    """The traced schedule an untuned build gives ``mod`` (the first of :func:`default_gpu_rules` that takes it on
    GPUs, TVM's plain lowering, an empty trace, on CPUs), or None when no rule applies."""
    if not is_gpu:
        return tvm.s_tir.Schedule(mod)
    return default_gpu_schedule(mod, target, sm_count)[0]


def _dlight_source(rule) -> str:
    """A dlight rule's name in the reports: ``dlight-matmul``, ``dlight-gemv``, ``dlight-general-reduction``,
    ``dlight-fallback``... (a big GEMM on GeneralReduction or Fallback is a slow kernel the report should show)."""
    name = type(getattr(rule, "rule", rule)).__name__.removeprefix("Unpadded")
    return "dlight-" + re.sub(r"(?<=[a-z])(?=[A-Z])", "-", name).lower()


def default_gpu_schedule(mod, target, sm_count: int = MEASURED_SMS):
    """(schedule, source) of the first of :func:`default_gpu_rules` that takes ``mod``: the source names the rule
    as the reports do (``whole-reduction``, ``short-reduction``, ``simt-matmul``, ``dlight-matmul``,
    ``dlight-general-reduction``...); (None, "dlight") when none does."""
    func = mod["main"]
    with target:
        for rule in default_gpu_rules(sm_count):
            try:
                sch = rule.apply(func, target, False)
            except Exception:  # noqa: BLE001 - a rule that cannot take this kernel: the next one
                continue
            if isinstance(sch, list):
                sch = sch[0] if sch else None
            if sch is None:
                continue
            try:
                if local_elements(_lower(sch.mod, target)) > MAX_LOCAL_ELEMENTS:
                    continue   # a per-thread cache of far more than the thread's share: the next rule
            except Exception:  # noqa: BLE001 - a schedule that does not lower: the next rule
                continue
            return sch, getattr(rule, "source", None) or _dlight_source(rule)
    return None, "dlight"
