"""The CPU default: the kernel an untuned llvm build runs for every kernel class (pointwise chains, row
reductions, GEMMs and convs), parallel over the target's cores and vectorised at its vector width
(``schedule``). Without it an untuned CPU kernel kept TVM's plain lowering: scalar, single-threaded loops
(MobileNetV2-style CNN at 112x112: 51 ms against onnxruntime's 2.8 ms). :func:`cpu_schedule` picks the rules by
the kernel's blocks; a contraction of two activations (attention's) is first padded and packed (``activations``).

GEMMs and convs are tuned over ``sketch``: the default's register block, packed width, reduction unroll and loop
order as knobs (``search_spaces/llvm.yaml``); every other class over MetaSchedule's stock CPU space. The tuner
measures this default first and keeps it as a record, so a tuned build is never slower.
"""
from __future__ import annotations

from tvmfuse._tvm import tvm
from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.cpu.activations import pad_and_pack
from tvmfuse.kernels.cpu.int8 import is_int8_gemm, schedule_int8_kernel
from tvmfuse.kernels.cpu.reduce_all import reduces_whole, scalar_block, schedule_whole_reductions
from tvmfuse.kernels.cpu.schedule import (inner_spatial_extent, loops_are_iters, dtype_bits, is_contraction,
                                          pack_weights, schedule_contraction, schedule_norm_rows,
                                          schedule_pointwise, schedule_rows)
from tvmfuse.kernels.cpu.sketch import contraction_sketches
from tvmfuse.kernels.sketch import DATA_PAR, REDUCE, inline_all_but_outputs, is_attention, iter_types
from tvmfuse.target import has_vnni, target_cores, vector_lanes, vector_registers

__all__ = ["CpuTemplate", "cpu_schedule", "vector_lanes"]


def cpu_schedule(mod, target, cores: int):
    """The default schedule of the kernel ``mod`` (``main``) on the llvm ``target``: a Schedule whose trace
    replays it, and its kind (pointwise | contraction | rows), or None where the kernel is not one of them."""
    sch = tvm.s_tir.Schedule(mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if not blocks:
        return None

    def lanes_of(bits: int) -> int:
        return vector_lanes(target, bits)

    reductions = [b for b in blocks if REDUCE in iter_types(sch, b)]
    if any(t not in (DATA_PAR, REDUCE) for b in blocks for t in iter_types(sch, b)):
        return None
    # only flat kernels: each block under its own loops, one per iteration variable, nothing nested (a kernel
    # written with serial in-place loops, the planner's attention, is not what these rules read)
    if any(sch.get_child_blocks(b) or not (loops_are_iters(sch, b) or scalar_block(sch, b)) for b in blocks):
        return None
    if not reductions:
        schedule_pointwise(sch, lanes_of, cores)
        return sch, "pointwise"
    if all(reduces_whole(sch, b) for b in reductions):   # DynamicQuantizeLinear's min and max: no rows, no tiles
        trial = sch.copy()
        try:
            names = [sch.get(b).name_hint for b in reductions]
            schedule_whole_reductions(trial, [trial.get_sblock(n) for n in names],
                                      lanes_of(dtype_bits(trial, reductions[0])))
            return trial, "whole-reduction"
        except Exception:  # noqa: BLE001 - a ragged extent: TVM's plain lowering, as before
            return None
    contractions = [b for b in reductions if is_contraction(sch, b)]
    # one reduction along an axis that is not the output's innermost (a GEMM, a conv, a pooling window): tiles
    # vectorised along the output's innermost axis
    if len(reductions) == 1 and (contractions or inner_spatial_extent(sch, reductions[0]) >= 4):
        inline_all_but_outputs(sch)
        (block,) = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if REDUCE in iter_types(sch, b)]
        if not loops_are_iters(sch, block):
            return None
        if is_int8_gemm(sch, block) and has_vnni(target):   # a quantized GEMM: VNNI's uint8 x int8 dot products
            trial = sch.copy()
            try:
                schedule_int8_kernel(trial, trial.get_sblock(sch.get(block).name_hint), cores, lanes_of(32))
                return trial, "int8"
            except Exception:  # noqa: BLE001 - a shape VNNI's 16 x 4 steps do not tile: the int32 default below
                pass
        lanes, registers = lanes_of(dtype_bits(sch, block)), vector_registers(target)
        block = pad_and_pack(sch, block, lanes, registers)
        schedule_contraction(sch, block, lanes, registers=registers, cores=cores)
        return sch, "contraction"
    if contractions:
        return None
    # statistics of the output's rows (softmax, LayerNorm; RMSNorm's one sum of squares too): partial results
    # vectorised (an RMSNorm at 128 x 2048 as one chain of dependent adds a row: 135-270 us)
    trial = sch.copy()
    try:
        schedule_norm_rows(trial, lanes_of(dtype_bits(trial, reductions[0])), cores)
        return trial, "rows"
    except Exception:  # noqa: BLE001 - rows these rules do not read: several reductions keep TVM's plain lowering
        if len(reductions) > 1:
            return None
    schedule_rows(sch, lanes_of(dtype_bits(sch, reductions[0])), cores)
    return sch, "rows"


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
            found = cpu_schedule(mod, target, target_cores(target))
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
