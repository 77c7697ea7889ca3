"""The CPU default schedules: every kernel parallel over its outer loops and vectorised along its innermost
contiguous axis at the target's vector width, written with traceable schedule primitives (so the tuner keeps
the default as a record, and a tuned build is never slower than it).

* pointwise: the chain inlined into its outputs; each output's loops fused, the inner ``lanes`` vectorised, the
  rest parallel;
* contractions (GEMM, batched GEMM, a conv in any layout, depthwise too): the output tiled into register blocks
  (a block of rows times a vector tile of the innermost output axis, up to two vectors wide), the reduction loops
  between the tile loops and the register block, the accumulators kept in a tile-sized buffer that the epilogue
  (bias, activation, residual) reads once the tile is done, the tile loops fused and parallel (weight-block first
  where the weight outweighs the other input, so each thread streams its share of the weight once; a ragged row
  tile, the last one guarded, where no tile divides the row); up to 14 accumulators with AVX-512's 32 registers,
  12 with 16; a depthwise conv of more than two vectors of channels one pixel at a time over all of them, that
  loop left to LLVM's vectoriser; a grouped conv's vector tile within one group (output channels no vector divides
  are padded by the planner: ``plan/rewrites/pad_channels.py``);
* a single reduction over the innermost axes (a mean, a global pooling): the output's row loops fused and
  parallel, every other block computed at the row, the row's elementwise loops vectorised;
* several reductions of a row along the output's innermost axis (softmax, LayerNorm, RMSNorm): the same, with the
  single-use elementwise steps inlined and each reduction split into a vector of partial results (``rfactor``).
  With llvm's fast ``exp`` (``plan/fastmath.py``) GPT-2's attention softmax (1x4x128x128) went from 377 us a
  call in TVM's plain lowering to 62-101 us, its LayerNorms from 11 to 4 us (2 cores, loaded machine). A softmax
  along an outer axis keeps the plain lowering.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tvmfuse._tvm import tvm
from tvmfuse.kernels.cpu.concat import concat_chunk
from tvmfuse.kernels.knobs import names_in
from tvmfuse.kernels.sketch import DATA_PAR, REDUCE, inline_all_but_outputs, iter_types

# the most channels a depthwise conv's one tile takes (MobileNetV2's 960 at 2x2 pixels)
MAX_DEPTHWISE_TILE = 1024

# below this many multiply-adds (or elements of a pointwise kernel) a kernel runs on one thread: waking the pool's
# threads costs a few microseconds, more than such a kernel takes
MIN_PARALLEL_WORK = 1 << 15


def _extent(sch, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tvm.tirx.IntImm) else None


def _vector_tile(extent: int, lanes: int, vectors: int = 2) -> int:
    """The innermost tile: up to ``vectors`` whole vectors where they divide the axis (most first), else one, else
    the largest divisor up to two vectors (a 7-wide axis is one 7-lane vector: LLVM splits it into legal parts)."""
    for t in [v * lanes for v in range(vectors, 1, -1)] + [lanes, lanes // 2, lanes // 4]:
        if t >= 4 and extent % t == 0:
            return t
    if extent <= 2 * lanes:
        return extent
    return max(d for d in range(1, 2 * lanes + 1) if extent % d == 0)


def longest_rows(registers: int) -> int:
    """The most register rows a tile takes: 14 with AVX-512's 32 vector registers, 8 with 16
    (:func:`contraction_tiles`)."""
    return 14 if registers >= 32 else 8


def row_tile(extent: int, most: int) -> int:
    return next(t for t in range(most, 0, -1) if extent % t == 0)


def vectorize_last(sch, block, lanes: int) -> None:
    """Vectorise the innermost loop of ``block`` (split to ``lanes`` where it is longer and divides), if it is
    spatial and at most two vectors long."""
    loops = sch.get_loops(block)
    if not loops:
        return
    ext = _extent(sch, loops[-1])
    if ext is None or ext <= 1:
        return
    if ext > 2 * lanes:
        if ext % lanes:
            return
        loops = list(sch.split(loops[-1], [None, lanes]))
    sch.vectorize(loops[-1])


def dtype_bits(sch, block) -> int:
    return int(tvm.runtime.DataType(str(sch.get(block).writes[0].source.dtype)).bits)


# the most chunks a concatenation's innermost axis is unrolled into (DenseNet-121's widest: 1024 channels of 32)
MAX_CONCAT_CHUNKS = 64


def _schedule_concat(sch, block, loops, lanes: int) -> bool:
    """A concatenation along the innermost axis (:func:`concat_chunk`): that axis in chunks of one input each,
    unrolled, so each chunk's selection is a constant and its loads plain vectors (DenseNet-121's concat + BN +
    ReLU kernels, 1x56x56x224 of six inputs: 0.30-0.41 ms with the select chain in every lane, 0.055 ms in chunks).
    False where the chunks are no whole vectors or too many to unroll."""
    chunk = concat_chunk(sch, block)
    last = _extent(sch, loops[-1]) or 0
    if chunk is None or chunk % lanes or last // chunk > MAX_CONCAT_CHUNKS:
        return False
    outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    chunks, within = sch.split(loops[-1], [None, chunk])
    _, vec = sch.split(within, [None, lanes])
    sch.vectorize(vec)
    sch.unroll(chunks)
    if (_extent(sch, outer) or 0) * last >= MIN_PARALLEL_WORK:
        sch.parallel(outer)
    return True


def schedule_pointwise(sch, lanes_of, cores: int) -> None:
    inline_all_but_outputs(sch)
    for block in sch.get_output_blocks(sch.get_sblock("root")):
        pointwise_block(sch, block, lanes_of(dtype_bits(sch, block)), cores)


def pointwise_block(sch, block, lanes: int, cores: int) -> None:
    """One elementwise block under its own loops: parallel over the outer ones, vectorised along the innermost."""
    loops = sch.get_loops(block)
    last = _extent(sch, loops[-1]) or 0
    if len(loops) > 1 and _schedule_concat(sch, block, loops, lanes):
        return
    if len(loops) > 1 and last % lanes == 0 and last >= 4 * lanes:
        # a long innermost axis is split on its own and the outer ones fused: fusing it too leaves each lane's
        # index a division and remainder of the fused one, which LLVM gathers lane by lane (a channel
        # concatenation's select then ran 5x slower than TVM's scalar loop)
        inner = next(t for t in (lanes * 4, lanes * 2, lanes) if last % t == 0)
        outer_loops = [sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]]
        rows, vec = sch.split(loops[-1], [None, inner])
        if inner > lanes:
            _, vec = sch.split(vec, [None, lanes])
        sch.vectorize(vec)
        if (_extent(sch, outer_loops[0]) or 0) * last >= MIN_PARALLEL_WORK:
            sch.parallel(outer_loops[0])
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    ext = _extent(sch, fused) or 0
    inner = next((t for t in (lanes * 4, lanes * 2, lanes) if ext % t == 0 and ext // t >= cores), None)
    if inner is None:
        if ext >= MIN_PARALLEL_WORK:
            sch.parallel(fused)
        return
    outer, vec = sch.split(fused, [None, inner])
    if ext >= MIN_PARALLEL_WORK:
        sch.parallel(outer)
    if inner > lanes:
        _, vec = sch.split(vec, [None, lanes])
    sch.vectorize(vec)


def is_contraction(sch, block) -> bool:
    """A multiply-accumulate: two tensors read with the reduction variables (a GEMM, a conv)."""
    b = sch.get(block)
    rvars = {str(iv.var.name) for iv in b.iter_vars if int(iv.iter_type) == REDUCE}
    with_r = {r.source.name for r in b.reads if any(names_in(rg.min) & rvars for rg in r.region)}
    return len(with_r) >= 2


def loops_are_iters(sch, block) -> bool:
    """The block's loops are its iteration variables one to one, in order (a planner kernel before scheduling)."""
    loops = sch.get_loops(block)
    b = sch.get(block)
    if len(loops) != len(b.iter_vars):
        return False
    return all(int(iv.dom.extent) == _extent(sch, lp) for iv, lp in zip(b.iter_vars, loops))


