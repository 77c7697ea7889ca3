"""Tuning tasks: one per distinct fused kernel of a partitioned module."""
from __future__ import annotations

from dataclasses import dataclass

from tvmfuse._tvm import estimate_flops, is_scheduled, ms, structural_hash, tvm
from tvmfuse.target import TargetInfo


@dataclass(frozen=True)
class Kernel:
    """A fused kernel to tune.

    ``mod`` is MetaSchedule's normalized workload (the PrimFunc as ``main``); ``weight`` is how many
    times the model calls it; ``flops`` is TVM's static estimate.
    """

    name: str
    mod: tvm.IRModule
    weight: int
    flops: float
    extracted: object  # ms.ExtractedTask

    @property
    def workload_hash(self) -> int:
        return structural_hash(self.mod)


def extract_kernels(fused_mod: tvm.IRModule, *, target: TargetInfo) -> list[Kernel]:
    """One :class:`Kernel` per structurally distinct PrimFunc the Relax ``main`` calls, less those scheduled where
    they were made (topi's sorts and scans: the build runs them as they are, ``prescheduled``, so a record of
    theirs would never be applied)."""
    tasks = ms.relax_integration.extract_tasks(fused_mod, target.target)
    kernels = []
    for task in tasks:
        if is_scheduled(task.dispatched[0]["main"]):
            continue
        try:
            flops = estimate_flops(task.dispatched[0])
        except Exception:  # noqa: BLE001 - TVM's estimator rejects some loop nests; weigh those as 0
            flops = 0.0
        kernels.append(Kernel(name=str(task.task_name), mod=task.dispatched[0], weight=int(task.weight),
                              flops=flops, extracted=task))
    return kernels
