"""The kernel template interface: everything the tuner, the build and the inspector ask of a template.

A template is one package under ``tvmfuse/kernels/`` whose ``__init__`` defines a :class:`KernelTemplate` subclass,
listed in :func:`tvmfuse.kernels.registry` (dlight's ``ScheduleRule``: the first that fits wins, and None means
"not mine"). What it can tell (CUTLASS's ``can_implement``, Triton's ``Config`` lists):

* :meth:`~KernelTemplate.fits`: whether it takes a kernel on a target, and if not, why;
* its knobs (the space file's entries it reads) and, for a template whose kernels are written from a config,
  :meth:`~KernelTemplate.configs` and the :meth:`~KernelTemplate.default_config` per shape;
* :meth:`~KernelTemplate.default_kernel`: the kernel an untuned build runs;
* :meth:`~KernelTemplate.schedule`: its MetaSchedule sketch, for the space file's ``template: <sketch_name>``;
* :meth:`~KernelTemplate.expand`: for a template written as whole kernels, the swap of a tuned sketch's
  annotated PrimFunc for the kernel its config names;
* :meth:`~KernelTemplate.reference`: a scalar twin that checks its kernels on the CPU, where one exists;
* :meth:`~KernelTemplate.source_files`: its code, whose hash is part of every tuning record's key.

Every method has a "does not apply" answer here, so a template implements only what it has.
"""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
# the interface, the registry and the search's config mutator: what they say changes no kernel, so they key no
# record
_NOT_KERNEL_CODE = frozenset({KERNELS / "base.py", KERNELS / "__init__.py", KERNELS / "mutator.py"})


# a config's launch (KernelTemplate.config_figures): blocks of its grid, threads and shared-memory bytes per block,
# padding (work its tiles compute past the kernel's extents, over the work the kernel needs: a partial tile's idle
# rows, columns or lanes) and work (outputs, or multiply-adds, of one block)
FIGURES = ("blocks", "threads", "shared_bytes", "padding", "work")


