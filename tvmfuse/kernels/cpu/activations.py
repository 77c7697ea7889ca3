"""Contractions of two activations (attention's scores and its weighted sum of values): padded to whole vectors
where no vector divides the output's columns, and the operand read along them packed into vector-wide panels.

The register block vectorises the output's innermost axis; where no whole vector divides it the rules take the
largest divisor (197, a prime: one lane, scalar code), and a guarded last tile runs scalar too (TVM's vectoriser
cannot predicate the guard of a tile that is ragged in rows and columns). A weight is zero-padded once, in the
graph (``plan/rewrites/pad_channels.py``); two activations are not constants, so the kernel pads them itself
(TVM's ``pad_einsum``): each input copied into a zero-padded buffer, the contraction over whole tiles, and the
epilogue keeping the real rows and columns. On the 2-core EPYC (AVX-512), 12 heads of 64, hot: scores at 197
tokens 3.4 ms -> 0.29 ms, at 50 tokens 104 -> 19 us, at 120 (half vectors) 120 -> 59 us; at 77 (11-lane vectors)
even (41 -> 39 us).

A weight is also packed once, at compile time, into the order the tiles read it (``schedule.pack_weights``); an
activation is packed at each call, here: ``[..., K, N]`` copied to ``[..., N / lanes, K, lanes]``, so a tile's
steps along K read consecutive vectors where the plain layout puts them a row of N apart (at 512 tokens, 2 KB:
every step of the 64 on the same cache sets). 8 heads of 64 on the 2-core EPYC, hot: 1500 tokens (Whisper's
encoder) 34.2 -> 6.9 ms, 512 tokens 3.66 -> 0.89 ms, 197 tokens 255 -> 193 us, 128 tokens 70 -> 59 us; at 64 and
50 tokens the copy costs more than it saves (11.8 -> 14.2 us), so panels of ``PACK_BYTES`` or less stay as they are.
"""
from __future__ import annotations

import math

from tvmfuse.kernels.cpu.schedule import (contraction_loops, dtype_bits, is_contraction, longest_rows, row_tile,
                                          vectorize_last)
from tvmfuse.kernels.sketch import DATA_PAR, REDUCE

# an operand whose K x N panel (one batch's) is at most this many bytes is read as it is: it stays in L1
PACK_BYTES = 16 * 1024

# the padded iteration space at most this multiple of the real one (50 tokens padded to 64 columns and 56 rows:
# 1.43x the work, 5x faster)
MOST_PADDED_WORK = 1.5


def _work(padded: list[int], exts: list[int]) -> float:
    return math.prod(p / e for p, e in zip(padded, exts))


