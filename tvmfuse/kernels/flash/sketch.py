"""The attention sketch: the planner's scalar schedule, and on CUDA one of the flash template's tile configs
sampled and annotated on the root block."""
from __future__ import annotations

from tvmfuse.kernels.flash.config import ANNOTATION, CANDIDATES, configs, spec_of
from tvmfuse.kernels.knobs import sample, sample_option
from tvmfuse.kernels.flash.simt import simt_configs
from tvmfuse.plan.attention import simt_gpu_misfit, tiled_gpu_misfit


def template_attention(sch, space, info: dict) -> list:
    """The planner's online-softmax attention.

    On CUDA, where its shape fits the tensor-core flash template (:mod:`tvmfuse.kernels.flash`), the sketch samples
    one of the template's tile configs (the ``flash_*`` knobs, as an index into the configs that fit) and
    annotates it on the root block; the builder swaps the kernel for that flash kernel. fp32 attention samples the
    CUDA-core flash kernel's configs (:mod:`tvmfuse.kernels.flash.simt`) the same way. The PrimFunc itself
    keeps the scalar schedule below (one query row per thread, its accumulator in registers), which is what
    every other target and shape runs.
    """
    root = sch.get_sblock("root")
    spec = spec_of(sch.mod["main"])
    if info.get("target_kind") == "cuda" and spec is not None and tiled_gpu_misfit(spec) is None:
        knobs = {k: space.knobs.get(f"flash_{k}")
                 for k in ("warps", "m_tiles", "block_n", "stages", "wgmma", "overlap", "tma")}
        choices = {k: v.values for k, v in knobs.items() if v is not None}
        # Hopper's wgmma kernels (their overlapped and warp-specialized variants) need the arch-specific target
        for k in ("wgmma", "overlap"):
            choices[k] = tuple(bool(v) for v in choices.get(k, (False,))
                               if not v or info.get("target_arch") == "sm_90a") or (False,)
        choices["tma"] = tuple(int(v) for v in choices.get("tma", (0,))
                               if not v or info.get("target_arch") == "sm_90a") or (0,)
        options = configs(spec, **choices,
                          max_shared_bytes=int(space.extra.get("flash_max_shared_bytes", 100 * 1024)))
        if options:
            index = sample_option(sch, options, knobs)
            sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
            sch.annotate(root, ANNOTATION, index)
    elif info.get("target_kind") == "cuda" and spec is not None and simt_gpu_misfit(spec) is None:
        # fp32: the CUDA-core flash kernel's configs, from the space's flash_simt_* knobs (all where it has none)
        knobs = {k: space.knobs.get(f"flash_simt_{k}") for k in ("threads", "rows", "lanes", "block_n")}
        options = simt_configs(spec, **{k: v.values for k, v in knobs.items() if v is not None})
        if options:
            sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
            sch.annotate(root, ANNOTATION, sample_option(sch, options, knobs))
    blocks = sch.get_child_blocks(root)
    if len(blocks) != 1:
        raise ValueError("attention template: needs the planner's single attention block")
    loops = sch.get_loops(blocks[0])
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    threads = sample(sch, space.knobs["threads"])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if "unroll" in space.knobs:
        sch.annotate(root, "meta_schedule.unroll_explicit", sample(sch, space.knobs["unroll"]))
    return [sch]
