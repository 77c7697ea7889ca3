"""``--precision tf32`` on a GPU: the fp32 GEMM and conv kernels marked for the tensor cores, their weights in the
order the tensor cores read them, and fp32 attention marked for the flash template's TF32 kernel.

The graph stays fp32: inputs, outputs, activations, epilogues and every other kernel. A GEMM or conv kernel
(one fp32 multiply-accumulate over fp32 operands) that a tensor-core template takes on the target gets the
attribute :data:`ATTR`, and the kernel templates that read it (Hopper's wgmma) compute its products in TF32 (fp32
operands rounded to a 10-bit mantissa by the tensor core, fp32 accumulation), as cuBLAS and cuDNN do under
PyTorch's ``allow_tf32``. The attribute is part of the kernel's structure, so its tuning records are apart from the
fp32 kernel's. The kernels no tensor-core template takes (depthwise convs, GEMVs; every one off Hopper) stay fp32,
operands and constants alike.

wgmma reads TF32 operands from shared memory K-major only (the transposed read is fp16 / bf16's): a weight
stored ``[K, N]`` (what the exporters write for a Linear) is transposed here, once, to ``[N, K]`` at every call
of its kernel, and the kernel reads it so. A conv's filters are K-major already (channels-last, OHWI).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from tvmfuse._tvm import PrimFunc, tvm
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec
from tvmfuse.plan.graph import kernel_calls
from tvmfuse.plan.weights import (Edit, apply, constant_params, kn_weight, mac_block, operand_params,
                                  transposed_kernel)

ATTR = "tvmfuse.tf32"
# the operands (parameter indices) rounded to TF32 at compile time: constants at every call (weights)
ROUNDED = "tvmfuse.tf32_rounded"


def tf32_rounded(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` rounded to TF32's 10-bit mantissa, to nearest with ties away from zero (PTX's
    ``cvt.rna.tf32.f32``, what the kernel applies to the operands it reads; infinities and NaNs kept)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits).astype(np.uint32).view(np.float32)


def tf32_attention(func: PrimFunc):
    """The TF32 spec of the planner's fp32 attention kernel ``func`` (its :class:`AttentionSpec` with ``tf32`` set,
    for the flash template's tensor-core kernel), or None where ``func`` is not one."""
    attrs = func.attrs
    if attrs is None or SPEC_ATTR not in attrs:
        return None
    spec = AttentionSpec.from_json(str(attrs[SPEC_ATTR]))
    return replace(spec, tf32=True) if spec.dtype == "float32" else None


def on_tensor_cores(func: PrimFunc, target) -> bool:
    """Whether a tensor-core template computes ``func`` (a GEMM or conv kernel marked :data:`ATTR`) in TF32 on
    ``target``: Hopper's wgmma takes it and the GEMV template (CUDA cores, which would read the marked weights in
    fp32) does not."""
    from tvmfuse.kernels import get

    return get("wgmma").fits(func, target) is None and get("gemv").fits(func, target) is not None


def tf32_kernels(mod: tvm.IRModule, target=None) -> tuple[tvm.IRModule, str | None]:
    """``mod`` (a partitioned module) with its fp32 GEMM and conv kernels that a tensor-core template computes on
    ``target`` (a ``tvm.target.Target``; :func:`on_tensor_cores`) marked :data:`ATTR`, each weight stored ``[K, N]``
    transposed to ``[N, K]`` (kernel and calls alike; only where every call passes a constant), its fp32 attention
    kernels' specs marked ``tf32`` (:func:`tf32_attention`), and a note for the plan's rewrites (None where no
    kernel was marked). ``target`` None: every GEMM and conv kernel. The others stay fp32, their constants too: a
    depthwise conv, a 3-channel stem or a GEMV run on CUDA cores, where TF32 operands would cost accuracy and gain
    nothing."""
    calls = kernel_calls(mod["main"])
    edits, attention, kept = {}, 0, 0
    for gv, func in mod.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        spec = tf32_attention(func)
        if spec is not None:
            edits[gv] = Edit(func.with_attr(SPEC_ATTR, spec.to_json()))
            attention += 1
            continue
        block, sch = mac_block(func)
        if block is None:
            continue
        # operands that are constants at every call are rounded here, once: the kernel rounds only the others
        consts = constant_params(calls, gv, operand_params(func, sch, block))
        weight, transposed = kn_weight(func, sch, block), None
        if weight is not None and weight[0] in consts:
            func, transposed = transposed_kernel(func, sch, block, weight[1]), weight[0]
        marked = func.with_attr(ATTR, True).with_attr(ROUNDED, consts)
        if target is not None and not on_tensor_cores(marked, target):
            kept += 1
            continue
        edits[gv] = Edit(marked, transposed, {p: tf32_rounded for p in consts})
    if not edits:
        return mod, (f"tf32: none of the {kept} GEMM/conv kernels runs on tensor cores here; all stay fp32"
                     if kept else None)
    out = apply(mod, edits)
    transposed = [gv for gv, e in edits.items() if e.transposed is not None]
    rounded = [gv for gv, e in edits.items() if e.values]
    sites = sum(len(calls.get(gv, [])) for gv in transposed)
    gemms = len(edits) - attention
    parts = [f"{gemms} GEMM/conv kernels on the tensor cores in TF32" if gemms else "",
             f"{attention} attention kernels on the TF32 flash kernel (mma.sync)" if attention else "",
             f"{len(transposed)} kernels' weights ({sites} calls) transposed to [N, K] at compile time"
             if transposed else "",
             f"{len(rounded)} kernels' constant operands rounded to TF32 at compile time" if rounded else "",
             f"{kept} GEMM/conv kernels kept in fp32 (no tensor-core template takes them)" if kept else ""]
    return out, "tf32: " + "; ".join(p for p in parts if p)
