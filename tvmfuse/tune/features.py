"""Features the cost model sees for a candidate: MetaSchedule's per-store features, and the knobs of the config a
template sketch chose.

The kernels tvmfuse writes whole (flash attention, the wgmma GEMM, the row program) are sketched as one
placeholder schedule whose root block carries the candidate configs' names and the sampled index; the builder
swaps in the template's kernel for that config. Every config of such a kernel therefore has the same per-store
features, and a cost model on them alone cannot tell the configs apart: it predicts one value for all of them.
:class:`TemplateFeatures` appends to each store's row the chosen template (one-hot) and the config's knobs, read
from its name (``t512 r1 m1``, ``g2 m1 n256 k64 s4 r8 z128 f2 t1``, ``w8 n64 s2 h``: a letter and a number each,
a bare letter a flag), the number as log2(1 + n), one column per letter; configs that differ differ in features.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from tvmfuse._tvm import derived_object, ms, tvm
from tvmfuse.kernels import registry
from tvmfuse.kernels.annotations import chosen
from tvmfuse.kernels.mutator import knob_vector

_LETTERS = 26


@lru_cache(maxsize=1)
def _keyed() -> tuple:
    """(name, candidates_key, index_key) of each template whose sketch annotates a config choice."""
    return tuple((t.name, t.candidates_key, t.index_key) for t in registry() if t.candidates_key and t.index_key)


def width() -> int:
    """Columns :func:`config_features` gives."""
    return len(_keyed()) + _LETTERS


def config_name(func) -> tuple[str, str] | None:
    """(template, config name) a template sketch annotated on ``func``'s root block, or None."""
    block = getattr(getattr(func, "body", None), "block", None)
    if block is None:
        return None
    notes = block.annotations
    for name, candidates, index in _keyed():
        if candidates in notes and index in notes:
            return name, chosen(notes[candidates], notes[index], name)
    return None


def config_features(func) -> np.ndarray:
    """The template one-hot and knob columns of ``func``'s chosen config; zeros where no template config is
    annotated (a kernel scheduled by primitives, whose per-store features already differ)."""
    out = np.zeros(width(), dtype="float32")
    found = config_name(func)
    if found is None:
        return out
    template, name = found
    out[[n for n, _, _ in _keyed()].index(template)] = 1.0
    base = len(_keyed())
    # a knob's column is its first letter; log2(1 + value) keeps tiles and counts comparable (a flag, "h", is 1)
    for letters, value in knob_vector(name).items():
        out[base + ord(letters[0]) - ord("a")] = np.log2(1.0 + value)
    return out


@derived_object
class TemplateFeatures(ms.feature_extractor.PyFeatureExtractor):
    """MetaSchedule's per-store features with each candidate's :func:`config_features` appended to every row."""

    def __init__(self):
        super().__init__()
        self.per_store = ms.feature_extractor.PerStoreFeature()

    def extract_from(self, context, candidates):
        out = []
        for cand, feats in zip(candidates, self.per_store.extract_from(context, candidates)):
            f = feats.numpy()
            extra = config_features(cand.sch.mod["main"]).astype(f.dtype)
            out.append(tvm.runtime.tensor(np.hstack([f, np.tile(extra, (f.shape[0], 1))])))
        return out
