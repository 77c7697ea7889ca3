"""Search spaces from ``search_spaces/<target>.yaml``: classify each fused kernel, build its MetaSchedule space.

A space file names, per kernel class, a *template* (the sketch of a kernel template in the registry,
:mod:`tvmfuse.kernels`, whose numeric knobs are ``sample_categorical`` decisions MetaSchedule searches over and
whose structural choices are separate sketches) or ``stock`` (MetaSchedule's post-order-apply space with a named
rule set). Every space is tried once on the CPU before tuning (:func:`select_space`): a template that cannot
schedule a kernel, or a stock rule set that yields no schedule (the tensor-core rule on some shapes), falls back to
the next space, and the choice and the reason are reported.

Kernel classes: ``pointwise`` (injective blocks only), ``row_reduction`` (reductions over the last axis
with prologue/epilogue: add+LayerNorm, RMSNorm, softmax), ``gemm`` and ``conv`` (a multiply-accumulate
reduction with an epilogue), ``attention`` (the planner's online-softmax kernel, ``tvmfuse.kernel``
attribute), ``other``.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from tvmfuse._tvm import ms, tvm
from tvmfuse.errors import TvmfuseError
from tvmfuse.kernels import code_digest, registry, sketch_template
from tvmfuse.kernels.knobs import Knob, names_in
from tvmfuse.kernels.sketch import DATA_PAR, REDUCE, is_attention, root_blocks
from tvmfuse.kernels.space import postprocessor, schedule_fn, sketch_info, tune_context

# shipped inside the package (a non-editable install has no source tree); ``search_spaces/`` at the top of the
# repository links here, where users read and edit them
SPACES_DIR = Path(__file__).resolve().parents[1] / "search_spaces"
CLASSES = ("pointwise", "row_reduction", "gemm", "conv", "attention", "other")


# ----------------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class ClassSpace:
    name: str
    template: str
    knobs: dict = field(default_factory=dict)
    stock_rules: str | None = None
    fallback_rules: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SpaceFile:
    version: str
    target: str
    classes: dict
    builder_timeout_s: float
    path: Path
    digest: str

    def for_class(self, name: str) -> ClassSpace:
        return self.classes.get(name) or self.classes["other"]


class SpaceError(TvmfuseError):
    exit_code = 2


def _parse_knob(name: str, spec) -> Knob:
    if isinstance(spec, list):
        spec = {"values": spec}
    if not isinstance(spec, dict) or not spec.get("values"):
        raise SpaceError(f"knob '{name}' needs a non-empty 'values' list")
    values = tuple(spec["values"])
    probs = tuple(float(p) for p in spec.get("probs", [1.0 / len(values)] * len(values)))
    if len(probs) != len(values) or any(p < 0 for p in probs) or sum(probs) <= 0:
        raise SpaceError(f"knob '{name}': 'probs' must be as many non-negative weights as 'values'")
    total = sum(probs)
    return Knob(name, values, tuple(p / total for p in probs))


def load_space_file(path: str | Path) -> SpaceFile:
    """Parse and validate one space file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpaceError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(doc, dict) or "version" not in doc or "classes" not in doc:
        raise SpaceError(f"{path}: a space file needs 'version' and 'classes'")
    classes = {}
    for cname, spec in (doc["classes"] or {}).items():
        if cname not in CLASSES:
            raise SpaceError(f"{path}: unknown kernel class '{cname}'", hint="classes: " + ", ".join(CLASSES))
        spec = dict(spec or {})
        template = spec.pop("template", "stock")
        if template != "stock" and sketch_template(template) is None:
            sketches = sorted(t.sketch_name for t in registry() if t.sketch_name)
            raise SpaceError(f"{path}: class '{cname}': unknown template '{template}'",
                             hint="templates: stock, " + ", ".join(sketches))
        knobs = {k: _parse_knob(k, v) for k, v in (spec.pop("knobs", None) or {}).items()}
        classes[cname] = ClassSpace(cname, template, knobs, spec.pop("stock_rules", None),
                                    spec.pop("fallback_rules", None), spec)
    classes.setdefault("other", ClassSpace("other", "stock", {}, None))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return SpaceFile(version=str(doc["version"]), target=str(doc.get("target", path.stem)), classes=classes,
                     builder_timeout_s=float(doc.get("builder_timeout_s", 60)), path=path, digest=digest)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> SpaceFile:
    return load_space_file(path)


