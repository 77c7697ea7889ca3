"""High-level rewrites on Relax operators, before legalization (phase 1 of the planner).

- :class:`FoldBatchNorm`: conv2d followed by per-channel affine constants (inference BatchNorm, which the
  importer's ``DecomposeOpsForInference`` turned into add/subtract/divide/multiply) becomes conv2d with
  scaled weights plus one bias add.
- :class:`FuseAttention`: MatMul(Q, Kᵀ) -> scale -> (mask) -> Softmax -> MatMul(·, V) becomes one call to
  an online-softmax kernel (:mod:`tvmfuse.plan.attention`) that never writes the N×N scores.
- :class:`HorizontalGemm`: MatMuls reading the same input with constant weights become one MatMul on
  concatenated weights plus slices, when the cost model finds it saves bytes.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tirx, tvm
from tvmfuse.plan.graph import substitute, tensor_bytes, tensor_shape
from tvmfuse.plan.tags import RewriteLog, Tag

_CLEAN = [relax.transform.FoldConstant(), relax.transform.CanonicalizeBindings(),
          relax.transform.DeadCodeElimination()]


def _op(call) -> str:
    return str(call.op.name) if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else ""


def _bindings(mod):
    blocks = [b for b in mod["main"].body.blocks if isinstance(b, relax.DataflowBlock)]
    return list(blocks[0].bindings) if len(blocks) == 1 else None


def _users(bindings) -> dict:
    users: dict = {}
    for b in bindings:
        def visit(e, b=b):
            if isinstance(e, relax.Var):
                users.setdefault(e, []).append(b)
        relax.analysis.post_order_visit(b.value, visit)
    return users


def rebuild_main(mod, plan: dict, skip: set, names: dict | None = None, pre: dict | None = None) -> tvm.IRModule:
    """Re-emit ``main``: ``plan[var] = fn(bb, vmap) -> value`` replaces that binding's value (named
    ``names[var]`` when given); bindings whose var is in ``skip`` are dropped."""
    names, pre = names or {}, pre or {}
    main = mod["main"]
    rest = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}, attrs=mod.attrs)
    bb = relax.BlockBuilder(rest)
    vmap: dict = {}
    with bb.function("main", list(main.params), attrs=dict(main.attrs) if main.attrs else None):
        with bb.dataflow():
            for b in main.body.blocks[0].bindings:
                if b.var in pre:
                    pre[b.var](bb, vmap)
                if b.var in skip:
                    continue
                is_out = not isinstance(b.var, relax.DataflowVar)
                if b.var in plan:
                    value, name = plan[b.var](bb, vmap), names.get(b.var, str(b.var.name))
                else:
                    value, name = substitute(b.value, vmap), str(b.var.name)
                new = bb.emit_output(value, name_hint=name) if is_out else bb.emit(value, name_hint=name)
                vmap[b.var] = new
        bb.emit_func_output(substitute(main.body.body, vmap))
    return bb.finalize()


def _module_pass(name: str, fn: Callable) -> tvm.transform.Pass:
    return tvm.transform.module_pass(lambda mod, _ctx: fn(mod), opt_level=0, name=name)


def _cleaned_dataflow(mod, prepare: Callable | None = None):
    """``mod`` cleaned (and ``prepare``d), ``main``'s dataflow bindings and each variable's users.

    Bindings (and users) are ``None`` when ``main`` has no single dataflow block to rewrite.
    """
    mod = tvm.transform.Sequential(_CLEAN)(mod)
    if prepare is not None:
        mod = prepare(mod)
    bindings = _bindings(mod)
    return mod, bindings, (None if bindings is None else _users(bindings))


# ---------------------------------------------------------------------------------------------- identities
def drop_inference_identities(mod) -> tvm.IRModule:
    """Dropout is the identity at inference: ``dropout(x)`` -> ``(x, x)`` (CanonicalizeBindings removes it)."""
    bindings = _bindings(mod)
    if bindings is None:
        return mod
    plan = {}
    for b in bindings:
        if _op(b.value) == "relax.nn.dropout":
            plan[b.var] = lambda bb, vmap, x=b.value.args[0]: relax.Tuple([vmap.get(x, x), vmap.get(x, x)])
    if not plan:
        return mod
    return tvm.transform.Sequential(_CLEAN)(rebuild_main(mod, plan, set()))


# ---------------------------------------------------------------------------------------------- BatchNorm
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
    if len(us) == 1 and isinstance(var, relax.DataflowVar) and _op(us[0].value) == op:
        return us[0]
    return None


class FoldBatchNorm:
    """conv2d [-> astype] -> (add | subtract | multiply | divide by per-channel constants)+ => conv2d(W·s) [-> astype] + t."""

    def __init__(self, *, log: RewriteLog):
        self.log = log

    def __new__(cls, *, log: RewriteLog):
        self = super().__new__(cls)
        self.__init__(log=log)
        return _module_pass("FoldBatchNorm", self.transform_module)

    def transform_module(self, mod):
        mod, bindings, users = _cleaned_dataflow(mod, drop_inference_identities)
        if bindings is None:
            return mod
        plan, skip, names = {}, set(), {}
        for b in bindings:
            if _op(b.value) != "relax.nn.conv2d" or not isinstance(b.value.args[1], RelaxConstant):
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
                op = _op(u.value)
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


# ------------------------------------------------------------------------------------------ channels last
def channels_last(mod, *, log: RewriteLog):
    """Run 2-D convolutions in NHWC with OHWI weights (Relax's ConvertLayout), then fold the weight and
    parameter transposes into the constants. Elementwise ops, pooling and the folded BatchNorm follow the
    layout, so one transpose stays at the input and one where the features leave the conv stack."""
    if not _count_calls(mod, "relax.nn.conv2d"):
        return mod
    before = _count_calls(mod, "relax.permute_dims")
    mod = tvm.transform.Sequential([
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}),
        relax.transform.FoldConstant(),
    ])(mod)
    added = _count_calls(mod, "relax.permute_dims") - before
    mod, cancelled = compose_transposes(mod)
    log.notes.append(f"convolutions run channels-last (NHWC): {added} layout transposes added at the edges"
                     + (f"; {cancelled} transposes that undid each other removed" if cancelled else ""))
    return mod


def _count_calls(mod, op: str) -> int:
    """Calls of ``op`` in ``main``."""
    n = [0]

    def visit(e):
        if _op(e) == op:
            n[0] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return n[0]


def _axes(call) -> list[int]:
    axes = call.attrs.axes
    ndim = int(call.args[0].ty.ndim)
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def compose_transposes(mod) -> "tuple[tvm.IRModule, int]":
    """``permute_dims(permute_dims(x, p), q)`` -> ``permute_dims(x, p[q])``, and ``x`` for an identity permutation
    (ConvertLayout leaves one where a model's own output transpose followed the layout).

    A model that takes NHWC tensors says so in ONNX as Transpose -> Conv (NCHW); once the convs run NHWC the
    layout transpose that :func:`channels_last` puts in front of them undoes the model's, and the pair would
    otherwise cost a copy of the input. The inner transpose stays while something else reads it. Returns
    the module and the number of transposes removed."""
    bindings = _bindings(mod)
    if bindings is None:
        return mod, 0
    defs = {b.var: b.value for b in bindings}
    plan = {}
    for b in bindings:
        if _op(b.value) != "relax.permute_dims":
            continue
        axes, x = _axes(b.value), b.value.args[0]
        inner = defs.get(x)
        composed = _op(inner) == "relax.permute_dims"
        if composed:
            p = _axes(inner)
            axes, x = [p[i] for i in axes], inner.args[0]
        if axes == list(range(len(axes))):
            plan[b.var] = lambda bb, vmap, x=x: vmap.get(x, x)
        elif composed:
            plan[b.var] = lambda bb, vmap, x=x, axes=axes: relax.op.permute_dims(vmap.get(x, x), axes)
    if not plan:
        return mod, 0
    before = _count_calls(mod, "relax.permute_dims")
    mod = tvm.transform.Sequential(_CLEAN)(rebuild_main(mod, plan, set()))
    return mod, before - _count_calls(mod, "relax.permute_dims")


# -------------------------------------------------------------------------------------------- narrow convs
def _im2col(x, *, oh: int, ow: int, r: int, s: int, kpad: int, stride, dilation, pad):
    """A conv's im2col rows as TE: ``[n * oh * ow, kpad]``, K in the filter's (r, s, c) order, zero where a window
    leaves the NHWC input ``x`` and past ``r * s * c``."""
    from tvm import te

    n, h, w, c = (int(d) for d in x.shape)
    (sh, sw), (dh, dw), (pt, pl) = stride, dilation, pad

    def row(m, kk):
        hi = m // ow % oh * sh - pt + kk // (s * c) * dh
        wi = m % ow * sw - pl + kk // c % s * dw
        inside = tirx.all(kk < r * s * c, hi >= 0, hi < h, wi >= 0, wi < w)
        return tirx.if_then_else(inside, x[m // (oh * ow), hi, wi, kk % c], tirx.const(0, x.dtype))

    return te.compute((n * oh * ow, kpad), row, name="im2col")


def im2col_narrow_convs(mod, *, log: RewriteLog, limit_k: int = 512, allow_dtypes=("float16",)):
    """NHWC convs with fewer than 16 input channels (an image's 1-4: a network's stem), as an im2col kernel and a
    GEMM.

    The tensor-core conv template reads each filter tap's channels 64 at a time (:mod:`tvmfuse.tune.hopper`), so a
    network's stem (3 channels, 7x7, stride 2) got a generic schedule: on the H200 ResNet-50 b32's
    stem took 242 us where cuDNN's first-layer kernel took 61 us, 11% of the model's time. Here the rows of A
    (one per output pixel; K = R*S*C taps x channels, zero-padded to a multiple of 64) are written by one
    injective kernel, and the conv becomes ``matmul(A, W)`` with the filter as a [K, F] constant: a GEMM the
    wgmma template takes, its epilogue fused as any GEMM's. Costs A's bytes (written once, read once): taken only
    where K, padded, is at most ``limit_k``, and only below 16 channels, where a tap's channels do not fill one
    tensor-core K step (wider convs that the template cannot take keep the other tensor-core template, untested
    against this), and for the input types in ``allow_dtypes`` (fp16: the wgmma template's). The plan accounts
    the three new nodes as the one conv they replace."""
    bindings = _bindings(mod)
    if bindings is None:
        return mod
    plan, names = {}, {}
    for b in bindings:
        call = b.value
        if _op(call) != "relax.nn.conv2d" or not isinstance(call.args[1], RelaxConstant):
            continue
        at, x = call.attrs, call.args[0]
        xs, ys = tensor_shape(x.ty), tensor_shape(b.var.ty)
        if (str(at.data_layout), str(at.kernel_layout), str(at.out_layout)) != ("NHWC", "OHWI", "NHWC") \
                or int(at.groups) != 1 or xs is None or ys is None or xs[3] >= 16 or str(x.ty.dtype) not in allow_dtypes:
            continue
        weight = const_numpy(call.args[1])
        f, r, s, c = weight.shape
        k = r * s * c
        kpad = -(-k // 64) * 64
        if kpad > limit_k:
            continue
        w_mat = np.zeros((kpad, f), weight.dtype)
        w_mat[:k] = weight.reshape(f, k).T
        geometry = dict(oh=ys[1], ow=ys[2], r=r, s=s, kpad=kpad, stride=[int(v) for v in at.strides],
                        dilation=[int(v) for v in at.dilation], pad=[int(v) for v in at.padding[:2]])
        rows_name, gemm_name, out_name = (log.fresh(p) for p in ("im2col", "im2col_gemm", "im2col_out"))
        # the conv (input, filter, output as one kernel) is the unfused baseline; the rows are the rewrite's own
        conv_bytes = tensor_bytes(x.ty) + weight.nbytes + tensor_bytes(b.var.ty)
        log.tags[gemm_name] = Tag("im2col", ("conv2d",), conv_bytes, note=f"conv as im2col rows (K {k} -> {kpad}) x GEMM")
        log.tags[rows_name] = log.tags[out_name] = Tag("im2col", (), 0)

        def emit(bb, vmap, x=x, geometry=geometry, w_mat=w_mat, out_dtype=str(b.var.ty.dtype), ys=ys,
                 rows_name=rows_name, gemm_name=gemm_name):
            rows = bb.emit_te(_im2col, vmap.get(x, x), **geometry, primfunc_name_hint="im2col", name_hint=rows_name)
            gemm = bb.emit(relax.op.matmul(rows, relax.const(w_mat), out_dtype=out_dtype), name_hint=gemm_name)
            return relax.op.reshape(gemm, ys)

        plan[b.var], names[b.var] = emit, out_name
        log.notes.append(f"conv {b.var.name} ({c} input channels, {r}x{s}) runs as im2col + GEMM (K {k} padded to "
                         f"{kpad})")
    if not plan:
        return mod
    return tvm.transform.Sequential(_CLEAN)(rebuild_main(mod, plan, set(), names))


# ---------------------------------------------------------------------------------------------- attention
def _scalar(const) -> float | None:
    arr = const_numpy(const)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


class FuseAttention:
    """matmul(Q, Kᵀ) -> [·scale | /scale] -> [+mask] -> softmax(-1) -> matmul(·, V) => one attention kernel."""

    def __new__(cls, *, log: RewriteLog, decline=None):
        """``decline``: a reason not to form the kernel on this target, or a function of the
        :class:`AttentionSpec` giving one (None: form it); declined matches are reported as fusions not
        taken, with the reason, and the graph is left as it is."""
        self = super().__new__(cls)
        self.log = log
        self.decline = decline
        return _module_pass("FuseAttention", self.transform_module)

    def _match(self, b, defs, users):
        """The attention ending at binding ``b`` (the second matmul): (spec, args, dropped vars) or None."""
        from tvmfuse.plan.attention import AttentionSpec

        def single(var):
            return isinstance(var, relax.DataflowVar) and len(users.get(var, [])) == 1

        dropped = []
        pv = b.value
        if _op(pv) == "relax.astype":
            # fp16 models: the frontend accumulates matmuls in fp32 and casts back (astype(matmul(..., f32)));
            # the attention kernel accumulates in fp32 itself, so look through the cast
            inner = defs.get(pv.args[0])
            if inner is None or _op(inner.value) != "relax.matmul" or not single(inner.var):
                return None
            dropped.append(inner.var)
            pv = inner.value
        if _op(pv) != "relax.matmul":
            return None
        probs, v = pv.args
        pb = defs.get(probs)
        if pb is None or _op(pb.value) != "relax.nn.softmax" or not single(probs):
            return None
        rank = len(tensor_shape(probs.ty) or ())
        if int(pb.value.attrs.axis) not in (-1, rank - 1):
            return None
        dropped.append(pb.var)
        cur = pb.value.args[0]
        scale, mask, order = None, None, []
        while True:
            cb = defs.get(cur)
            if cb is None or not single(cur):
                return None
            op = _op(cb.value)
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
            elif op == "relax.add" and mask is None:
                lhs, rhs = cb.value.args
                out_shape = tensor_shape(cb.var.ty)
                if _chain_var(lhs, defs) and tensor_shape(lhs.ty) == out_shape:
                    prev, mask = lhs, rhs
                elif _chain_var(rhs, defs) and tensor_shape(rhs.ty) == out_shape:
                    prev, mask = rhs, lhs
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
        # a Transpose of K's last two axes used only here: read K directly
        k_rows, kb = False, defs.get(kt)
        if kb is not None and _op(kb.value) == "relax.permute_dims" and single(kt) and qs and len(qs) >= 3:
            axes = [int(a) for a in kb.value.attrs.axes] if kb.value.attrs.axes is not None else None
            r = len(qs)
            if axes == list(range(r - 2)) + [r - 1, r - 2]:
                k_rows = True
                dropped.append(kb.var)
        if None in (qs, ks, vs, os_) or not (len(qs) == len(ks) == len(vs) >= 3):
            return None
        batch = qs[:-2]
        if ks[:-2] != batch or vs[:-2] != batch or ks[-2] != qs[-1] or vs[-2] != ks[-1]:
            return None
        dtype = str(q.ty.dtype)
        if str(kt.ty.dtype) != dtype or str(v.ty.dtype) != dtype:
            return None
        mshape = tensor_shape(mask.ty) if mask is not None else None
        full = batch + (qs[-2], ks[-1])
        if mask is not None:
            if mshape is None or len(mshape) > len(full) or any(
                    d not in (1, f) for d, f in zip(mshape[::-1], full[::-1])):
                return None
        spec = AttentionSpec(batch=batch, seq_q=qs[-2], seq_k=ks[-1], head_dim=qs[-1], head_dim_v=vs[-1],
                             dtype=dtype, scale=scale, mask_shape=mshape,
                             mask_dtype=str(mask.ty.dtype) if mask is not None else "float32",
                             scale_first=(order[::-1].index("scale") < order[::-1].index("mask"))
                             if len(order) == 2 else True, k_rows=k_rows)
        if k_rows:
            ops = ("transpose",)
            kt_bytes = 2 * tensor_bytes(kt.ty)
            kt = kb.value.args[0]
        else:
            ops, kt_bytes = (), 0
        args = [q, kt, v] + ([mask] if mask is not None else [])
        # unfused: matmul, each elementwise op on the scores, softmax, matmul: one kernel each
        sb = tensor_bytes(probs.ty)
        ops = ops + ("matmul",) + tuple({"scale": "multiply", "mask": "add"}[o] for o in order[::-1]) + ("softmax", "matmul")
        unfused = kt_bytes + (tensor_bytes(q.ty) + tensor_bytes(kt.ty) + sb) + len(order) * 2 * sb + (
            tensor_bytes(mask.ty) if mask is not None else 0) + 2 * sb + (sb + tensor_bytes(v.ty) + tensor_bytes(b.var.ty))
        return spec, args, dropped, ops, unfused

    def transform_module(self, mod):
        from tvmfuse.plan.attention import attention_primfunc
        from tvmfuse.plan.report import Rejection

        mod, bindings, users = _cleaned_dataflow(mod)
        if bindings is None:
            return mod
        defs = {b.var: b for b in bindings}
        plan, skip, names, gvs = {}, set(), {}, {}
        for b in bindings:
            m = self._match(b, defs, users)
            if m is None:
                continue
            spec, args, dropped, ops, unfused = m
            reason = self.decline(spec) if callable(self.decline) else self.decline
            if reason:
                self.log.rejected.append(Rejection(ops=ops, reason=f"attention not fused: {reason}"))
                continue
            out_ty = b.var.ty

            def emit(bb, vmap, spec=spec, args=args, out_ty=out_ty):
                key = spec.key()
                if key not in gvs:
                    gvs[key] = bb.add_func(attention_primfunc(spec), "attention")
                return relax.call_tir(gvs[key], relax.Tuple([vmap.get(a, a) for a in args]), out_ty=out_ty)

            plan[b.var] = emit
            skip.update(dropped)
            names[b.var] = name = self.log.fresh("attention")
            n = int(np.prod(spec.batch)) * spec.seq_q * spec.seq_k
            self.log.tags[name] = Tag("attention", ops, unfused,
                                      note=f"{n} scores ({spec.seq_q}x{spec.seq_k} per head) never written to memory")
            self.log.notes.append(f"attention {'x'.join(map(str, spec.batch))} heads, {spec.seq_q}x{spec.seq_k}: one kernel")
        if not plan:
            return mod
        return rebuild_main(mod, plan, skip, names)


def _chain_var(var, defs) -> bool:
    b = defs.get(var)
    return b is not None and _op(b.value) in ("relax.matmul", "relax.multiply", "relax.divide")


# ---------------------------------------------------------------------------------------------- horizontal
_EPILOGUE_OPS = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.nn.relu", "relax.sigmoid",
                 "relax.tanh", "relax.erf", "relax.nn.gelu", "relax.nn.silu", "relax.reshape", "relax.permute_dims",
                 "relax.astype", "relax.clip", "relax.power", "relax.sqrt", "relax.exp"}


class HorizontalGemm:
    """MatMuls of one input with constant 2-D weights => one MatMul on concatenated weights + slices."""

    def __new__(cls, *, log: RewriteLog, cost_model=None):
        from tvmfuse.plan.cost import CostModel

        self = super().__new__(cls)
        self.log, self.cost_model = log, cost_model or CostModel()
        return _module_pass("HorizontalGemm", self.transform_module)

    def transform_module(self, mod):
        from tvmfuse.plan.report import Rejection

        mod, bindings, users = _cleaned_dataflow(mod)
        if bindings is None:
            return mod
        by_input: dict = {}
        for b in bindings:
            if _op(b.value) != "relax.matmul":
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
                if len(us) == 1 and isinstance(mm.var, relax.DataflowVar) and _op(us[0].value) == "relax.add":
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
                fusable_epilogue = len(us) == 1 and _op(us[0].value) in _EPILOGUE_OPS and isinstance(out.var, relax.DataflowVar)
                feeds_anchor = any(_op(u.value) not in _EPILOGUE_OPS for u in us)
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
