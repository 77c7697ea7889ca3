"""Attention as one kernel: MatMul(Q, Kᵀ) -> scale -> (mask) -> Softmax -> MatMul(·, V) becomes one call to an
online-softmax kernel (:mod:`tvmfuse.plan.attention`) that never writes the N×N scores."""
from __future__ import annotations

import dataclasses

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax
from tvmfuse.plan.graph import tensor_bytes, tensor_shape
from tvmfuse.plan.rewrites._common import cleaned_dataflow, module_pass, op_name, rebuild_main
from tvmfuse.plan.rewrites.attention_inputs import MASKED_AT_MOST, causal_offset, kv_repeat
from tvmfuse.plan.tags import RewriteLog, Tag


class _KRows:
    """K as rows for the attention kernel, emitted with it: ``permute_dims(source, axes)`` (Kᵀ's own permute with its
    last two axes swapped back)."""

    def __init__(self, source, axes: list[int]):
        self.source, self.axes = source, axes

    def emit(self, bb, vmap):
        return bb.emit(relax.op.permute_dims(vmap.get(self.source, self.source), self.axes), name_hint="k_rows")


def _narrow_keys(kt) -> bool:
    """Whether Kᵀ's rows (its last axis, the keys) leave no 16-byte vector aligned: the flash kernels then copy Kᵀ
    in narrower vectors (:func:`~tvmfuse.plan.attention.key_vector`), and K as rows would go 16 bytes at a time."""
    from tvmfuse.plan.attention import key_vector

    shape, dtype = tensor_shape(kt.ty), str(kt.ty.dtype)
    return shape is not None and key_vector(shape[-1], dtype) * np.dtype(dtype).itemsize < 16


def _scalar(const) -> float | None:
    arr = const_numpy(const)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


