"""The registry of tvmfuse's kernel templates: what an untuned build and a tuned record's expansion ask of each.

A template is named by the schedule source it gives a kernel an untuned build leaves to it (``flash-default``,
``wgmma-default``, ``rows-default``, ``pointwise-default``); ``default_kernel`` writes that kernel, or returns None
where the template does not take the kernel (then the next template is asked, in registry order, and dlight's
rules take what none takes). ``compile`` loops over :func:`registry`; adding a template adds an entry here and, for
a template whose kernels are written whole (not reached by schedule primitives), its expansion of tuned sketches
to :func:`tvmfuse.tune.expand.expand`, which the search-space code below this module calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

from tvmfuse._tvm import PrimFunc, tvm


@dataclass(frozen=True)
class KernelTemplate:
    name: str
    targets: tuple[str, ...]   # target kinds it writes kernels for
    default_kernel: Callable[[PrimFunc, object], Optional[PrimFunc]]   # (planner's kernel, TargetInfo) -> kernel

    @property
    def untuned_source(self) -> str:
        """The schedule source an untuned build reports for a kernel this template wrote."""
        return f"{self.name}-default"


def _flash_default(func, target):
    import tvmfuse.tune.flash as flash
    import tvmfuse.tune.hopper as hopper
    from tvmfuse.plan.attention import tiled_gpu_misfit

    # the planner forms attention on CUDA only where the template fits; a module planned elsewhere may not
    spec = flash.spec_of(func)
    if spec is None or tiled_gpu_misfit(spec) is not None:
        return None
    return flash.flash_kernel(func, wgmma=hopper.supports(target.target))


def _wgmma_default(func, target):
    import tvmfuse.tune.hopper as hopper

    # Hopper GEMMs and convs: dlight's rules have no tensor cores
    return hopper.default_kernel(func, target.target)


def _rows_default(func, target):
    import tvmfuse.tune.rows as rows

    # softmax, norms: dlight's schedule ran softmax 65536x2048 at 268 us on the H200, the program's default 131 us
    return rows.default_kernel(func)


def _pointwise_default(func, target):
    from tvmfuse.tune.spaces import pointwise_default_schedule

    # the pointwise template at the space's `untuned` knobs (SwiGLU on the H200: 185 us, dlight's 481)
    sch = pointwise_default_schedule(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target.target)
    return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)


@lru_cache(maxsize=1)
def registry() -> tuple[KernelTemplate, ...]:
    """The templates, in the order an untuned build asks them."""
    return (
        KernelTemplate("flash", ("cuda",), _flash_default),
        KernelTemplate("wgmma", ("cuda",), _wgmma_default),
        KernelTemplate("rows", ("cuda",), _rows_default),
        KernelTemplate("pointwise", ("cuda",), _pointwise_default),
    )


def untuned_kernel(func: PrimFunc, target) -> tuple[str, PrimFunc] | None:
    """(schedule source, kernel) of the first template that takes ``func`` on ``target``, or None."""
    for t in registry():
        if target.kind in t.targets:
            kernel = t.default_kernel(func, target)
            if kernel is not None:
                return t.untuned_source, kernel
    return None


