"""The planner's GEMM and conv kernels as the wgmma template reads them: their :class:`GemmSpec`, the operands'
parameters and the epilogue's store, or the reason they do not fit (:class:`Misfit`)."""
from __future__ import annotations

import math
from dataclasses import replace

from tvmfuse._tvm import structural_equal, structural_hash
from tvmfuse.kernels.tirtext import BINARY, FUNCS, dtype_of, expr_text
from tvmfuse.kernels.wgmma.spec import ConvGeometry, GemmSpec


class Misfit(ValueError):
    """The kernel is not a GEMM this template takes (the reason is the message)."""


def _script(expr, env: dict, buffers: dict, acc, lets: list[str] | None = None) -> str:
    """TVMScript text of an epilogue expression: variables through ``env`` (name -> text), loads of a function
    parameter through ``buffers`` (buffer -> parameter name), and the loads of the GEMM's result ``acc`` =
    (buffer, {index texts: placeholder}) as their placeholders (``{acc}``; a gated epilogue's ``{acc0}`` and
    ``{acc1}``). Raises :class:`Misfit` on anything else.

    ``lets``: a list that receives the lines that compute, once each, the sub-expressions that occur more than once,
    the text then reading them. An epilogue inlined into one expression repeats its producers at every use (erf's
    polynomial reads its argument 21 times, and that argument is the product plus the bias over sqrt(2), converted
    between half and float), and the conversions are inline assembly in CUDA's headers, which nvcc does not merge:
    with the stores unrolled, RoBERTa's fp16 GEMM + erf-GELU compiled to 41,000 SASS instructions (the plain GEMM:
    976) and ran 20x slower than the GEMM (the H100). The values go to local buffers, not let bindings: TVM's
    simplifier substitutes a let's value back at each use."""
    def load(node, rec):
        src = _name(node)
        if src == acc[0]:
            placeholder = acc[1].get(tuple(str(i) for i in node.indices))
            if placeholder is None:
                raise Misfit("the epilogue reads the product at other indices")
            return placeholder
        name = buffers.get(src)
        if name is None:
            raise Misfit(f"the epilogue reads an intermediate buffer ({src})")
        return f"{name}[{', '.join(rec(i) for i in node.indices) or '()'}]"   # (a 0-d parameter: ``p[()]``)

    def var(node):
        if node.name not in env:
            raise Misfit(f"unknown variable {node.name}")
        return env[node.name]

    misfit = lambda why: Misfit(f"the epilogue {why}")  # noqa: E731
    if lets is None:
        return expr_text(expr, load, var, misfit)
    return _bound_text(expr, load, var, misfit, lets, f"ev{len(lets)}_")


def _bound_text(expr, load, var, misfit, lets: list[str], prefix: str) -> str:
    """``expr_text`` of ``expr`` with each compound sub-expression that occurs more than once computed once into a
    local buffer of its dtype (``lets`` receives the buffers and the stores, each value after those it reads) and
    read from it where it occurs."""
    def key(node):
        kind = type(node).__name__
        if kind in ("Var", "IntImm", "FloatImm") or dtype_of(node) == "bool":
            return None
        if kind in ("BufferLoad", "TensorLoad") and not node.indices:
            return None
        return structural_hash(node)

    counts: dict[int, int] = {}

    def count(node, rec):
        k = key(node)
        if k is None:
            return None
        counts[k] = counts.get(k, 0) + 1
        # a repeat is not walked again: what it holds counts once, as the repeat itself is computed once
        return "" if counts[k] > 1 else None

    expr_text(expr, load, var, misfit, count)
    bound: dict[int, list] = {}            # key -> [(node, the text that reads its value)]
    slots: dict[str, int] = {}             # dtype -> values of that dtype so far
    stores: list[str] = []

    def bind(node, rec):
        k = key(node)
        if k is None or counts[k] < 2:
            return None
        for other, text in bound.get(k, []):
            if structural_equal(other, node):
                return text
        # the node's own text, its sub-expressions bound in turn (the hook passes the node itself on)
        value = expr_text(node, load, var, misfit, lambda n, r: None if n is node else bind(n, r))
        dt = dtype_of(node)
        slots[dt] = slots.get(dt, 0) + 1
        text = f"{prefix}{dt}[{slots[dt] - 1}]"
        stores.append(f"{text} = {value}")
        bound.setdefault(k, []).append((node, text))
        return text

    out = expr_text(expr, load, var, misfit, bind)
    lets += [f"{prefix}{dt} = T.alloc_buffer(({n},), '{dt}', scope='local')" for dt, n in slots.items()] + stores
    return out


