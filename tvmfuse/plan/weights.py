"""Constant GEMM operands changed once at compile time into the form a GPU kernel template reads: a weight stored
``[K, N]`` transposed to ``[N, K]`` (kernel and calls alike), constants rewritten value by value (TF32's rounding).

A weight whose columns leave its rows off 16-byte boundaries (GPT-2's and Whisper's vocabularies, 50257 and 51865
columns, in fp16) cannot be copied 16 bytes at a time in ``[K, N]``; as ``[N, K]`` its rows are the hidden size's,
and Hopper's wgmma template reads it K-major (:func:`odd_columns_kmajor`). TF32 transposes every weight: wgmma reads
TF32 operands K-major only (:mod:`tvmfuse.plan.tf32`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tvmfuse._tvm import PrimFunc, RelaxConstant, const_numpy, param_buffers, relax, tvm
from tvmfuse.plan.graph import kernel_calls


def _load(e):
    """The buffer load ``e`` is (through a cast), or None."""
    if type(e).__name__ == "Cast":
        e = e.value
    return e if type(e).__name__ in ("TensorLoad", "BufferLoad") else None


def _dtype(load) -> str:
    return str(load.source.dtype if hasattr(load, "source") else load.buffer.dtype)


def mac_block(func: PrimFunc, operand_dtype: str = "float32"):
    """The block of ``func`` that accumulates fp32 products of ``operand_dtype`` operands (``c = c + a * b`` over
    a reduction axis), and the schedule it was found in; (None, None) where there is not exactly one."""
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
        if all(op is not None and _dtype(op) == operand_dtype for op in operands):
            found.append(b)
    return (found[0], sch) if len(found) == 1 else (None, None)


def operand_params(func: PrimFunc, sch, block) -> list[int]:
    """The parameter indices of the two operands ``block`` multiplies."""
    bufs = param_buffers(func)
    value = sch.get(block).body.value
    out = []
    for op in (_load(value.b.a), _load(value.b.b)):
        buf = op.source if hasattr(op, "source") else op.buffer
        out += [i for i, p in enumerate(bufs) if p.same_as(buf)]
    return out


def kn_weight(func: PrimFunc, sch, block) -> tuple[int, int] | None:
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


def constant_params(calls: dict, gv, params: list[int]) -> list[int]:
    """Those of ``params`` that every call of kernel ``gv`` passes a constant (none where it has no call)."""
    sites = calls.get(gv, [])
    return [p for p in params if sites and all(isinstance(args[p], RelaxConstant) for args in sites)]


@dataclass
class Edit:
    """A kernel's rewrite: the kernel as rewritten, the parameter transposed ``[K, N]`` -> ``[N, K]`` (None:
    none), and a function applied to each of some constant arguments (after the transpose)."""

    func: PrimFunc
    transposed: int | None = None
    values: dict[int, Callable[[np.ndarray], np.ndarray]] = field(default_factory=dict)


def transposed_kernel(func: PrimFunc, sch, block, read: int) -> PrimFunc:
    """``func`` reading its B (``block``'s read ``read``, stored ``[K, N]``) as ``[N, K]``."""
    sch.transform_layout(block, ("read", read), lambda k, n: (n, k))
    return sch.mod["main"]


def apply(mod: tvm.IRModule, edits: dict) -> tvm.IRModule:
    """``mod`` with each kernel ``gv`` of ``edits`` replaced by its :class:`Edit`'s, every call's constant arguments
    transposed and rewritten alike. A kernel whose signature changed gets a GlobalVar of its new type (calls are
    checked against it)."""
    keys = {}
    for gv, edit in edits.items():
        key = gv
        if edit.transposed is not None:
            key = tvm.ir.GlobalVar(gv.name_hint)
            relax.expr._update_type(key, edit.func.ty)
        keys[gv] = key
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class Operands(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the mutator's name
            call = super().visit_call_(call)
            gv = call.args[0] if call.op.same_as(call_tir) else None
            edit = edits.get(gv)
            if edit is None or (edit.transposed is None and not edit.values):
                return call
            args = list(call.args[1].fields)
            for p in sorted({*edit.values, *([edit.transposed] if edit.transposed is not None else [])}):
                value = const_numpy(args[p])
                value = np.ascontiguousarray(value.T) if p == edit.transposed else value
                args[p] = relax.const(edit.values.get(p, lambda v: v)(value))
            return relax.Call(call.op, [keys[gv], relax.Tuple(args), *call.args[2:]], call.attrs,
                              ty_args=call.ty_args)

    items = {}
    for gv, f in mod.functions.items():   # (in the module's order)
        items[keys.get(gv, gv)] = edits[gv].func if gv in edits else f
    out = tvm.IRModule(items, attrs=mod.attrs)
    if any(e.transposed is not None or e.values for e in edits.values()):
        main_gv = out.get_global_var("main")
        main = out[main_gv]
        out[main_gv] = relax.Function(main.params, Operands().visit_expr(main.body), main.ret_ty, main.is_pure,
                                      attrs=main.attrs)
    return out


# GEMMs of at most this many rows stream their weight (decode steps, a small batch's classifier): a kernel that
# reads each weight element once takes ``[K, N]`` at any N with narrower vectors, and keeps the layout as stored
STREAMED_ROWS = 64


def odd_columns_kmajor(mod: tvm.IRModule) -> tuple[tvm.IRModule, str | None]:
    """``mod`` (a partitioned module) with the constant fp16 weights stored ``[K, N]`` whose N is no multiple of 8
    transposed to ``[N, K]``, kernel and calls alike, where the hidden size K keeps the rows 16-byte aligned and
    the GEMM has more rows than :data:`STREAMED_ROWS` (a tile of the tensor cores reads them); a note for the plan
    (None where none was)."""
    calls = kernel_calls(mod["main"])
    edits = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        block, sch = mac_block(func, "float16")
        weight = None if block is None else kn_weight(func, sch, block)
        if weight is None or weight[0] not in constant_params(calls, gv, [weight[0]]):
            continue
        k, n = (int(d) for d in param_buffers(func)[weight[0]].shape)
        rows = int(np.prod([int(d) for d in sch.get(block).body.buffer.shape[:-1]]))
        if n % 8 and k % 8 == 0 and rows > STREAMED_ROWS:
            edits[gv] = Edit(transposed_kernel(func, sch, block, weight[1]), weight[0])
    if not edits:
        return mod, None
    whose = "1 kernel's" if len(edits) == 1 else f"{len(edits)} kernels'"
    return apply(mod, edits), (f"fp16: {whose} weights of columns no multiple of 8 transposed to [N, K] at compile "
                               "time (16-byte rows for the tensor-core template)")
