"""Register staging shared by the pointwise and row sketches: vector widths that fit, flat register caches, and
vector loads into registers around scalar math with one vector store."""
from __future__ import annotations

from tvmfuse._tvm import tvm
from tvmfuse.kernels.knobs import Knob


def dtype_bytes(dtype) -> int:
    return max(1, tvm.runtime.DataType(str(dtype)).bits // 8)


def vector_knob(knob: Knob, inner: int, ebytes: int) -> Knob:
    """The lanes of ``knob`` that divide ``inner`` and make vectors of at most 16 bytes (``ebytes`` an element)."""
    return knob.filtered(lambda v: inner % int(v) == 0 and int(v) * ebytes <= 16)


def vectorize_under(s, block, anchor) -> None:
    """Fuse and vectorize the loops of ``block`` that lie under ``anchor``."""
    loops = s.get_loops(block)
    anchor_sref = s.get_sref(anchor)
    idx = next(i for i, lp in enumerate(loops) if s.get_sref(lp).same_as(anchor_sref))
    inner = loops[idx + 1:]
    if not inner:
        return
    lp = s.fuse(*inner) if len(inner) > 1 else inner[0]
    s.vectorize(lp)


def fuse_leading(dims: list[int], n: int):
    """The index map ``(i0, ..., i_{n-1}, *rest) -> (i0 * d1 * ... * d_{n-1} + ... + i_{n-1}, *rest)``."""
    def fuse(*idx):
        f = idx[0]
        for i, extent in zip(idx[1:n], dims[1:n]):
            f = f * extent + i
        return (f, *idx[n:])

    return tvm.tirx.IndexMap.from_func(fuse, ndim=len(dims))


def flat_map(dims: list[int]):
    return fuse_leading(dims, len(dims))


def flatten_copy(s, copy, which: tuple) -> None:
    """Make a register cache one-dimensional, buffer and copy block: ``(i, j, ...) -> i * J + j ...``.

    A thread's vector of a row-major tensor is addressed through a fused index as ``(f // N, f % N)``; on
    multi-dimensional caches TVM could not prove that region to be ``vec`` elements when a row spans
    several thread blocks (``bx * 2048 - (bx // 4) * 8192`` against ``(bx % 4) * 2048``): it kept the whole
    tensor as each thread's array (a 16384 x 8192 SwiGLU asked for 268 million registers per thread) or
    left loops of min/max extent that cannot be vectorized. Flat, the index simplifies back to ``f``.
    ``copy`` is the cache block (fresh, at the root); ``which`` names its local buffer.
    """
    kind, index = which
    stmt = s.get(copy)
    buf = (stmt.writes if kind == "write" else stmt.reads)[index].source
    dims = [int(d) for d in buf.shape]
    if len(dims) < 2 or [int(iv.dom.extent) for iv in stmt.iter_vars] != dims:
        return
    try:
        s.transform_block_layout(copy, flat_map(dims))
    except tvm.s_tir.ScheduleError:
        # the copy shares its loops with the block it caches (a cache_write under that block's thread
        # loops, as in the row template): those indices carry no fused division, nothing to flatten
        return
    s.transform_layout(copy, which, flat_map(dims))


def stage_through_registers(s, block, anchor, lanes, *, reads=True, flatten=True) -> None:
    """Vector loads into registers, scalar math, one vector store.

    TVM's vectorizer scalarizes a whole loop when its body calls something it cannot vectorize (erf,
    exp, sigmoid): the loads and stores then go out 2 bytes at a time. Staging each input's lanes in a
    local buffer (a vectorized copy), computing in an unrolled loop and writing through a local buffer
    (a vectorized copy) keeps the 16-byte accesses whatever the arithmetic.

    ``flatten``: flatten the register caches (see :func:`flatten_copy`). Not for a row kernel: there the
    copy is bounded per row, and a flat index hides a column split that does not divide the row (768
    columns as 2 x 64 threads x 8 lanes): the store's bound became the whole tensor's, so the last
    threads wrote their unused lanes over the next row's first columns (BERT's LayerNorm on the H200: relative error 0.58, caught by the kernel check).
    """
    if reads is True:
        names = [str(r.source.name) for r in s.get(block).reads]
    else:
        names = list(reads or [])
    for name in names:
        cr = s.cache_read(block, name, "local", consumer_blocks=[block])
        if flatten:
            flatten_copy(s, cr, ("write", 0))
        s.compute_at(cr, anchor, preserve_unit_loops=True)
        vectorize_under(s, cr, anchor)
    cw = s.cache_write(block, 0, "local")
    if flatten:
        flatten_copy(s, cw, ("read", 0))
    s.reverse_compute_at(cw, anchor, preserve_unit_loops=True)
    vectorize_under(s, cw, anchor)
    s.unroll(lanes)
