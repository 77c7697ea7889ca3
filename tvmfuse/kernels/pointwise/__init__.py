"""The pointwise template: an injective chain (a fused elementwise kernel, a broadcast, a transpose) in one pass of
16-byte vector loads and stores, its elements, threads and blocks as knobs.

The package: ``sketch`` (the one-shot and grid-stride sketches), ``transpose`` (the shared-memory tile of a
transpose of the innermost axis) and this registry entry, whose untuned kernel is the one-shot sketch at its class's
``untuned`` knobs in the space file.
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.pointwise.sketch import template_pointwise
from tvmfuse.kernels.pointwise.transpose import transposed_input

__all__ = ["PointwiseTemplate", "template_pointwise", "transposed_input"]


class PointwiseTemplate(KernelTemplate):
    """Injective kernels on CUDA; its untuned kernel is its own sketch at the space's ``untuned`` knobs."""

    name = "pointwise"
    targets = ("cuda",)
    kernel_classes = ("pointwise",)
    sketch_name = "pointwise"
    searched_in = "pointwise"
    knobs = ("vector_lanes", "threads", "vectors_per_thread", "loop", "grid_stride_waves", "unroll")

    def fits(self, func, target) -> str | None:
        from tvmfuse.kernels.sketch import DATA_PAR, is_attention, root_blocks

        if target.kind.name not in self.targets:
            return super().fits(func, target)
        if is_attention(func):
            return "the planner's attention kernel"
        blocks = root_blocks(func)
        if not blocks or not all(int(iv.iter_type) == DATA_PAR for b in blocks for iv in b.iter_vars):
            return "not injective: it has a reduction or an opaque block"
        return None

    def schedule(self, sch, space, info: dict) -> list:
        return template_pointwise(sch, space, info)

    def default_trace(self, func, target, space, sketches):
        """The one-shot sketch at the knob values of the space's ``untuned`` entry (vector lanes: the widest the
        kernel takes), post-processed; None without that entry, for a transpose (its tiled sketch is the one that
        runs well) or where an ``untuned`` value is not among the kernel's candidates."""
        from tvmfuse._tvm import tvm
        from tvmfuse.kernels.sketch import inline_all_but_outputs

        untuned = space.extra.get("untuned")
        if not untuned or not sketches:
            return None
        probe = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        inline_all_but_outputs(probe)
        (block,) = probe.get_output_blocks(probe.get_sblock("root"))
        if transposed_input(probe, block, [int(d) for d in probe.get(block).writes[0].source.shape]) is not None:
            return None
        sketch = sketches[0]   # one-shot: lanes, threads, vectors a thread, unroll, in this order
        cats = [i for i in sketch.trace.insts if i.kind.name == "SampleCategorical"]
        want = [None, untuned.get("threads"), untuned.get("vectors_per_thread"), untuned.get("unroll")]
        if len(cats) != len(want):
            return None
        trace = sketch.trace
        for inst, value in zip(cats, want):
            candidates = [int(c) for c in inst.attrs[0]]
            value = max(candidates) if value is None else int(value)
            if value not in candidates:
                return None
            trace = trace.with_decision(inst, candidates.index(value), remove_postproc=True)
        return trace, True

    def default_kernel(self, func, target, space=None):
        # the template at the space's `untuned` knobs (SwiGLU on the H200: 185 us, dlight's 481)
        from tvmfuse._tvm import tvm
        from tvmfuse.kernels.space import traced_default

        sch = traced_default(self, self, tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target,
                             space)
        return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)
