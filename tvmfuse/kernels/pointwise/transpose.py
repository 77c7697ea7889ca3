"""The pointwise template's transpose sketch: a tile through shared memory, read along the input's innermost axis
and written along the output's."""
from __future__ import annotations

import math

from tvmfuse._tvm import tvm
from tvmfuse.kernels.knobs import Knob, sample
from tvmfuse.kernels.staging import vector_knob


def transposed_input(sch, block, shape: list[int]):
    """``(input name, output axis, input axis)`` when the block reads a full-size input whose innermost index
    is another output axis than the output's innermost (NCHW -> NHWC: ``y[n, h, w, c] = x[n, c, h, w]``):
    ``output axis`` is the one the input's innermost indexes (w), ``input axis`` the input's dimension that the
    output's innermost indexes (c). None for any other kernel."""
    stmt = sch.get(block)
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(ivars) != len(shape) or len(shape) < 2:
        return None
    size = math.prod(shape)
    for r in stmt.reads:
        if math.prod(int(d) for d in r.source.shape) != size:
            continue
        last = r.region[-1]
        if int(last.extent) != 1 or not isinstance(last.min, tvm.tirx.Var):
            continue
        axis = next((i for i, v in enumerate(ivars) if v.same_as(last.min)), None)
        in_axis = next((i for i, rg in enumerate(r.region) if int(rg.extent) == 1 and
                        isinstance(rg.min, tvm.tirx.Var) and rg.min.same_as(ivars[-1])), None)
        if axis is not None and axis != len(shape) - 1 and in_axis is not None:
            return str(r.source.name), axis, in_axis
    return None


def _tiles(extent: int, candidates=(64, 32, 16, 8)) -> tuple[int, ...]:
    """Tile sizes for one side of a transpose: the whole extent when it is small, else divisors."""
    tiles = tuple(t for t in candidates if extent % t == 0 and t < extent)
    return ((extent,) if extent <= max(candidates) else ()) + tiles or (extent,)


def transpose_sketch(s, name: str, transpose: tuple[str, int, int], space, shape: list[int],
                      ebytes: int):
    """A transpose through a shared-memory tile: read coalesced along the input's innermost axis, write
    coalesced along the output's.

    The flat pointwise sketches read an NCHW input 2 bytes at a time with a stride of H x W elements when they
    write NHWC: on the H200 the 64 x 256 x 56 x 56 fp16 transpose of the conv case ran 212 us, 23%
    of the copy ceiling. Here a block owns a ``tile_a x tile_b`` tile (``a`` = the output axis that is the
    input's innermost, ``b`` = the output's innermost), copies it into shared memory with vector loads along
    ``a``, and writes it with vector stores along ``b``; rows of the tile are padded by one bank word so the
    column reads do not conflict.
    """
    src, a, in_axis = transpose
    blk = s.get_sblock(name)
    loops = s.get_loops(blk)
    last = len(shape) - 1
    tiles_a, tiles_b = _tiles(shape[a]), _tiles(shape[last], (64, 32))
    # the widest tiles first: on the H200 the conv case's transpose ran 55 us (96% of the copy)
    # with 56 x 64 tiles (a whole row of w, 64 channels) and 125-179 us with 8-wide ones
    ta = sample(s, Knob.leaning("transpose_tile_a", tiles_a, 0.8))
    tb = sample(s, Knob.leaning("transpose_tile_b", tiles_b, 0.8))
    ao, ai = s.split(loops[a], [None, ta])
    bo, bi = s.split(loops[last], [None, tb])
    others = [lp for i, lp in enumerate(loops) if i not in (a, last)]
    s.reorder(*others, ao, bo, ai, bi)
    bx = s.fuse(*others, ao, bo)
    s.bind(bx, "blockIdx.x")
    threads = sample(s, space.knobs["threads"].filtered(lambda t: int(t) <= 256))
    # the staged tile: loads along the input's innermost axis
    cache = s.cache_read(blk, src, "shared")
    s.compute_at(cache, bx)
    s.storage_align(cache, 0, in_axis, 64 // ebytes, 4 // ebytes)  # row stride = an odd number of bank words
    inner = s.get_loops(cache)[1:]
    fused = s.fuse(*inner) if len(inner) > 1 else inner[0]
    # an odd number of words per row keeps each row's start 4-byte aligned, no more: the tile is filled with
    # 4-byte loads (16-byte ones are misaligned on odd rows: the H200 killed every such candidate)
    word = max(1, 4 // ebytes)   # elements per 4-byte word
    vin = word if math.gcd(*tiles_a) % word == 0 else 1
    _, tx, lanes = s.split(fused, [None, threads, vin])
    s.bind(tx, "threadIdx.x")
    s.vectorize(lanes)
    # the output: stores along its innermost axis
    fused = s.fuse(ai, bi)
    # at most 4 lanes: the gathered lanes' int32 index vector of 8 (32 bytes) fails TVM's VerifyGPUCode, which
    # rejected about a third of this sketch's candidates
    vout = sample(s, vector_knob(space.knobs["vector_lanes"], math.gcd(*tiles_b), ebytes).filtered(
        lambda v: int(v) <= 4))
    _, tx, lanes = s.split(fused, [None, threads, vout])
    s.bind(tx, "threadIdx.x")
    s.vectorize(lanes)
    return s
