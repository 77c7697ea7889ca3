"""Inference BatchNorm folded into the conv before it.

The importer's ``DecomposeOpsForInference`` turns BatchNorm into subtract/divide/multiply/add by per-channel
constants; after a conv2d with a constant filter those become a scaled filter and one bias add.
"""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax
from tvmfuse.plan.graph import substitute, tensor_bytes, tensor_shape
from tvmfuse.plan.rewrites._common import cleaned_dataflow, module_pass, op_name, rebuild_main
from tvmfuse.plan.rewrites.identities import drop_inference_identities
from tvmfuse.plan.tags import RewriteLog, Tag


def _per_channel(const, channels: int) -> np.ndarray | None:
    """A constant broadcasting along NCHW's channel axis only, as a length-C vector (None if not)."""
    arr = const_numpy(const).astype(np.float64)
    if arr.ndim == 0 or arr.size == 1:
        return np.full(channels, float(arr.reshape(-1)[0]))
    shape = arr.shape
    squeezed = [d for d in shape if d != 1]
    if squeezed != [channels]:
        return None
    # the channel dim must be at axis -3 when right-aligned with NCHW
    if len(shape) < 3 or shape[-3] != channels or any(d != 1 for d in shape[-2:]):
        return None
    return arr.reshape(-1)


def _single_user(users: dict, var, op: str):
    """The binding of ``var``'s only user when that user is an ``op`` call and ``var`` stays inside the dataflow."""
    us = users.get(var, [])
    if len(us) == 1 and isinstance(var, relax.DataflowVar) and op_name(us[0].value) == op:
        return us[0]
    return None


class FoldBatchNorm:
    """conv2d [-> astype] -> (add | subtract | multiply | divide by per-channel constants)+ => conv2d(W·s) [-> astype] + t."""

    def __init__(self, *, log: RewriteLog):
        self.log = log

    def __new__(cls, *, log: RewriteLog):
        self = super().__new__(cls)
        self.__init__(log=log)
        return module_pass("FoldBatchNorm", self.transform_module)

    def transform_module(self, mod):
        mod, bindings, users = cleaned_dataflow(mod, drop_inference_identities)
        if bindings is None:
            return mod
        plan, skip, names = {}, set(), {}
        for b in bindings:
            if op_name(b.value) != "relax.nn.conv2d" or not isinstance(b.value.args[1], RelaxConstant):
                continue
            attrs = b.value.attrs
            if str(attrs.data_layout) != "NCHW" or str(attrs.kernel_layout) != "OIHW":
                continue
            channels = tensor_shape(b.var.ty)[1]
            scale, shift = np.ones(channels), np.zeros(channels)
            chain, cur, ops = [], b.var, []
            # an fp16 conv accumulates in fp32 and is cast back before the BatchNorm (the importer's form): the
            # chain starts after that cast, and the folded bias is added in the cast's dtype
            cast = _single_user(users, cur, "relax.astype")
            head = cur = b.var if cast is None else cast.var   # what the folded bias is added to
            while True:
                us = users.get(cur, [])
                if len(us) != 1 or not isinstance(cur, relax.DataflowVar):
                    break
                u = us[0]
                op = op_name(u.value)
                if op not in ("relax.add", "relax.subtract", "relax.multiply", "relax.divide"):
                    break
                lhs, rhs = u.value.args
                other, cur_is_lhs = (rhs, True) if lhs.same_as(cur) else (lhs, False)
                if not isinstance(other, RelaxConstant) or tensor_shape(u.var.ty) != tensor_shape(b.var.ty):
                    break
                vec = _per_channel(other, channels)
                if vec is None or (not cur_is_lhs and op in ("relax.subtract", "relax.divide")):
                    break
                if op == "relax.add":
                    shift = shift + vec
                elif op == "relax.subtract":
                    shift = shift - vec
                elif op == "relax.multiply":
                    scale, shift = scale * vec, shift * vec
                else:
                    scale, shift = scale / vec, shift / vec
                chain.append(u)
                ops.append(op.split(".")[-1])
                cur = u.var
            if not any(o in ("multiply", "divide", "subtract") for o in ops):
                continue  # a conv bias alone: nothing to fold
            weight = const_numpy(b.value.args[1])
            dtype = weight.dtype
            with np.errstate(over="ignore", invalid="ignore"):
                new_w = (weight.astype(np.float64) * scale.reshape(-1, *([1] * (weight.ndim - 1)))).astype(dtype)
                new_b = shift.reshape(1, channels, 1, 1).astype(str(head.ty.dtype))
            if not (np.isfinite(new_w).all() and np.isfinite(new_b).all()):
                continue  # scaled past the dtype's range (fp16: 65504): the unfolded ops keep the values in range
            conv_call, last = b.value, chain[-1]

            def emit_conv(bb, vmap, conv_call=conv_call, new_w=new_w):
                return relax.Call(conv_call.op, [substitute(conv_call.args[0], vmap), relax.const(new_w)], conv_call.attrs,
                                  ty_args=conv_call.ty_args)

            def emit_bias(bb, vmap, head=head, new_b=new_b):
                return relax.op.add(vmap[head], relax.const(new_b))

            plan[b.var] = emit_conv
            for u in chain[:-1]:
                skip.add(u.var)
            # the chain's last binding keeps its var name (users refer to it); tag it by that name
            plan[last.var] = emit_bias
            names[last.var] = tag_name = self.log.fresh("bnfold")
            y = tensor_bytes(head.ty)
            # the unfused baseline is the imported graph's ops (as FuseOps sees them): one kernel each
            orig = tuple(ops)
            unfused = len(ops) * (2 * y + channels * new_b.dtype.itemsize)
            bn_ops = ops
            self.log.tags[tag_name] = Tag(
                "bn_folded", orig, unfused, note=f"BatchNorm ({'/'.join(bn_ops)}) folded into the conv weights and bias")
            self.log.notes.append(f"BatchNorm after conv {b.var.name} folded into its weights ({len(ops)} ops -> 1 bias add)")
        if not plan:
            return mod
        return rebuild_main(mod, plan, skip, names)

