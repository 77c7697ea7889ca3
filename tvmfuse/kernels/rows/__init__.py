"""A row kernel written whole: each row in its threads' registers, read once, coalesced, written once.

A row-reduction kernel of the planner (softmax, add+LayerNorm, RMSNorm: spatial blocks over ``[rows..., N]``,
reductions over the last axis, per-row blocks between them) becomes one *row program*: ``threads`` threads own
a row (``rows_per_block`` rows per thread block), thread ``t`` holds the row's elements ``(j * threads + t) *
lanes + v`` (``j`` a vector step, ``v`` a lane) in registers, so every step's loads and stores are 16-byte
vectors contiguous across the threads. Every block of the kernel then runs on those registers in order:
spatial blocks element by element, reductions over the thread's elements and then across the threads (warp
shuffles; across warps through a few words of shared memory), per-row blocks once per thread. HBM sees each
input element read once and each output element written once.

A row too wide for its threads' registers is *streamed* instead (``stream.py``): a pass over the row per
reduction (softmax's max and sum in one, ``online``), the inputs kept in registers (``keep`` vectors a thread:
all of a ragged row that no thread count splits evenly), staged in shared memory or re-read through L2.

The schedule-based ``registers`` sketch of the row-reduction template cannot lay a row out like this: TVM 0.27
compacts a thread's register cache only to a contiguous slice (an interleaved one keeps the whole row, 2048
registers), so its loads were strided, and it ran slower than the shared-memory sketch on the H200.

Like the flash and wgmma templates, a sketch annotates the kernel's root block with a config and the builder
swaps the PrimFunc for the program (:func:`expand`). The annotation also carries the kernel as the planner made
it, and the program is generated from that: MetaSchedule's postprocessing rewrites the sketch's own blocks
(it splits each reduction into an init and an update block).

``program`` reads a kernel as a row program, ``configs`` splits rows over threads, ``source`` writes the
register program and ``stream`` the streamed one; this module is the template's registry entry.
"""
from __future__ import annotations

from functools import lru_cache

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.rows.configs import (Room, configs, default_config, room_for, staged_bytes_for, streamed_configs,
                                          untuned_config)
from tvmfuse.kernels.rows.program import (ANNOTATION, CANDIDATES, L2, REGISTERS, SHARED, SOURCE, STREAMED, Misfit,
                                          RowConfig, RowProgram, _widened, analyze, parse_config)
from tvmfuse.kernels.rows.source import register_source
from tvmfuse.kernels.rows.stream import online_pairs, stream_source

__all__ = ["ANNOTATION", "CANDIDATES", "L2", "REGISTERS", "SHARED", "SOURCE", "STREAMED", "Misfit", "Room",
           "RowConfig", "RowProgram", "RowsTemplate", "online_pairs", "room_for", "analyze", "annotate", "annotated", "configs", "default_config",
           "default_kernel", "expand", "kernel_for", "parse_config", "row_source", "streamed_configs",
           "untuned_config", "_widened"]


def row_source(prog: RowProgram, cfg: RowConfig | None, emulate: bool = False) -> str:
    """TVMScript of the program under ``cfg``: the row in registers (``source``), or streamed where ``cfg``
    streams it (``stream``). ``emulate``: its threads as serial loops, which builds for any target, so the CPU
    checks the element-to-thread mapping, the reductions' order and the index arithmetic numerically; ``cfg``
    None: the emulation at one thread per row."""
    if cfg is not None and cfg.mode in STREAMED:
        return stream_source(prog, cfg, emulate)
    return register_source(prog, cfg, emulate)


def default_kernel(func, target=None):
    """The row program of ``func`` under :func:`untuned_config` (on ``target``'s GPU), or None."""
    cfg = untuned_config(func, target)
    return None if cfg is None else kernel_for(func, cfg)


def kernel_for(func, cfg: RowConfig | None, emulate: bool = False):
    """The row program of ``func`` under ``cfg`` as a PrimFunc (``emulate``, or ``cfg`` None: the emulation, see
    :func:`row_source`)."""
    from tvmfuse.kernels.wgmma.ptx import parse

    return parse(row_source(analyze(func), cfg, emulate))


def annotate(sch, root, func, options: list[RowConfig], index) -> None:
    """Record on ``root`` the planner's kernel ``func``, the configs and the sampled ``index`` into them."""
    sch.annotate(root, SOURCE, func.script())
    sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
    sch.annotate(root, ANNOTATION, index)


def annotated(func):
    """(the planner's kernel, the config) a row-program sketch annotated on ``func``'s root block, or None."""
    from tvmfuse.kernels.annotations import chosen, root_annotations
    from tvmfuse.kernels.wgmma.ptx import parse

    notes = root_annotations(func, SOURCE, CANDIDATES, ANNOTATION)
    if notes is None:
        return None
    return parse(str(notes[SOURCE])), parse_config(chosen(notes[CANDIDATES], notes[ANNOTATION], "row program"))


