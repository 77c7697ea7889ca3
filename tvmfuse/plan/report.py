"""The plan: which operators became which kernel, the HBM bytes it moves, and the fusions not taken."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Group:
    """One fused kernel.

    ``bytes_unfused``: HBM bytes its operators move when each runs as its own kernel (every input read
    and every output written once per operator); ``bytes_fused``: bytes the fused kernel moves.
    """

    name: str
    pattern: str
    ops: tuple[str, ...]
    bytes_unfused: int
    bytes_fused: int

    @property
    def kernels_unfused(self) -> int:
        return max(1, len(self.ops))


@dataclass(frozen=True)
class Rejection:
    ops: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Plan:
    planner: str
    groups: tuple[Group, ...]
    rejected: tuple[Rejection, ...] = field(default=())

    @property
    def totals(self) -> dict:
        return {
            "kernels_unfused": sum(g.kernels_unfused for g in self.groups),
            "kernels_fused": len(self.groups),
            "bytes_unfused": sum(g.bytes_unfused for g in self.groups),
            "bytes_fused": sum(g.bytes_fused for g in self.groups),
        }

    def group(self, name: str) -> Group | None:
        return next((g for g in self.groups if g.name == name), None)

    def to_json(self) -> dict:
        return {
            "planner": self.planner,
            "groups": [{**asdict(g), "ops": list(g.ops)} for g in self.groups],
            "totals": self.totals,
            "rejected": [{"ops": list(r.ops), "reason": r.reason} for r in self.rejected],
        }
