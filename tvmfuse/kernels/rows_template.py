"""The row program's registry entry: softmax, norms and other row kernels written whole from their blocks, each
thread holding interleaved 16-byte vectors of its row.

Its code still lives in :mod:`tvmfuse.tune.rows`, which its owner moves under ``kernels/`` later; until then this
entry imports it inside each function, the one import of ``tvmfuse.tune`` the kernel layer has
(``tests/test_layout.py`` names it).
"""
from __future__ import annotations

from pathlib import Path

from tvmfuse.kernels.base import KernelTemplate


def _rows():
    import tvmfuse.tune.rows as rows

    return rows


def program_sketch(sch, space):
    """Sketch ``program`` of a row kernel: one of the row program's configs sampled (the ``threads`` and
    ``rows_per_block`` knobs) and annotated on the root block, every block's loops bound as they are (the builder
    swaps the whole PrimFunc for the program, generated from these blocks). None where the kernel is not a row
    program or no config fits."""
    from tvmfuse.kernels.knobs import sample_option
    from tvmfuse.kernels.sketch import bind_placeholder

    rows = _rows()
    try:
        prog = rows.analyze(sch.mod["main"])
    except rows.Misfit:
        return None
    knobs = {"threads": space.knobs.get("threads"), "rows_per_block": space.knobs.get("rows_per_block")}
    options = rows.configs(prog, **{k: v.values for k, v in knobs.items() if v is not None},
                           max_elements=int(space.extra.get("row_register_elements", 64)))
    if not options:
        return None
    s = sch.copy()
    root = s.get_sblock("root")
    rows.annotate(s, root, sch.mod["main"], options, sample_option(s, options, knobs))
    bind_placeholder(s)
    return s


class RowsTemplate(KernelTemplate):
    """The row program on CUDA; the row-reduction sketch samples its configs (its ``program`` sketch)."""

    name = "rows"
    targets = ("cuda",)
    kernel_classes = ("row_reduction",)
    searched_in = "row_reduction"
    config_field = "row_program_config"
    config_words = ("the row program {config} (threads per row, rows per block, v: vector lanes, m1 / m2: the row "
                    "streamed through shared memory / L2)")
    knobs = ("threads", "rows_per_block", "row_register_elements")

    @property
    def candidates_key(self) -> str:
        return _rows().CANDIDATES

    def fits(self, func, target) -> str | None:
        if target.kind.name not in self.targets:
            return super().fits(func, target)
        rows = _rows()
        try:
            fitting = rows.default_config(rows.analyze(func)) is not None
        except rows.Misfit as err:
            return str(err) or "not a row program"
        except TypeError:
            return "a symbolic extent, which no config can split"
        return None if fitting else "no row-program config fits"

    def configs(self, func, target, space=None) -> list:
        if self.fits(func, target) is not None:
            return []
        rows = _rows()
        knobs = {k: space.knobs[k].values for k in ("threads", "rows_per_block") if space and k in space.knobs}
        extra = {"max_elements": int(space.extra.get("row_register_elements", 64))} if space else {}
        return rows.configs(rows.analyze(func), **knobs, **extra)

    def default_config(self, func, target):
        return None if target.kind.name not in self.targets else _rows().untuned_config(func)

    def default_kernel(self, func, target, space=None):
        # softmax, norms: dlight's schedule ran softmax 65536x2048 at 268 us on the H200, the program's default 131 us
        return _rows().default_kernel(func)

    def config_of(self, func) -> str | None:
        found = _rows().annotated(func)
        return None if found is None else found[1].name

    def expand(self, mod):
        return _rows().expand(mod)

    def source_files(self) -> list[Path]:
        from tvmfuse.kernels.base import _with_imports

        return _with_imports([Path(__file__).resolve(), Path(_rows().__file__).resolve()])
