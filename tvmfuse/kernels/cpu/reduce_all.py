"""Whole-tensor reductions: a kernel whose reductions each fold a whole tensor to one value.

onnxruntime's ``quantize_dynamic`` puts a ``DynamicQuantizeLinear`` before every quantized GEMM: the min and max of
the whole activation, then its scale and zero point. TVM fuses the two reductions and the scalar arithmetic into one
kernel that the row rules do not read (there are no rows), so it kept TVM's plain lowering: one chain of dependent
compares, on one core, 0.41 ms for BERT-base's 128 x 768 activation, 48 of them a run (20 ms of 69). Here each
reduction keeps ``lanes`` partial results, one vector, over the flattened tensor (``rfactor``), and folds them at
the end; the scalar blocks after them are left as they are.
"""
from __future__ import annotations

from tvmfuse.kernels.sketch import REDUCE, iter_types


def reduces_whole(sch, block) -> bool:
    """Whether ``block`` reduces every axis it iterates (its output is one value)."""
    types = iter_types(sch, block)
    return bool(types) and all(t == REDUCE for t in types)


def scalar_block(sch, block) -> bool:
    """A block computing one value under no loop (the scale and zero point after the reductions)."""
    return not sch.get_loops(block) and all(int(iv.dom.extent) == 1 for iv in sch.get(block).iter_vars)


def schedule_whole_reductions(sch, blocks, lanes: int) -> None:
    """Each whole-tensor reduction of ``blocks`` as ``lanes`` partial results vectorised over its flattened
    loops, folded at the end; raises where a reduction's extent is not a multiple of ``lanes`` (rfactor cannot
    take the guard a ragged split leaves)."""
    # TVM 0.27's rfactor fails an internal check ("block_realize == old_block_realize_") while a sibling block
    # sits under no loop: the scalar blocks get a unit loop first
    for other in sch.get_child_blocks(sch.get_sblock("root")):
        if not sch.get_loops(other):
            sch.add_unit_loop(other)
    for block in blocks:
        loops = sch.get_loops(block)
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        extent = int(sch.get(fused).extent)
        width = next((w for w in (lanes * 4, lanes * 2, lanes) if extent % w == 0), None)
        if width is None:
            raise ValueError(f"a reduction of {extent} elements is not a multiple of {lanes} lanes")
        _, inner = sch.split(fused, [None, width])
        partial = sch.rfactor(inner, 0)
        sch.vectorize(sch.get_loops(partial)[-1])
