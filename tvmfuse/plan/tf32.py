"""``--precision tf32`` on a GPU: the fp32 GEMM and conv kernels marked for the tensor cores, their weights in the
order the tensor cores read them, and fp32 attention marked for the flash template's TF32 kernel.

The graph stays fp32: inputs, outputs, activations, epilogues and every other kernel. A GEMM or conv kernel
(one fp32 multiply-accumulate over fp32 operands) gets the attribute :data:`ATTR`, and the kernel templates that
read it (Hopper's wgmma) compute its products in TF32 (fp32 operands rounded to a 10-bit mantissa by the
tensor core, fp32 accumulation), as cuBLAS and cuDNN do under PyTorch's ``allow_tf32``. The attribute is part of
the kernel's structure, so its tuning records are apart from the fp32 kernel's.

wgmma reads TF32 operands from shared memory K-major only (the transposed read is fp16 / bf16's): a weight
stored ``[K, N]`` (what the exporters write for a Linear) is transposed here, once, to ``[N, K]`` at every call
of its kernel, and the kernel reads it so. A conv's filters are K-major already (channels-last, OHWI).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from tvmfuse._tvm import PrimFunc, RelaxConstant, const_numpy, param_buffers, relax, tvm
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec
from tvmfuse.plan.graph import kernel_calls

ATTR = "tvmfuse.tf32"
# the operands (parameter indices) rounded to TF32 at compile time: constants at every call (weights)
ROUNDED = "tvmfuse.tf32_rounded"


def tf32_rounded(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` rounded to TF32's 10-bit mantissa, to nearest with ties away from zero (PTX's
    ``cvt.rna.tf32.f32``, what the kernel applies to the operands it reads; infinities and NaNs kept)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits).astype(np.uint32).view(np.float32)


def _load(e):
    """The buffer load ``e`` is (through a cast), or None."""
    if type(e).__name__ == "Cast":
        e = e.value
    return e if type(e).__name__ in ("TensorLoad", "BufferLoad") else None


def _mac_block(func: PrimFunc):
    """The block of ``func`` that accumulates fp32 products of fp32 operands (``c = c + a * b`` over a reduction
    axis), and the schedule it was found in; (None, None) where there is not exactly one."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    found = []
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        block = sch.get(b)
        body = block.body
        if not any(int(iv.iter_type) == 2 for iv in block.iter_vars) or type(body).__name__ != "BufferStore":
            continue
        value = body.value
        if str(body.buffer.dtype) != "float32" or type(value).__name__ != "Add" or type(value.b).__name__ != "Mul":
            continue
        operands = [_load(value.b.a), _load(value.b.b)]
        if all(op is not None and str(op.source.dtype if hasattr(op, "source") else op.buffer.dtype) == "float32"
               for op in operands):
            found.append(b)
    return (found[0], sch) if len(found) == 1 else (None, None)


def _operand_params(func: PrimFunc, sch, block) -> list[int]:
    """The parameter indices of the two operands ``block`` multiplies."""
    bufs = param_buffers(func)
    value = sch.get(block).body.value
    out = []
    for op in (_load(value.b.a), _load(value.b.b)):
        buf = op.source if hasattr(op, "source") else op.buffer
        out += [i for i, p in enumerate(bufs) if p.same_as(buf)]
    return out


def _kn_weight(func: PrimFunc, sch, block) -> tuple[int, int] | None:
    """(its parameter index, its position among ``block``'s reads) of a 2-D B that ``block`` reads ``[k, j]`` (the
    reduction axis, then the output's last axis), or None."""
    blk = sch.get(block)
    store = blk.body
    red = [str(iv.var.name) for iv in blk.iter_vars if int(iv.iter_type) == 2]
    if len(red) != 1 or not store.indices:
        return None
    last = str(store.indices[-1])
    bufs = param_buffers(func)
    reads = [r.source if hasattr(r, "source") else r.buffer for r in blk.reads]
    for op in (_load(store.value.b.a), _load(store.value.b.b)):
        buf = op.source if hasattr(op, "source") else op.buffer
        if [str(i) for i in op.indices] == [red[0], last]:
            param = next((i for i, p in enumerate(bufs) if p.same_as(buf)), None)
            read = next((i for i, r in enumerate(reads) if r.same_as(buf)), None)
            return None if param is None or read is None else (param, read)
    return None


