"""MetaSchedule's build function for tvmfuse's candidates: template kernels swapped in, tvmfuse's pass options,
and the builder that runs it."""
from __future__ import annotations

import functools
import logging

from tvmfuse import nvcc_cache
from tvmfuse._tvm import build_context, cuda_compile, cuda_sources, ms
from tvmfuse.kernels import expand

log = logging.getLogger("tvmfuse.tune")


def fast_build(mod, target, _params, *, precompile: bool = False):
    """MetaSchedule builder function without the 42 s tensor-intrinsic import of the stock one.

    The candidate reaching the builder is already scheduled (tensorized blocks carry their bodies),
    so the intrinsic registry is not needed to compile it.

    ``precompile`` (a CUDA candidate measured on this machine): compile its CUDA source here, into the nvcc cache.
    TVM 0.27 compiles a CUDA module only when it is loaded on the GPU, which is in the runner, one candidate at a
    time and inside the runner's timeout; compiled in the parallel build workers instead, the runner's load is a
    cache hit. A compile that fails here is left to the runner, which reports it.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = expand(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod))  # flash attention, wgmma GEMMs
    with build_context():
        built = tvm_build(mod, target=target)
    if precompile and nvcc_cache.installed() is not None:
        try:
            with target:
                for src in cuda_sources(built):
                    cuda_compile(src)
        except Exception as e:  # noqa: BLE001 - the runner's own compile at load reports it
            log.debug("precompiling a candidate failed (%s); the runner compiles it", str(e)[:200])
    return built


def make_builder(*, workers: int, timeout_s: float, precompile: bool = False):
    """The LocalBuilder of a tuning run: tvmfuse's build function, and in every worker the nvcc cache this process
    compiles through (``precompile``: see :func:`fast_build`)."""
    f_build = functools.partial(fast_build, precompile=True) if precompile else fast_build
    return ms.builder.LocalBuilder(f_build=f_build, max_workers=workers, timeout_sec=timeout_s,
                                   initializer=nvcc_cache.worker_initializer())
