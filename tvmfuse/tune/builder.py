"""MetaSchedule's build function for tvmfuse's candidates (template kernels swapped in, tvmfuse's pass options), and
a builder that keeps its worker processes for the whole run."""
from __future__ import annotations

from tvmfuse._tvm import build_context, derived_object, ms
from tvmfuse.kernels import expand

# a worker is replaced after this many builds: MetaSchedule restarts its builder pool for every batch because
# its workers leak memory over many builds; replacing each worker now and then bounds that without paying
# the start of every worker (a Python process importing TVM and tvmfuse) on every batch
WORKER_USES = 32


def fast_build(mod, target, _params):
    """MetaSchedule builder function without the 42 s tensor-intrinsic import of the stock one.

    The candidate reaching the builder is already scheduled (tensorized blocks carry their bodies),
    so the intrinsic registry is not needed to compile it.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = expand(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod))  # flash attention, wgmma GEMMs
    with build_context():
        return tvm_build(mod, target=target)


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder with one pool of worker processes for the whole run.

    LocalBuilder starts a fresh pool for every batch it builds, and each worker imports TVM and tvmfuse before its
    first build: on a loaded 2-core machine that start took longer than the builds (418 s of a 589 s tune of a
    10-kernel model went to 20 builder calls). Here the pool starts on the first batch and each worker is
    replaced after :data:`WORKER_USES` builds; a build past ``timeout_sec`` kills its worker, as in LocalBuilder.
    :meth:`close` ends the pool."""

    def __init__(self, *, f_build=fast_build, max_workers: int, timeout_sec: float, initializer=None,
                 worker_uses: int = WORKER_USES):
        super().__init__()
        self.f_build, self.max_workers, self.timeout_sec = f_build, max_workers, timeout_sec
        self.initializer, self.worker_uses = initializer, worker_uses
        self._pool = None

    def build(self, build_inputs):
        from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
        from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

        if self._pool is None:
            self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                           initializer=self.initializer, maximum_process_uses=self.worker_uses)
        jobs = [(self.f_build, None, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs]
        results = []
        for done in self._pool.map_with_error_catching(lambda job: _worker_func(*job), jobs):
            if done.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(done.value, None))
            elif done.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, f"LocalBuilder: An exception occurred\n{done.value}"))
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