def padded_extents(exts: list[int], lanes: int, registers: int) -> list[int] | None:
    """The spatial extents a contraction of two activations is padded to, or None where the rules' tiles fit: the
    innermost axis to whole vectors where it is longer than two and no vector divides it, and the row axis (the
    next one longer than 1) to whole register rows where the rules would leave it few (197, a prime: 15 tiles of
    14), each while the padded work stays within ``MOST_PADDED_WORK`` of the real one."""
    last = len(exts) - 1
    if exts[last] <= 2 * lanes or exts[last] % lanes == 0:
        return None
    padded = list(exts)
    padded[last] = -(-exts[last] // lanes) * lanes
    if _work(padded, exts) > MOST_PADDED_WORK:
        return None
    longest = longest_rows(registers)
    row = next((i for i in range(last - 1, -1, -1) if exts[i] > 1), None)
    if row is not None and exts[row] > longest and row_tile(exts[row], longest) < longest // 2:
        rows = list(padded)
        rows[row] = -(-exts[row] // longest) * longest
        if _work(rows, exts) <= MOST_PADDED_WORK:
            padded = rows
    return padded


def _reads_weight(sch, block) -> bool:
    """Whether the contraction reads a parameter the planner marked layout-free (a weight)."""
    func = sch.mod["main"]
    free = [func.params[int(i)] for i in (func.attrs or {}).get("layout_free_buffers", [])]
    if hasattr(func, "buffer_map"):   # before TVM 0.27 parameters map to their buffers
        free = [func.buffer_map[p] for p in free]
    return any(r.source.same_as(p) for r in sch.get(block).reads for p in free)


def pad_and_pack(sch, block, lanes: int, registers: int):
    """Pad the contraction ``block`` (the kernel's only reduction, its epilogue inlined into the output) where
    :func:`padded_extents` says and pack its column operand (:func:`pack_columns`); the contraction block (its
    name kept), or ``block`` unchanged where it reads a weight."""
    if not is_contraction(sch, block) or _reads_weight(sch, block):
        return block
    _, reduce, exts = contraction_loops(sch, block)
    padded = padded_extents(exts, lanes, registers)
    if padded is not None:
        name = sch.get(block).name_hint
        sch.pad_einsum(block, padded + [1] * len(reduce))   # each iteration's extent up to a multiple of these
        block = sch.get_sblock(name)
        # the copy of the padded result into the real one: folded into the epilogue that reads it, or (the
        # contraction is the output) left to the register block's write-back
        for consumer in sch.get_consumers(block):
            if sch.get_consumers(consumer):
                sch.compute_inline(consumer)
    packed = pack_columns(sch, block, lanes)
    if padded is not None:
        for producer in sch.get_producers(block):
            if sch.get(producer).name_hint != packed:
                _copy_loops(sch, producer, lanes)
    return block


def _copy_loops(sch, block, lanes: int) -> None:
    """A copy's innermost loop vectorised, its outer loops fused and parallel."""
    loops = sch.get_loops(block)
    vectorize_last(sch, block, lanes)
    outer = sch.get_loops(block)[:len(loops) - 1]
    if outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _column_operand(sch, block) -> tuple[int, bool] | None:
    """The read of the contraction's operand indexed by the output's innermost variable and a reduction variable
    in its last two indices: (its index among the block's reads, whether the reduction variable comes first:
    ``[..., K, N]``), or None."""
    b = sch.get(block)
    spatial = [iv.var for iv in b.iter_vars if int(iv.iter_type) == DATA_PAR]
    rvars = [iv.var for iv in b.iter_vars if int(iv.iter_type) == REDUCE]
    if not spatial:
        return None
    for i, r in enumerate(b.reads):
        mins = [rg.min for rg in r.region]
        if len(mins) < 2:
            continue
        if mins[-1].same_as(spatial[-1]) and any(mins[-2].same_as(v) for v in rvars):
            return i, True
        if mins[-2].same_as(spatial[-1]) and any(mins[-1].same_as(v) for v in rvars):
            return i, False
    return None


def pack_columns(sch, block, lanes: int) -> str | None:
    """Pack the operand the contraction ``block`` reads along its output's columns (:func:`_column_operand`) into
    ``[..., N / lanes, K, lanes]`` panels, copied at each call (the padded copy itself where the kernel pads it),
    where the columns are whole vectors and one batch's panel is over ``PACK_BYTES``: the name of the copy's
    block (scheduled here), or None."""
    found = _column_operand(sch, block)
    if found is None:
        return None
    idx, k_first = found
    buf = sch.get(block).reads[idx].source
    shape = [int(d) for d in buf.shape]
    n, k = (shape[-1], shape[-2]) if k_first else (shape[-2], shape[-1])
    if n % lanes or n * k * dtype_bits(sch, block) // 8 <= PACK_BYTES:
        return None
    copies = [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(buf)]
    copy = copies[0] if copies else sch.cache_read(block, idx, "global")

    def panels(*ix):
        col, red = (ix[-1], ix[-2]) if k_first else (ix[-2], ix[-1])
        return (*ix[:-2], col // lanes, red, col % lanes)

    sch.transform_layout(block, ("read", idx), panels)
    # the copy's loops: batch, panel (parallel), K, the panel's lanes (vectorised): it writes each panel in order
    loops = sch.get_loops(copy)
    col, red = (loops[-1], loops[-2]) if k_first else (loops[-2], loops[-1])
    panel, lane = sch.split(col, [None, lanes])
    sch.reorder(*loops[:-2], panel, red, lane)
    sch.vectorize(lane)
    sch.parallel(sch.fuse(*loops[:-2], panel) if loops[:-2] else panel)
    return sch.get(copy).name_hint