def _name(node) -> str:
    """The buffer a load reads or a store writes, by name (TVM 0.27 loads name a ``source``, stores a ``buffer``)."""
    for field in ("source", "buffer"):
        if hasattr(node, field):
            return str(getattr(node, field).name)
    raise Misfit(f"not a load or store: {type(node).__name__}")


def _param_buffers(func) -> list:
    """The buffers of ``func``'s parameters (:func:`tvmfuse._tvm.param_buffers`)."""
    from tvmfuse._tvm import param_buffers

    return param_buffers(func)


def _param_decls(func) -> list[str]:
    """TVMScript declarations of ``func``'s parameters, renamed ``p0, p1, ..`` (the names a store refers to)."""
    return [f"p{n}: T.Buffer({tuple(int(d) for d in buf.shape)!r}, '{buf.dtype}')"
            for n, buf in enumerate(_param_buffers(func))]


def _reduction_blocks(sch) -> list:
    return [b for b in sch.get_child_blocks(sch.get_sblock("root"))
            if any(int(iv.iter_type) == 2 for iv in sch.get(b).iter_vars)]


def _extents(block) -> list[int]:
    return [int(iv.dom.extent) for iv in block.iter_vars]


def analyze(func, dtypes: tuple[str, ...] | None = None, gated: bool = False) -> tuple[GemmSpec, dict]:
    """The :class:`GemmSpec` of a planner GEMM PrimFunc (its elementwise intermediates inlined), and what the
    kernel generator needs besides: ``a`` / ``b`` (parameter indices of A and B) and ``store`` (the epilogue's
    store, with the fields of :func:`gemm_source`'s ``store``). ``dtypes``: the operand dtypes taken (None:
    wgmma's, fp16, and fp32 where the planner marked the kernel for TF32; the GEMV template reads fp32 GEMMs
    through it too). ``gated``: take a gated epilogue (``rewrites.gated_gemm``), one output of each pair of
    product columns ``2j``, ``2j + 1``: its store reads ``{acc0}`` and ``{acc1}`` at an even ``{col}``, and
    ``info["gated"]`` is set. Raises :class:`Misfit`."""
    from tvmfuse._tvm import tvm
    from tvmfuse.kernels.sketch import inline_all_but_outputs
    from tvmfuse.plan.tf32 import ATTR, X3

    x3 = bool(func.attrs is not None and func.attrs.get(X3))
    tf32 = x3 or bool(func.attrs is not None and func.attrs.get(ATTR))
    if dtypes is None:
        dtypes = ("float16", "float32") if tf32 else ("float16",)

    sch = tvm.s_tir.Schedule(func)
    reductions = _reduction_blocks(sch)
    if len(reductions) != 1:
        raise Misfit("needs exactly one reduction block")
    main_name = sch.get(reductions[0]).name_hint
    inline_all_but_outputs(sch, keep=(main_name,))
    func = sch.mod["main"]
    bufs = _param_buffers(func)
    params = {str(buf.name): i for i, buf in enumerate(bufs)}
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    main = next(b for b in blocks if b.name_hint == main_name)
    rest = [b for b in blocks if b.name_hint != main_name]
    if main.init is None or type(main.body).__name__ != "BufferStore":
        raise Misfit("the reduction is not an initialized accumulation")
    spatial = [iv for iv in main.iter_vars if int(iv.iter_type) == 0]
    red = [iv for iv in main.iter_vars if int(iv.iter_type) == 2]
    # an NHWC conv: (n, oh, ow, f) x (r, s, c); an NWC one (Whisper's stem): (n, ow, f) x (s, c), a conv of height 1
    conv = (len(red), len(spatial)) in ((3, 4), (2, 3))
    if not conv and len(red) != 1 or len(spatial) < 2 or len(spatial) + len(red) != len(main.iter_vars):
        raise Misfit("needs spatial dims and one reduction dim (a conv: four and three, or three and two)")
    c_store = main.body
    c = _name(c_store)
    names = [str(iv.var.name) for iv in spatial]
    if [str(i) for i in c_store.indices] != names or str(c_store.buffer.dtype) != "float32":
        raise Misfit("needs an fp32 accumulator indexed by the spatial dims")
    value = c_store.value
    if type(value).__name__ != "Add" or type(value.b).__name__ != "Mul":
        raise Misfit("the reduction is not a multiply-accumulate")
    ext = [int(iv.dom.extent) for iv in spatial]
    if conv:
        # (an fp32 conv is read only where marked for TF32: the GEMV template asks for fp32 GEMMs, not convs)
        spec, x, y = _conv_spec(value.b, names, red, ext, bufs, params, dtypes if tf32 else ("float16",))
        oh, ow = (ext[1], ext[2]) if len(ext) == 4 else (1, ext[1])
        out_idx = ["{row}" + f" // {oh * ow}", *(["{row}" + f" // {ow} % {oh}"] if len(ext) == 4 else []),
                   "{row}" + f" % {ow}", "{col}"]
    else:
        spec, x, y = _gemm_spec(value.b, names, red[0], ext, bufs, params, dtypes)
        out_idx = _gemm_out_index(spec)
    if x3 and spec.dtype == "float32":   # fp32 in three TF32 products (GemmSpec's float32x3)
        spec = replace(spec, dtype="float32x3")
    pname = {name: f"p{n}" for name, n in params.items()}
    reindexed = paired = False
    if not rest:
        if c not in params:
            raise Misfit("no output")
        store = f"{pname[c]}[{', '.join(out_idx)}] = {{acc}}"
    else:
        if len(rest) != 1 or type(rest[0].body).__name__ != "BufferStore":
            raise Misfit("the epilogue is not one elementwise block")
        epi = rest[0]
        out = _name(epi.body)
        if out not in params or any(int(iv.iter_type) != 0 for iv in epi.iter_vars):
            raise Misfit("the epilogue does not store a parameter elementwise")
        evars = [str(iv.var.name) for iv in epi.iter_vars]
        reads = {tuple(str(i) for i in ld.indices) for ld in _loads(epi.body.value) if _name(ld) == c}
        if len(reads) == 2 and not conv:
            env, placeholders = _gated_env(epi, c, out_idx, ext)
            if not gated:
                raise Misfit("a gated epilogue (one output of each pair of product columns): the wgmma template's")
            paired = True
        elif len(reads) != 1:
            raise Misfit("the epilogue reads the product at more than one index")
        else:
            (read,) = reads
            placeholders = {read: "{acc}"}
            if list(read) == evars and _extents(epi) == ext:   # elementwise: the product's index is the output's
                env = dict(zip(evars, [f"({e})" for e in out_idx]))
            else:   # a reshape / transpose of the product (heads split off, NHWC back to NCHW): invert the read
                env = _inverted_env(epi, c, out_idx, math.prod(ext))
                reindexed = True
        lets: list[str] = []   # the store's lines before it: the values it uses more than once, each computed once
        expr = _script(epi.body.value, env, pname, (c, placeholders), lets)
        index = ", ".join(_script(i, env, pname, (c, placeholders)) for i in epi.body.indices)
        store = "\n".join([*lets, f"{pname[out]}[{index}] = {expr}"])
    return spec, {"a": params[_name(x)], "b": params[_name(y)], "store": store, "reindexed": reindexed,
                  "gated": paired}