def load_spaces(target_kind: str, directory: str | Path | None = None) -> SpaceFile:
    """The space file for a target kind (``cuda`` or ``llvm``)."""
    path = Path(directory or SPACES_DIR) / f"{target_kind}.yaml"
    if not path.exists():
        raise SpaceError(f"no search-space file {path}")
    return _load_cached(str(path), path.stat().st_mtime)


# ----------------------------------------------------------------------------------- classification
def classify(func) -> str:
    """The kernel class of a fused PrimFunc (see module docstring)."""
    if is_attention(func):
        return "attention"
    blocks = root_blocks(func)
    if not blocks:
        return "other"
    reductions = [b for b in blocks if any(int(iv.iter_type) == REDUCE for iv in b.iter_vars)]
    if not reductions:
        if all(all(int(iv.iter_type) == DATA_PAR for iv in b.iter_vars) for b in blocks):
            return "pointwise"
        return "other"
    names = " ".join(b.name_hint.lower() for b in reductions)
    if "conv" in names:
        return "conv"
    if any(w in names for w in ("matmul", "dense", "einsum")):
        return "gemm"
    # a reduction reading two different tensors both indexed by the reduction var is a contraction
    for b in reductions:
        rvars = {str(iv.var.name) for iv in b.iter_vars if int(iv.iter_type) == REDUCE}
        with_r = {r.source.name for r in b.reads if any(names_in(rg.min) & rvars for rg in r.region)}
        if len(with_r) >= 2:
            return "gemm"
    return "row_reduction"


# ------------------------------------------------------------------------------------ space selection
@dataclass(frozen=True)
class SpaceChoice:
    """What a kernel is tuned in: ``generator`` for ``extracted_tasks_to_tune_contexts(space=...)``."""

    kernel_class: str
    source: str            # template:<name> | stock:<rules> | stock:<fallback> (after <reason>)
    generator: object      # ms SpaceGenerator, or the string "post-order-apply"
    version: str
    note: str = ""

    def to_json(self) -> dict:
        return {"class": self.kernel_class, "space": self.source, "version": self.version, "note": self.note}


def sketch_mutators(template, target_kind: str):
    """The mutators of ``template``'s sketch: the target's, and where the sketch samples a template's config (its
    own, or the configs of a template it offers), the config-neighbour mutator (:mod:`tvmfuse.kernels.mutator`):
    MetaSchedule alone never moves a config index to a nearby config."""
    from tvmfuse.kernels.mutator import mutator_probs

    keys = tuple((t.candidates_key, t.index_key) for t in registry()
                 if t.candidates_key and t.index_key and t.searched_in == template.sketch_name)
    return mutator_probs(target_kind, keys) if keys else target_kind


def _stock(rules: str | None, target_kind: str):
    kind = rules or target_kind
    return ms.space_generator.PostOrderApply(sch_rules=kind, postprocs=kind, mutator_probs=kind)


def _dry_run(generator, mod, target, tensor_cores: bool) -> int:
    """Generate the design space once on the CPU; the number of sketches (raises if it fails)."""
    from tvmfuse._tvm import ensure_tensor_intrinsics

    ensure_tensor_intrinsics(target.kind.name, tensor_cores=tensor_cores)
    return len(tune_context(mod, target, generator).generate_design_space())


