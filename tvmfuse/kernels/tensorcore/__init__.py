"""The tensor-core template for GEMM and conv kernels with a fused epilogue (fp16 in, fp32 accumulate): wmma or
``ldmatrix`` + ``mma.sync`` tiles with every size a MetaSchedule decision, before them the GEMV template's sketch
for GEMMs of at most 16 rows (``tvmfuse.kernels.gemv``), and on sm_90a the wgmma template's sketch
(``tvmfuse.kernels.wgmma``).

The package: ``sketch`` (the schedule, one sketch per pipeline depth and intrinsic) and ``postprocs`` (MetaSchedule's
CUDA postprocessors with a GPU check that knows the dynamic shared memory).
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.tensorcore.postprocs import tensorcore_postprocs
from tvmfuse.kernels.tensorcore.sketch import template_gemm_tensorcore

__all__ = ["TensorCoreTemplate", "template_gemm_tensorcore", "tensorcore_postprocs"]


class TensorCoreTemplate(KernelTemplate):
    """GEMMs and convs on CUDA tensor cores, tuned through its knobs; it has no untuned kernel of its own (on sm_90a
    an untuned build runs the wgmma template's default)."""

    name = "tensorcore"
    targets = ("cuda",)
    kernel_classes = ("gemm", "conv")
    sketch_name = "gemm_tensorcore"
    knobs = ("warps_m", "warps_n", "frags_m", "frags_n", "k_frags", "vector_lanes", "store_lanes", "raster_group",
             "pipeline_stages", "intrinsics", "max_dynamic_shared_bytes")
    uses = ("gemv", "wgmma")
    tensor_cores = True

    def fits(self, func, target) -> str | None:
        from tvmfuse.kernels.sketch import REDUCE, root_blocks

        if target.kind.name not in self.targets:
            return super().fits(func, target)
        reductions = [b for b in root_blocks(func) if any(int(iv.iter_type) == REDUCE for iv in b.iter_vars)]
        if len(reductions) != 1:
            return "needs one multiply-accumulate block"
        ins = {str(r.source.dtype) for r in reductions[0].reads}
        return None if ins == {"float16"} else f"needs fp16 inputs (got {', '.join(sorted(ins))})"

    def schedule(self, sch, space, info: dict) -> list:
        return template_gemm_tensorcore(sch, space, info)

    def postprocs(self, space) -> list:
        return tensorcore_postprocs(int(space.extra.get("max_dynamic_shared_bytes", 49152)))
