"""The CPU default: the kernel an untuned llvm build runs for every kernel class (pointwise chains, row
reductions, GEMMs and convs), parallel over the target's cores and vectorised at its vector width
(``schedule``). Without it an untuned CPU kernel kept TVM's plain lowering: scalar, single-threaded loops
(MobileNetV2-style CNN at 112x112: 51 ms against onnxruntime's 2.8 ms).

GEMMs and convs are tuned over ``sketch``: the default's register block, packed width, reduction unroll and loop
order as knobs (``search_spaces/llvm.yaml``); every other class over MetaSchedule's stock CPU space. The tuner
measures this default first and keeps it as a record, so a tuned build is never slower.
"""
from __future__ import annotations

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.cpu.schedule import cpu_schedule, pack_weights, vector_lanes
from tvmfuse.kernels.cpu.sketch import contraction_sketches
from tvmfuse.kernels.sketch import is_attention

__all__ = ["CpuTemplate", "cpu_schedule", "vector_lanes"]


def _cores(target) -> int:
    try:
        return max(1, int(target.attrs.get("num-cores", 1)))
    except (TypeError, ValueError):
        return 1


class CpuTemplate(KernelTemplate):
    """Every kernel class on llvm; its untuned kernel is a hand schedule (see ``schedule``); GEMMs and convs also
    have a sketch whose knobs are the hand schedule's choices (``sketch``, ``template: cpu_contraction``)."""

    name = "cpu"
    targets = ("llvm",)
    kernel_classes = ("pointwise", "row_reduction", "gemm", "conv", "other")
    sketch_name = "cpu_contraction"
    searched_in = "cpu_contraction"
    knobs = ("vectors", "rows", "unroll", "order")

    def schedule(self, sch, space, info: dict) -> list:
        return contraction_sketches(sch, space, info)

    def fits(self, func, target) -> str | None:
        if target.kind.name not in self.targets:
            return super().fits(func, target)
        if is_attention(func):
            return "the planner's attention kernel"
        return None

    def traced_kernel(self, mod, target, space=None):
        if self.fits(mod["main"], target) is not None:
            return None
        try:
            found = cpu_schedule(mod, target, _cores(target))
        except Exception:  # noqa: BLE001 - a kernel the rules cannot schedule keeps TVM's plain lowering
            return None
        if found is None:
            return None
        sch, kind = found
        if kind == "contraction":
            pack_weights(sch)
        return sch

    def default_kernel(self, func, target, space=None):
        from tvmfuse._tvm import tvm

        sch = self.traced_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target, space)
        return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)
