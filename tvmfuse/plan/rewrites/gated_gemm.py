"""Gated GEMMs (SwiGLU, GeGLU): two MatMuls of one input whose results meet in one elementwise result,
``act(x @ Wg) * (x @ Wu)``, become one MatMul on the weights' columns interleaved, ``[g0, u0, g1, u1, ..]``, and
two stride-2 slices of it. The planner then fuses the slices and the gating into the GEMM's epilogue: each
accumulator pair of a row (two adjacent columns, one thread's) is one ``(g, u)``, so the kernel stores
``act(g) * u`` and neither ``x`` is read twice nor ``u`` written and read back."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.graph import tensor_bytes, tensor_shape
from tvmfuse.plan.rewrites._common import CLEAN, cleaned_dataflow, module_pass, op_name, rebuild_main
from tvmfuse.plan.tags import RewriteLog, Tag

# elementwise ops a gating may hold between the two products and its one result
_GATING_OPS = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.nn.relu", "relax.sigmoid",
               "relax.tanh", "relax.erf", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.astype",
               "relax.clip", "relax.power", "relax.sqrt", "relax.exp", "relax.negative"}


def _gating(g, u, bindings, users, out_vars) -> list | None:
    """The bindings computing one result from the products ``g`` and ``u`` alone (and constants), elementwise at
    their shape, ending in that result; None where a value between them is read by anything else, or the two never
    meet."""
    shape = tensor_shape(g.var.ty)
    inside = {g.var, u.var}
    members: list = []
    for b in bindings:   # in binding order: a reader comes after what it reads
        read = [a for a in b.value.args if isinstance(a, relax.Var)] if isinstance(b.value, relax.Call) else []
        if not any(a in inside for a in read) or b.var in inside:
            continue
        if op_name(b.value) not in _GATING_OPS or tensor_shape(b.var.ty) != shape or any(
                a not in inside for a in read):
            continue   # a reader outside the gating: only the result may have one (checked below)
        inside.add(b.var)
        members.append(b)

    def escapes(v) -> bool:
        return v in out_vars or any(r.var not in inside for r in users.get(v, []))

    if not members or escapes(g.var) or escapes(u.var) or any(escapes(b.var) for b in members[:-1]):
        return None
    return members


def _halves(mm, users):
    """(the last binding before the split, the first half's binding, the second half's) where the product of
    ``mm`` (through casts) is split in two halves of its last axis, by ``split`` or by two slices; None otherwise."""
    cur = mm
    while len(users.get(cur.var, [])) == 1 and op_name(users[cur.var][0].value) == "relax.astype":
        cur = users[cur.var][0]
    shape = tensor_shape(cur.var.ty)
    readers = users.get(cur.var, [])
    if shape is None or shape[-1] % 2 or not readers:
        return None
    n, axis = shape[-1] // 2, len(shape) - 1
    if len(readers) == 1 and op_name(readers[0].value) == "relax.split":
        at = readers[0].value.attrs
        parts = users.get(readers[0].var, [])
        sections = at.indices_or_sections
        even = [int(i) for i in sections] == [n] if not isinstance(sections, int) and hasattr(sections, "__len__") \
            else int(sections) == 2
        if not even or int(at.axis) % len(shape) != axis or len(parts) != 2 or \
                not all(isinstance(p.value, relax.TupleGetItem) for p in parts):
            return None
        by_index = {int(p.value.index): p for p in parts}
        return (cur, by_index[0], by_index[1]) if set(by_index) == {0, 1} else None
    if len(readers) != 2 or any(op_name(r.value) != "relax.strided_slice" for r in readers):
        return None
    spans = {}
    for r in readers:   # strided_slice(x, axes, begin, end[, strides]), each a tuple of integers
        try:
            axes, begin, end, *strides = ([int(getattr(f, "value", f)) for f in a.fields] for a in r.value.args[1:])
        except (AttributeError, TypeError):
            return None
        if [a % len(shape) for a in axes] != [axis] or strides not in ([], [[1]]):
            return None
        spans[(begin[0], min(end[0], 2 * n))] = r
    return (cur, spans[(0, n)], spans[(n, 2 * n)]) if set(spans) == {(0, n), (n, 2 * n)} else None


class GatedGemm:
    """``act(x @ Wg) * (x @ Wu)`` => one MatMul on ``[Wg | Wu]`` interleaved by column + two stride-2 slices."""

    def __new__(cls, *, log: RewriteLog, min_rows: int, dtypes=("float16",)):
        self = super().__new__(cls)
        self.log, self.min_rows, self.dtypes = log, min_rows, tuple(dtypes)
        return module_pass("GatedGemm", self.transform_module)

    def transform_module(self, mod):
        mod, bindings, users = cleaned_dataflow(mod)
        if bindings is None:
            return mod
        out_vars = {b.var for b in bindings if not isinstance(b.var, relax.DataflowVar)}
        by_input: dict = {}
        for b in bindings:
            if op_name(b.value) != "relax.matmul":
                continue
            x, w = b.value.args
            xs, ws = tensor_shape(x.ty), tensor_shape(w.ty)
            if (not isinstance(w, RelaxConstant) or not isinstance(x, relax.Var) or ws is None or len(ws) != 2
                    or xs is None or int(np.prod(xs[:-1])) < self.min_rows or str(w.ty.dtype) not in self.dtypes
                    or str(x.ty.dtype) != str(w.ty.dtype)):
                continue
            key = next((k for k in by_input if k.same_as(x)), x)
            by_input.setdefault(key, []).append(b)
        plan, names, pre, taken = {}, {}, {}, set()
        for x, mms in by_input.items():
            for i, g in enumerate(mms):
                for u in mms[i + 1:]:
                    if g.var in taken or u.var in taken or tensor_shape(g.var.ty) != tensor_shape(u.var.ty) \
                            or str(g.value.attrs.out_dtype) != str(u.value.attrs.out_dtype):
                        continue
                    gating = _gating(g, u, bindings, users, out_vars)
                    if gating is None:
                        continue
                    taken |= {g.var, u.var}
                    self._merge(x, g, u, gating, plan, names, pre)
        for mm in (m for ms in by_input.values() for m in ms if m.var not in taken):
            halves = _halves(mm, users)
            if halves is not None:
                last, g, u = halves
                gating = _gating(g, u, bindings, users, out_vars)
                if gating is not None:
                    self._interleave(mm, last, g, u, gating, plan, names)
        if not plan:
            return mod
        return tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set(), names, pre))

    def _interleave(self, mm, last, g, u, gating, plan, names):
        """One GEMM on ``[Wg | Wu]`` already (a fused ``gate_up_proj``) split in halves: its columns interleaved."""
        w = const_numpy(mm.value.args[1])
        n = w.shape[1] // 2
        x, w = mm.value.args[0], _interleaved(w[:, :n], w[:, n:])

        def emit_mm(bb, vmap, out_dtype=mm.value.attrs.out_dtype):
            return relax.op.matmul(vmap.get(x, x), relax.const(w), out_dtype=out_dtype)

        plan[mm.var] = emit_mm
        names[mm.var] = merged = self.log.fresh("gated")
        self._gate_pairs(g, u, lambda vmap: vmap[last.var], 2 * n, plan, names)
        self._record(merged, x, ("matmul",), tensor_bytes(x.ty) + tensor_bytes(mm.value.args[1].ty)
                     + tensor_bytes(mm.var.ty), w.shape, gating, "split in halves, its columns interleaved")

    def _merge(self, x, g, u, gating, plan, names, pre):
        w = _interleaved(const_numpy(g.value.args[1]), const_numpy(u.value.args[1]))
        merged = self.log.fresh("gated")
        holder = {}

        def emit_merged(bb, vmap, out_dtype=g.value.attrs.out_dtype):   # the products' type (fp32 sums of fp16)
            holder["var"] = bb.emit(relax.op.matmul(vmap.get(x, x), relax.const(w), out_dtype=out_dtype),
                                    name_hint=merged)

        pre[g.var] = emit_merged
        self._gate_pairs(g, u, lambda vmap: holder["var"], w.shape[1], plan, names)
        unfused = sum(tensor_bytes(x.ty) + tensor_bytes(mm.value.args[1].ty) + tensor_bytes(mm.var.ty)
                      for mm in (g, u))
        self._record(merged, x, ("matmul", "matmul"), unfused, w.shape, gating, "interleaved")

    def _gate_pairs(self, g, u, source, width: int, plan, names) -> None:
        """``g`` and ``u`` become the even and the odd columns of ``source(vmap)`` (views the epilogue reads)."""
        for half, b in enumerate((g, u)):
            plan[b.var] = lambda bb, vmap, half=half: relax.op.strided_slice(
                source(vmap), axes=[-1], begin=[half], end=[width], strides=[2])
            names[b.var] = name = self.log.fresh("gate" if half == 0 else "up")
            self.log.tags[name] = Tag("pair", (), 0)   # a view of the merged GEMM's columns, in its epilogue

    def _record(self, merged: str, x, ops: tuple, unfused: int, shape, gating, how: str) -> None:
        self.log.tags[merged] = Tag("gated", ops, unfused, note=f"x @ [Wg | Wu] {how}, gated in column pairs")
        gates = " ".join(op_name(b.value).split(".")[-1] for b in gating)
        self.log.notes.append(f"gated GEMM: {x.name} @ [Wg | Wu] ({shape[0]} x {shape[1]}) {how}, then {gates} "
                              "on each column pair")


def _interleaved(wg: np.ndarray, wu: np.ndarray) -> np.ndarray:
    """``[K, N]`` twice as ``[K, 2N]``: column ``2j`` is ``wg``'s ``j``, column ``2j + 1`` ``wu``'s."""
    return np.stack([wg, wu], axis=-1).reshape(wg.shape[0], 2 * wg.shape[1])
