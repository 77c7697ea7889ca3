"""The row-reduction template's sketches: reductions over the last axis, each row reduced by its own threads, its
row staged in shared memory, in registers, or re-read by every pass; or, where the row program takes the kernel, the
row program's sketch alone."""
from __future__ import annotations

from tvmfuse.kernels.knobs import Knob, sample
from tvmfuse.kernels.rows import program_sketch
from tvmfuse.kernels.sketch import DATA_PAR, REDUCE, inline_all_but_outputs, iter_types
from tvmfuse.kernels.staging import dtype_bytes, fuse_leading, stage_through_registers, vector_knob


def _flatten_rows(s, shape: list[int]) -> None:
    """Give every block of a row kernel with more than one leading axis (softmax over [B, H, S, S]) a single
    row iterator: ``(i0, ..., i_{n-2}, k) -> (row, k)``.

    Computing the per-row blocks at a loop fused from several leading loops otherwise makes TVM estimate
    their regions from the fused index's divisions and modulos, which gives loops with min/max extents
    that can no longer be bound to threads.
    """
    lead = shape[:-1]
    if len(lead) < 2:
        return
    # the intermediates (per-row statistics, staged rows) first: a fused row must index them directly, or
    # compute_at cannot invert the division/modulo that would address them
    root = s.get_sblock("root")
    local = {str(buf.name) for buf in s.get(root).alloc_buffers}
    for b in s.get_child_blocks(root):
        buf = s.get(b).writes[0].source
        dims = [int(d) for d in buf.shape]
        if str(buf.name) in local and dims[:len(lead)] == lead:
            s.transform_layout(b, ("write", 0), fuse_leading(dims, len(lead)))
    for b in s.get_child_blocks(root):
        ivs = s.get(b).iter_vars
        if len(ivs) != len(shape) or [int(iv.dom.extent) for iv in ivs[:-1]] != lead:
            continue
        if any(int(iv.iter_type) != DATA_PAR for iv in ivs[:-1]):
            continue
        s.transform_block_layout(b, fuse_leading(shape, len(lead)))


def _split_columns(s, loop, threads, lanes, contiguous: bool):
    """Split a row's column loop into (thread, vector step, lanes) loops, returned in that order. Contiguous:
    column = (thread, step, lane), each thread a slice of its own (what keeps a row in registers); else
    column = (step, thread, lane), each step's vectors contiguous across the threads (coalesced)."""
    if contiguous:
        return tuple(s.split(loop, [threads, None, lanes]))
    step, lane = s.split(loop, [None, lanes])
    step, tx = s.split(step, [None, threads])
    return tx, step, lane


