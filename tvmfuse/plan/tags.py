"""What the high-level rewrites tell the planner about the nodes they created, keyed by var name.

A folded BatchNorm, a fused attention or a horizontally merged GEMM replaces several original operators;
the plan accounts for them as the operators they replaced (kernels and HBM bytes before fusion).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tag:
    tag: str                      # "bn_folded", "attention", "horizontal", "split", "gated", "pair"
    ops: tuple[str, ...]          # the original operators this node stands for (may be empty)
    bytes_unfused: int            # their HBM bytes, each as its own kernel
    note: str = ""


@dataclass
class RewriteLog:
    tags: dict[str, Tag] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rejected: list = field(default_factory=list)  # Rejection objects from the rewrites
    counter: int = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}_{self.counter}"
