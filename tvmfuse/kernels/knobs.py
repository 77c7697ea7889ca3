"""Knobs: a named, searchable choice of a schedule template (values and their prior probabilities)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple
    probs: tuple

    @classmethod
    def uniform(cls, name: str, values) -> "Knob":
        values = tuple(values)
        return cls(name, values, tuple(1.0 / len(values) for _ in values))

    @classmethod
    def leaning(cls, name: str, values, first: float) -> "Knob":
        """``first`` on the first value, the rest shared equally among the others."""
        values = tuple(values)
        if len(values) == 1:
            return cls(name, values, (1.0,))
        rest = (1.0 - first) / (len(values) - 1)
        return cls(name, values, (first, *(rest for _ in values[1:])))

    def filtered(self, keep: Callable[[object], bool]) -> "Knob":
        """The values ``keep`` accepts, probabilities renormalized (the last value if none is accepted)."""
        pairs = [(v, p) for v, p in zip(self.values, self.probs) if keep(v)]
        if not pairs:
            pairs = [(self.values[-1], 1.0)]
        total = sum(p for _, p in pairs) or 1.0
        return Knob(self.name, tuple(v for v, _ in pairs), tuple(p / total for _, p in pairs))


def sample(sch, knob: Knob):
    """A MetaSchedule decision over the knob's values (what the search mutates)."""
    return sch.sample_categorical(candidates=list(knob.values), probs=list(knob.probs))


def sample_option(sch, options: list, knobs: dict):
    """A MetaSchedule decision: an index into ``options`` (template configs), each weighted by the product of
    the priors its fields have in ``knobs`` (field name -> Knob, or None for a field without a knob)."""
    weights = []
    for option in options:
        w = 1.0
        for field, knob in knobs.items():
            if knob is not None:
                w *= knob.probs[knob.values.index(getattr(option, field))]
        weights.append(w)
    total = sum(weights) or 1.0
    return sch.sample_categorical(candidates=list(range(len(options))), probs=[w / total for w in weights])


def names_in(expr) -> set[str]:
    """The identifiers in a TIR expression's text."""
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", str(expr)))
