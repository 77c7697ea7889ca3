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

An fp32 build on Hopper takes the same kernels at fp32's accuracy (:data:`X3`, ``AttentionSpec.x3``): each operand
is split into two TF32 parts in the kernel and three products summed, so the tensor cores run what the CUDA cores
would otherwise (cuBLAS's fp32 GEMM, what PyTorch runs without ``allow_tf32``, has no tensor cores).
"""
from __future__ import annotations

from dataclasses import replace

from tvmfuse._tvm import PrimFunc, tvm
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec, tiled_gpu_misfit
from tvmfuse.plan.graph import kernel_calls
from tvmfuse.plan.weights import (Edit, _load, apply, constant_params, kn_weight, mac_block, operand_params,
                                  transposed_kernel)
from tvmfuse.verify import tf32_rounded   # (the reference's TF32 emulation rounds its constants alike)

ATTR = "tvmfuse.tf32"
# fp32 GEMM and conv kernels in fp32's accuracy on the tensor cores: each operand split into two TF32 parts and three
# products summed (the wgmma template's ``float32x3``), what an fp32 build runs on sm_90a
X3 = "tvmfuse.fp32x3"
# the operands (parameter indices) rounded to TF32 at compile time: constants at every call (weights)
ROUNDED = "tvmfuse.tf32_rounded"


def tf32_attention(func: PrimFunc):
    """The TF32 spec of the planner's fp32 attention kernel ``func`` (its :class:`AttentionSpec` with ``tf32`` set,
    for the flash template's tensor-core kernel), or None where ``func`` is not one."""
    attrs = func.attrs
    if attrs is None or SPEC_ATTR not in attrs:
        return None
    spec = AttentionSpec.from_json(str(attrs[SPEC_ATTR]))
    return replace(spec, tf32=True) if spec.dtype == "float32" else None


# a GEMM of at most this many rows is the GEMV template's (CUDA cores), which would read TF32-rounded constants in fp32
# (its MAX_ROWS, which the planner may not import: tests/plan/test_tf32.py holds the two answers together)
GEMV_ROWS = 16


def _vars(expr) -> set:
    """The variables ``expr`` (an operand's load) reads: its block's iteration variables."""
    return set(tvm.tirx.analysis.undefined_vars(expr))


def hopper(target) -> bool:
    """Whether ``target`` (a ``tvm.target.Target``) is an arch-specific Hopper one (``sm_90a``), where the wgmma
    template runs (the planner's side of ``kernels.wgmma.supports``)."""
    return target is not None and target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"


def on_tensor_cores(sch, block, target) -> bool:
    """Whether Hopper's wgmma computes the multiply-accumulate ``block`` (of :func:`mac_block`) in TF32 on
    ``target``: an ``sm_90a`` target; both operands K-major (a constant ``[K, N]`` weight transposed first);
    operands that share no output axis but leading ones (a batched GEMM's batch:
    a depthwise conv's channel is an output axis both operands read, a batch of one-column GEMMs the CUDA cores run);
    more than :data:`GEMV_ROWS` rows (fewer are the GEMV template's). Read off the block's structure, as the
    templates read it (tests/plan/test_tf32.py holds the two to the same answer)."""
    if not hopper(target):
        return False
    b = sch.get(block)
    loads = [_load(b.body.value.b.a), _load(b.body.value.b.b)]
    axes = [iv for iv in b.iter_vars if int(iv.iter_type) == 0]
    reads = [_vars(ld) for ld in loads]
    shared = [i for i, iv in enumerate(axes) if iv.var in reads[0] and iv.var in reads[1]]
    if shared != list(range(len(shared))):
        return False
    # TF32 operands K-major only (wgmma's transposed read is fp16's): each operand's last index a reduction axis
    reduction = {iv.var for iv in b.iter_vars if int(iv.iter_type) == 2}
    if not all(ld.indices and _vars(ld.indices[-1]) <= reduction and _vars(ld.indices[-1]) for ld in loads):
        return False
    # M: the output axes only the operand without the last (N's) axis reads
    a = 0 if axes and axes[-1].var not in reads[0] else 1
    rows = 1
    for iv in axes:
        if iv.var in reads[a] and iv.var not in reads[1 - a]:
            rows *= int(iv.dom.extent) if isinstance(iv.dom.extent, tvm.tirx.IntImm) else GEMV_ROWS + 1
    return rows > GEMV_ROWS


def tf32_kernels(mod: tvm.IRModule, target=None, x3: bool = False) -> tuple[tvm.IRModule, str | None]:
    """``mod`` (a partitioned module) with its fp32 GEMM and conv kernels that a tensor-core template computes on
    ``target`` (a ``tvm.target.Target``; :func:`on_tensor_cores`) marked :data:`ATTR`, each weight stored ``[K, N]``
    transposed to ``[N, K]`` (kernel and calls alike; only where every call passes a constant), its fp32 attention
    kernels' specs marked ``tf32`` (:func:`tf32_attention`), and a note for the plan's rewrites (None where no
    kernel was marked). ``target`` None: every GEMM and conv kernel. The others stay fp32, their constants too: a
    depthwise conv or a GEMV runs on CUDA cores, where TF32 operands would cost accuracy and gain nothing.

    ``x3``: fp32's accuracy instead (an fp32 build): the kernels are marked :data:`X3` and attention specs ``x3``,
    their operands split into TF32 parts in the kernel (no constant rounded)."""
    calls = kernel_calls(mod["main"])
    edits, attention, kept = {}, 0, 0
    for gv, func in mod.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        spec = tf32_attention(func)
        if spec is not None:
            spec = replace(spec, x3=x3)
            if x3 and tiled_gpu_misfit(spec) is not None:   # (past its registers: the CUDA-core kernel keeps it)
                continue
            edits[gv] = Edit(func.with_attr(SPEC_ATTR, spec.to_json()))
            attention += 1
            continue
        block, sch = mac_block(func)
        if block is None:
            continue
        # operands that are constants at every call are rounded here, once: the kernel rounds only the others
        consts = constant_params(calls, gv, operand_params(func, sch, block))
        weight, transposed, kernel = kn_weight(func, sch, block), None, func
        if weight is not None and weight[0] in consts:
            kernel, transposed = transposed_kernel(func, sch, block, weight[1]), weight[0]
        mac, ksch = mac_block(kernel)
        if target is not None and (mac is None or not on_tensor_cores(ksch, mac, target)):
            kept += 1
            continue
        if x3:   # (the kernel splits every operand, constants too)
            edits[gv] = Edit(kernel.with_attr(X3, True), transposed, {})
            continue
        marked = kernel.with_attr(ATTR, True).with_attr(ROUNDED, consts)
        edits[gv] = Edit(marked, transposed, {p: tf32_rounded for p in consts})
    name = "fp32x3" if x3 else "tf32"
    if not edits:
        return mod, (f"{name}: none of the {kept} GEMM/conv kernels runs on tensor cores here; all stay fp32"
                     if kept else None)
    out = apply(mod, edits)
    transposed = [gv for gv, e in edits.items() if e.transposed is not None]
    rounded = [gv for gv, e in edits.items() if e.values]
    sites = sum(len(calls.get(gv, [])) for gv in transposed)
    gemms = len(edits) - attention
    parts = [(f"{gemms} GEMM/conv kernels on the tensor cores in three TF32 products (fp32's accuracy)" if x3 else
              f"{gemms} GEMM/conv kernels on the tensor cores in TF32") if gemms else "",
             f"{attention} attention kernels on the TF32 flash kernel (mma.sync"
             + (", three products a fragment)" if x3 else ")") if attention else "",
             f"{len(transposed)} kernels' weights ({sites} calls) transposed to [N, K] at compile time"
             if transposed else "",
             f"{len(rounded)} kernels' constant operands rounded to TF32 at compile time" if rounded else "",
             f"{kept} GEMM/conv kernels kept in fp32 (no tensor-core template takes them)" if kept else ""]
    return out, f"{name}: " + "; ".join(p for p in parts if p)
