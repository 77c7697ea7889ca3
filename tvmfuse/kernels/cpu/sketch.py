"""The CPU contraction sketch (``template: cpu_contraction`` in ``search_spaces/llvm.yaml``): the CPU default's
register-blocked GEMM / conv (``schedule.schedule_contraction``) with its choices as knobs the search samples:

* ``vectors``: the vector tile along the output's innermost axis, in vectors of the target's width (the width the
  weight is packed at: ``[O / tile, ..., tile]``), kept where it divides the axis;
* ``rows``: the register block's rows along the nearest outer axis (a ragged last tile where it does not divide);
* ``outer``: where the default's block takes the whole row axis and fills its accumulators from the next outer
  axis (a 3x3-pixel conv: 3 x 3 pixels), that outer tile or 1;
* ``unroll``: the innermost reduction loop split by it and the inner part unrolled (a longer straight line of
  loads and FMAs), kept where it divides that loop;
* ``order``: ``weight-first`` (each thread streams its share of the weight once: few pixels, a big weight) or
  ``pixel-first`` (the pixel tiles outermost): a structural choice, so one sketch each.

The rules' own choice for the kernel (the untuned default) is among the values, so every sketch holds it (but a
depthwise conv's tile over all its channels, which the rules leave to LLVM's vectoriser: the tuner's record of the
default is its own trace); the tuner measures the default first as a record. Where the kernel is not one
contraction the sketch raises and the space falls back to MetaSchedule's stock CPU space (reported per kernel).
"""
from __future__ import annotations

from tvmfuse.kernels.cpu.activations import pad_and_pack
from tvmfuse.kernels.cpu.int8 import default_tiles as int8_default_tiles
from tvmfuse.kernels.cpu.int8 import is_int8_gemm, schedule_int8_kernel
from tvmfuse.kernels.cpu.schedule import (contraction_facts, contraction_loops, default_tiles, dtype_bits,
                                          is_contraction, left_to_llvm, row_axis_of, schedule_contraction)
from tvmfuse.kernels.knobs import Knob, sample
from tvmfuse.kernels.sketch import REDUCE, inline_all_but_outputs, iter_types

ORDERS = ("weight-first", "pixel-first")


def _values(knob: Knob | None, fallback: tuple, keep, extra: int) -> tuple:
    """The knob's values (``fallback`` without one) that ``keep`` accepts, with ``extra`` (the rules' choice)."""
    values = knob.values if knob is not None else fallback
    return tuple(sorted({int(v) for v in values if keep(int(v))} | {extra}))


def contraction_sketches(sch, space, info: dict) -> list:
    """The sketches of a contraction kernel (one per ``order``), each sampling ``vectors``, ``rows`` and
    ``unroll``; ``info``: the target's ``vector_bits`` (``kernels.space.sketch_info``)."""
    inline_all_but_outputs(sch)
    root = sch.get_sblock("root")
    reductions = [b for b in sch.get_child_blocks(root) if REDUCE in iter_types(sch, b)]
    if len(reductions) != 1 or not is_contraction(sch, reductions[0]):
        raise ValueError("the cpu_contraction sketch takes one GEMM or conv reduction")
    name = sch.get(reductions[0]).name_hint
    if info.get("vnni") and is_int8_gemm(sch, reductions[0]):
        return [_int8_sketch(sch, name, space, info)]
    lanes = max(1, int(info["vector_bits"]) // dtype_bits(sch, reductions[0]))
    registers = int(info.get("vector_registers", 16))
    # padded and packed as the default is, so its tiles are among the sketch's
    block = pad_and_pack(sch, reductions[0], lanes, registers)
    _, reduce, exts = contraction_loops(sch, block)
    facts = contraction_facts(sch, block)
    default = default_tiles(exts, lanes, registers, facts)
    last = len(exts) - 1
    row_axis = row_axis_of(exts)
    knob = space.knobs.get("vectors")
    # whole vectors that divide the axis (a grouped conv's group: a tile across groups gathers its input), and the
    # rules' tile (1000 channels: half a vector a pixel row, 2.5 a GEMV); a depthwise conv's tile over all its
    # channels only where nothing else fits: the rules leave its loop to LLVM, a sampled tile is vectorised by TVM
    vectors = {int(v) * lanes for v in (knob.values if knob else (1, 2, 4))
               if (facts.group or exts[last]) % (int(v) * lanes) == 0}
    if not (vectors and left_to_llvm(default[last], exts[last], lanes, facts.depthwise)):
        vectors.add(default[last])
    vectors = tuple(sorted(vectors))
    # a ragged row tile only where the outputs keep the whole result (``result_kept_whole``)
    rows = (_values(space.knobs.get("rows"), (1, 2, 4, 6, 8),
                    lambda r: r <= exts[row_axis] and (facts.whole or exts[row_axis] % r == 0),
                    default.get(row_axis, 1)) if row_axis is not None else ())
    outer = next((i for i in default if i not in (last, row_axis)), None)
    inner_r = int(sch.get(reduce[-1]).extent) if reduce else 1
    unrolls = _values(space.knobs.get("unroll"), (1, 2, 4), lambda u: inner_r % u == 0, 1) if reduce else ()
    orders = space.knobs["order"].values if "order" in space.knobs else ORDERS
    sketches = []
    for order in orders:
        if order not in ORDERS:
            raise ValueError(f"cpu_contraction: unknown order '{order}' (orders: {', '.join(ORDERS)})")
        s = sch.copy()
        block = s.get_sblock(name)
        tiles = {last: sample(s, Knob.uniform("vectors", vectors))}
        if rows:
            tiles[row_axis] = sample(s, Knob.uniform("rows", rows))
        if outer is not None:
            tiles[outer] = sample(s, Knob.uniform("outer", (1, default[outer])))
        unroll = sample(s, Knob.uniform("unroll", unrolls)) if len(unrolls) > 1 else None
        schedule_contraction(s, block, lanes, tiles=tiles, weight_first=order == "weight-first", unroll=unroll,
                             registers=registers)
        sketches.append(s)
    return sketches


def _int8_sketch(sch, name: str, space, info: dict):
    """The quantized GEMM's VNNI kernel (:mod:`tvmfuse.kernels.cpu.int8`) with its register block sampled: ``rows``
    (at most 8, dividing the rows) by ``vectors`` of 16 int32 columns (dividing the columns); the untuned tiles are
    among the values."""
    loops = sch.get_loops(sch.get_sblock(name))
    m, n = (int(sch.get(lp).extent) for lp in loops[-3:-1])
    mr, nb = int8_default_tiles(m, n)
    rows = _values(space.knobs.get("rows"), (1, 2, 4, 7, 8), lambda r: r <= 8 and m % r == 0, mr)
    vectors = _values(space.knobs.get("vectors"), (1, 2, 4), lambda v: (n // 16) % v == 0, nb)
    s = sch.copy()
    schedule_int8_kernel(s, s.get_sblock(name), int(info.get("cores", 1)), int(info["vector_bits"]) // 32,
                         rows=sample(s, Knob.uniform("rows", rows)), vectors=sample(s, Knob.uniform("vectors", vectors)))
    return s
