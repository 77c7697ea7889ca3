"""The row-reduction template: reductions over the last axis with their prologue and epilogue (add+LayerNorm,
RMSNorm, softmax), each row reduced by its own threads; its row staged in shared memory, in registers, or re-read
by every pass, one sketch each, and the row program's sketch (``tvmfuse.kernels.rows``) beside them.

It has no untuned kernel of its own: an untuned build runs the row program's default where it fits.
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.row_reduction.sketch import template_row_reduction

__all__ = ["RowReductionTemplate", "template_row_reduction"]


class RowReductionTemplate(KernelTemplate):
    """Row kernels on CUDA, tuned through the ``row_storage`` sketches and their knobs."""

    name = "row_reduction"
    targets = ("cuda",)
    kernel_classes = ("row_reduction",)
    sketch_name = "row_reduction"
    knobs = ("threads", "rows_per_block", "vector_lanes", "row_storage", "unroll", "max_shared_bytes",
             "row_register_elements")
    uses = ("rows",)

    def fits(self, func, target) -> str | None:
        from tvmfuse.kernels.sketch import REDUCE, root_blocks

        if target.kind.name not in self.targets:
            return super().fits(func, target)
        blocks = root_blocks(func)
        if not any(int(iv.iter_type) == REDUCE for b in blocks for iv in b.iter_vars):
            return "no reduction"
        return None

    def schedule(self, sch, space, info: dict) -> list:
        return template_row_reduction(sch, space, info)
