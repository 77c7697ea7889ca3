"""Schedule helpers every template sketch uses: a fused kernel's blocks, inlining all but its outputs, loop kinds, and
the placeholder binding of a sketch whose kernel a template writes whole. A leaf: it imports no template."""
from __future__ import annotations

from tvmfuse._tvm import tvm

DATA_PAR, REDUCE = 0, 2  # tirx.IterVar.DataPar / CommReduce


def is_attention(func) -> bool:
    """Whether ``func`` is the planner's attention kernel (``tvmfuse.plan.attention``), which only the attention
    templates schedule."""
    attrs = func.attrs
    return attrs is not None and "tvmfuse.kernel" in attrs and str(attrs["tvmfuse.kernel"]) == "attention"


def root_blocks(func) -> list:
    """The blocks under the root block (fused kernels here are flat: one level of blocks)."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    return [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def inline_all_but_outputs(sch, keep=()) -> None:
    """Inline every non-output block (producers first, then trailing consumers), keeping ``keep``."""
    root = sch.get_sblock("root")
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    changed = True
    while changed:
        changed = False
        for b in sch.get_child_blocks(root):
            name = sch.get(b).name_hint
            if name in outputs or name in keep:
                continue
            try:
                sch.compute_inline(b)
                changed = True
            except Exception:  # noqa: BLE001 - not inlinable (a reduction): leave it
                continue


def iter_types(sch, block) -> list[int]:
    return [int(iv.iter_type) for iv in sch.get(block).iter_vars]


def bind_placeholder(sch) -> None:
    """Bind every block's spatial loops, fused, to blocks of 128 threads: a valid GPU schedule for a sketch whose
    PrimFunc the builder swaps for a template's kernel (wgmma, row program), so the postprocessors accept it."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        spatial = loops[:len(loops) - iter_types(sch, block).count(REDUCE)]
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        bx, tx = sch.split(fused, [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
