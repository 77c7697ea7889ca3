"""Stage 3: the kernel templates, one package each behind :class:`~tvmfuse.kernels.base.KernelTemplate`, and the
registry that the tuner, the build and the inspector loop over (no caller knows a template by name).

Adding a template is its package here plus its block in ``tvmfuse/search_spaces/*.yaml``
(``docs/adding-a-template.md``).
"""
from __future__ import annotations

from functools import lru_cache

from tvmfuse.kernels.base import KernelTemplate, files_digest

__all__ = ["KernelTemplate", "code_digest", "default_schedule", "expand", "get", "registry", "sketch_template",
           "untuned_kernel"]


@lru_cache(maxsize=1)
def registry() -> tuple[KernelTemplate, ...]:
    """The templates, in the order an untuned build asks them for a kernel (the first that writes one wins) and
    a tuned module's kernels are expanded."""
    from tvmfuse.kernels.cpu import CpuTemplate
    from tvmfuse.kernels.flash import FlashTemplate
    from tvmfuse.kernels.gemv import GemvTemplate
    from tvmfuse.kernels.pointwise import PointwiseTemplate
    from tvmfuse.kernels.row_reduction import RowReductionTemplate
    from tvmfuse.kernels.rows import RowsTemplate
    from tvmfuse.kernels.tensorcore import TensorCoreTemplate
    from tvmfuse.kernels.wgmma import WgmmaTemplate

    # gemv before wgmma: a GEMM of at most 16 rows is the weight's bytes, which wgmma's 64-row tiles would pad
    return (FlashTemplate(), GemvTemplate(), WgmmaTemplate(), RowsTemplate(), PointwiseTemplate(), TensorCoreTemplate(),
            RowReductionTemplate(), CpuTemplate())


def get(name: str) -> KernelTemplate:
    """The template named ``name``."""
    for t in registry():
        if t.name == name:
            return t
    raise KeyError(f"no kernel template '{name}' (templates: {', '.join(t.name for t in registry())})")


def sketch_template(sketch_name: str | None) -> KernelTemplate | None:
    """The template whose MetaSchedule sketch a space file names ``template: <sketch_name>``, or None."""
    return next((t for t in registry() if sketch_name is not None and t.sketch_name == sketch_name), None)


def _tvm_target(target):
    """A TVM target from a ``tvmfuse.target.TargetInfo`` (what the build holds) or a TVM target."""
    return target.target if hasattr(target, "canonical") else target


def untuned_kernel(func, target, space=None) -> tuple[str, object] | None:
    """(schedule source, kernel) of the first template that writes an untuned kernel for ``func`` on ``target``,
    or None (dlight's rules then take it). ``space``: the kernel's class block of the target's space file, which
    a template whose default is a point of its knobs (pointwise) needs (``tvmfuse.tune.defaults.untuned_kernel``
    passes it)."""
    target = _tvm_target(target)
    for t in registry():
        if target.kind.name in t.targets:
            kernel = t.default_kernel(func, target, space)
            if kernel is not None:
                return t.untuned_source, kernel
    return None


def default_schedule(mod, target, space):
    """The schedule an untuned build gives the kernel ``mod`` (``main``) on ``target`` as a traced sketch of its
    class's ``space``: the first template's that has one (see :func:`tvmfuse.kernels.space.traced_default`), or
    None."""
    from tvmfuse.kernels.space import traced_default

    for t in registry():
        sch = traced_default(t, sketch_template(t.searched_in), mod, target, space)
        if sch is None and target.kind.name in t.targets:
            sch = t.traced_kernel(mod, target, space)
        if sch is not None:
            return sch
    return None


def expand(mod):
    """``mod`` with the kernels of templates written whole (flash attention, the GEMV, Hopper's wgmma GEMM, the row program)
    swapped in for the PrimFuncs whose tuned schedules select them. Everything that builds a scheduled module
    (MetaSchedule's builder, the kernel check, ``compile``) passes it through here first."""
    for t in registry():
        mod = t.expand(mod)
    return mod


def code_digest(template: KernelTemplate) -> str:
    """A hash of the code of ``template`` and of the templates it :attr:`~KernelTemplate.uses` (whose kernels its
    sketch selects), directly or not: part of the key of every record tuned with its sketch."""
    files, todo, seen = set(), [template], set()
    while todo:
        t = todo.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        files.update(t.source_files())
        todo.extend(get(name) for name in t.uses)
    return files_digest(files)