def select_space(mod, target, spaces: SpaceFile | None = None) -> SpaceChoice:
    """Classify the kernel ``mod`` (``main`` = the fused PrimFunc) and build its space, falling back cleanly."""
    kind = target.kind.name
    spaces = spaces or load_spaces(kind)
    func = mod["main"]
    cls = classify(func)
    space = spaces.for_class(cls)
    info = sketch_info(space, target)
    # (source, make the generator, its traces tensorize); MetaSchedule names its tensor-core rule sets *-tensorcore
    attempts: list[tuple[str, Callable, bool]] = []
    if space.template != "stock":
        tmpl = sketch_template(space.template)
        attempts.append((f"template:{space.template}",
                         lambda: schedule_fn(tmpl, space, info, kind, sketch_mutators(tmpl, kind)), tmpl.tensor_cores))
    else:
        rules = space.stock_rules or kind
        attempts.append((f"stock:{rules}", lambda: _stock(space.stock_rules, kind), "tensorcore" in rules))
    if space.fallback_rules:
        attempts.append((f"stock:{space.fallback_rules}", lambda: _stock(space.fallback_rules, kind),
                         "tensorcore" in space.fallback_rules))
    if not any(src == f"stock:{kind}" for src, _, _ in attempts):
        attempts.append((f"stock:{kind}", lambda: _stock(kind, kind), False))
    notes = []
    for source, make, tensor_cores in attempts:
        try:
            gen = make()
            if source == f"stock:{kind}":  # the target's own space: the last resort, not dry-run
                return SpaceChoice(cls, source, gen, spaces.version, "; ".join(notes))
            n = _dry_run(gen, mod, target, tensor_cores)
        except Exception as err:  # noqa: BLE001 - a space that cannot schedule this kernel: try the next
            notes.append(f"{source} failed: {(str(err).strip().splitlines() or [type(err).__name__])[-1][:160]}")
            continue
        if n == 0:
            notes.append(f"{source} yielded no schedule")
            continue
        return SpaceChoice(cls, source, gen, spaces.version, "; ".join(notes))
    # nothing worked: MetaSchedule's target default (the tuner reports what happens)
    return SpaceChoice(cls, "post-order-apply", "post-order-apply", spaces.version, "; ".join(notes))


def sample_schedules(mod, target, choice: SpaceChoice, n: int = 4, seed: int = 0) -> list:
    """``n`` random points of a kernel's space, post-processed as MetaSchedule would build them.

    Returns scheduled IRModules, with template kernels swapped in (:func:`tvmfuse.kernels.expand`) as the
    builder swaps them (the ones whose post-processing rejected them, e.g. too many threads, are skipped, as
    MetaSchedule skips them).
    """
    from tvmfuse.kernels import expand

    gen = choice.generator
    if isinstance(gen, str):
        gen = _stock(None, target.kind.name)
    ctx = tune_context(mod, target, gen, seed)
    sketches = ctx.generate_design_space()
    postprocess = postprocessor(ctx)
    out = []
    tries = 0
    while len(out) < n and tries < 8 * n:
        sketch = sketches[tries % len(sketches)]
        tries += 1
        sch = tvm.s_tir.Schedule(mod, seed=seed + tries)
        tvm.s_tir.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        if postprocess(sch):
            out.append(expand(sch.mod))
    return out


# ----------------------------------------------------------------------------------------- record keys
def space_key(mod, spaces: SpaceFile | None) -> str:
    """What keys a tuning record of the kernel ``mod`` (``main``) besides its workload, target and device: a hash
    of the space file's contents (``spaces``, the target's) and of the code of the template its class is tuned
    with, which includes the templates whose kernels that template's sketch selects (``kernels.code_digest``).
    A record made under another space file or other template code has another key, so it is never served."""
    if spaces is None:   # a target kind without a space file: MetaSchedule's stock space, nothing of ours
        return hashlib.sha256(b"no space file").hexdigest()[:16]
    try:
        cls = classify(mod["main"])
    except Exception:  # noqa: BLE001 - a workload classify() cannot read is tuned in the `other` space
        cls = "other"
    space = spaces.for_class(cls)
    template = sketch_template(space.template) if space.template != "stock" else None
    # a stock space's first record is the untuned build's kernel: the code of the templates that write it for
    # this target without a sketch of their own (the CPU default) keys it too
    stock = ["stock"] + [code_digest(t) for t in registry() if spaces.target in t.targets
                          and t.sketch_name is None and t.searched_in is None]
    text = "\n".join([spaces.digest, cls, space.template, code_digest(template) if template else ",".join(stock)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