class FuseAttention:
    """matmul(Q, Kᵀ) -> [·scale | /scale] -> [+mask [+bias]] -> softmax(-1) -> matmul(·, V) => one attention
    kernel."""

    def __new__(cls, *, log: RewriteLog, decline=None):
        """``decline``: a reason not to form the kernel on this target, or a function of the
        :class:`AttentionSpec` giving one (None: form it); declined matches are reported as fusions not
        taken, with the reason, and the graph is left as it is."""
        self = super().__new__(cls)
        self.log = log
        self.decline = decline
        return module_pass("FuseAttention", self.transform_module)

    def _match(self, b, defs, users):
        """The attention ending at binding ``b`` (the second matmul): (spec, args, dropped vars) or None."""
        from tvmfuse.plan.attention import AttentionSpec

        def single(var):
            return isinstance(var, relax.DataflowVar) and len(users.get(var, [])) == 1

        dropped = []
        pv = b.value
        if op_name(pv) == "relax.astype":
            # fp16 models: the frontend accumulates matmuls in fp32 and casts back (astype(matmul(..., f32)));
            # the attention kernel accumulates in fp32 itself, so look through the cast
            inner = defs.get(pv.args[0])
            if inner is None or op_name(inner.value) != "relax.matmul" or not single(inner.var):
                return None
            dropped.append(inner.var)
            pv = inner.value
        if op_name(pv) != "relax.matmul":
            return None
        probs, v = pv.args
        pb = defs.get(probs)
        if pb is None or op_name(pb.value) != "relax.nn.softmax" or not single(probs):
            return None
        rank = len(tensor_shape(probs.ty) or ())
        if int(pb.value.attrs.axis) not in (-1, rank - 1):
            return None
        dropped.append(pb.var)
        cur = pb.value.args[0]
        scale, masks, order = None, [], []
        while True:
            cb = defs.get(cur)
            if cb is None or not single(cur):
                return None
            op = op_name(cb.value)
            if op == "relax.matmul":
                break
            if op == "relax.astype":
                # a cast of the scores (the fp32-accumulated Q·Kᵀ cast back to fp16): the kernel works in fp32
                dropped.append(cb.var)
                cur = cb.value.args[0]
                continue
            if op in ("relax.multiply", "relax.divide") and scale is None:
                lhs, rhs = cb.value.args
                other, prev = (rhs, lhs) if isinstance(rhs, RelaxConstant) else (lhs, rhs)
                if not isinstance(other, RelaxConstant) or (op == "relax.divide" and other.same_as(lhs)):
                    return None
                val = _scalar(other)
                if val is None or val == 0:
                    return None
                scale = val if op == "relax.multiply" else 1.0 / val
                order.append("scale")
            elif op == "relax.where" and len(masks) < 2:
                # a constant condition choosing between the scores and a value that hides them (GPT-Neo's and the
                # older GPT-2 exports' causal mask): the same as adding 0 or that value to the scores
                found = _where_mask(cb, defs, 1.0 if scale is None else scale)
                if found is None:
                    return None
                prev, mask = found
                masks.insert(0, mask)
                order.append("where")
            elif op == "relax.add" and len(masks) < 2:   # a mask, and a bias added beside it (T5)
                lhs, rhs = cb.value.args
                out_shape = tensor_shape(cb.var.ty)
                if _chain_var(lhs, defs) and tensor_shape(lhs.ty) == out_shape:
                    prev = lhs
                    masks.insert(0, rhs)
                elif _chain_var(rhs, defs) and tensor_shape(rhs.ty) == out_shape:
                    prev = rhs
                    masks.insert(0, lhs)
                else:
                    return None
                order.append("mask")
            else:
                return None
            dropped.append(cb.var)
            cur = prev
        mm = defs[cur]
        dropped.append(mm.var)
        q, kt = mm.value.args
        qs, ks, vs, os_ = (tensor_shape(x.ty) for x in (q, kt, v, b.var))
        # a Transpose of K's last two axes used only here: read K directly. Kᵀ made by another permute (the
        # exporters' one transpose that splits the heads and turns K at once) whose keys leave no 16-byte vector
        # aligned (ViT's 197, Whisper's 1500 in fp16): the same permute with the last two axes swapped back gives K as
        # rows, which the kernel copies 16 bytes at a time
        k_rows, kb, k_permuted = False, defs.get(kt), None
        if kb is not None and op_name(kb.value) == "relax.permute_dims" and single(kt) and qs and len(qs) >= 3:
            axes = [int(a) for a in kb.value.attrs.axes] if kb.value.attrs.axes is not None else None
            r = len(qs)
            if axes == list(range(r - 2)) + [r - 1, r - 2]:
                k_rows = True
                dropped.append(kb.var)
            elif axes is not None and len(axes) == r and _narrow_keys(kt):
                k_rows, k_permuted = True, _KRows(kb.value.args[0], [*axes[:-2], axes[-1], axes[-2]])
                dropped.append(kb.var)
        if None in (qs, ks, vs, os_) or not (len(qs) == len(ks) == len(vs) >= 3):
            return None
        batch = qs[:-2]
        # GQA / MQA: K and V with fewer heads, read for a group of query heads each: their repeat (repeat_kv's
        # Unsqueeze -> Expand|Tile -> Reshape) dropped, or a single K/V head that the matmuls broadcast
        k_src = k_permuted or (kb.value.args[0] if k_rows else kt)
        group, kv_dropped, kv_extra = 1, [], 0
        reps = [kv_repeat(x, defs, users) for x in (k_src, v)] if k_permuted is None else [None]
        if all(reps) and reps[0][1] == reps[1][1]:
            group = reps[0][1]
            kv_dropped = reps[0][2] + reps[1][2]
            k_src, v = reps[0][0], reps[1][0]
            kv_extra = tensor_bytes(k_src.ty) + tensor_bytes(v.ty)   # unfused, the repeats read these
            ks = tensor_shape(k_src.ty)
            ks = (*ks[:-2], ks[-1], ks[-2]) if k_rows else ks
            vs = tensor_shape(v.ty)
        elif (ks[:-2] == vs[:-2] and ks[-3] == 1 and len(batch) >= 1 and batch[-1] > 1
              and ks[:-3] == batch[:-1]):
            group = batch[-1]
        kv_batch = batch if group == 1 else (*batch[:-1], batch[-1] // group)
        if ks[:-2] != kv_batch or vs[:-2] != kv_batch or ks[-2] != qs[-1] or vs[-2] != ks[-1]:
            return None
        dtype = str(q.ty.dtype)
        if str(kt.ty.dtype) != dtype or str(v.ty.dtype) != dtype:
            return None
        full = batch + (qs[-2], ks[-1])
        for mask in masks:
            mshape = tensor_shape(mask.ty)
            if mshape is None or len(mshape) > len(full) or any(
                    d not in (1, f) for d, f in zip(mshape[::-1], full[::-1])):
                return None
        steps = ["mask" if o == "where" else o for o in order[::-1]]   # the score's ops in the order they run
        if "scale" in steps and len(masks) == 2 and steps[1] == "scale":
            return None   # scale between the two additions: not one place for both
        scale_first = steps.index("scale") < steps.index("mask") if ("scale" in steps and masks) else True
        causal, offset, note = False, 0, None
        after = scale if (scale is not None and not scale_first) else 1.0
        for mask in masks:
            off, why = causal_offset(mask, qs[-2], ks[-1], after)
            note = note or why
            if off is not None and not causal:   # the kernel skips the hidden keys: that mask is no input
                causal, offset = True, off
                masks = [m for m in masks if m is not mask]
        mask_bytes = sum(tensor_bytes(m.ty) for m in masks)
        shapes = [tensor_shape(m.ty) for m in masks] + [None, None]
        dtypes = [str(m.ty.dtype) for m in masks] + ["float32", "float32"]
        spec = AttentionSpec(batch=batch, seq_q=qs[-2], seq_k=ks[-1], head_dim=qs[-1], head_dim_v=vs[-1],
                             dtype=dtype, scale=scale, mask_shape=shapes[0], mask_dtype=dtypes[0],
                             scale_first=scale_first, k_rows=k_rows, causal=causal, causal_offset=offset,
                             kv_group=group, bias_shape=shapes[1], bias_dtype=dtypes[1])
        dropped += kv_dropped
        if k_rows and k_permuted is None:
            ops = ("transpose",)
            kt_bytes = 2 * tensor_bytes(kt.ty)
        else:   # (a permute to K as rows still runs, as Kᵀ's did)
            ops, kt_bytes = (), 0
        k_bytes = tensor_bytes(kt.ty if k_permuted is not None else k_src.ty)   # (K as rows: Kᵀ's bytes)
        args = [q, k_src, v] + masks
        ops = (("repeat_kv",) if kv_dropped else ()) + ops
        # unfused: matmul, each elementwise op on the scores, softmax, matmul: one kernel each
        sb = tensor_bytes(probs.ty)
        named = {"scale": "multiply", "mask": "add", "where": "where"}
        ops = ops + ("matmul",) + tuple(named[o] for o in order[::-1]) + ("softmax", "matmul")
        kv_scale = group if kv_dropped else 1   # the unfused matmuls read the repeated K and V
        unfused = kv_extra * (1 + group) + kt_bytes + (
            tensor_bytes(q.ty) + k_bytes * kv_scale + sb) + len(order) * 2 * sb + mask_bytes + 2 * sb + (
            sb + tensor_bytes(v.ty) * kv_scale + tensor_bytes(b.var.ty))
        return spec, args, dropped, ops, unfused, note

    def transform_module(self, mod):
        from tvmfuse.plan.attention import attention_primfunc
        from tvmfuse.plan.report import Rejection

        mod, bindings, users = cleaned_dataflow(mod)
        if bindings is None:
            return mod
        defs = {b.var: b for b in bindings}
        plan, skip, names, gvs = {}, set(), {}, {}
        for b in bindings:
            m = self._match(b, defs, users)
            if m is None:
                continue
            spec, args, dropped, ops, unfused, mask_note = m
            reason = self.decline(spec) if callable(self.decline) else self.decline
            if reason:
                self.log.rejected.append(Rejection(ops=ops, reason=f"attention not fused: {reason}"))
                continue
            at, out_ty = b.var, b.var.ty
            heads_out = _heads_transpose(b.var, spec, users)
            if heads_out is not None:   # the output stored with its rows before its heads: the transpose is gone
                spec = dataclasses.replace(spec, seq_major_out=True)
                dropped = [*dropped, b.var]
                at, out_ty = heads_out, heads_out.ty
                ops, unfused = (*ops, "transpose"), unfused + 2 * tensor_bytes(b.var.ty)

            def emit(bb, vmap, spec=spec, args=args, out_ty=out_ty):
                if spec not in gvs:   # (a frozen spec: one kernel for equal specs)
                    gvs[spec] = bb.add_func(attention_primfunc(spec), "attention")
                ins = [a.emit(bb, vmap) if isinstance(a, _KRows) else vmap.get(a, a) for a in args]
                return relax.call_tir(gvs[spec], relax.Tuple(ins), out_ty=out_ty)

            plan[at] = emit
            skip.update(dropped)
            names[at] = name = self.log.fresh("attention")
            n = int(np.prod(spec.batch)) * spec.seq_q * spec.seq_k
            extras = (["stored with its rows before its heads (the transpose after it fused)"]
                      if spec.seq_major_out else []) + (
                [f"causal (offset {spec.causal_offset}): the mask is not read and the hidden keys are skipped"]
                if spec.causal else []) + ([mask_note] if mask_note else []) + (
                [f"{spec.kv_batch[-1]} K/V heads for {spec.batch[-1]} query heads, never repeated in memory"]
                if spec.kv_group > 1 else [])
            self.log.tags[name] = Tag("attention", ops, unfused,
                                      note=f"{n} scores ({spec.seq_q}x{spec.seq_k} per head) never written to memory"
                                      + "".join(f"; {e}" for e in extras))
            self.log.notes.append(f"attention {'x'.join(map(str, spec.batch))} heads, {spec.seq_q}x{spec.seq_k}: one "
                                  "kernel" + "".join(f"; {e}" for e in extras))
        if not plan:
            return mod
        return rebuild_main(mod, plan, skip, names)


def _heads_transpose(var, spec, users):
    """The variable of the one transpose that reads ``var`` (the attention's output, ``[..., heads, rows, d]``) and
    swaps its heads and rows, as exporters do before the output projection; or None."""
    readers = users.get(var, [])
    r = len(spec.batch) + 2
    if not spec.batch or len(readers) != 1 or not isinstance(var, relax.DataflowVar):
        return None
    t = readers[0]
    if op_name(t.value) != "relax.permute_dims" or t.value.attrs.axes is None:
        return None
    axes = [int(a) for a in t.value.attrs.axes]
    return t.var if axes == [*range(r - 3), r - 2, r - 3, r - 1] else None


def _where_mask(b, defs, after: float):
    """(the scores, an additive constant mask) for binding ``b``, ``where(cond, scores, fill)`` or ``where(cond, fill,
    scores)`` with ``cond`` a constant and ``fill`` a constant that hides a key (at most
    :data:`~tvmfuse.plan.rewrites.attention_inputs.MASKED_AT_MOST` once multiplied by ``after``, the scale applied
    after it); or None. The two agree only where every row keeps a key: a row whose keys are all replaced by
    ``fill`` is uniform, not ``softmax(scores + fill)``, so such a condition is not taken."""
    cond, a, c = b.value.args
    shape = tensor_shape(b.var.ty)
    if not isinstance(cond, RelaxConstant):
        return None
    keep = np.asarray(const_numpy(cond)).astype(bool)
    if _chain_var(a, defs) and isinstance(c, RelaxConstant):
        scores, fill = a, c
    elif _chain_var(c, defs) and isinstance(a, RelaxConstant):
        scores, fill, keep = c, a, ~keep
    else:
        return None
    value = _scalar(fill)
    if (value is None or tensor_shape(scores.ty) != shape or keep.ndim < 1 or keep.ndim > len(shape)
            or not (value * after <= MASKED_AT_MOST) or not keep.any(axis=-1).all()):
        return None
    dtype = str(scores.ty.dtype)
    return scores, relax.const(np.where(keep, 0, value).astype(dtype), dtype)


def _chain_var(var, defs) -> bool:
    b = defs.get(var)
    return b is not None and op_name(b.value) in ("relax.matmul", "relax.multiply", "relax.divide", "relax.add",
                                                  "relax.astype", "relax.where")

