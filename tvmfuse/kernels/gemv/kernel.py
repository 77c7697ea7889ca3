"""The GEMV template's reading of a planner GEMM (through the wgmma template's recogniser), its kernel at a config,
the MetaSchedule sketch that samples one, and the swap of a tuned sketch's PrimFunc for its kernel."""
from __future__ import annotations

import json

from tvmfuse.kernels.annotations import chosen, root_annotations, swap_kernels
from tvmfuse.kernels.gemv.config import (ANNOTATION, CANDIDATES, MAX_ROWS, MMA_ROWS, SMALL_OUTPUTS, SMALL_ROWS, SPEC, GemvConfig, configs,
                                         default_config, parse_config)
from tvmfuse.kernels.gemv.source import gemv_source
from tvmfuse.kernels.wgmma.analysis import Misfit, _param_buffers, _param_decls, _reduction_blocks
from tvmfuse.kernels.wgmma.analysis import analyze as gemm_analyze
from tvmfuse.kernels.wgmma.spec import GemmSpec
from tvmfuse.plan.tf32 import ATTR as TF32

_DTYPES = ("float16", "float32")
# GemvConfig's fields: knobs gemv_<field>
KNOBS = ("lanes", "threads", "threads_n", "split", "rows", "unroll", "mma", "stages", "xs")


def analyze(func) -> tuple[GemmSpec, dict]:
    """(spec, {a, b, store, dtype}) of a planner GEMM the template takes: a matmul of at most :data:`MAX_ROWS`
    rows (the product of A's leading dims; :data:`MMA_ROWS` for an fp16 [K, N] weight) against a weight shared by
    them, fp16 or fp32, with an elementwise epilogue. Raises :class:`Misfit` with the reason otherwise."""
    spec, info = gemm_analyze(func, dtypes=_DTYPES)
    if spec.conv is not None:
        raise Misfit("a convolution, not a GEMM")
    if spec.grid_batch != 1:
        raise Misfit("a batched GEMM (each batch its own B)")
    bufs = _param_buffers(func)
    dtypes = {str(bufs[info["a"]].dtype), str(bufs[info["b"]].dtype)}
    if len(dtypes) != 1:
        raise Misfit(f"A and B differ in dtype ({', '.join(sorted(dtypes))})")
    dtype = dtypes.pop()
    # past 16 rows only the tensor-core kernel (an fp16 [K, N] weight) keeps the weight's stream the time (MMA_ROWS)
    most = MMA_ROWS if dtype == "float16" and not spec.b_kmajor else MAX_ROWS
    tf32 = bool(func.attrs is not None and func.attrs.get(TF32))
    if dtype == "float32" and spec.rows * spec.n <= SMALL_OUTPUTS and not tf32:
        # a small fp32 GEMM: row groups of MAX_ROWS (see SMALL_ROWS); in TF32 the tensor-core template takes it. (One
        # marked for three TF32 products (X3) stays here: exact fp32, and launch-bound where a tensor core would
        # not help; its planner mark only reaches the wgmma template past these)
        most = SMALL_ROWS
    if spec.rows > most:
        raise Misfit(f"M = {spec.rows} rows: the GEMV template takes at most {most}"
                     + ("" if most == MMA_ROWS else f" (an fp16 [K, N] weight: {MMA_ROWS})"))
    return spec, {**info, "dtype": dtype}


def kernel_for(func, spec: GemmSpec, info: dict, cfg: GemvConfig, emulate: bool = False):
    """The GEMV kernel of ``func`` under ``cfg`` (its parameters, in order, renamed ``p0, p1, ..``; its global
    symbol kept). ``emulate``: its threads as serial loops, built for any target (see ``source``)."""
    from tvmfuse.kernels.wgmma.ptx import parse

    kernel = parse(gemv_source(spec, cfg, _param_decls(func), f"p{info['a']}", f"p{info['b']}", info["store"],
                               info["dtype"], emulate))
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    return kernel.with_attr("global_symbol", symbol) if symbol is not None else kernel


