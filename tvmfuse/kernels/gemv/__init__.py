"""A skinny-GEMM / GEMV template: decode-time GEMMs (at most 16 rows against a weight, 64 for an fp16 [K, N] one),
memory-bound on the weight.

The tensor-core templates tile M by 64-128 rows and waste most of a 1-16 row GEMM; this package writes the kernel
whole, as TVMScript, so the weight is streamed from HBM once, in 16-byte vector loads coalesced across a warp:

* a ``[K, N]`` weight (ONNX MatMul's): ``threads_n`` threads along N, each a vector of ``lanes`` columns (32
  threads: 512 contiguous bytes a row), the block's other threads along K, each ``unroll`` consecutive rows a
  step (that many loads in flight); the ``rows`` rows of M a block holds are accumulated in fp32 registers
  from x's values, read once per thread and K step and reused across the thread's columns; the K threads'
  partials are summed through shared memory by all the block's threads;
* an ``[N, K]`` weight (Gemm's transB, a Linear's): a warp per ``threads_n`` columns, each lane a vector of
  ``lanes`` K elements (a warp reads 32 contiguous vectors of a column), x's vectors reused across the columns,
  the partials summed by warp shuffles;
* a ``[K, N]`` fp16 weight also has a tensor-core kernel (``mma``, ``c1`` in a config's name): D = W^T x^T on
  ``mma.sync.m16n8k16``, the weight tile the A operand (16 columns of N a tile) and M's rows, zero-padded, one or
  two n8 tiles of B, so a weight element costs no fp32 multiply-add per row of M (at 8-16 rows those took longer
  than the weight's stream). A lane's four 16-byte loads a k16 step are its own A fragment (the K order and the
  column order within a warp chosen so), warps along N and K (their partials summed through shared memory). ptxas
  issues a step's register loads just before its mmas, so a warp would hold one k16 step in flight: with
  ``stages`` > 1 (``p`` in a config's name) each lane copies its own weight vectors and x's halves by ``cp.async``
  into a ring of that many iterations in shared memory, ``stages - 1`` iterations ahead of the mmas (stages 1: the
  register loads, the next iteration prefetched into L2); M's rows up to 64, eight n8 tiles; ``xs`` (``x1``) at
  stages 1: each iteration's x tile copied once into shared memory by the warps along N that share its K range,
  which read their x fragments there (else each warp reads x from L2: at 32-64 rows as many bytes as its weight);
  an ``[N, K]`` weight keeps the CUDA-core kernel;
* where the columns alone leave the GPU's SMs idle (N / columns a block < two blocks an SM), ``split`` thread
  blocks share K: each stores fp32 partials and a second kernel sums them;
* the untuned kernel holds every row of M in the block that reads a weight tile, so the weight leaves HBM once
  (a config of fewer ``rows`` puts the rest of M in adjacent blocks of the launch, blockIdx.x, which find the
  tile in L2 only if it is still there); its other knobs come from a cost in bytes over the SMs' registers,
  bytes in flight, waves and a split's launch (:func:`default_config`);
* the fused kernel's epilogue (cast, bias, activation, residual) is applied once on the final sum, before the one
  store.

The planner's GEMM is read by the wgmma template's recogniser (:func:`tvmfuse.kernels.wgmma.analyze`), so both
templates agree on which PrimFuncs are a matmul with an elementwise epilogue. The GEMM space's tensor-core sketch
offers this one first for GEMMs it fits (it samples a config among :func:`configs`, the ``gemv_*`` knobs), and an
untuned build runs :func:`default_config`'s kernel.

The package: ``config`` (the configs, which fit, the default), ``source`` (the TVMScript), ``kernel`` (reading a
kernel, a kernel per config, the sketch, the swap for a tuned sketch).
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.gemv.config import (ANNOTATION, CANDIDATES, MAX_ROWS, MMA_ROWS, SPEC, GemvConfig, blocks, configs,
                                         default_config, parse_config, register_words)
from tvmfuse.kernels.gemv.kernel import (KNOBS, analyze, annotated, default_kernel, expand, kernel_for, schedule,
                                         space_configs, untuned)
from tvmfuse.kernels.gemv.source import gemv_source

__all__ = ["ANNOTATION", "CANDIDATES", "KNOBS", "MAX_ROWS", "MMA_ROWS", "SPEC", "GemvConfig", "GemvTemplate", "analyze",
           "annotated", "blocks", "configs", "default_config", "default_kernel", "expand", "gemv_source",
           "kernel_for", "parse_config", "register_words", "schedule", "space_configs", "untuned"]


class GemvTemplate(KernelTemplate):
    """GEMMs of at most 16 rows on CUDA (fp16 or fp32; 64 for an fp16 [K, N] weight, on tensor cores), written whole
    from a config; the GEMM space's tensor-core sketch offers its configs first where it fits."""

    name = "gemv"
    targets = ("cuda",)
    kernel_classes = ("gemm",)
    searched_in = "gemm_tensorcore"
    candidates_key, index_key = CANDIDATES, ANNOTATION
    config_field = "gemv_config"
    config_words = ("the GEMV template's config {config} (v: vector lanes, t: threads a block, n: threads along N "
                    "/ columns a warp, s: K split over blocks, m: rows a block, u: vectors in flight a thread, c1: on "
                    "tensor cores, n then warps along N, p: their pipeline's stages, x1: x's tile staged in shared "
                    "memory)")
    knobs = tuple(f"gemv_{k}" for k in KNOBS)

    def fits(self, func, target) -> str | None:
        if target.kind.name not in self.targets:
            return super().fits(func, target)
        try:
            spec, info = analyze(func)
        except Exception as err:  # noqa: BLE001 - Misfit, or a kernel shape the recogniser did not foresee
            return str(err) or type(err).__name__
        return None if default_config(spec, info["dtype"]) is not None else "no GEMV config fits its shape"

    def configs(self, func, target, space=None) -> list:
        if self.fits(func, target) is not None:
            return []
        spec, info = analyze(func)
        return space_configs(spec, info["dtype"], space)

    def default_config(self, func, target):
        found = untuned(func, target)
        return None if found is None else found[2]

    def default_kernel(self, func, target, space=None):
        # M <= 16 (64 on tensor cores): the weight's bytes are the kernel's time, which a K split over the SMs keeps
        # streaming (wgmma's blocks are its output tiles, fewer than the SMs at these M: config.MMA_ROWS)
        return default_kernel(func, target)

    def config_of(self, func) -> str | None:
        found = annotated(func)
        return None if found is None else found[2].name

    def expand(self, mod):
        return expand(mod)
