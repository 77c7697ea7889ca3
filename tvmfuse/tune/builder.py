"""MetaSchedule's build function for tvmfuse's candidates: template kernels swapped in, tvmfuse's pass options,
and the builder that runs it."""
from __future__ import annotations

import functools
import logging
import signal

from tvmfuse import nvcc_cache
from tvmfuse._tvm import build_context, cuda_compile, cuda_sources, derived_object, ms
from tvmfuse.kernels import expand
from tvmfuse.kernels.cpu.prefetch import tir_pipeline

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
    with build_context():   # the pipeline the model's build runs (on llvm: the weight prefetch)
        built = tvm_build(mod, target=target, pipeline=tir_pipeline(target))
    if precompile and nvcc_cache.installed() is not None:
        try:
            with target:
                for src in cuda_sources(built):
                    cuda_compile(src)
        except Exception as e:  # noqa: BLE001 - the runner's own compile at load reports it
            log.debug("precompiling a candidate failed (%s); the runner compiles it", str(e)[:200])
    return built


# builds a worker serves before it is replaced: MetaSchedule's LocalBuilder starts new workers for every batch
# (for a memory leak of long-lived workers); each start imports TVM and tvmfuse, seconds of CPU a worker
WORKER_USES = 32


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder (the same worker function, results and messages) with its worker processes kept
    from one batch to the next, each replaced after ``max_uses`` builds or a timeout. A tuning run of small batches
    (the first pass of a time-bounded run: one candidate a kernel) spent more on starting workers than on building."""

    def __init__(self, *, f_build, max_workers: int, timeout_sec: float, initializer=None,
                 max_uses: int = WORKER_USES):
        super().__init__()
        self.f_build, self.max_workers, self.timeout_sec = f_build, max_workers, timeout_sec
        self.initializer, self.max_uses = initializer, max_uses
        self.pool = None

    def build(self, build_inputs):
        from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
        from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

        if self.pool is None:
            self.pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                          initializer=self.initializer, maximum_process_uses=self.max_uses)
        results = []
        jobs = [(self.f_build, None, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs]
        for r in self.pool.map_with_error_catching(lambda x: _worker_func(*x), jobs):
            if r.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(r.value, None))
            elif r.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, "LocalBuilder: An exception occurred\n" + str(r.value)))
        return results

    def close(self) -> None:
        """Stop the workers (a later build starts new ones)."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def make_builder(*, workers: int, timeout_s: float, precompile: bool = False):
    """The builder of a tuning run (:class:`PooledBuilder`): tvmfuse's build function, and in every worker the nvcc
    cache this process compiles through (``precompile``: see :func:`fast_build`). Close it (``close_builder``)."""
    f_build = functools.partial(fast_build, precompile=True) if precompile else fast_build
    return PooledBuilder(f_build=f_build, max_workers=workers, timeout_sec=timeout_s,
                         initializer=worker_initializer())


def worker_initializer():
    """The initializer of a tuning run's worker pools (builder and runner): the nvcc cache this process compiles
    through (:func:`tvmfuse.nvcc_cache.worker_initializer`), and :func:`_ignore_blocked_signals`."""
    return functools.partial(_init_worker, nvcc_cache.worker_initializer())


def _init_worker(install_cache) -> None:
    install_cache()
    _ignore_blocked_signals()


def _ignore_blocked_signals() -> None:
    """SIGINT and SIGTERM ignored in a worker that starts with them blocked: ``tvmfuse tune`` blocks them so that its
    workers finish the trials in flight on a Ctrl-C (tvmfuse.cli.interrupt), but the programs a worker runs may
    unblock them: ``tar -czf`` (MetaSchedule's export of a built candidate) runs gzip with them unblocked, so a
    Ctrl-C that came while a candidate was packed killed gzip and failed that build ("tar: Error is not recoverable",
    a failed record: tests/cli/test_interrupt.py failed once in a full run). An ignored signal stays ignored in the
    programs it runs (tar and gzip keep it so), and a worker started without them blocked is left as it was."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signum in blocked:
            signal.signal(signum, signal.SIG_IGN)


def close_builder(builder) -> None:
    inst = getattr(builder, "_inst", builder)   # the Python object behind TVM's derived-object wrapper
    if hasattr(inst, "close"):
        inst.close()
