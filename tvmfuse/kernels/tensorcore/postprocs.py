"""The tensor-core template's postprocessors: MetaSchedule's CUDA ones, with the GPU check that knows its
dynamic shared memory."""
from __future__ import annotations

from tvmfuse._tvm import tvm


def tensorcore_postprocs(max_shared_bytes: int) -> list:
    """MetaSchedule's CUDA postprocs with ``VerifyGPUCode`` replaced by :func:`verify_gpu_kernel`."""
    from tvmfuse._tvm import derived_object, ms, verify_gpu_kernel

    @derived_object
    class VerifyTensorCoreKernel(ms.postproc.PyPostproc):
        def __init__(self):
            super().__init__()
            self.target = None

        def _initialize_with_tune_context(self, context) -> None:
            self.target = context.target

        def apply(self, sch) -> bool:
            return all(verify_gpu_kernel(f, self.target, max_shared_bytes=max_shared_bytes)
                       for f in sch.mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))

        def clone(self):
            other = VerifyTensorCoreKernel()
            other.target = self.target
            return other

    return [ms.postproc.DisallowDynamicLoop(), ms.postproc.RewriteCooperativeFetch(),
            ms.postproc.RewriteUnboundBlock(), ms.postproc.RewriteParallelVectorizeUnroll(),
            ms.postproc.RewriteReductionBlock(), VerifyTensorCoreKernel()]
