"""Features the cost model sees for a candidate: MetaSchedule's per-store features, and the knobs of the config a
template sketch chose.

The kernels tvmfuse writes whole (flash attention, the wgmma GEMM, the row program) are sketched as one
placeholder schedule whose root block carries the candidate configs' names and the sampled index; the builder
swaps in the template's kernel for that config. Every config of such a kernel therefore has the same per-store
features, and a cost model on them alone cannot tell the configs apart: it predicts one value for all of them.
:class:`TemplateFeatures` appends to each store's row the chosen template (one-hot) and the config's knobs, read
from its name (``t512 r1 m1``, ``g2 m1 n256 k64 s4 r8 z128 f2 t1``, ``w8 n64 s2 h``: a letter and a number each,
a bare letter a flag), the number as log2(1 + n), one column per letter; configs that differ differ in features.
Then the config's launch on the GPU (:data:`ANALYTIC`: its grid, threads, shared memory, padding of partial tiles,
work a block, blocks an SM, waves over the SMs and how full the last one is), from the template's figures, which
let one model carry what it learnt at one shape to the next.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from tvmfuse._tvm import derived_object, ms, tvm
from tvmfuse.kernels import registry
from tvmfuse.kernels.base import FIGURES
from tvmfuse.kernels.annotations import chosen
from tvmfuse.kernels.mutator import knob_vector

_LETTERS = 26


@lru_cache(maxsize=1)
def _keyed() -> tuple:
    """(name, candidates_key, index_key) of each template whose sketch annotates a config choice."""
    return tuple((t.name, t.candidates_key, t.index_key) for t in registry() if t.candidates_key and t.index_key)


# the analytic columns after the knobs: a config's launch (``KernelTemplate.config_figures``) and what it makes of
# the GPU's SMs, the same columns for every template, so one model learns across shapes and templates
ANALYTIC = FIGURES + ("blocks_per_sm", "waves", "tail")


def width() -> int:
    """Columns :func:`config_features` gives."""
    return len(_keyed()) + _LETTERS + len(ANALYTIC)


def analytic(figures: dict, sm_count: int, shared_per_sm: int) -> list[float]:
    """:data:`ANALYTIC`'s columns of a config's figures on a GPU of ``sm_count`` SMs with ``shared_per_sm`` bytes of
    shared memory each: counts as log2(1 + n); ``padding`` as it is; ``blocks_per_sm`` the blocks its threads and
    shared memory let an SM hold (at most 32); ``waves`` the grid over all SMs' blocks; ``tail`` the share of the
    last wave's slots the grid fills (1: a whole number of waves)."""
    threads, shared = max(int(figures["threads"]), 1), int(figures["shared_bytes"])
    per_sm = max(min(2048 // threads, shared_per_sm // shared if shared else 32, 32), 1)
    slots, blocks = sm_count * per_sm, max(int(figures["blocks"]), 1)
    waves = blocks / slots
    tail = blocks / (-(-blocks // slots) * slots)
    log = np.log2
    return [log(1.0 + blocks), log(1.0 + threads), log(1.0 + shared), float(figures["padding"]),
            log(1.0 + float(figures["work"])), log(1.0 + per_sm), log(1.0 + waves), tail]


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


def config_features(func, device=None) -> np.ndarray:
    """The template one-hot, knob and :data:`ANALYTIC` columns of ``func``'s chosen config (``device``: the
    GPU's ``DeviceFigures``, None: the H200's); zeros where no template config is annotated (a kernel scheduled by
    primitives, whose per-store features already differ), the analytic ones zero where the template has no
    figures for it."""
    from tvmfuse.kernels import get

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
    figures = get(template).config_figures(func, name)
    if figures is not None:
        if device is None:
            from tvmfuse.target import device_figures

            device = device_figures(None)
        out[base + _LETTERS:] = analytic(figures, device.sm_count, device.shared_per_sm)
    return out


@derived_object
class TemplateFeatures(ms.feature_extractor.PyFeatureExtractor):
    """MetaSchedule's per-store features with each candidate's :func:`config_features` appended to every row."""

    def __init__(self):
        super().__init__()
        self.per_store = ms.feature_extractor.PerStoreFeature()
        self.devices: dict = {}

    def _device(self, target):
        from tvmfuse.target import device_figures

        key = str(target)
        if key not in self.devices:
            self.devices[key] = device_figures(target) if target is not None and target.kind.name == "cuda" else None
        return self.devices[key]

    def extract_from(self, context, candidates):
        out = []
        device = self._device(context.target)
        for cand, feats in zip(candidates, self.per_store.extract_from(context, candidates)):
            f = feats.numpy()
            extra = config_features(cand.sch.mod["main"], device).astype(f.dtype)
            out.append(tvm.runtime.tensor(np.hstack([f, np.tile(extra, (f.shape[0], 1))])))
        return out
