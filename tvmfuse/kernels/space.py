"""A template's sketch as a MetaSchedule design space: its space generator, the context that lists its sketches,
the postprocessors a candidate goes through, and the untuned build's point of it (a traced sketch whose decisions
are the template's default)."""
from __future__ import annotations

from typing import Callable

from tvmfuse._tvm import ms, tvm


def sketch_info(space, target) -> dict:
    """What a sketch reads of the target besides its class's ``space`` block: the target kind and arch, and the
    GPU's figures (:func:`tvmfuse.target.device_figures`: SMs, shared memory per SM; a space file's ``sm_count``
    overrides the SMs) with where they came from (``device_source``)."""
    from tvmfuse.target import device_figures

    info = {"target_kind": target.kind.name, "target_arch": str(target.attrs.get("arch", ""))}
    if target.kind.name == "llvm":   # the CPU sketch's vector width, from the mcpu's features
        from tvmfuse.target import has_vnni, target_cores, vector_lanes, vector_registers

        info["vector_bits"] = 32 * vector_lanes(target, 32)
        info["vector_registers"] = vector_registers(target)
        info["vnni"] = has_vnni(target)   # quantized GEMMs: the VNNI kernel's tiles (kernels/cpu/int8.py)
        info["cores"] = target_cores(target)
    if target.kind.name == "cuda":
        fig = device_figures(target)
        info.update(sm_count=int(space.extra.get("sm_count", fig.sm_count)), shared_per_sm=fig.shared_per_sm,
                    shared_per_block=fig.shared_per_block, l2_bytes=fig.l2_bytes,
                    device_source="space file" if "sm_count" in space.extra else fig.source)
    return info


def schedule_fn(template, space, info: dict, target_kind: str, mutator_probs=None):
    """MetaSchedule's space generator over ``template``'s sketch of a kernel in ``space``; ``mutator_probs``: its
    mutators (default: the target's; the tuner adds the config-neighbour mutator, ``tune.spaces.sketch_mutators``)."""
    def fn(sch):
        return template.schedule(sch, space, info)

    postprocs = template.postprocs(space)
    return ms.space_generator.ScheduleFn(fn, sch_rules=[], postprocs=target_kind if postprocs is None else postprocs,
                                         mutator_probs=target_kind if mutator_probs is None else mutator_probs)


def tune_context(mod, target, generator, seed: int = -1):
    """A MetaSchedule tune context over ``generator``'s space (to list its sketches and post-process them);
    ``seed`` -1: MetaSchedule's own."""
    return ms.TuneContext(mod=mod, target=target, space_generator=generator,
                          search_strategy=ms.search_strategy.ReplayTrace(), task_name="sketches", rand_state=seed)


def postprocessor(ctx) -> Callable:
    """``apply(sch) -> bool``: the space's postprocessors run on a candidate as MetaSchedule runs them (False
    where one rejects it, e.g. too many threads)."""
    postprocs = list(ctx.space_generator.postprocs)
    for p in postprocs:
        p._initialize_with_tune_context(ctx)

    def apply(sch) -> bool:
        sch.enter_postproc()
        return all(p.apply(sch) for p in postprocs)

    return apply


def config_trace(sketches: list, candidates_key: str, choose: Callable):
    """The trace of the sketch among ``sketches`` that annotates config candidates under ``candidates_key`` (the
    flash, wgmma and row-program templates), with its config (the first decision) the index ``choose(names)``
    picks among the candidates' names; None where no sketch carries them or ``choose`` declines."""
    sketch = next((s for s in sketches if candidates_key in s.mod["main"].body.block.annotations), None)
    if sketch is None:
        return None
    index = choose(str(sketch.mod["main"].body.block.annotations[candidates_key]).split(";"))
    if index is None:
        return None
    first = next(i for i in sketch.trace.insts if i.kind.name == "SampleCategorical")  # the config comes first
    return sketch.trace.with_decision(first, index, remove_postproc=True)


def traced_default(template, sketcher, mod, target, space):
    """The schedule an untuned build gives ``mod``'s kernel (``main``) through ``template``, as a traced sketch of
    the design space of ``sketcher`` (the template whose sketch is ``template.searched_in``) in ``space`` (the
    kernel's class block): a Schedule whose trace a database can keep, or None where ``space`` does not tune the
    kernel with that sketch, the template does not take it, or the sketch cannot schedule it."""
    from tvmfuse._tvm import ensure_tensor_intrinsics

    kind = target.kind.name
    if (sketcher is None or space is None or kind not in template.targets
            or space.template != template.searched_in or template.fits(mod["main"], target) is not None):
        return None
    try:
        ensure_tensor_intrinsics(kind, tensor_cores=sketcher.tensor_cores)
        ctx = tune_context(mod, target, schedule_fn(sketcher, space, sketch_info(space, target), kind))
        sketches = ctx.generate_design_space()
    except Exception:  # noqa: BLE001 - the sketch cannot schedule this kernel: the space falls back past it too
        return None
    found = template.default_trace(mod["main"], target, space, sketches)
    if found is None:
        return None
    trace, postprocess = found
    sch = tvm.s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    # post-processed where the template asks (the pointwise unroll annotation becomes loop pragmas); the kernels
    # written whole need none: the builder swaps them in
    return sch if not postprocess or postprocessor(ctx)(sch) else None
