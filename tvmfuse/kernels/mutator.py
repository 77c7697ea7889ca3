"""A MetaSchedule mutator that moves a template kernel's config to a *neighbouring* config.

The templates written from a config (wgmma, flash, the row program) sample their config as one
``sample_categorical`` index into the candidates annotated on the sketch's root block. MetaSchedule has no mutator
of its own for such a decision (its categorical mutator changes unroll annotations only), so its evolutionary
search could change a config only by drawing a fresh random population: the next tile size, one more stage,
twice the warps were no likelier than any other config, and evolution could not climb from a good config to a
better one next to it. :class:`ConfigNeighbour` proposes, for the config a trace chose, one knob moved one step
with the others kept: among the candidates equal to it in every other knob, the nearest value above or below.

A config's knobs are read from its name (``g2 m1 n256 k64 s4 r8 z128 f0 t1``, ``t256 r2 v4 m1``, ``w8 n64 s2 h``:
a letter and a number each, a bare letter a flag; a knob a name leaves out is 0), as the cost model reads them.
"""
from __future__ import annotations

import random
import re

from tvmfuse._tvm import derived_object, ms

_TOKEN = re.compile(r"([a-z]+)(\d*)")
# applications per template (the config's annotation key): what a tuning run reports and the tests count
APPLIED: dict[str, int] = {}
# the mutator's share beside MetaSchedule's own mutators of the target (their probabilities sum to 1)
PROBABILITY = 0.5


def knob_vector(name: str) -> dict[str, int]:
    """The knobs a config name spells: letter(s) -> number (a bare flag letter -> 1)."""
    out: dict[str, int] = {}
    for token in name.split():
        m = _TOKEN.fullmatch(token)
        if m is None:
            continue
        letters, number = m.groups()
        if number:
            out[letters] = int(number)
        else:
            for ch in letters:
                out[ch] = 1
    return out


def neighbours(names: list[str], index: int) -> list[int]:
    """Indices of the configs next to ``names[index]``: one knob moved to the nearest value above or below among
    the configs equal to it in every other knob. Empty where it has none (a space of one config)."""
    vectors = [knob_vector(n) for n in names]
    keys = sorted({k for v in vectors for k in v})
    here = [vectors[index].get(k, 0) for k in keys]
    rows = [[v.get(k, 0) for k in keys] for v in vectors]
    out = []
    for j in range(len(keys)):
        line = [(row[j], i) for i, row in enumerate(rows)
                if row[j] != here[j] and all(row[q] == here[q] for q in range(len(keys)) if q != j)]
        above = [x for x in line if x[0] > here[j]]
        below = [x for x in line if x[0] < here[j]]
        if above:
            out.append(min(above)[1])
        if below:
            out.append(max(below)[1])
    return sorted(set(out))


def template_keys() -> tuple[tuple[str, str], ...]:
    """(candidates annotation, index annotation) of every template whose sketch samples a config."""
    from tvmfuse.kernels import registry

    return tuple((t.candidates_key, t.index_key) for t in registry() if t.candidates_key and t.index_key)


def config_decision(trace, keys):
    """(the SampleCategorical instruction of the config, the candidates' names, the chosen index, the candidates
    key) of ``trace``'s template config, or None where it annotates none of ``keys``."""
    notes = {str(inst.attrs[0]): inst.inputs[1] for inst in trace.insts if inst.kind.name == "Annotate"}
    for cand_key, idx_key in keys:
        if cand_key in notes and idx_key in notes:
            names, rv = str(notes[cand_key]).split(";"), notes[idx_key]
            for inst in trace.insts:
                if inst.kind.name == "SampleCategorical" and inst.outputs and inst.outputs[0].same_as(rv):
                    decision = trace.get_decision(inst)
                    if decision is None:
                        return None
                    # the decision is an index into the instruction's candidates, whose values index the names
                    return inst, names, int(inst.attrs[0][int(decision)]), cand_key
    return None


@derived_object
class ConfigNeighbour(ms.mutator.PyMutator):
    """Moves a template config one knob one step (:func:`neighbours`); declines (None) a trace that annotates
    no template config, or a config without neighbours, so MetaSchedule's other mutators take it."""

    def __init__(self, keys: tuple | None = None, seed: int = 0):
        super().__init__()
        self.keys = tuple(keys) if keys is not None else None
        self._rng = random.Random(seed)

    def _initialize_with_tune_context(self, context) -> None:
        if self.keys is None:
            self.keys = template_keys()

    def apply(self, trace, rand_state=None):
        found = config_decision(trace, self.keys if self.keys is not None else template_keys())
        if found is None:
            return None
        inst, names, index, key = found
        near = neighbours(names, index)
        if not near:
            return None
        if rand_state is not None:
            self._rng.seed(int(rand_state) ^ self._rng.getrandbits(32))
        choice = self._rng.choice(near)
        APPLIED[key] = APPLIED.get(key, 0) + 1
        values = [int(c) for c in inst.attrs[0]]
        return trace.with_decision(inst, values.index(choice), remove_postproc=True)

    def clone(self):
        return ConfigNeighbour(self.keys, self._rng.getrandbits(32))


def mutator_probs(target_kind: str, keys: tuple | None = None) -> dict:
    """MetaSchedule's mutators of ``target_kind`` at their probabilities scaled to ``1 - PROBABILITY``, and
    :class:`ConfigNeighbour` at :data:`PROBABILITY`: the space generator's ``mutator_probs`` of a template sketch."""
    own = {m: float(p) * (1.0 - PROBABILITY) for m, p in ms.Mutator.create(target_kind).items()}
    own[ConfigNeighbour(keys)] = PROBABILITY
    return own