def untuned(func, target) -> tuple[GemmSpec, dict, GemvConfig] | None:
    """(spec, info, config) of the kernel an untuned CUDA build runs for ``func``; None where it does not fit."""
    if target.kind.name != "cuda":
        return None
    try:
        spec, info = analyze(func)
    except Exception:  # noqa: BLE001 - Misfit, or a shape the recogniser did not foresee: not this template's
        return None
    if spec.rows > MAX_ROWS and _wgmma_splits(func, target):
        return None
    from tvmfuse.target import device_figures

    cfg = default_config(spec, info["dtype"], device_figures(target).sm_count)   # the split that fills its SMs
    return None if cfg is None else (spec, info, cfg)


def _wgmma_splits(func, target) -> bool:
    """Whether Hopper's wgmma template runs ``func`` untuned as a K split (17-64 rows: it measured faster than this
    template's tensor-core kernel, ``wgmma.config.skinny_config``)."""
    from tvmfuse.kernels.wgmma.kernel import untuned_config

    found = untuned_config(func, target)
    return found is not None and found[2].split > 1


def default_kernel(func, target):
    found = untuned(func, target)
    return None if found is None else kernel_for(func, *found)


def space_configs(spec: GemmSpec, dtype: str, space) -> list[GemvConfig]:
    """The configs the space's ``gemv_*`` knobs allow for ``spec`` (all of :func:`configs` without a space)."""
    if space is None:
        return configs(spec, dtype)
    knobs = {k: space.knobs[f"gemv_{k}"].values for k in KNOBS if f"gemv_{k}" in space.knobs}
    return configs(spec, dtype, **knobs)


def schedule(sch, space) -> GemmSpec | None:
    """The GEMV sketch of a GEMM kernel (``sch``, modified in place): one config sampled (the ``gemv_*`` knobs
    give the choices and priors) and annotated on the root block with the kernel's spec, and a plain thread
    binding any GPU check accepts (the builder swaps the PrimFunc for the kernel, :func:`expand`). None where
    the kernel does not fit or the space has no ``gemv_*`` knobs."""
    from tvmfuse.kernels.knobs import sample_option
    from tvmfuse.kernels.sketch import bind_placeholder, inline_all_but_outputs

    if not any(f"gemv_{k}" in space.knobs for k in KNOBS):
        return None
    try:
        spec, info = analyze(sch.mod["main"])
    except Exception:  # noqa: BLE001 - as untuned(): the GEMM space keeps its other sketches
        return None
    options = space_configs(spec, info["dtype"], space)
    if not options:
        return None
    root = sch.get_sblock("root")
    knobs = {k: space.knobs.get(f"gemv_{k}") for k in KNOBS}
    # priors by the knobs' values; rows capped at M (a 3-row GEMM's 3) are not among them: uniform there
    knobs = {k: v if v is not None and all(getattr(o, k) in v.values for o in options) else None
             for k, v in knobs.items()}
    index = sample_option(sch, options, knobs)
    sch.annotate(root, SPEC, json.dumps({"spec": json.loads(spec.to_json()), **info}, sort_keys=True))
    sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
    sch.annotate(root, ANNOTATION, index)
    inline_all_but_outputs(sch, keep=(sch.get(_reduction_blocks(sch)[0]).name_hint,))
    bind_placeholder(sch)
    return spec


def annotated(func):
    """(spec, info, config) a tuned GEMV sketch annotated on ``func``'s root block, or None."""
    notes = root_annotations(func, SPEC, CANDIDATES, ANNOTATION)
    if notes is None:
        return None
    info = json.loads(str(notes[SPEC]))
    return (GemmSpec.from_json(json.dumps(info.pop("spec"))), info,
            parse_config(chosen(notes[CANDIDATES], notes[ANNOTATION], "gemv")))


def expand(mod):
    """``mod`` with every GEMV-annotated PrimFunc replaced by the kernel its annotation selects."""
    def gemv(gv, func):
        found = annotated(func)
        return None if found is None else kernel_for(func, *found)

    return swap_kernels(mod, gemv)