def inner_spatial_extent(sch, block) -> int:
    b = sch.get(block)
    spatial = [iv for iv in b.iter_vars if int(iv.iter_type) == DATA_PAR]
    return int(spatial[-1].dom.extent) if spatial and isinstance(spatial[-1].dom.extent, tvm.tirx.IntImm) else 0


def _buffer_bytes(buf) -> int:
    n = int(tvm.runtime.DataType(str(buf.dtype)).bits) // 8
    for e in buf.shape:
        n *= int(e) if isinstance(e, tvm.tirx.IntImm) else 1
    return n


def _reduced_reads(sch, block) -> tuple[str | None, list]:
    """The output's innermost spatial variable (None: no spatial axis) and, for each tensor ``block`` reads with
    its reduction variables, (the variables its indices use, the tensor, its indices' text)."""
    b = sch.get(block)
    ivs = list(b.iter_vars)
    spatial = [iv for iv in ivs if int(iv.iter_type) == DATA_PAR]
    rvars = {str(iv.var.name) for iv in ivs if int(iv.iter_type) == REDUCE}
    reads = []
    for r in b.reads:
        used = set().union(*(names_in(rg.min) for rg in r.region)) if r.region else set()
        if used & rvars:
            reads.append((used, r.source, " ".join(str(rg.min) for rg in r.region)))
    return (str(spatial[-1].var.name) if spatial else None), reads