class KernelTemplate:
    """One kernel template. Subclasses set the class attributes and override the methods they have.

    Attributes
    ----------
    name : the registry's name; an untuned kernel it writes is reported as ``<name>-default``
    targets : the target kinds it writes kernels for
    kernel_classes : the kernel classes it serves (``tvmfuse.tune.spaces.classify``)
    sketch_name : the ``template:`` a space file names for the MetaSchedule sketch this template owns (None: none)
    searched_in : the sketch whose samples choose this template's configs or knobs (its own, or the sketch of
        another template that offers this one's kernels among its sketches)
    candidates_key : the root-block annotation holding the config names a tuned sketch chose among
    index_key : the root-block annotation holding the sampled index into them
    config_field : the key under which ``tvmfuse inspect`` shows the config a kernel's best record selects
    config_words : how ``tvmfuse inspect`` says a kernel runs a config: ``{config}`` is its name
    knobs : the knobs of its class's block in the space file that it reads
    uses : templates whose kernels its sketch may select: their code is part of this template's digest
    tensor_cores : its sketches tensorize, so the tensor intrinsics must be registered before they are applied
    """

    name: str = ""
    targets: tuple[str, ...] = ()
    kernel_classes: tuple[str, ...] = ()
    sketch_name: str | None = None
    searched_in: str | None = None
    candidates_key: str | None = None
    index_key: str | None = None
    config_field: str | None = None
    config_words: str = "the {name} template's config {config}"
    knobs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    tensor_cores: bool = False

    def __repr__(self) -> str:
        return f"<kernel template {self.name}>"

    @property
    def untuned_source(self) -> str:
        """The schedule source an untuned build reports for a kernel this template wrote."""
        return f"{self.name}-default"

    # -- fit, configs, defaults ----------------------------------------------------------------------
    def fits(self, func, target) -> str | None:
        """None when the template takes ``func`` (a planner PrimFunc) on ``target`` (a TVM target), else why not."""
        if target.kind.name not in self.targets:
            return f"the {self.name} template writes kernels for {', '.join(self.targets) or 'no target'} only"
        return None

    def configs(self, func, target, space=None) -> list:
        """The configs that fit ``func`` (from the knobs of ``space``, its class's block of the space file, where
        given); empty for a template tuned through knobs alone."""
        return []

    def default_config(self, func, target):
        """The config an untuned build runs (an object with a ``name``), or None."""
        return None

    def config_figures(self, func, name: str) -> dict | None:
        """What the config named ``name`` launches for ``func``, the cost model's analytic features across shapes
        (``tvmfuse.tune.features``): each of :data:`FIGURES`. None where the template has no configs or cannot
        read the kernel."""
        return None

    def default_kernel(self, func, target, space=None):
        """The kernel an untuned build runs for ``func`` on ``target`` (its parameters and global symbol
        ``func``'s), or None where the template does not take it. ``space``: the kernel's class block of the space
        file, for a template whose default is a point of its knobs."""
        return None

    def traced_kernel(self, mod, target, space=None):
        """For a template whose untuned kernel is a hand schedule rather than a point of a sketch (the CPU
        default): that kernel of ``mod`` (``main``) as a traced Schedule, which the tuner measures first and keeps
        as a record; None where it has none."""
        return None

    def default_trace(self, func, target, space, sketches):
        """The untuned build's kernel as a point of the design space ``sketches`` (the Schedules MetaSchedule
        generated from :attr:`searched_in`'s sketch): ``(trace, post-process it)``, or None. By default the sketch
        that carries :attr:`candidates_key`, at :meth:`default_config`."""
        cfg = self.default_config(func, target)
        if cfg is None or self.candidates_key is None:
            return None
        from tvmfuse.kernels.space import config_trace

        trace = config_trace(sketches, self.candidates_key, lambda names: names.index(cfg.name)
                             if cfg.name in names else None)
        return None if trace is None else (trace, False)

    def config_of(self, func) -> str | None:
        """The name of the config a tuned schedule of ``func`` annotated on its root block, or None."""
        return None

    # -- the MetaSchedule sketch ---------------------------------------------------------------------
    def schedule(self, sch, space, info: dict) -> list:
        """The sketches of one kernel (``sch``; ``space`` its class block; ``info``: ``sm_count``, ``target_kind``,
        ``target_arch``), each with its knobs as ``sample_categorical`` decisions; raises where it cannot."""
        raise ValueError(f"the {self.name} template has no sketch of its own")

    def postprocs(self, space) -> list | None:
        """The MetaSchedule postprocessors its candidates go through (None: the target's own)."""
        return None

    # -- kernels written whole -----------------------------------------------------------------------
    def expand(self, mod):
        """``mod`` with every PrimFunc whose tuned sketch selects one of this template's kernels replaced by it."""
        return mod

    def reference(self, func):
        """A scalar twin of the kernel it writes for ``func``, built for any target, or None."""
        return None

    # -- what keys its records -----------------------------------------------------------------------
    def source_files(self) -> list[Path]:
        """The files of its code: its package, and what it imports of ``tvmfuse.kernels``."""
        module = type(self).__module__
        path = Path(__import__(module, fromlist=["_"]).__file__)
        own = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
        return _with_imports(own)

    def digest(self) -> str:
        """A hash of :meth:`source_files`; a tuning record keys the code of its template and of the templates in
        :attr:`uses` (:func:`tvmfuse.kernels.code_digest`), so a record made with other code does not match."""
        return files_digest(self.source_files())


def files_digest(files) -> str:
    """A hash of the files' paths (below ``tvmfuse/``) and contents."""
    h = hashlib.sha256()
    for f in sorted(set(files)):
        name = f.relative_to(KERNELS.parent) if f.is_relative_to(KERNELS.parent) else f
        h.update(str(name).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _module_file(name: str) -> Path | None:
    """The source file of the ``tvmfuse`` module ``name``, or None."""
    base = KERNELS.parent.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _with_imports(files: list[Path]) -> list[Path]:
    """``files`` and every module of ``tvmfuse.kernels`` they import, directly or not."""
    seen, todo = set(), list(files)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                if n.startswith("tvmfuse.kernels.") and (found := _module_file(n)) is not None:
                    todo.append(found)
    return sorted(seen - _NOT_KERNEL_CODE)
