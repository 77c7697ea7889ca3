"""The wgmma template's MetaSchedule sketch: one config sampled and annotated on the kernel's root block (the
GEMM space's tensor-core sketch asks it first on sm_90a)."""
from __future__ import annotations

import json

from tvmfuse.kernels.knobs import sample_option
from tvmfuse.kernels.sketch import bind_placeholder, inline_all_but_outputs
from tvmfuse.kernels.wgmma.analysis import _reduction_blocks, analyze
from tvmfuse.kernels.wgmma.config import ANNOTATION, CANDIDATES, SPEC, configs
from tvmfuse.kernels.wgmma.spec import GemmSpec

_KNOBS = ("warpgroups", "m_tiles", "block_n", "stages", "raster", "inflight", "tma", "persistent", "staged", "split",
          "a_regs")


def schedule(sch, space, sms: int | None = None) -> GemmSpec | None:
    """The wgmma sketch of a GEMM or conv kernel (``sch``, modified in place): its intermediates inlined, one
    config of :func:`configs` sampled (the ``wgmma_*`` knobs give the choices and priors) and annotated on the
    root block with the kernel's spec (and ``sms``, the target GPU's SMs, a persistent kernel's blocks), and a
    plain thread binding that any GPU check accepts (the builder swaps
    the whole PrimFunc for the annotated kernel, see :func:`expand`). Returns the spec, None if the kernel
    does not fit."""
    try:
        spec, info = analyze(sch.mod["main"], gated=True)
    except Exception:  # noqa: BLE001 - Misfit, or a kernel shape analyze() did not foresee: decline, and the
        return None    # GEMM space keeps its mma/wmma sketches rather than failing as a whole
    knobs = {k: space.knobs.get(f"wgmma_{k}") for k in _KNOBS}
    options = configs(spec, **{k: v.values for k, v in knobs.items() if v is not None},
                      max_shared_bytes=int(space.extra.get("wgmma_max_shared_bytes", 227 * 1024)),
                      **({} if sms is None else {"sm_count": int(sms)}))
    if "{acc0}" in info["store"]:   # a gated epilogue reads two sums at once: no K split (its partials are one)
        options = [c for c in options if c.split == 1]
    if not options:
        return None
    root = sch.get_sblock("root")
    index = sample_option(sch, options, knobs)
    sch.annotate(root, SPEC, json.dumps({"spec": json.loads(spec.to_json()), **info,
                                          **({} if sms is None else {"sms": int(sms)})}, sort_keys=True))
    sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
    sch.annotate(root, ANNOTATION, index)
    inline_all_but_outputs(sch, keep=(sch.get(_reduction_blocks(sch)[0]).name_hint,))
    bind_placeholder(sch)
    return spec
