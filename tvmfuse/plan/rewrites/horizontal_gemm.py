"""Horizontal GEMMs: MatMuls reading the same input with constant weights become one MatMul on concatenated
weights plus slices, when the cost model finds it saves bytes."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax
from tvmfuse.plan.graph import tensor_bytes, tensor_shape
from tvmfuse.plan.rewrites._common import cleaned_dataflow, module_pass, op_name, rebuild_main
from tvmfuse.plan.tags import RewriteLog, Tag


_EPILOGUE_OPS = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.nn.relu", "relax.sigmoid",
                 "relax.tanh", "relax.erf", "relax.nn.gelu", "relax.nn.silu", "relax.reshape", "relax.permute_dims",
                 "relax.astype", "relax.clip", "relax.power", "relax.sqrt", "relax.exp"}


class HorizontalGemm:
    """MatMuls of one input with constant 2-D weights => one MatMul on concatenated weights + slices."""

    def __new__(cls, *, log: RewriteLog, cost_model=None):
        from tvmfuse.plan.cost import CostModel

        self = super().__new__(cls)
        self.log, self.cost_model = log, cost_model or CostModel()
        return module_pass("HorizontalGemm", self.transform_module)

    def transform_module(self, mod):
        from tvmfuse.plan.report import Rejection

        mod, bindings, users = cleaned_dataflow(mod)
        if bindings is None:
            return mod
        by_input: dict = {}
        for b in bindings:
            if op_name(b.value) != "relax.matmul":
                continue
            x, w = b.value.args
            ws = tensor_shape(w.ty)
            if not isinstance(w, RelaxConstant) or ws is None or len(ws) != 2 or not isinstance(x, relax.Var):
                continue
            key = next((k for k in by_input if k.same_as(x)), x)
            by_input.setdefault(key, []).append(b)
        plan, skip, names, pre = {}, set(), {}, {}
        for x, mms in by_input.items():
            if len(mms) < 2 or len({str(m.value.args[1].ty.dtype) for m in mms}) != 1:
                continue
            branches = []
            for mm in mms:
                out, bias = mm, None
                us = users.get(mm.var, [])
                if len(us) == 1 and isinstance(mm.var, relax.DataflowVar) and op_name(us[0].value) == "relax.add":
                    other = us[0].value.args[1] if us[0].value.args[0].same_as(mm.var) else us[0].value.args[0]
                    n = tensor_shape(mm.value.args[1].ty)[1]
                    if isinstance(other, RelaxConstant) and tensor_shape(other.ty) in ((n,), (1, n)):
                        out, bias = us[0], other
                branches.append((mm, out, bias))
            if len({b is None for _, _, b in branches}) != 1:
                branches = [(mm, mm, None) for mm, _, _ in branches]
            extra_bytes, extra_launches = 0, 0
            for _, out, _ in branches:
                us = users.get(out.var, [])
                fusable_epilogue = len(us) == 1 and op_name(us[0].value) in _EPILOGUE_OPS and isinstance(out.var, relax.DataflowVar)
                feeds_anchor = any(op_name(u.value) not in _EPILOGUE_OPS for u in us)
                if fusable_epilogue or feeds_anchor:
                    extra_bytes += 2 * tensor_bytes(out.var.ty)
                    extra_launches += 1
            ops = tuple(o for mm, _, bias in branches for o in (("matmul", "add") if bias is not None else ("matmul",)))
            score = self.cost_model.score_horizontal(shared_input_bytes=tensor_bytes(x.ty), branches=len(branches),
                                                     extra_bytes=extra_bytes, extra_launches=extra_launches)
            if not score.profitable:
                self.log.rejected.append(Rejection(ops=ops, reason=f"horizontal merge of {len(branches)} GEMMs reading "
                                                                   f"{x.name}: {score.reason}"))
                continue
            ws = [const_numpy(mm.value.args[1]) for mm, _, _ in branches]
            w_cat = np.concatenate(ws, axis=1)
            b_cat = (np.concatenate([const_numpy(b).reshape(-1) for _, _, b in branches])
                     if branches[0][2] is not None else None)
            first = min((mm for mm, _, _ in branches),
                        key=lambda m: next(k for k, bnd in enumerate(bindings) if bnd.var.same_as(m.var)))
            merged_name = self.log.fresh("horizontal")
            holder = {}

            def emit_merged(bb, vmap, x=x, w_cat=w_cat, b_cat=b_cat, holder=holder, merged_name=merged_name):
                mm = bb.emit(relax.op.matmul(vmap.get(x, x), relax.const(w_cat)),
                             name_hint=merged_name if b_cat is None else merged_name + "_mm")
                if b_cat is not None:
                    mm = bb.emit(relax.op.add(mm, relax.const(b_cat)), name_hint=merged_name)
                holder["var"] = mm

            pre[first.var] = emit_merged
            off = 0
            for k, (mm, out, bias) in enumerate(branches):
                n = ws[k].shape[1]

                def emit_slice(bb, vmap, off=off, n=n, holder=holder):
                    return relax.op.strided_slice(holder["var"], axes=[-1], begin=[off], end=[off + n])

                off += n
                if out is not mm:
                    skip.add(mm.var)
                plan[out.var] = emit_slice
                names[out.var] = sname = self.log.fresh("split")
                self.log.tags[sname] = Tag("split", (), 0)
            unfused = sum(tensor_bytes(x.ty) + tensor_bytes(mm.value.args[1].ty) + tensor_bytes(mm.var.ty)
                          for mm, _, _ in branches) + sum(
                2 * tensor_bytes(out.var.ty) + tensor_bytes(b.ty) for _, out, b in branches if b is not None)
            self.log.tags[merged_name] = Tag(
                "horizontal", ops, unfused,
                note=f"{len(branches)} GEMMs read {x.name} once instead of {len(branches)}x")
            self.log.notes.append(f"{len(branches)} GEMMs reading {x.name} merged into one ({score.bytes_saved} B saved)")
        if not plan:
            return mod
        return rebuild_main(mod, plan, skip, names, pre)