def weight_heavy(sch, block) -> bool:
    """The contraction's weight (the tensor read along the output's innermost axis and the reduction) is larger
    than its other input: a late conv of a CNN at few pixels, a GEMV. Its tiles then run weight-block first, each
    thread streaming its own share of the weight once (a block re-read from L1/L2 for every pixel tile), where the
    pixel tiles outermost stream the whole weight from memory again for each of them, on every thread."""
    inner, reads = _reduced_reads(sch, block)
    if inner is None:
        return False
    weight = max((_buffer_bytes(buf) for used, buf, _ in reads if inner in used), default=0)
    other = max((_buffer_bytes(buf) for used, buf, _ in reads if inner not in used), default=0)
    return weight > other > 0


def group_width(sch, block) -> int | None:
    """The output channels of one group of a grouped conv (``K`` in its input's channel index
    ``ff // K * C + rc``), or None: no grouped conv (a depthwise conv reads its input at ``ff`` itself)."""
    return _group_width(*_reduced_reads(sch, block))


def _group_width(inner: str | None, reads: list) -> int | None:
    if inner is None:
        return None
    pattern = re.compile(rf"\b{re.escape(inner)} // (?:T\.int(?:32|64)\()?(\d+)")
    widths = [int(m.group(1)) for used, _, text in reads if inner in used for m in pattern.finditer(text)]
    return max(widths) if widths and max(widths) > 1 else None


def channelwise(sch, block) -> bool:
    """Whether the contraction ``block`` reads both tensors it reduces over along the output's innermost axis too,
    each channel its own window: a depthwise conv, where that axis is no GEMM column that a weight row broadcasts
    over (a pooling, one tensor, is not; nor a grouped conv, whose groups are GEMMs: :func:`group_width`)."""
    inner, reads = _reduced_reads(sch, block)
    return inner is not None and len(reads) >= 2 and all(inner in used for used, _, _ in reads) \
        and _group_width(inner, reads) is None


@dataclass(frozen=True)
class ContractionFacts:
    """What the register block's rules read of a contraction besides its extents (:func:`contraction_tiles`)."""

    whole: bool              # the outputs keep every element it computes (:func:`result_kept_whole`)
    depthwise: bool          # :func:`channelwise`
    group: int | None        # :func:`group_width`