def template_row_reduction(sch, space, info: dict) -> list:
    """Reductions over the last axis: ``rows_per_block`` rows per thread block (threadIdx.y), each reduced by
    its own ``threads`` threads (a row per warp at 32).

    Sketch ``shared``: the row (the prologue's result, or the input the reductions read) is staged in
    shared memory with vectorized loads, the reductions read it from there (cross-thread reductions
    lower to warp shuffles), the epilogue writes with vectorized stores. Sketch ``registers``: the same
    rows staged in registers instead: each thread owns a contiguous ``cols / threads`` slice of its row
    (at most ``row_register_elements``), loaded once with vector loads; every pass reads the thread's
    own registers, and only the cross-thread reductions meet (warp shuffles, one small shared buffer):
    one read and one write of HBM per element, no shared-memory passes or barriers between them.
    Sketch ``recompute``: no staging, each pass re-reads the inputs. Sketch ``program``: the row program
    (``tvmfuse.kernels.rows``); where it takes the kernel on CUDA it is the only sketch.
    """
    storages = list(space.knobs.get("row_storage", Knob("row_storage", ("shared", "recompute"), (0.5, 0.5))).values)
    if "program" in storages and info.get("target_kind") == "cuda":
        # where the row program takes the kernel it is the only sketch: its configs hold the row in registers,
        # stage it in shared memory or re-read it through L2, and on the H200 its best beat the schedule-based
        # sketches' on every kernel both took (softmax 65536 x 2048: 165 against 184 us, add+LayerNorm 16384 x 8192:
        # 188 against 201). Beside it, a search spent most trials on those sketches: 27 of 33 in a replay of
        # drawn row shapes (benchmarks/search_replay.py), where its neighbours in the program's configs went untried
        program = program_sketch(sch, space, info)
        if program is not None:
            return [program]
    root = sch.get_sblock("root")
    outs = sch.get_output_blocks(root)
    if len(outs) != 1:
        raise ValueError("row_reduction template: needs one output block")
    out_name = sch.get(outs[0]).name_hint
    out_buf = sch.get(outs[0]).writes[0].source
    shape = [int(d) for d in out_buf.shape]
    if len(shape) < 2 or any(t != DATA_PAR for t in iter_types(sch, outs[0])):
        raise ValueError("row_reduction template: output must be a spatial block with >= 2 dims")
    cols = shape[-1]
    ebytes = dtype_bytes(out_buf.dtype)
    # full-row spatial blocks read by a reduction: candidates for staging (the prologue, e.g. x + r)
    prologue = []
    for b in sch.get_child_blocks(root):
        name = sch.get(b).name_hint
        if name == out_name or REDUCE in iter_types(sch, b):
            continue
        wbuf = sch.get(b).writes[0].source
        if [int(d) for d in wbuf.shape] == shape and any(REDUCE in iter_types(sch, c) for c in sch.get_consumers(b)):
            prologue.append((name, wbuf))
    # (Softmax's exp(x - max) is staged too, written over x in place. Recomputing it from the staged x in the
    # sum and output passes instead removes a barrier per step, but ran 1.26x slower on the H200:
    # 232 vs 184 us at 32 threads x 1 row, 65536 x 2048.)
    max_shared = int(space.extra.get("max_shared_bytes", 49152))
    sketches = []
    for storage in storages:
        if storage == "program":
            continue
        s = sch.copy()
        in_registers = storage == "registers"
        staging = storage == "shared" or in_registers
        scope = "local" if in_registers else "shared"
        keep = {n for n, _ in prologue} if staging else set()
        inline_all_but_outputs(s, keep=keep)
        root_s = s.get_sblock("root")
        _flatten_rows(s, shape)
        blocks = s.get_child_blocks(root_s)
        out = s.get_sblock(out_name)
        reds = [b for b in blocks if REDUCE in iter_types(s, b)]
        if not reds:
            raise ValueError("row_reduction template: no reduction left")
        staged_bytes = 0
        staged = []
        if staging:
            for b in blocks:
                if s.get(b).name_hint in keep:
                    s.set_scope(b, 0, scope)
                    staged.append(b)
                    staged_bytes += cols * dtype_bytes(s.get(b).writes[0].source.dtype)
            # Full-row inputs a reduction reads straight from HBM are staged too (softmax's max reads x before
            # its exp prologue exists; RMSNorm's sum of squares reads x): each is then read from HBM once,
            # with vector loads, and every later pass reads shared memory (unstaged, softmax's max pass reads x
            # with 2-byte loads and the exp pass reads it again).
            for red in reds:
                for region in s.get(red).reads:
                    src = region.source
                    if [int(d) for d in src.shape] != shape or src.scope() != "global":
                        continue
                    cb = s.cache_read(red, str(src.name), scope)  # every consumer reads the staged row
                    staged.append(cb)
                    staged_bytes += cols * dtype_bytes(src.dtype)
            if not staged or (storage == "shared" and staged_bytes > max_shared):
                continue
        # the row loop: fuse the output's leading loops; rows_per_block rows share a block (threadIdx.y)
        loops = s.get_loops(out)
        row = s.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        n_rows = int(s.get(row).extent)
        col = s.get_loops(out)[-1]
        threads_k = space.knobs["threads"].filtered(lambda t: int(t) <= max(32, cols))
        vec_k = vector_knob(space.knobs["vector_lanes"], cols, max(ebytes, 2))
        if in_registers:
            # each thread's slice: whole vectors (of the widest lanes, so any sampled width divides it), and
            # at most row_register_elements per staged row
            widest = max(int(v) for v in vec_k.values)
            most = int(space.extra.get("row_register_elements", 64))
            threads_k = threads_k.filtered(lambda t: cols % (int(t) * widest) == 0 and cols // int(t) <= most)
            if not threads_k.values:
                continue
        threads = sample(s, threads_k)
        vec = sample(s, vec_k)
        tx, co, lanes = _split_columns(s, col, threads, vec, in_registers)
        rows_k = space.knobs.get("rows_per_block")
        ty = None
        if rows_k is not None:
            per_row = max(1, staged_bytes)
            rows_k = rows_k.filtered(lambda r: n_rows % int(r) == 0 and int(r) * per_row <= max_shared)
            rpb = sample(s, rows_k)
            row, ty = s.split(row, [None, rpb])
            s.bind(ty, "threadIdx.y")
        s.bind(row, "blockIdx.x")
        s.bind(tx, "threadIdx.x")
        # Sketch `recompute` computes each row's producers under its threadIdx.y loop. Sketch `shared` cannot:
        # a shared buffer is visible to the whole block, so compute_at relaxes threadIdx.y and every warp would
        # compute every row of the block (the H200: 2 rows per block ran 1.3-1.6x slower, 4 rows
        # 2.6-3x). Its producers go under the block loop instead, their row loop bound to threadIdx.y: each
        # warp group stages and reduces its own row, and more rows are in flight per SM than one-row blocks
        # (at most 32 resident per SM) allow.
        anchor = ty if ty is not None and storage != "shared" else row
        for b in reversed([b for b in s.get_child_blocks(root_s) if s.get(b).name_hint != out_name]):
            s.compute_at(b, anchor, preserve_unit_loops=True)
        for b in s.get_child_blocks(root_s):
            name = s.get(b).name_hint
            if name == out_name:
                continue
            if ty is not None and anchor is row:
                rows = s.get_loops(b)[1]  # the block's own rows (rows_per_block of them), when it is per row
                if int(s.get(rows).extent) == int(s.get(ty).extent) and len(s.get_loops(b)) > 2:
                    s.bind(rows, "threadIdx.y")
            types = iter_types(s, b)
            inner = s.get_loops(b)[-1]
            if REDUCE in types:
                s.set_scope(b, 0, "local")
                if in_registers:   # over the thread's own slice, then across the threads
                    rtx, _ = s.split(inner, [threads, None])
                else:
                    _, rtx = s.split(inner, [None, threads])
                s.bind(rtx, "threadIdx.x")
            else:
                btx, _, bl = _split_columns(s, inner, threads, vec, in_registers)
                s.bind(btx, "threadIdx.x")
                s.vectorize(bl)
        # the epilogue: vector loads of its row operands into registers, scalar math, one vector store
        red_out = {str(s.get(b).writes[0].source.name) for b in s.get_child_blocks(root_s)
                   if REDUCE in iter_types(s, b)}
        row_reads = [str(r.source.name) for r in s.get(out).reads
                     if str(r.source.name) not in red_out and len(r.source.shape) >= 1
                     and int(r.source.shape[-1]) == cols]
        stage_through_registers(s, out, co if in_registers else tx, lanes, reads=row_reads, flatten=False)
        if "unroll" in space.knobs:
            s.annotate(root_s, "meta_schedule.unroll_explicit", sample(s, space.knobs["unroll"]))
        sketches.append(s)
    if not sketches:
        raise ValueError("row_reduction template: no sketch fits")
    return sketches
