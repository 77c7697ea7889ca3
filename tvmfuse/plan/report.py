"""The plan: which operators became which kernel, the HBM bytes it moves, and the fusions not taken."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Group:
    """One fused kernel (one call site in ``main``).

    ``bytes_unfused``: HBM bytes its operators move when each runs as its own kernel (every input read
    and every output written once per operator); ``bytes_fused``: bytes the fused kernel moves.
    ``kernel``: the PrimFunc it calls; ``notes``: residual reuse and rewrites (read once instead of
    twice, BatchNorm folded, ...); ``score``: the cost model's gain for the last merge (bytes).
    """

    name: str
    pattern: str
    ops: tuple[str, ...]
    bytes_unfused: int
    bytes_fused: int
    kernel: str = ""
    notes: tuple[str, ...] = ()
    score: float = 0.0

    @property
    def kernels_unfused(self) -> int:
        return max(1, len(self.ops))

    @property
    def launches_saved(self) -> int:
        return self.kernels_unfused - 1


@dataclass(frozen=True)
class Rejection:
    ops: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Plan:
    planner: str
    groups: tuple[Group, ...]
    rejected: tuple[Rejection, ...] = field(default=())
    rewrites: tuple[str, ...] = field(default=())

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

    def by_pattern(self, pattern: str) -> list[Group]:
        return [g for g in self.groups if g.pattern == pattern]

    def to_json(self) -> dict:
        return {
            "planner": self.planner,
            "groups": [{**asdict(g), "ops": list(g.ops), "notes": list(g.notes),
                        "kernels_unfused": g.kernels_unfused, "launches_saved": g.launches_saved}
                       for g in self.groups],
            "totals": self.totals,
            "rejected": [{"ops": list(r.ops), "reason": r.reason} for r in self.rejected],
            "rewrites": list(self.rewrites),
        }