def tf32_attention(func: PrimFunc):
    """The TF32 spec of the planner's fp32 attention kernel ``func`` (its :class:`AttentionSpec` with ``tf32`` set,
    for the flash template's tensor-core kernel), or None where ``func`` is not one."""
    attrs = func.attrs
    if attrs is None or SPEC_ATTR not in attrs:
        return None
    spec = AttentionSpec.from_json(str(attrs[SPEC_ATTR]))
    return replace(spec, tf32=True) if spec.dtype == "float32" else None


def tf32_kernels(mod: tvm.IRModule) -> tuple[tvm.IRModule, str | None]:
    """``mod`` (a partitioned module) with its fp32 GEMM and conv kernels marked :data:`ATTR` and each weight
    stored ``[K, N]`` transposed to ``[N, K]`` (kernel and calls alike; only where every call passes a constant),
    its fp32 attention kernels' specs marked ``tf32`` (:func:`tf32_attention`), and a note for the plan's rewrites
    (None where no kernel was marked)."""
    calls = kernel_calls(mod["main"])
    funcs, transposed, rounded, attention = {}, {}, {}, 0
    for gv, func in mod.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        spec = tf32_attention(func)
        if spec is not None:
            funcs[gv] = func.with_attr(SPEC_ATTR, spec.to_json())
            attention += 1
            continue
        block, sch = _mac_block(func)
        if block is None:
            continue
        sites = calls.get(gv, [])
        # operands that are constants at every call are rounded here, once: the kernel rounds only the others
        consts = [p for p in _operand_params(func, sch, block)
                  if sites and all(isinstance(args[p], RelaxConstant) for args in sites)]
        if consts:
            rounded[gv] = consts
        weight, key = _kn_weight(func, sch, block), gv
        if weight is not None and weight[0] in consts:
            w, read = weight
            sch.transform_layout(block, ("read", read), lambda k, n: (n, k))
            func = sch.mod["main"]
            # the kernel's signature changed: a GlobalVar of the new type (calls are checked against it)
            key = tvm.ir.GlobalVar(gv.name_hint)
            relax.expr._update_type(key, func.ty)
            transposed[gv] = (w, key)
        funcs[key] = func.with_attr(ATTR, True).with_attr(ROUNDED, consts)
    if not funcs:
        return mod, None
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class Operands(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the mutator's name
            call = super().visit_call_(call)
            gv = call.args[0] if call.op.same_as(call_tir) else None
            if gv not in rounded:
                return call
            w, new_gv = transposed.get(gv, (None, gv))
            args = list(call.args[1].fields)
            for p in rounded[gv]:
                value = const_numpy(args[p])
                args[p] = relax.const(tf32_rounded(value.T if p == w else value))
            return relax.Call(call.op, [new_gv, relax.Tuple(args), *call.args[2:]], call.attrs, ty_args=call.ty_args)

    items = {}
    for gv, f in mod.functions.items():   # (in the module's order)
        if gv in transposed:
            gv = transposed[gv][1]
        items[gv] = funcs.get(gv, f)
    out = tvm.IRModule(items, attrs=mod.attrs)
    if rounded:
        main_gv = out.get_global_var("main")
        main = out[main_gv]
        out[main_gv] = relax.Function(main.params, Operands().visit_expr(main.body), main.ret_ty, main.is_pure,
                                      attrs=main.attrs)
    sites = sum(len(calls.get(gv, [])) for gv in transposed)
    gemms = len(funcs) - attention
    parts = [f"{gemms} GEMM/conv kernels on the tensor cores in TF32" if gemms else "",
             f"{attention} attention kernels on the TF32 flash kernel (mma.sync)" if attention else "",
             f"{len(transposed)} kernels' weights ({sites} calls) transposed to [N, K] at compile time"
             if transposed else "",
             f"{len(rounded)} kernels' constant operands rounded to TF32 at compile time" if rounded else ""]
    return out, "tf32: " + "; ".join(p for p in parts if p)
