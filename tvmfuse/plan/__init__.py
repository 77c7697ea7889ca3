"""Stage 2: partition a Relax module into fused kernels and explain the decisions (a :class:`Plan`)."""
from tvmfuse.plan.partition import PLANNERS, partition
from tvmfuse.plan.report import Group, Plan, Rejection

__all__ = ["PLANNERS", "partition", "Plan", "Group", "Rejection"]
