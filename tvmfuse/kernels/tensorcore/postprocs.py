"""The tensor-core template's postprocessors: MetaSchedule's CUDA ones, with the GPU check that knows its
dynamic shared memory."""
from __future__ import annotations

from tvmfuse._tvm import tvm


def tensorcore_postprocs(max_shared_bytes: int) -> list:
    """MetaSchedule's CUDA postprocs with ``VerifyGPUCode`` replaced by :func:`verify_gpu_kernel`."""
    from tvmfuse._tvm import derived_object, ms

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


def verify_gpu_kernel(func, target, *, max_shared_bytes: int, max_static_shared_bytes: int = 49152,
                      max_vector_bytes: int = 32) -> bool:
    """MetaSchedule's ``VerifyGPUCode`` check with limits that fit tensor-core kernels on sm_80+.

    The stock postproc (TVM 0.27) lowers a candidate and checks it against the target's
    ``max_shared_memory_per_block`` (the 48 KB static limit, though dynamic shared memory can be opted
    up to 227 KB on Hopper, which TVM's CUDA runtime does at launch) and 16 vector bytes, which every
    8-lane fp16 copy fails because its int32x8 index ramp counts as 32 bytes. This runs the same
    lowering passes and checks: threads, vthreads, vector bytes (``max_vector_bytes``, default 32 = the
    index ramp of a 16-byte access), all shared memory against ``max_shared_bytes`` and static shared
    memory against ``max_static_shared_bytes``.
    """
    import tvm.s_tir.transform as st
    import tvm.tirx.transform as tt
    from tvm.s_tir.analysis import calculate_allocated_bytes, verify_gpu_code

    passes = [st.LowerCrossThreadReduction(), st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
              st.ConvertBlocksToOpaque(), st.LiftThreadBinding(), st.ManifestSharedMemoryLocalStage(),
              st.CompactBufferAllocation(), tt.StmtSimplify(), st.LowerAutoCopy(), st.UnifyThreadBinding(),
              st.LowerMatchBuffer(), st.InjectSoftwarePipeline(), st.LowerOpaqueBlock(), tt.FlattenBuffer(),
              tt.BF16ComputeLegalize(), tt.NarrowDataType(32), tt.StmtSimplify(), tt.VectorizeLoop(True),
              st.InjectVirtualThread(), st.InjectDoubleBuffer(), tt.StorageRewrite(), tt.LowerIntrin()]
    func = func.with_attr("global_symbol", "main").with_attr("target", target).with_attr("tirx.noalias", True)
    try:
        lowered = tvm.transform.Sequential(passes)(tvm.IRModule({"main": func}))["main"]
    except Exception:  # noqa: BLE001 - a candidate that does not lower is invalid, as in the stock postproc
        return False
    limits = {"max_threads_per_block": int(target.attrs.get("max_threads_per_block", 1024)), "max_vthread": 8,
              "max_vector_bytes": max_vector_bytes}
    if not verify_gpu_code(lowered, {**limits, "max_shared_memory_per_block": max_shared_bytes}):
        return False
    allocated = dict(calculate_allocated_bytes(lowered)["main"])
    static, dynamic = int(allocated.get("shared", 0)), int(allocated.get("shared.dyn", 0))
    # TVM's CUDA runtime opts a kernel into more than 48 KB only when its *dynamic* part exceeds 48 KB: with
    # less dynamic memory, static + dynamic above 48 KB fails at launch (CUDA_ERROR_INVALID_VALUE; 7 of 26
    # GEMM/conv candidates on the H200, e.g. 14 KB static + 46 KB dynamic)
    if dynamic <= max_static_shared_bytes < static + dynamic:
        return False
    return static <= max_static_shared_bytes and static + dynamic <= max_shared_bytes
