"""The row program for rows too wide for registers: each reduction a pass over the row, streamed from global
memory (staged in shared memory or re-read through L2)."""
from __future__ import annotations

import math

from tvmfuse.kernels.rows.program import (_COL, _COMBINE, _LOG2E, _SHFL, SHARED, Misfit, RowConfig, RowProgram,
                                          _buf, _expr, _widened)
from tvmfuse.kernels.rows.source import _across_threads, _flat_views, _indent, _kernel, _Reciprocals


def stream_source(prog: RowProgram, cfg: RowConfig, emulate: bool) -> str:
    """TVMScript of the program streaming its rows (``cfg.mode`` in :data:`STREAMED`, a row a block): thread
    ``tx`` takes the row's vectors ``j * threads + tx`` (the last partial round guarded), each reduction a pass
    over them with the elementwise steps before it recomputed from the inputs, and a last pass that computes and
    stores the outputs. Inputs come from global memory in 16-byte vectors once: a thread's first ``cfg.keep``
    vectors stay in its registers; under SHARED the others are kept in shared memory, under L2 later passes read
    them again. ``cfg.online``: a max reduction and the sum of ``exp(x - max)`` after it (softmax, log-softmax)
    are one pass, the running sum rescaled by ``exp(old max - new max)`` as the max grows. A row whose width is
    not a whole number of vectors starts at a different alignment in each row: its vectors are the aligned ones
    inside it, and the few elements before and after them (``off`` and ``tl``, fewer than a vector each) are
    taken one a thread."""
    T_, L = cfg.threads, cfg.lanes or prog.lanes()
    N, R = prog.cols, prog.rows
    V = N // L
    unaligned = N % L != 0
    S, guard = -(-V // T_), V % T_ != 0 or unaligned
    K = min(cfg.keep, S)            # vectors a thread keeps in registers
    SA = max(V - K * T_, 0) * L     # elements of the aligned part staged in shared memory (SHARED)
    unroll, vec = ("T.serial", "T.serial") if emulate else ("T.unroll", "T.vectorized")
    jloop = unroll if S <= 16 else "T.serial"
    per = T_ if emulate else 1
    ev, sc = (f"tx * {L} + v" if emulate else "v"), ("tx" if emulate else "0")
    col, row = _COL, "bx"   # (rendered once, each part of a pass puts its own column in)
    scope, shared = ("", "") if emulate else (", scope='local'", ", scope='shared'")
    outs = {o.name for o in prog.outputs}
    inputs = [p.name for p in prog.params if p.name in prog.full and p.name not in outs]
    dtypes = {p.name: p.dtype for p in prog.params}
    dtypes.update({s.buffer.name: s.buffer.dtype for s in prog.steps})
    wide = _widened(prog)
    by_step = {s.buffer.name: s for s in prog.steps if s.kind == "elementwise"}
    inlined: dict = {}
    loaded: set = set()   # inputs a pass has read from global memory (kept or staged since)
    pairs = online_pairs(prog) if cfg.online else {}
    fused = {j: i for i, j in pairs.items()}

    def threads(code: str) -> str:
        return f"for tx in T.serial({T_}):\n" + _indent(code, 4) if emulate else code

    def whole(buf) -> str:
        if buf.name in inputs:
            return f"{buf.name}_v[{ev}]"
        if buf.name not in inlined:
            st = by_step[buf.name]
            inlined[buf.name] = "(" + render(st) + ")"
        return inlined[buf.name]

    def render(st) -> str:
        return _expr(st.value, prog, st.roles, elem=ev, col=col, row=row, scalar=sc, wide=wide, whole=whole,
                     bcast=lambda b: f"{b.name}_f[{col}]", divisor=lambda b, roles=st.roles: divisor(b, roles))

    divisor = _Reciprocals(prog, row=row, sc=sc, wide=wide, per=per, scope=scope, threads=threads)
    allocs, code = [], ""

    def stream(compute, stores=()) -> str:
        """A pass over the thread's part of the row: the inputs ``compute`` reads loaded, ``compute`` (the code
        for one lane, or a function of the lanes giving the code for them all), then the ``stores`` (output
        names) from their ``<name>_o`` registers; vectors where the row has them (the kept ones from registers),
        single elements in an unaligned row's head and tail."""
        text = compute if isinstance(compute, str) else compute(1)
        used = [name for name in inputs if f"{name}_v[" in text]
        first = {name for name in used if name not in loaded}
        loaded.update(used)
        # (column in the row, flat index, where it is kept, lanes, lane loop, j range or condition) of each part;
        # the vectors' indices written so TVM proves them aligned, or it loads them element by element
        vector = f"(j * {T_} + tx) * {L} + v"
        kept = f"{f'tx * {K * L} + ' if emulate else ''}j * {L} + v"
        stage = f"((j - {K}) * {T_} + tx) * {L} + v" if K else vector
        base = f"{row} * {N} + "
        parts = []
        if unaligned:
            aligned = f"({row} * {N} + {L - 1}) // {L} * {L}"
            vparts = [(f"off + {vector}", f"{aligned} + {vector}")]
        else:
            vparts = [(vector, base + vector)]
        at, flat = vparts[0]
        if K:
            parts.append((at, flat, "keep", kept, L, vec, f"{K}"))
        if K < S:
            parts.append((at, flat, "stage", stage, L, vec, f"{K}, {S}" if K else f"{S}"))
        if unaligned:
            parts += [("tx", f"{row} * {N} + tx", "stage", f"{SA} + tx", 1, "T.serial", "tx < off"),
                      (f"off + nb * {L} + tx", f"{row} * {N} + off + nb * {L} + tx", "stage", f"{SA + L} + tx", 1,
                       "T.serial", "tx < tl")]
        out = ""
        for at, flat, where, idx, lanes, vloop, cond in parts:
            loads = ""
            for name in used:
                if where == "keep":
                    src = f"{name}_f[{flat}]" if name in first else f"{name}_k[{idx}]"
                    keep_it = name in first
                    dst = f"{name}_k[{idx}]"
                else:
                    staged_src = cfg.mode == SHARED and name not in first
                    src = f"{name}_sh[{idx}]" if staged_src else f"{name}_f[{flat}]"
                    keep_it = cfg.mode == SHARED and name in first
                    dst = f"{name}_sh[{idx}]"
                loads += f"for v in {vloop}({lanes}):\n    {name}_v[{ev}] = {src}\n"
                if keep_it:
                    loads += f"for v in {vloop}({lanes}):\n    {dst} = {name}_v[{ev}]\n"
            body = (f"for v in {unroll}({lanes}):\n" + _indent(compute, 4) if isinstance(compute, str)
                    else compute(lanes))
            inner = loads + body.replace(_COL, at)
            inner += "".join(f"for v in {vloop}({lanes}):\n    {o}_f[{flat}] = {o}_o[{ev}]\n" for o in stores)
            if not cond.startswith("tx"):
                loop = unroll if where == "keep" else jloop
                if guard:
                    inner = f"if j * {T_} + tx < {'nb' if unaligned else V}:\n" + _indent(inner, 4)
                out += threads(f"for j in {loop}({cond}):\n" + _indent(inner, 4))
            else:
                out += threads(f"if {cond}:\n" + _indent(inner, 4))
        return out

    for name in inputs:
        allocs.append(f"{name}_v = T.alloc_buffer(({per * L},), '{dtypes[name]}'{scope})\n")
        if K:
            allocs.append(f"{name}_k = T.alloc_buffer(({per * K * L},), '{dtypes[name]}'{scope})\n")
        if cfg.mode == SHARED and SA + (2 * L if unaligned else 0):
            allocs.append(f"{name}_sh = T.alloc_buffer(({SA + 2 * L if unaligned else SA},), '{dtypes[name]}'"
                          f"{'' if emulate else ', scope=' + repr('shared.dyn')})\n")
    W = T_ // 32
    for n, st in enumerate(prog.steps):
        name, acc_t = st.buffer.name, ("float32" if st.buffer.name in wide else st.buffer.dtype)
        if st.kind == "elementwise":
            continue
        allocs.append(f"{name}_s = T.alloc_buffer(({per},), '{acc_t}'{scope})\n")
        if st.kind == "row":
            val = render(st)
            code += divisor.take() + threads(f"{name}_s[{sc}] = {val}\n")
            continue
        if emulate:
            allocs.append(f"{name}_x = T.alloc_buffer(({per},), '{acc_t}')\n")
        acc, comb = f"{name}_s[{sc}]", _COMBINE[st.combine]
        val, init = render(st), _expr(st.init, prog, st.roles, row=row, scalar=sc, wide=wide)
        if name in wide:
            init, val = f"T.Cast('float32', {init})", f"T.Cast('float32', {val})"
        code += divisor.take() + threads(f"{acc} = {init}\n")
        if n in pairs:   # the max: its pass is the sum's
            continue
        if n in fused:
            mx = prog.steps[fused[n]]
            m_t = mx.buffer.dtype
            for suffix, t in (("t", m_t), ("o", m_t)):
                allocs.append(f"{mx.buffer.name}_{suffix} = T.alloc_buffer(({per},), '{t}'{scope})\n")
            allocs.append(f"{name}_o = T.alloc_buffer(({per},), '{acc_t}'{scope})\n")
            if emulate:
                allocs.append(f"{mx.buffer.name}_x = T.alloc_buffer(({per},), '{m_t}')\n")
            if W > 1:
                allocs.append(f"red_{fused[n]} = T.alloc_buffer(({W},), '{m_t}'{shared})\n")
                allocs.append(f"red_{n} = T.alloc_buffer(({W},), '{acc_t}'{shared})\n")
            m_acc, m_tmp, mval = f"{mx.buffer.name}_s[{sc}]", f"{mx.buffer.name}_t[{sc}]", render(mx)

            def online(lanes, acc=acc, val=val, m_acc=m_acc, m_tmp=m_tmp, mval=mval):
                # the vector's max first, the sum rescaled once a vector, then the vector's terms at that max
                return (f"{m_tmp} = {m_acc}\nfor v in {unroll}({lanes}):\n    {m_tmp} = T.max({m_tmp}, {mval})\n"
                        f"{acc} = {acc} * {_rescale(m_acc, m_tmp)}\n{m_acc} = {m_tmp}\n"
                        f"for v in {unroll}({lanes}):\n    {acc} = {acc} + {val}\n")

            code += stream(online)
            code += _online_across_threads(mx.buffer.name, fused[n], name, n, T_, emulate, unroll, threads)
            continue
        if W > 1:
            allocs.append(f"red_{n} = T.alloc_buffer(({W},), '{acc_t}'{shared})\n")
        code += stream(f"{acc} = {comb.format(a=acc, b=val)}\n")
        code += _across_threads(name, n, comb, T_, emulate, unroll, threads)
    stores = [(o, o) for o in prog.outputs] + list(prog.reshaped)
    compute = ""
    for o, src in stores:
        allocs.append(f"{o.name}_o = T.alloc_buffer(({per * L},), '{o.dtype}'{scope})\n")
        compute += f"{o.name}_o[{ev}] = {whole(src if not isinstance(src, str) else _named(prog, src))}\n"
    code += divisor.take() + stream(compute, [o.name for o, _ in stores])
    # an unaligned row: the elements before its first whole vector, its whole vectors, the elements after
    lets = (f"off = T.truncmod({L} - T.truncmod(bx * {N}, {L}), {L})\nnb = ({N} - off) // {L}\n"
            f"tl = {N} - off - nb * {L}\n") if unaligned else ""
    body = "".join(dict.fromkeys(allocs + divisor.allocs)) + lets + code
    return _kernel(prog, R, 1, T_, _flat_views(prog), body, emulate)


def _rescale(old: str, new: str) -> str:
    """exp(old - new) in float32, as 2^((old - new) log2 e): what a running sum of exp(x - old) is multiplied by
    when the running max moves from ``old`` to ``new``."""
    return f"T.exp2((T.Cast('float32', {old}) - T.Cast('float32', {new})) * T.float32({_LOG2E!r}))"


def _online_across_threads(mx: str, nm: int, sm: str, ns: int, threads_: int, emulate: bool, unroll: str,
                           threads) -> str:
    """Code combining the threads' (running max, running sum) pairs of an online max and sum: each pair's sum
    rescaled to the larger max; warp shuffles, then a pair of words per warp in shared memory."""
    sc = "tx" if emulate else "0"
    m, s, W = f"{mx}_s[{sc}]", f"{sm}_s[{sc}]", threads_ // 32

    def merge(om: str, os: str) -> str:
        return (f"{mx}_t[{sc}] = T.max({m}, {om})\n"
                f"{s} = {s} * {_rescale(m, f'{mx}_t[{sc}]')} + {os} * {_rescale(om, f'{mx}_t[{sc}]')}\n"
                f"{m} = {mx}_t[{sc}]\n")

    code = ""
    for k in (16, 8, 4, 2, 1)[5 - int(math.log2(min(threads_, 32))):]:
        if emulate:   # every lane merges lane ^ k's pair, both as they were
            code += threads(f"{mx}_o[tx] = {mx}_s[T.bitwise_xor(tx, {k})]\n{sm}_o[tx] = {sm}_s[T.bitwise_xor(tx, {k})]\n")
            code += threads(merge(f"{mx}_o[tx]", f"{sm}_o[tx]"))
        else:
            code += (f"{mx}_o[0] = {_SHFL.format(v=m, m=k)}\n{sm}_o[0] = {_SHFL.format(v=s, m=k)}\n"
                     + merge(f"{mx}_o[0]", f"{sm}_o[0]"))
    if W > 1:
        if emulate:
            code += (f"for w in T.serial({W}):\n    red_{nm}[ty * {W} + w] = {mx}_s[w * 32]\n"
                     f"    red_{ns}[ty * {W} + w] = {sm}_s[w * 32]\n")
        else:
            code += (f"if tx % 32 == 0:\n    red_{nm}[ty * {W} + tx // 32] = {m}\n    red_{ns}[ty * {W} + tx // 32] = {s}\n"
                     f"T.tvm_storage_sync('shared')\n")
        code += threads(f"{m} = red_{nm}[ty * {W}]\n{s} = red_{ns}[ty * {W}]\n"
                        f"for w in {unroll}(1, {W}):\n" + _indent(merge(f"red_{nm}[ty * {W} + w]",
                                                                         f"red_{ns}[ty * {W} + w]"), 4))
    return code


def online_pairs(prog: RowProgram) -> dict:
    """{step index of a max reduction: step index of the sum it fuses with}: a sum right after the max (only
    elementwise steps between) of ``exp(a - max)`` where ``a`` is what the max reduces (softmax's and
    log-softmax's), accumulated in float32: such a sum can follow a running max."""
    wide = _widened(prog)
    by_name = {s.buffer.name: s for s in prog.steps if s.kind == "elementwise"}
    out = {}
    for i, mx in enumerate(prog.steps):
        if mx.kind != "reduce" or mx.combine != "Max":
            continue
        j = i + 1
        while j < len(prog.steps) and prog.steps[j].kind == "elementwise":
            j += 1
        if j == len(prog.steps):
            continue
        sm = prog.steps[j]
        if (sm.kind != "reduce" or sm.combine != "Add"
                or ("float32" if sm.buffer.name in wide else str(sm.buffer.dtype)) != "float32"):
            continue
        e, roles = sm.value, sm.roles
        while True:
            while type(e).__name__ == "Cast":
                e = e.value
            if type(e).__name__ in ("BufferLoad", "TensorLoad") and _buf(e).name in by_name:
                st = by_name[_buf(e).name]
                e, roles = st.value, st.roles
                continue
            break
        if type(e).__name__ != "Call" or str(getattr(e.op, "name", "")) != "tirx.exp":
            continue
        arg = e.args[0]
        if type(arg).__name__ != "Sub":
            continue
        b = arg.b
        if type(b).__name__ not in ("BufferLoad", "TensorLoad") or not _buf(b).same_as(mx.buffer):
            continue

        def text(expr, rl):
            def inline(buf):
                return f"({text(by_name[buf.name].value, by_name[buf.name].roles)})" if buf.name in by_name \
                    else f"{buf.name}@"
            return _expr(expr, prog, rl, whole=inline, bcast=lambda buf: f"{buf.name}#")

        a = text(arg.a, roles)
        if f"{mx.buffer.name}_s[" in a or a != text(mx.value, mx.roles):
            continue
        out[i] = j
    return out


def _named(prog: RowProgram, name: str):
    """The parameter or step buffer called ``name``."""
    for b in [*prog.params, *(s.buffer for s in prog.steps)]:
        if b.name == name:
            return b
    raise Misfit(f"no buffer {name}")