def _gated_env(epi, c: str, out_idx: list[str], ext: list[int]) -> tuple[dict, dict]:
    """(env, placeholders) of a gated epilogue: it reads the product at ``(.., i, 2 * j)`` and ``(.., i, 2 * j +
    1)`` for its output ``(.., i, j)`` (a gated GEMM's g and u, ``rewrites.gated_gemm``), the first as ``{acc0}``
    and the second as ``{acc1}``; the output's column is the even product column ``{col}`` halved."""
    from tvm import sym

    evars = [iv.var for iv in epi.iter_vars]
    names = [str(v.name) for v in evars]
    if ext[-1] % 2 or _extents(epi) != [*ext[:-1], ext[-1] // 2]:
        raise Misfit("the epilogue reads two product columns an output but is not half the product's width")
    placeholders = {}
    for ld in _loads(epi.body.value):
        if _name(ld) != c:
            continue
        idx = list(ld.indices)
        coef = sym.detect_linear_equation(idx[-1], [evars[-1]]) if len(idx) == len(evars) else []
        if [str(i) for i in idx[:-1]] != names[:-1] or len(coef) != 2 or \
                not all(type(k).__name__ == "IntImm" for k in coef) or int(coef[0].value) != 2 or \
                int(coef[1].value) not in (0, 1):
            raise Misfit("the epilogue reads the product at two indices that are not a column pair")
        placeholders[tuple(str(i) for i in idx)] = "{acc%d}" % int(coef[1].value)
    if len(set(placeholders.values())) != 2:
        raise Misfit("the epilogue reads the product at two indices that are not a column pair")
    env = dict(zip(names, [f"({e})" for e in out_idx[:-1]] + ["({col} // 2)"]))
    return env, placeholders


def _fp16_param(e, bufs, params, dtypes=("float16",)):
    """The fp16 (``dtypes``) parameter load ``e`` is (through a cast), or :class:`Misfit`."""
    if type(e).__name__ == "Cast":
        e = e.value
    if type(e).__name__ not in ("TensorLoad", "BufferLoad") or _name(e) not in params:
        raise Misfit("the operands are not parameters")
    if str(bufs[params[_name(e)]].dtype) not in dtypes:
        raise Misfit("the operands are not " + " or ".join(d.replace("float", "fp") for d in dtypes))
    return e


def _gemm_spec(mul, names, red, ext, bufs, params, dtypes=("float16",)):
    """(spec, A's load, B's load) of a (batched) GEMM's multiply ``mul`` over the spatial ``names``."""
    x, y = _fp16_param(mul.a, bufs, params, dtypes), _fp16_param(mul.b, bufs, params, dtypes)
    *batch, i, j = names
    k = str(red.var.name)
    idx = lambda e: [str(t) for t in e.indices]  # noqa: E731
    if i in idx(y):
        x, y = y, x
    ax, bx = idx(x), idx(y)
    if ax[-2:] != [i, k] or ax[:-2] not in ([], batch):
        raise Misfit(f"A is not [.., rows, K] ({ax})")
    if bx[-2:] == [k, j]:
        b_kmajor = False
    elif bx[-2:] == [j, k]:
        b_kmajor = True
    else:
        raise Misfit(f"B is not [.., K, N] or [.., N, K] ({bx})")
    if bx[:-2] not in ([], batch):
        raise Misfit("B is batched over part of the batch")
    spec = GemmSpec(batch=tuple(ext[:len(batch)]), m=ext[-2], n=ext[-1], k=int(red.dom.extent),
                    a_batched=bool(batch) and len(ax) > 2, b_batched=bool(batch) and len(bx) > 2,
                    b_kmajor=b_kmajor, dtype=_same_dtype(x, y, bufs, params))
    if spec.b_batched and not spec.a_batched:
        raise Misfit("B batched but A shared")
    b_dims = [spec.n, spec.k] if b_kmajor else [spec.k, spec.n]
    for load, dims in ((x, [*spec.batch[:len(ax) - 2], spec.m, spec.k]), (y, [*spec.batch[:len(bx) - 2], *b_dims])):
        if [int(d) for d in bufs[params[_name(load)]].shape] != dims:
            raise Misfit(f"{_name(load)}'s shape is not its loads' extents")
    return spec, x, y


def _same_dtype(x, y, bufs, params) -> str:
    """The one dtype of the operand loads ``x`` and ``y`` (:class:`Misfit` where they differ)."""
    dx, dy = (str(bufs[params[_name(e)]].dtype) for e in (x, y))
    if dx != dy:
        raise Misfit(f"the operands' types differ ({dx}, {dy})")
    return dx


def _conv_spec(mul, names, red, ext, bufs, params, dtypes=("float16",)):
    """(spec, the input's load, the filter's load) of an NHWC conv's multiply ``mul``: the output ``(n, oh, ow,
    f)`` over ``names``, the filter read ``[f, r, s, c]`` and the input ``[n, oh * sh + r * dh - pt, ow * sw + s *
    dw - pl, c]``, zero-padded through an ``if_then_else`` where a window leaves the input. An NWC conv (``names``
    ``(n, ow, f)``, filter ``[f, s, c]``, OWI) is the conv of height 1: its geometry's ``h``, ``oh`` and ``r`` 1, and
    its buffers' flat offsets are the NHWC ones."""
    from tvm import sym

    from tvmfuse._tvm import tvm

    loads = []
    for e in (mul.a, mul.b):
        e = e.value if type(e).__name__ == "Cast" else e
        guarded = type(e).__name__ == "Call" and str(getattr(e.op, "name", "")).endswith(".if_then_else")
        if guarded:   # the padding, inlined: if_then_else(inside the input, the load, 0)
            zero = e.args[2]
            if type(zero).__name__ not in ("FloatImm", "IntImm") or float(zero.value) != 0.0:
                raise Misfit("the conv pads with a nonzero value")
            e = e.args[1]
        loads.append((_fp16_param(e, bufs, params, dtypes), guarded))
    one_d = len(names) == 3
    n, *pixel, f = names
    *taps, c = (str(iv.var.name) for iv in red)
    idx = lambda e: [str(t) for t in e.indices]  # noqa: E731
    if idx(loads[0][0]) == [f, *taps, c]:
        loads.reverse()
    (x, guarded), (y, _) = loads
    if idx(y) != [f, *taps, c]:
        raise Misfit(f"the filter is not read [f, {'s' if one_d else 'r, s'}, c] ({'OWI' if one_d else 'OHWI'}) "
                     f"({idx(y)})")
    if len(x.indices) != len(names) or idx(x)[0] != n or idx(x)[-1] != c:
        raise Misfit(f"the input is not read [n, {'..' if one_d else '.., ..'}, c] ({'NWC' if one_d else 'NHWC'}) "
                     f"({idx(x)})")
    geo = [(1, 1, 0)] if one_d else []   # (a 1-D conv's height: stride 1, dilation 1, no padding)
    for index, out_var, tap in zip(x.indices[1:-1], pixel, taps):
        free = {str(v.name): v for v in tvm.tirx.analysis.undefined_vars(index, [])}
        if set(free) != {out_var, tap}:
            raise Misfit("the input's spatial index is not stride * out + dilation * tap + offset")
        coef = sym.detect_linear_equation(index, [free[out_var], free[tap]])
        if len(coef) != 3 or not all(type(k).__name__ == "IntImm" for k in coef):
            raise Misfit("the input's spatial index is not linear")
        stride, dilation, offset = (int(k.value) for k in coef)
        if stride < 1 or dilation < 1 or offset > 0:
            raise Misfit("a conv window this template does not take")
        geo.append((stride, dilation, -offset))
    (sh, dh, pt), (sw, dw, pl) = geo
    in_shape = [int(d) for d in bufs[params[_name(x)]].shape]
    f_shape = [int(d) for d in bufs[params[_name(y)]].shape]
    ks = [int(iv.dom.extent) for iv in red]
    if f_shape != [ext[-1], *ks] or in_shape[0] != ext[0] or in_shape[-1] != ks[-1]:
        raise Misfit("the conv's buffers are not its loads' extents")
    if one_d:   # as NHWC of height 1
        in_shape, ext, ks = [in_shape[0], 1, *in_shape[1:]], [ext[0], 1, *ext[1:]], [1, *ks]
    g = ConvGeometry(n=ext[0], h=in_shape[1], w=in_shape[2], c=ks[2], oh=ext[1], ow=ext[2], r=ks[0], s=ks[1],
                     stride=(sh, sw), pad=(pt, pl), dilation=(dh, dw))
    if g.padded and not guarded:
        raise Misfit("the conv reads outside its input without padding")
    dtype = _same_dtype(x, y, bufs, params)
    # a 1x1 conv of stride 1 reads its NHWC input as a [rows, channels] matrix, row for row: a GEMM (whose A tiles
    # TMA loads at any image size, where the conv's pixel patches leave 14x14 and 7x7 images to cp.async), and
    # its channels are its K, which may end in a partial K step (MobileNet's 24, 96, 144)
    pointwise = (g.r, g.s, g.stride, g.pad, g.h, g.w) == (1, 1, (1, 1), (0, 0), g.oh, g.ow)
    per_copy = 8 if dtype == "float16" else 4   # a copy moves 16 bytes of one pixel's channels
    if g.c % per_copy and not pointwise:
        raise Misfit(f"the conv's input channels ({g.c}) are not a multiple of {per_copy}")
    spec = GemmSpec(batch=(), m=g.n * g.oh * g.ow, n=ext[3], k=g.r * g.s * g.c, a_batched=False, b_batched=False,
                    b_kmajor=True, conv=None if pointwise else g, dtype=dtype)
    return spec, x, y


def _gemm_out_index(spec: GemmSpec) -> list[str]:
    """The product's index of (bz, row, col) as format strings: rows fold the batch when B is shared."""
    nb = len(spec.batch)
    flat, inner_rows = ("{row}" + f" // {spec.m}", "{row}" + f" % {spec.m}") if spec.fold_batch else ("{bz}", "{row}")
    bidx = []
    for d in range(nb):
        inner = math.prod(spec.batch[d + 1:])
        e = f"({flat}) // {inner}" if inner > 1 else f"({flat})"
        bidx.append(f"{e} % {spec.batch[d]}" if d else e)
    return [*bidx, inner_rows, "{col}"]


def _loads(expr) -> list:
    """Every buffer load in an expression (the node kinds :func:`_script` translates)."""
    kind = type(expr).__name__
    if kind in ("TensorLoad", "BufferLoad"):
        return [expr] + [ld for i in expr.indices for ld in _loads(i)]
    children = {"Cast": ("value",), "Not": ("a",), "Select": ("condition", "true_value", "false_value")}.get(
        kind, ("a", "b") if kind in BINARY or kind in FUNCS or kind in ("And", "Or") else ())
    out = [ld for f in children for ld in _loads(getattr(expr, f))]
    if kind == "Call":
        out += [ld for a in expr.args for ld in _loads(a)]
    return out


def _inverted_env(epi, c: str, out_idx: list[str], size: int) -> dict:
    """The epilogue's iteration variables as TVMScript of the product's index (``out_idx``: batch dims, row,
    column), when the epilogue reads the product through a bijective index map (a reshape or transpose)."""
    from tvmfuse._tvm import tvm

    read = next(ld for ld in _loads(epi.body.value) if _name(ld) == c)
    ext = _extents(epi)
    if math.prod(ext) != size:
        raise Misfit("the epilogue's iteration space is not the product's")
    try:
        inverse = tvm.tirx.function.IndexMap([iv.var for iv in epi.iter_vars], list(read.indices), None).inverse(ext)
    except Exception as err:  # noqa: BLE001 - TVM raises when the map is not bijective
        raise Misfit(f"the epilogue's read of the product is not invertible ({str(err).strip()[:80]})") from None
    if len(inverse.initial_indices) != len(out_idx):
        raise Misfit("the epilogue's read of the product has another rank")
    penv = {str(v.name): f"({e})" for v, e in zip(inverse.initial_indices, out_idx)}
    evars = [str(iv.var.name) for iv in epi.iter_vars]
    return {name: f"({_script(e, penv, {}, ('', {}))})" for name, e in zip(evars, inverse.final_indices)}
