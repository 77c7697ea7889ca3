"""Contractions of two activations padded to whole vectors: attention's scores at a sequence length no vector
divides (ViT's 197 tokens, CLIP's 77, a prompt of 50).

The register block vectorises the output's innermost axis; where no whole vector divides it the rules take the
largest divisor (197, a prime: one lane, scalar code), and a guarded last tile runs scalar too (TVM's vectoriser
cannot predicate the guard of a tile that is ragged in rows and columns). A weight is zero-padded once, in the
graph (``plan/rewrites/pad_channels.py``); two activations are not constants, so the kernel pads them itself
(TVM's ``pad_einsum``): each input copied into a zero-padded buffer, the contraction over whole tiles, and the
epilogue keeping the real rows and columns. On the 2-core EPYC (AVX-512), 12 heads of 64, hot: scores at 197
tokens 3.4 ms -> 0.29 ms, at 50 tokens 104 -> 19 us, at 120 (half vectors) 120 -> 59 us; at 77 (11-lane vectors)
even (41 -> 39 us).
"""
from __future__ import annotations

from tvmfuse.kernels.cpu.schedule import contraction_loops, is_contraction, row_tile, vectorize_last

# the padded iteration space at most this multiple of the real one (50 tokens padded to 64 columns and 56 rows:
# 1.43x the work, 5x faster)
MOST_PADDED_WORK = 1.5


def _work(padded: list[int], exts: list[int]) -> float:
    work = 1.0
    for p, e in zip(padded, exts):
        work *= p / e
    return work


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
    longest = 14 if registers >= 32 else 8   # the rules' longest register row (schedule.contraction_tiles)
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


def pad_activations(sch, block, lanes: int, registers: int):
    """Pad the contraction ``block`` (the kernel's only reduction, its epilogue inlined into the output) where
    :func:`padded_extents` says, the input copies parallel and vectorised; the contraction block (its name kept),
    or ``block`` unchanged."""
    if not is_contraction(sch, block) or _reads_weight(sch, block):
        return block
    _, reduce, exts = contraction_loops(sch, block)
    padded = padded_extents(exts, lanes, registers)
    if padded is None:
        return block
    name = sch.get(block).name_hint
    sch.pad_einsum(block, padded + [1] * len(reduce))   # each iteration's extent up to a multiple of these
    block = sch.get_sblock(name)
    for producer in sch.get_producers(block):
        loops = sch.get_loops(producer)
        vectorize_last(sch, producer, lanes)
        outer = sch.get_loops(producer)[:len(loops) - 1]
        if outer:
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    # the copy of the padded result into the real one: folded into the epilogue that reads it, or (the contraction
    # is the output) left to the register block's write-back
    for consumer in sch.get_consumers(block):
        if sch.get_consumers(consumer):
            sch.compute_inline(consumer)
    return block
