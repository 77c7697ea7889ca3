"""A GEMM whose output is split along its columns (a fused projection: GPT-2's QKV ``c_attn``, Phi-3's
``gate_up_proj``) as one GEMM per part, on the weight's column blocks, where that saves bytes."""
from __future__ import annotations

import functools

from tvmfuse._tvm import RelaxConstant, const_numpy, relax
from tvmfuse.plan.graph import tensor_bytes, tensor_shape
from tvmfuse.plan.rewrites._common import cleaned_dataflow, module_pass, op_name, rebuild_main
from tvmfuse.plan.tags import RewriteLog


class SplitGemm:
    """``split(reshape?(matmul(x, W) + b?), axis=-1)`` => one ``matmul(x, W[:, a:b]) + b[a:b]`` (reshaped alike) a
    part.

    Split as it is, the GEMM's whole output goes through HBM to a ``split`` kernel and each part again to its own
    consumer (GPT-2: a reshape and transpose per head layout, each a kernel of its own), since a kernel holds one
    epilogue chain. One GEMM a part reads ``x`` once a part instead, and each part's reshape and transpose fuse
    into its GEMM's store, as BERT's separate Q, K and V projections do. Taken where the extra reads of ``x``
    weigh less than the split's own read and write of the output; the weight is cut once, at compile time."""

    def __new__(cls, *, log: RewriteLog):
        self = super().__new__(cls)
        self.log = log
        return module_pass("SplitGemm", self.transform_module)

    def transform_module(self, mod):
        from tvmfuse.plan.report import Rejection

        mod, bindings, users = cleaned_dataflow(mod)
        if bindings is None:
            return mod
        defs = {b.var: b for b in bindings}
        plan, skip = {}, set()
        for b in bindings:
            found = self._match(b, defs, users)
            if found is None:
                continue
            chain, bounds, items, unit = found
            x, weight = chain[0].value.args[0], const_numpy(chain[0].value.args[1])
            # one more read of x for each part read beyond the first; the split's read and write of the output saved
            extra, saved = (len(items) - 1) * tensor_bytes(x.ty), 2 * tensor_bytes(chain[-2].var.ty)
            ops = tuple(op_name(c.value).removeprefix("relax.") for c in chain)
            if extra >= saved:
                self.log.rejected.append(Rejection(ops=ops, reason=f"split GEMM: {len(items)} GEMMs would read "
                                                                   f"{x.name} {extra} B more than the split saves"))
                continue
            for item in items:
                lo, hi = bounds[int(item.value.index)], bounds[int(item.value.index) + 1]
                plan[item.var] = functools.partial(_emit_part, chain=chain[:-1], weight=weight, lo=lo, hi=hi,
                                                   name=str(item.var.name), unit=unit)
            skip.update(c.var for c in chain)
            self.log.notes.append(f"a GEMM of {len(bounds) - 1} parts reading {x.name} as {len(items)} GEMMs "
                                  f"({saved - extra} B saved)")
        if not plan:
            return mod
        return rebuild_main(mod, plan, skip)

    @staticmethod
    def _match(split, defs, users):
        """(the bindings from the matmul to the split, the parts' column bounds, the TupleGetItem bindings that read
        the parts) for a split binding, or None: between the matmul and the split, only casts, a bias add and
        reshapes that keep the last axis, each the only reader of the one before."""
        if op_name(split.value) != "relax.split" or not isinstance(split.var, relax.DataflowVar):
            return None
        shape = tensor_shape(split.value.args[0].ty)
        if shape is None or len(shape) < 2:
            return None
        axis = int(split.value.attrs.axis) % len(shape)
        # along the columns, or along the heads of a [.., heads, d] view of them (Falcon's fused query_key_value:
        # the query heads, then the K and V heads), each head then d columns of the weight
        if axis not in (len(shape) - 1, len(shape) - 2):
            return None
        unit = 1 if axis == len(shape) - 1 else shape[-1]
        columns = shape[-1] * (shape[-2] if unit > 1 else 1)
        items = users.get(split.var, [])
        if not items or not all(isinstance(u.value, relax.TupleGetItem) for u in items):
            return None
        if len({int(u.value.index) for u in items}) != len(items):
            return None   # a part read twice would be computed twice
        chain, cur = [split], split.value.args[0]
        while True:
            node = defs.get(cur)
            if node is None or not isinstance(cur, relax.DataflowVar) or len(users.get(cur, [])) != 1:
                return None
            op = op_name(node.value)
            if op == "relax.matmul":
                break
            if op == "relax.reshape":
                inner, outer = tensor_shape(node.value.args[0].ty), tensor_shape(node.var.ty)
                heads_view = unit > 1 and outer is not None and outer[-2:] == shape[-2:]
                if inner is None or outer is None or not (
                        inner[-1] == outer[-1] == columns
                        or heads_view and (inner[-1] == columns or inner[-2:] == shape[-2:])):
                    return None
            elif op == "relax.add":
                out = tensor_shape(node.var.ty)
                if out is None or out[-1] != columns or not any(
                        isinstance(a, RelaxConstant) and tensor_shape(a.ty) in ((columns,), (1, columns))
                        for a in node.value.args):
                    return None
            elif op != "relax.astype":
                return None
            chain.insert(0, node)
            cur = next(a for a in node.value.args if not isinstance(a, RelaxConstant))
        x, w = node.value.args
        ws = tensor_shape(w.ty)
        if not isinstance(w, RelaxConstant) or ws is None or len(ws) != 2 or not isinstance(x, relax.Var):
            return None
        chain.insert(0, node)
        n, sections = shape[axis], split.value.attrs.indices_or_sections
        if ws[1] != columns:
            return None
        if isinstance(sections, int) or hasattr(sections, "value"):   # a count of equal parts
            parts = int(getattr(sections, "value", sections))
            if parts < 2 or n % parts:
                return None
            bounds = [k * (n // parts) for k in range(parts + 1)]
        else:   # the indices the parts start at
            bounds = [0, *(int(i) for i in sections), n]
        return chain, [b * unit for b in bounds], items, unit


def _emit_part(bb, vmap, *, chain, weight, lo: int, hi: int, name: str, unit: int = 1):
    """Columns ``[lo, hi)`` of ``chain`` (the matmul, then its casts, bias add and reshapes), re-emitted on the
    weight's and the bias's columns; the last op's value is returned for the caller to bind. ``unit`` > 1: the split
    was along the heads of a ``[.., heads, unit]`` view, which the part's view keeps, with its own heads."""
    mm = chain[0].value
    x = mm.args[0]
    y = relax.op.matmul(vmap.get(x, x), relax.const(weight[:, lo:hi]), out_dtype=mm.attrs.out_dtype)
    for k, node in enumerate(chain[1:]):
        y = bb.emit(y, name_hint=f"{name}_{k}")
        op = op_name(node.value)
        if op == "relax.astype":
            y = relax.op.astype(y, node.value.attrs.dtype)
        elif op == "relax.add":
            bias = next(a for a in node.value.args if isinstance(a, RelaxConstant))
            y = relax.op.add(y, relax.const(const_numpy(bias).reshape(-1)[lo:hi]))
        else:
            out = tensor_shape(node.var.ty)
            heads = unit > 1 and out[-1] == unit and out[-1] * out[-2] == weight.shape[1]
            y = relax.op.reshape(y, [*out[:-2], (hi - lo) // unit, unit] if heads else [*out[:-1], hi - lo])
    return y
