"""Swap hand-written template kernels in for the PrimFuncs whose schedules select them.

Three templates are written as whole kernels rather than reached by schedule primitives: flash attention
(``tvmfuse.tune.flash``), Hopper's wgmma GEMM (``tvmfuse.tune.hopper``) and the row program
(``tvmfuse.tune.rows``). A tuned schedule of such a
kernel annotates its root block with the template's config; everything that builds a scheduled module
(MetaSchedule's builder, the kernel check, ``compile``) passes it through :func:`expand` first.
"""
from __future__ import annotations


def expand(mod):
    import tvmfuse.tune.flash as flash
    import tvmfuse.tune.hopper as hopper
    import tvmfuse.tune.rows as rows
    return rows.expand(hopper.expand(flash.expand(mod)))