def contraction_facts(sch, block) -> ContractionFacts:
    return ContractionFacts(result_kept_whole(sch, block), channelwise(sch, block), group_width(sch, block))


def default_tiles(exts: list[int], lanes: int, registers: int, facts: ContractionFacts) -> dict[int, int]:
    """The rules' register block (:func:`contraction_tiles`) for a contraction of these ``facts``."""
    return contraction_tiles(exts, lanes, registers, ragged=facts.whole, depthwise=facts.depthwise,
                             group=facts.group)


def left_to_llvm(tile, extent: int, lanes: int, depthwise: bool) -> bool:
    """Whether the innermost tile is a depthwise conv's tile over all its channels past two vectors, whose loop the
    rules leave to LLVM's loop vectoriser (TVM's own vectors over that many lanes went through the stack)."""
    return depthwise and isinstance(tile, int) and tile == extent > 2 * lanes


def row_axis_of(exts: list[int]) -> int | None:
    """The register block's rows: the nearest spatial axis outside the innermost one that is longer than 1 (the
    GEMM's M, a conv's width), or None (a GEMV)."""
    return next((i for i in range(len(exts) - 2, -1, -1) if exts[i] > 1), None)


def contraction_tiles(exts: list[int], lanes: int, registers: int = 16, ragged: bool = True,
                      depthwise: bool = False, group: int | None = None) -> dict[int, int]:
    """The register block of a contraction whose spatial extents are ``exts`` (the output's innermost axis last), on
    a target with ``registers`` vector registers: spatial axis index -> tile (absent: 1). ``ragged``: whether a row
    tile may leave the last tile partial (not where the outputs keep part of the result:
    :func:`result_kept_whole`). ``depthwise``: the innermost axis is a depthwise conv's channels
    (:func:`channelwise`); ``group``: a grouped conv's output channels a group (:func:`group_width`)."""
    row_axis = row_axis_of(exts)
    if depthwise and 2 * lanes < exts[-1] <= MAX_DEPTHWISE_TILE:
        # a depthwise conv: one tile over all its channels, one pixel, the channel loop left to LLVM's loop
        # vectoriser (:func:`left_to_llvm`). On the 2-core EPYC, hot: MobileNetV3's 5x5 depthwise convs at
        # 14x14x240 and 7x7x576 48 -> 26 and 37 -> 16 us, its 3x3 at 28x28x72 31 -> 10 us, MobileNetV2's at
        # 16x16x144 9.5 -> 8.4 us. Rows of 16-lane vectors ran load-bound; channels no vector divides (ShuffleNet's
        # 58, 116, 232) took 29- or 4-lane vectors; TVM's own vectors over many lanes (240) went through the stack,
        # and several guarded tiles fell off the vectoriser (10-30x slower). Up to two vectors of channels keep the
        # rows below: MnasNet's 24 at 56x56 pixels, 8 lanes by 14 pixels 13 us, all 24 channels a pixel 28 us
        return {len(exts) - 1: exts[-1]}
    # a GEMV (one row) has registers to spare: up to 5 vectors a tile, so each step of the reduction reads whole
    # cache lines of the weight's row (a MobileNetV2 classifier, 1x1280 by 1280x1000: 8-wide tiles read half lines)
    vt = _vector_tile(exts[-1], lanes, 5 if row_axis is None else 2)
    if group:
        # a grouped conv: the vector tile within one group, so its lanes read one input channel (a broadcast); a
        # tile across groups gathers. ResNeXt-50's 3x3 convs on the 2-core EPYC: 4 channels a group 1.65 ms ->
        # 0.26 ms (4 lanes), 16 a group 1.74 ms -> 59 us (16 lanes); at 8 a group 1.48-1.79 ms across groups,
        # 122-135 us at 8 lanes
        vt = next(t for t in (2 * lanes, lanes, lanes // 2, lanes // 4, 2, 1) if t >= 1 and group % t == 0)
    if row_axis is None and vt < 2 * lanes and lanes % 2 == 0 and not group:
        # a GEMV whose width no two whole vectors divide (1000 classes: one 8-lane vector) ran one accumulator
        # chain, an FMA's latency a step (MobileNetV2's classifier: 85 us hot, onnxruntime's 47); half-vector
        # multiples give it several chains (40 lanes: 52-59 us on the 2-core EPYC)
        vt = next((t for t in range(5 * lanes, 2 * lanes, -(lanes // 2)) if exts[-1] % t == 0), vt)
    # accumulators a tile may hold, in rows. With 16 vector registers (AVX2), 12 accumulators leave room for the
    # weight's vectors and the broadcast input; half-width vectors leave registers for more rows (SqueezeNet's
    # 1000-channel 1x1 conv at 3x3 pixels: all 9 pixels, twice as fast as 3 rows). AVX-512's 32 registers take
    # 14: two vectors of 7 pixels or one of 14 (SqueezeNet's 3x3 convs at 14x14 and 7x7 pixels, 2-core EPYC:
    # 10-14% faster than 12 or 7). A longer or ragged block fell off a cliff there (16 accumulators, a ragged
    # 8-row tile of the 29-pixel stem: 3x slower), so ragged tiles keep the 16-register caps.
    wide = registers >= 32
    cap = 12 if vt * 2 <= lanes else (14 if wide else 8) if vt <= lanes else (7 if wide else 6)
    ragged_cap = 12 if vt * 2 <= lanes else 8 if vt <= lanes else 6
    longest = longest_rows(registers)
    tiles = {len(exts) - 1: vt}
    if row_axis is not None:
        tiles[row_axis] = row_tile(exts[row_axis], min(cap, longest))
        # one vector and more rows where two vectors leave few: a 7- or 14-pixel conv row takes 7 rows of one
        # vector (7 accumulators) rather than 1 or 2 rows of two (2 or 4); a two-vector tile can hold 6 rows
        one = row_tile(exts[row_axis], longest)
        if vt == 2 * lanes and one > 2 * tiles[row_axis]:
            vt, cap = lanes, longest
            tiles = {len(exts) - 1: vt, row_axis: one}
        elif tiles[row_axis] == 1 and ragged:
            # no row tile divides the axis (29 pixels, a prime): a ragged tile, the last one guarded, with the least
            # padding (29: 6 rows, one wasted); one row of a single vector chain ran SqueezeNet's first conv
            # (29x29x96, 7x7 over 3 channels) at a quarter of this speed: 3 accumulators cannot hide the FMA latency
            tiles[row_axis] = min(range(ragged_cap, 3, -1),
                                  key=lambda t: (-(-exts[row_axis] // t) * t - exts[row_axis], -t))
        # an axis taken whole (a 1x1 conv's width at 2x2 pixels) leaves accumulators free: the next outer axis
        # fills them, so each weight vector loaded serves every pixel of the block (else each row of pixels
        # streams the whole weight again)
        outer = next((i for i in range(row_axis - 1, -1, -1) if exts[i] > 1), None)
        if tiles[row_axis] == exts[row_axis] and outer is not None and cap // tiles[row_axis] >= 2:
            if (t := row_tile(exts[outer], min(cap // tiles[row_axis], longest))) > 1:
                tiles[outer] = t
    return tiles


def result_kept_whole(sch, block) -> bool:
    """Whether the kernel's outputs hold every element the contraction ``block`` computes. Where they keep part of
    it (a slice of the channels a padded weight added: ``plan/rewrites/pad_channels.py``), TVM's inlining of the
    epilogue into a tile's write-back replaced the ragged tile's row guard by the slice's channel guard, and the last
    tile wrote rows past the output's end (heap corruption): such kernels take only tiles that divide their axes."""
    computed = _buffer_bytes(sch.get(block).writes[0].source)
    root = sch.get_sblock("root")
    return all(_buffer_bytes(w.source) == computed for out in sch.get_output_blocks(root) for w in sch.get(out).writes)


def contraction_loops(sch, block) -> tuple[list, list, list[int]]:
    """A contraction block's spatial loops, its reduction loops and the spatial extents (raises where dynamic)."""
    types = iter_types(sch, block)
    loops = sch.get_loops(block)
    spatial = [lp for lp, t in zip(loops, types) if t == DATA_PAR]
    reduce = [lp for lp, t in zip(loops, types) if t == REDUCE]
    exts = [_extent(sch, lp) for lp in spatial]
    if not spatial or None in exts or any(_extent(sch, lp) is None for lp in reduce):
        raise ValueError("a dynamic or reduction-only contraction")
    return spatial, reduce, exts


def schedule_contraction(sch, block, lanes: int, tiles: dict | None = None, weight_first: bool | None = None,
                         unroll=None, registers: int = 16, cores: int = 1) -> None:
    """Register-blocked tiles of a GEMM or conv ``block``: parallel tiles, the reduction, then ``rows`` x vector
    tile accumulators (the vector along the output's innermost axis). ``tiles`` (spatial axis -> tile, a number or
    a sampled decision), ``weight_first`` and ``unroll`` (the innermost reduction loop split by it, the inner part
    unrolled: a sampled decision or None) are the sketch's knobs (``kernels/cpu/sketch.py``); by default the rules
    above choose; ``registers``: the target's vector registers (:func:`contraction_tiles`); ``cores``: the
    target's, for an epilogue scheduled on its own."""
    spatial, reduce, exts = contraction_loops(sch, block)
    depthwise = channelwise(sch, block)
    work = 1
    for e in exts + [_extent(sch, lp) for lp in reduce]:
        work *= e
    heavy = weight_heavy(sch, block) if weight_first is None else weight_first
    if tiles is None:
        tiles = default_tiles(exts, lanes, registers, contraction_facts(sch, block))
    outers, inners = [], []
    for i, lp in enumerate(spatial):
        tile = tiles.get(i, 1)
        if isinstance(tile, int) and tile == 1:
            outers.append(lp)
            continue
        o, n = sch.split(lp, [None, tile])
        outers.append(o)
        inners.append(n)
    if heavy:
        outers = [outers[-1], *outers[:-1]]
    unrolled = []
    if unroll is not None and reduce:
        reduce[-1], inner_r = sch.split(reduce[-1], [None, unroll])
        unrolled = [inner_r]
    sch.reorder(*outers, *reduce, *unrolled, *inners)
    tile_loop = sch.fuse(*outers) if len(outers) > 1 else outers[0]
    if work >= MIN_PARALLEL_WORK:
        sch.parallel(tile_loop)
    acc = sch.cache_write(block, 0, "global")
    sch.reverse_compute_at(acc, tile_loop, preserve_unit_loops=True)
    for consumer in sch.get_consumers(acc):
        try:
            sch.reverse_compute_inline(consumer)
        except Exception:  # noqa: BLE001 - an epilogue that cannot fold into the write-back: computed per tile
            try:
                sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
                vectorize_last(sch, consumer, lanes)
            except Exception:  # noqa: BLE001 - a tile's share of it is not an affine region
                # an epilogue that repeats the result (grouped K/V heads broadcast to every query head, through
                # reshapes) has no per-tile region TVM can solve: it runs after the tiles, as its own parallel,
                # vectorised loop nest over the stored result (it ran TVM's plain lowering, scalar, before)
                pointwise_block(sch, consumer, lanes, cores)
    vectorize_last(sch, acc, lanes)
    # vectorised before the init is split off: the update alone is no longer a reduction block to the check
    inner_loops = sch.get_loops(block)[-len(inners):] if inners else []
    if inner_loops and (_extent(sch, inner_loops[-1]) or 0) > 1 and \
            not left_to_llvm(tiles.get(len(exts) - 1), exts[-1], lanes, depthwise):
        sch.vectorize(inner_loops[-1])
        for lp in inner_loops[:-1]:
            sch.unroll(lp)
    for lp in unrolled:
        sch.unroll(lp)
    if reduce:
        init = sch.decompose_reduction(block, reduce[0])
        # the init's loops copy the update's kinds; vectorise its last where that did not carry over
        if int(sch.get(sch.get_loops(init)[-1]).kind) != int(tvm.tirx.ForKind.VECTORIZED):
            vectorize_last(sch, init, lanes)


def _single_output(sch):
    """The root block and a row kernel's one output block (several outputs: not a row kernel these rules read)."""
    root = sch.get_sblock("root")
    outputs = sch.get_output_blocks(root)
    if len(outputs) != 1:
        raise ValueError("a row kernel with several outputs")
    return root, outputs[0]


def schedule_rows(sch, lanes: int, cores: int) -> None:
    """Rows in parallel: the output's outer loops (all but the last) fused and parallel, every other block at
    that row, elementwise row loops vectorised."""
    inline_all_but_outputs(sch)
    root, out = _single_output(sch)
    loops = sch.get_loops(out)
    types = iter_types(sch, out)
    lead = next((i for i, t in enumerate(types) if t != DATA_PAR), len(types))
    row_loops = loops[:lead] if lead < len(types) else loops[:-1] if len(loops) > 1 else loops
    if not row_loops:
        raise ValueError("no row loop to run in parallel")
    row = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
    blocks = [b for b in sch.get_child_blocks(root) if not sch.get(b).same_as(sch.get(out))]
    for b in reversed(blocks):
        sch.compute_at(b, row, preserve_unit_loops=True)
    sch.parallel(row)
    if len(loops) > 1 and lead == len(types):
        vectorize_last(sch, out, lanes)
    for b in blocks:
        if all(t == DATA_PAR for t in iter_types(sch, b)):
            vectorize_last(sch, b, lanes)


def _inline_single_use(sch) -> None:
    """Inline every elementwise intermediate with one consumer (softmax's shift into its exp, LayerNorm's body into
    its reshape); one with several consumers (softmax's exp: its sum and the quotient) stays a row-sized buffer."""
    root = sch.get_sblock("root")
    # by name: the id of a block's Python wrapper is reused once the wrapper is freed, and matched another block
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    done = False
    while not done:
        done = True
        for b in sch.get_child_blocks(root):
            if sch.get(b).name_hint in outputs or any(t != DATA_PAR for t in iter_types(sch, b)):
                continue
            if len(sch.get_consumers(b)) != 1:
                continue
            try:
                sch.compute_inline(b)
            except Exception:  # noqa: BLE001 - not inlinable (its consumer reads it at another shape): kept
                continue
            done = False
            break


def _product(sch, loops) -> int:
    n = 1
    for lp in loops:
        n *= _extent(sch, lp) or 0
    return n


def row_lanes(width: int, lanes: int) -> int | None:
    """The partial results a row's reductions keep (and the vector its elementwise passes take): ``lanes``, or
    where no whole vector divides the row, the divisor between half a vector and two that LLVM splits into the
    fewest legal parts (1500 frames: 20, a vector and a quarter), or None (197, a prime: scalar chains). A split
    with a guarded last part cannot serve: TVM's compute_at drops the guard of an rfactor block (the last part
    read the next row)."""
    if width % lanes == 0:
        return lanes
    fits = [d for d in range(lanes // 2, 2 * lanes + 1) if width % d == 0]
    whole = [d for d in fits if d % max(1, lanes // 4) == 0]
    return max(whole or fits, default=None)


def schedule_norm_rows(sch, lanes: int, cores: int) -> None:
    """Several reductions of a row (softmax, LayerNorm, RMSNorm) with the row as the output's innermost axis: the
    rows in parallel, every block computed at its row (a row of intermediates stays in L1), the elementwise
    passes vectorised, and each reduction split into ``lanes`` partial results reduced as a vector (``rfactor``)
    so it is not one long chain of dependent adds."""
    _inline_single_use(sch)
    root, out = _single_output(sch)
    if any(t != DATA_PAR for t in iter_types(sch, out)):
        raise ValueError("the output block reduces")
    loops = sch.get_loops(out)
    width = _extent(sch, loops[-1]) if len(loops) > 1 else None
    if not width or _product(sch, loops[:-1]) <= 0:
        raise ValueError("no static row")
    for b in sch.get_child_blocks(root):
        types = iter_types(sch, b)
        if REDUCE in types and (types[-1] != REDUCE or types.count(REDUCE) != 1
                                or _extent(sch, sch.get_loops(b)[-1]) != width):
            raise ValueError("a reduction that is not along the output's rows")
    part = row_lanes(width, lanes)
    if part and width >= 2 * part:
        for b in [b for b in sch.get_child_blocks(root) if REDUCE in iter_types(sch, b)]:
            _, lane = sch.split(sch.get_loops(b)[-1], [None, part])
            try:
                sch.rfactor(lane, factor_axis=len(iter_types(sch, b)) - 1)
            except Exception:  # noqa: BLE001 - a reduction rfactor refuses keeps its scalar chain
                pass
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    others = [b for b in sch.get_child_blocks(root) if not sch.get(b).same_as(sch.get(out))]
    for b in reversed(others):
        sch.compute_at(b, row)
    for b in sch.get_child_blocks(root):
        # the rows' blocks must each be computed once a row: a producer read through a reshape may come out of
        # compute_at covering every row, and run once per row
        inner = sch.get_loops(b)[1:]
        if _product(sch, inner) > width:
            raise ValueError("a block is recomputed at each row")
    if _product(sch, [row]) * width >= MIN_PARALLEL_WORK:
        sch.parallel(row)
    for b in sch.get_child_blocks(root):
        types = iter_types(sch, b)
        inner = sch.get_loops(b)[1:]
        if not inner:  # a per-row scalar (the mean): its only loop is the row itself
            continue
        if all(t == DATA_PAR for t in types):
            if part and part != lanes and _extent(sch, inner[-1]) == width:
                sch.vectorize(sch.split(inner[-1], [None, part])[1])
            else:
                vectorize_last(sch, b, lanes)
        elif REDUCE in types and types[-2:-1] == [DATA_PAR] and len(inner) == 2 and _extent(sch, inner[0]) == part:
            # an rfactor block: (lane, chunk) loops under the row; the lane loop innermost and vectorised
            sch.reorder(inner[1], inner[0])
            sch.vectorize(inner[0])


def pack_weights(sch) -> bool:
    """The layout-free buffers (a kernel's weights: ``layout_free_buffers``, which the planner attaches on the
    CPU) rewritten into the order the schedule's loops read them (MetaSchedule's ``RewriteLayout``): an HWIO conv
    filter read a vector of output channels at a time becomes ``[O / tile, H, W, I, tile]``, so each step of
    the reduction reads the next contiguous vector, where the plain layout puts them a row of all output
    channels apart (2 KB for 512 of them: a cache line, and a DRAM page, for every vector). A postprocessing
    step of the trace, as in a tuned record, so the tuner's replay of this default rewrites once; the build packs
    the weights at compile time (``tvmfuse.compile.build.pack_weights``). Whether anything was rewritten."""
    func = sch.mod["main"]
    if "layout_free_buffers" not in (func.attrs or {}) or not list(func.attrs["layout_free_buffers"]):
        return False
    from tvm.s_tir import meta_schedule as ms

    sch.enter_postproc()
    return bool(ms.postproc.RewriteLayout().apply(sch))
