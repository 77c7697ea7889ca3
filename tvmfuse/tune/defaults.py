"""What an untuned build runs and what the tuner measures first: the templates' defaults (:mod:`tvmfuse.kernels`)
with the target's search spaces, and a template kernel's sketch at a chosen config.

The kernel layer knows no space file; this module hands each template its kernel's class block, so the registry's
defaults whose knobs live there (the pointwise template's ``untuned`` entry) see them.
"""
from __future__ import annotations

from typing import Callable

from tvmfuse._tvm import tvm
from tvmfuse.kernels import default_schedule, get, registry, sketch_template
from tvmfuse.kernels import untuned_kernel as _template_kernel
from tvmfuse.kernels.space import config_trace, traced_default, tune_context
from tvmfuse.tune.spaces import SpaceFile, classify, load_spaces, select_space


def _class_space(func, kind: str, spaces: SpaceFile | None):
    """The class block of ``func`` in ``spaces`` (default: the target's), or None where no template writes kernels
    for ``kind`` (then no space file is read)."""
    if not any(kind in t.targets for t in registry()):
        return None
    return (spaces or load_spaces(kind)).for_class(classify(func))


def untuned_kernel(func, target) -> tuple[str, object] | None:
    """(schedule source, kernel) an untuned build runs for ``func`` on ``target`` (a ``TargetInfo``): the first
    template's default (:func:`tvmfuse.kernels.untuned_kernel`), or None for dlight's rules."""
    return _template_kernel(func, target.target, _class_space(func, target.kind, None))


def default_template_schedule(mod, target, spaces: SpaceFile | None = None):
    """The schedule an untuned CUDA build gives a template kernel (flash attention, a wgmma GEMM on sm_90a, a row
    program, a pointwise kernel) as a traced sketch, or None for other kernels."""
    space = _class_space(mod["main"], target.kind.name, spaces)
    return None if space is None else default_schedule(mod, target, space)


def template_default_schedule(mod, target, template: str, spaces: SpaceFile | None = None):
    """:func:`default_template_schedule` through the template named ``template`` only, or None."""
    t = get(template)
    if target.kind.name not in t.targets:
        return None
    space = _class_space(mod["main"], target.kind.name, spaces)
    return traced_default(t, sketch_template(t.searched_in), mod, target, space)


def _config_sketches(mod, target, template: str, spaces: SpaceFile | None):
    """(the sketches of ``mod``'s space, the candidates' annotation key) where that space tunes ``mod`` with the
    sketch whose candidates are the configs of the template named ``template``, else None."""
    t = get(template)
    if target.kind.name not in t.targets or t.candidates_key is None or t.fits(mod["main"], target) is not None:
        return None
    choice = select_space(mod, target, spaces)
    if choice.source != f"template:{t.searched_in}":
        return None
    return tune_context(mod, target, choice.generator).generate_design_space(), t.candidates_key


def _applied(mod, trace):
    sch = tvm.s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    return sch


def config_schedule(mod, target, template: str, choose: Callable, spaces: SpaceFile | None = None):
    """The sketch of ``mod``'s space whose candidates are the configs of the template named ``template`` (flash,
    wgmma, rows), with its config decided by ``choose`` (the candidates' names -> an index, or None): a Schedule
    whose trace a database can keep, or None where the space does not tune ``mod`` with that sketch, the template
    does not take it, or ``choose`` declines."""
    found = _config_sketches(mod, target, template, spaces)
    trace = None if found is None else config_trace(*found, choose)
    return None if trace is None else _applied(mod, trace)


def config_schedules(mod, target, template: str, spaces: SpaceFile | None = None) -> dict:
    """Every candidate of :func:`config_schedule`'s sketch: config name -> its Schedule, in the sketch's order, the
    space generated once ({} where :func:`config_schedule` gives None whatever the choice)."""
    found = _config_sketches(mod, target, template, spaces)
    if found is None:
        return {}
    names: list[str] = []
    config_trace(*found, lambda offered: names.extend(offered))   # lists them, chooses none
    return {n: _applied(mod, config_trace(*found, lambda offered, i=i: i)) for i, n in enumerate(names)}