def expand(mod):
    """``mod`` with every row-program-annotated PrimFunc replaced by its program."""
    from tvmfuse.kernels.annotations import swap_kernels

    def program(gv, func):
        found = annotated(func)
        return None if found is None else kernel_for(*found).with_attr("global_symbol", gv.name_hint)

    return swap_kernels(mod, program)


def program_sketch(sch, space, info: dict | None = None):
    """Sketch ``program`` of a row kernel: one of the row program's configs sampled (the ``threads`` and
    ``rows_per_block`` knobs) and annotated on the root block, every block's loops bound as they are (the builder
    swaps the whole PrimFunc for the program, generated from these blocks). None where the kernel is not a row
    program or no config fits."""
    from tvmfuse.kernels.knobs import sample_option
    from tvmfuse.kernels.rows.configs import room_of
    from tvmfuse.kernels.sketch import bind_placeholder

    try:
        prog = analyze(sch.mod["main"])
    except Misfit:
        return None
    knobs = {"threads": space.knobs.get("threads"), "rows_per_block": space.knobs.get("rows_per_block")}
    options = configs(prog, **{k: v.values for k, v in knobs.items() if v is not None},
                           max_elements=int(space.extra.get("row_register_elements", 64)), room=room_of(info))
    if not options:
        return None
    s = sch.copy()
    root = s.get_sblock("root")
    annotate(s, root, sch.mod["main"], options, sample_option(s, options, knobs))
    bind_placeholder(s)
    return s


def _program(func) -> RowProgram | None:
    try:
        return analyze(func)
    except (Misfit, TypeError):
        return None


@lru_cache(maxsize=256)
def _program_of_source(text: str) -> RowProgram | None:
    """The row program of a sketch's annotated kernel (its TVMScript): parsed once, as the cost model asks for every
    candidate of a search's population."""
    from tvmfuse.kernels.wgmma.ptx import parse

    return _program(parse(text))


class RowsTemplate(KernelTemplate):
    """The row program on CUDA; the row-reduction sketch samples its configs (its ``program`` sketch)."""

    name = "rows"
    targets = ("cuda",)
    kernel_classes = ("row_reduction",)
    searched_in = "row_reduction"
    config_field = "row_program_config"
    config_words = ("the row program {config} (threads per row, rows per block, v: vector lanes, m1 / m2: the row "
                    "streamed through shared memory / L2, k: vectors a thread keeps in registers, o1: max and sum "
                    "in one pass)")
    knobs = ("threads", "rows_per_block", "row_register_elements")

    candidates_key, index_key = CANDIDATES, ANNOTATION

    def fits(self, func, target) -> str | None:
        if target.kind.name not in self.targets:
            return super().fits(func, target)
        # taken where any config fits, though the untuned build may run dlight's schedule (a ragged LayerNorm
        # narrower than 16384 columns, where dlight measured faster than the streamed default): the search still
        # offers the program's configs against it
        try:
            fitting = bool(configs(analyze(func), room=room_for(target)))
        except Misfit as err:
            return str(err) or "not a row program"
        except TypeError:
            return "a symbolic extent, which no config can split"
        return None if fitting else "no row-program config fits"

    def configs(self, func, target, space=None) -> list:
        if self.fits(func, target) is not None:
            return []
        knobs = {k: space.knobs[k].values for k in ("threads", "rows_per_block") if space and k in space.knobs}
        extra = {"max_elements": int(space.extra.get("row_register_elements", 64))} if space else {}
        return configs(analyze(func), **knobs, **extra, room=room_for(target))

    def default_config(self, func, target):
        return None if target.kind.name not in self.targets else untuned_config(func, target)

    def default_kernel(self, func, target, space=None):
        # softmax, norms: dlight's schedule ran softmax 65536x2048 at 268 us on the H200, the program's default 131 us
        return default_kernel(func, target)

    def config_of(self, func) -> str | None:
        found = annotated(func)
        return None if found is None else found[1].name

    def config_figures(self, func, name: str) -> dict | None:
        from tvmfuse.kernels.rows.configs import _staged_bytes

        from tvmfuse.kernels.annotations import root_annotations

        notes = root_annotations(func, SOURCE)   # a sketch's placeholder carries the planner's kernel
        prog = _program(func) if notes is None else _program_of_source(str(notes[SOURCE]))
        if prog is None:
            return None
        cfg = parse_config(name)
        step = cfg.threads * (cfg.lanes or prog.lanes())
        return {"blocks": -(-prog.rows // cfg.rows_per_block), "threads": cfg.threads * cfg.rows_per_block,
                "shared_bytes": _staged_bytes(prog, cfg) if cfg.mode == SHARED else 0,
                "padding": -(-prog.cols // step) * step / prog.cols - 1.0, "work": prog.cols * cfg.rows_per_block}

    def expand(self, mod):
        return expand(mod)

