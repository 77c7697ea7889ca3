"""A wgmma kernel for a planner kernel: at a config, at the untuned build's config, and swapped in for a tuned
sketch's annotation."""
from __future__ import annotations

import json

from tvmfuse.kernels.annotations import chosen, root_annotations, swap_kernels
from tvmfuse.kernels.wgmma.analysis import _param_decls, analyze
from tvmfuse.kernels.wgmma.config import (ANNOTATION, CANDIDATES, SPEC, WgmmaConfig, configs, default_config,
                                          parse_config, supports)
from tvmfuse.kernels.wgmma.cp_async import gemm_source
from tvmfuse.kernels.wgmma.ptx import parse
from tvmfuse.kernels.wgmma.spec import GemmSpec
from tvmfuse.plan.tf32 import ROUNDED


def kernel_for(func, spec: GemmSpec, a: int, b: int, store: str, cfg: WgmmaConfig, sms: int | None = None):
    """The wgmma kernel of ``func`` (its parameters, in order, renamed ``p0, p1, ..``; its global symbol kept);
    ``sms``: the GPU's SMs, a persistent kernel's blocks (None: the H200's)."""
    done = {int(i) for i in ((func.attrs or {}).get(ROUNDED) or [])}   # (operands the planner rounded)
    rounded = tuple(name for name, p in (("a", a), ("b", b)) if p in done)
    kernel = parse(gemm_source(spec, cfg, _param_decls(func), f"p{a}", f"p{b}", store, sms, rounded))
    symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
    return kernel.with_attr("global_symbol", symbol) if symbol is not None else kernel


def untuned_config(func, target) -> tuple[GemmSpec, dict, WgmmaConfig] | None:
    """(spec, {a, b, store, ..}, config) of the kernel an untuned build on ``target`` runs for the GEMM or conv
    ``func``: :func:`default_config`'s. None where the target is not sm_90a or the kernel does not fit.

    An untuned build has no kernel check, so this covers the paths run and checked on the H200:
    GEMMs; padded 3x3 convs and a 7x7 conv whose rows end in a partial tile (16 configs, all correct, the
    untuned conv case's dlight schedule took 8992 us against 490 us); epilogues that split heads (BERT's Q/K/V
    projections, checked in the pipeline: dlight 180-184 us, wgmma 14-22 us); partial tiles of columns and K (1x1
    convs of 24 and 144 channels, a 1000-column head, K 1000, GPT-2's 50257-word LM head, MobileNetV2 end to end)
    and convs whose K steps span filter taps (24, 40, 96 and 144 channels, stride 2); GEMM stores staged through
    shared memory (five fp16 GEMMs of N 96 to 1000, on the H100; convs and TF32 keep unstaged stores untuned); a
    skinny GEMM's K split over the SMs (32 and 64 rows, on the H100: :func:`skinny_config`)."""
    if not supports(target):
        return None
    try:
        spec, info = analyze(func, gated=True)
    except Exception:  # noqa: BLE001 - as schedule(): anything analyze() cannot take keeps the default path
        return None
    if not configs(spec, tma=(0, 1)):
        return None
    from tvmfuse.target import device_figures

    # (a gated epilogue reads two sums at once: no K split, as the sketch)
    return spec, info, default_config(spec, device_figures(target).sm_count, split="{acc0}" not in info["store"])


def default_kernel(func, target):
    """The kernel :func:`untuned_config` names (its parameters and global symbol ``func``'s), or None."""
    found = untuned_config(func, target)
    if found is None:
        return None
    spec, info, cfg = found
    from tvmfuse.target import device_figures

    return kernel_for(func, spec, info["a"], info["b"], info["store"], cfg, device_figures(target).sm_count)


def annotated(func):
    """(spec, {a, b, store}, config) a tuned schedule annotated on ``func``'s root block, or None."""
    notes = root_annotations(func, SPEC, CANDIDATES, ANNOTATION)
    if notes is None:
        return None
    info = json.loads(str(notes[SPEC]))
    return (GemmSpec.from_json(json.dumps(info["spec"])), info,
            parse_config(chosen(notes[CANDIDATES], notes[ANNOTATION], "wgmma")))


def expand(mod):
    """``mod`` with every wgmma-annotated GEMM PrimFunc replaced by the kernel its annotation selects."""
    def wgmma(gv, func):
        found = annotated(func)
        if found is None:
            return None
        spec, info, cfg = found   # (a record from before the sketch annotated the GPU's SMs: the H200's)
        return kernel_for(func, spec, info["a"], info["b"], info["store"], cfg, info.get("sms"))

    return swap_kernels(mod, wgmma)
