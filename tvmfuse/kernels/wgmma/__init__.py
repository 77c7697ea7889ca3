"""A Hopper GEMM TIR template: ``wgmma.mma_async`` on operands staged by ``cp.async``, epilogue on the accumulators.

tvmfuse's first GEMM template (:mod:`tvmfuse.kernels.tensorcore`) schedules the fused kernel onto ``mma.sync``
through MetaSchedule's tensorize; on an H200 that stops near half of cuBLAS, because Hopper's full
tensor-core rate is reached only by the warpgroup-wide, asynchronous ``wgmma``. No TVM 0.27 schedule
primitive or tensor intrinsic emits it, so this package writes the kernel itself, as TVMScript, for the
planner's GEMM kernels whose shape it fits (:func:`analyze`):

* a thread block computes a ``block_m x block_n`` tile of ``C = A·B`` with ``warpgroups`` warpgroups (128
  threads each), each owning ``64 * m_tiles`` rows: per 16-deep K slice it issues ``m_tiles``
  ``wgmma.mma_async.m64n{block_n}k16`` (fp16 in, fp32 accumulate in registers);
* A and B tiles, ``block_k`` deep, go through dynamic shared memory in ``stages`` buffers filled by
  ``cp.async`` (16-byte copies), ``stages - 1`` tiles ahead of the tensor cores. The tiles are stored as
  wgmma's canonical "no swizzle" layouts, 8 x 16-byte core matrices of 128 contiguous bytes (A and a
  K-major B: K-major; a ``[K, N]`` B: N-major, read transposed by the instruction), and each warp's copies
  fill whole core matrices, so neither the copies nor the tensor cores meet bank conflicts;
* the operands are named by 64-bit shared-memory matrix descriptors encoded here (start address, the
  byte offsets between core matrices along K and along M/N; checked on the H200 by
  ``benchmarks/wgmma_gemm.py``);
* an NHWC conv is the same kernel as an implicit GEMM (:class:`ConvGeometry`): each K step's A tile is one
  filter tap's 64 channels of the rows' input pixels, gathered by the same copies, padding zero-filled; rows
  may end in a partial tile (predicated copies and stores);
* thread blocks are launched in groups of ``raster`` tile rows, so a group's B tiles stay in L2;
* the fused kernel's epilogue (the cast, bias, activation, residual that follow the multiply in the
  planner's PrimFunc) is applied to each accumulator before the one store to global memory.

MetaSchedule samples a config among :func:`configs` (an index annotated on the PrimFunc's root block, as
the flash template does); the builder swaps the PrimFunc for the kernel it names (:func:`expand`).
Needs ``sm_90a`` (``wgmma`` is an arch-specific instruction).

The package: ``spec`` (what a kernel is to the template), ``analysis`` (reading a planner kernel, or why not),
``config`` (the tile configs, which fit, the default), ``layout`` (shared tiles, descriptors, addressing), ``ptx``
(our device functions), ``mma`` (a K step's wgmmas and the store), ``cp_async`` and ``tma`` (the two kernels),
``kernel`` (a kernel per config, the untuned one, the swap for a tuned sketch), ``reference`` (the scalar twin)
and ``sketch`` (the MetaSchedule sketch).
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.wgmma.analysis import Misfit, analyze
from tvmfuse.kernels.wgmma.config import (ANNOTATION, CANDIDATES, SMS, SPEC, WgmmaConfig, configs, default_config,
                                          kernel_shared_bytes, parse_config, pixel_tile, supports, tiles_m, tiles_n,
                                          whole_tiles)
from tvmfuse.kernels.wgmma.cp_async import gemm_source
from tvmfuse.kernels.wgmma.kernel import annotated, default_kernel, expand, kernel_for, untuned_config
from tvmfuse.kernels.wgmma.layout import desc, tile_layout
from tvmfuse.kernels.wgmma.ptx import ZFILL, parse, wgmma_issue
from tvmfuse.kernels.wgmma.reference import reference_for, reference_source
from tvmfuse.kernels.wgmma.sketch import schedule
from tvmfuse.kernels.wgmma.spec import ConvGeometry, GemmSpec
from tvmfuse.kernels.wgmma.tma import tma_maps, tma_source

__all__ = ["ANNOTATION", "CANDIDATES", "SMS", "SPEC", "ZFILL", "ConvGeometry", "GemmSpec", "Misfit", "WgmmaConfig",
           "WgmmaTemplate", "analyze", "annotated", "configs", "default_config", "default_kernel", "desc", "expand",
           "gemm_source", "kernel_for", "parse", "parse_config", "pixel_tile", "reference_for", "reference_source",
           "schedule", "supports", "tile_layout", "whole_tiles", "tma_maps", "tma_source", "untuned_config",
           "wgmma_issue"]


class WgmmaTemplate(KernelTemplate):
    """Hopper's wgmma GEMM and implicit-GEMM conv, written whole from a tile config; its configs are sampled by the
    GEMM space's tensor-core sketch, which offers it first on sm_90a."""

    name = "wgmma"
    targets = ("cuda",)
    kernel_classes = ("gemm", "conv")
    searched_in = "gemm_tensorcore"
    candidates_key, index_key = CANDIDATES, ANNOTATION
    config_field = "wgmma_config"
    config_words = ("the wgmma GEMM template with tiles {config} (warpgroups, 64-row tiles each, N, K step, stages, "
                    "raster, swizzle, batches in flight; t1 TMA, p1 persistent, e1 stores staged in shared memory)")
    knobs = tuple(f"wgmma_{k}" for k in ("warpgroups", "m_tiles", "block_n", "stages", "raster", "inflight", "tma",
                                         "persistent", "staged", "split", "a_regs"))

    def fits(self, func, target) -> str | None:
        if not supports(target):
            return "wgmma needs an arch-specific Hopper target (sm_90a)"
        try:
            spec, _ = analyze(func, gated=True)
        except Exception as err:  # noqa: BLE001 - Misfit, or a kernel shape analyze() did not foresee
            return str(err) or type(err).__name__
        return None if configs(spec, tma=(0, 1)) else "no tile config divides its columns and K"

    def configs(self, func, target, space=None) -> list:
        if self.fits(func, target) is not None:
            return []
        spec, info = analyze(func, gated=True)
        if space is None:
            return configs(spec, tma=(0, 1))
        knobs = {k[len("wgmma_"):]: space.knobs[k].values for k in self.knobs if k in space.knobs}
        if "{acc0}" in info["store"]:   # a gated epilogue: no K split (as the sketch)
            knobs["split"] = (1,)
        return configs(spec, **knobs, max_shared_bytes=int(space.extra.get("wgmma_max_shared_bytes", 227 * 1024)))

    def default_config(self, func, target):
        found = untuned_config(func, target)
        return None if found is None else found[2]

    def default_kernel(self, func, target, space=None):
        # Hopper GEMMs and convs: dlight's rules have no tensor cores
        return default_kernel(func, target)

    def config_of(self, func) -> str | None:
        found = annotated(func)
        return None if found is None else found[2].name

    def config_figures(self, func, name: str) -> dict | None:
        found = annotated(func)   # a sketch's placeholder carries the spec
        try:
            spec = analyze(func, gated=True)[0] if found is None else found[0]
        except Exception:  # noqa: BLE001 - not a GEMM the template reads: no figures
            return None
        cfg = parse_config(name)
        rows, cols = tiles_m(spec, cfg), tiles_n(spec, cfg)
        computed = rows * cfg.block_m * cols * cfg.block_n
        return {"blocks": rows * cols * spec.grid_batch * cfg.split, "threads": cfg.threads,
                "shared_bytes": kernel_shared_bytes(spec, cfg),
                "padding": max(computed / (spec.rows * spec.n) - 1.0, 0.0),
                "work": cfg.block_m * cfg.block_n * spec.k // cfg.split}

    def expand(self, mod):
        return expand(mod)

    def reference(self, func):
        return reference_for(func)
