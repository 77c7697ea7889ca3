"""The row program for rows too wide for registers: each reduction a pass over the row, streamed from global
memory (staged in shared memory or re-read through L2)."""
from __future__ import annotations

from tvmfuse.kernels.rows.program import _COL, _COMBINE, SHARED, Misfit, RowConfig, RowProgram, _expr, _widened
from tvmfuse.kernels.rows.source import _across_threads, _flat_views, _indent, _kernel, _Reciprocals


def stream_source(prog: RowProgram, cfg: RowConfig, emulate: bool) -> str:
    """TVMScript of the program streaming its rows (``cfg.mode`` in :data:`STREAMED`, a row a block): thread
    ``tx`` takes the row's vectors ``j * threads + tx`` (the last partial round guarded), each reduction a pass
    over them with the elementwise steps before it recomputed from the inputs, and a last pass that computes and
    stores the outputs. Inputs come from global memory in 16-byte vectors; under SHARED the first pass that
    reads one keeps it in shared memory and later passes read it there. A row whose width is not a whole number
    of vectors starts at a different alignment in each row: its vectors are the aligned ones inside it, and the
    few elements before and after them (``off`` and ``tl``, fewer than a vector each) are taken one a thread."""
    T_, L = cfg.threads, cfg.lanes or prog.lanes()
    N, R = prog.cols, prog.rows
    V = N // L
    unaligned = N % L != 0
    S, guard = -(-V // T_), V % T_ != 0 or unaligned
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
    staged: set = set()   # SHARED: inputs already in shared memory

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

    def stream(compute: str, stores=()) -> str:
        """A pass over the thread's part of the row: the inputs ``compute`` reads loaded, ``compute`` lane by
        lane, then the ``stores`` (output names) from their ``<name>_o`` registers; vectors where the row has
        them, single elements in an unaligned row's head and tail."""
        used = [name for name in inputs if f"{name}_v[" in compute]
        first = {name for name in used if cfg.mode == SHARED and name not in staged}
        staged.update(first)
        # (column in the row, flat index, index in the staged row, lanes, lane loop, condition) of each part;
        # the vectors' indices written so TVM proves them aligned, or it loads them element by element
        vector = f"(j * {T_} + tx) * {L} + v"
        if unaligned:
            aligned = f"({row} * {N} + {L - 1}) // {L} * {L}"
            parts = [(f"off + {vector}", f"{aligned} + {vector}", vector, L, vec, None),
                     ("tx", f"{row} * {N} + tx", f"{V * L} + tx", 1, "T.serial", "tx < off"),
                     (f"off + nb * {L} + tx", f"{row} * {N} + off + nb * {L} + tx", f"{V * L + L} + tx", 1,
                      "T.serial", "tx < tl")]
        else:
            parts = [(vector, f"{row} * {N} + {vector}", vector, L, vec, None)]
        out = ""
        for at, flat, staged_at, lanes, vloop, cond in parts:
            loads = ""
            for name in used:
                staged_src = cfg.mode == SHARED and name not in first
                src = f"{name}_sh[{staged_at}]" if staged_src else f"{name}_f[{flat}]"
                loads += f"for v in {vloop}({lanes}):\n    {name}_v[{ev}] = {src}\n"
                if name in first:
                    loads += f"for v in {vloop}({lanes}):\n    {name}_sh[{staged_at}] = {name}_v[{ev}]\n"
            inner = loads + f"for v in {unroll}({lanes}):\n" + _indent(compute.replace(_COL, at), 4)
            inner += "".join(f"for v in {vloop}({lanes}):\n    {o}_f[{flat}] = {o}_o[{ev}]\n" for o in stores)
            if cond is None:
                if guard:
                    inner = f"if j * {T_} + tx < {'nb' if unaligned else V}:\n" + _indent(inner, 4)
                out += threads(f"for j in {jloop}({S}):\n" + _indent(inner, 4))
            else:
                out += threads(f"if {cond}:\n" + _indent(inner, 4))
        return out

    for name in inputs:
        allocs.append(f"{name}_v = T.alloc_buffer(({per * L},), '{dtypes[name]}'{scope})\n")
        if cfg.mode == SHARED:
            allocs.append(f"{name}_sh = T.alloc_buffer(({V * L + 2 * L if unaligned else N},), '{dtypes[name]}'"
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
        if W > 1:
            allocs.append(f"red_{n} = T.alloc_buffer(({W},), '{acc_t}'{shared})\n")
        acc, comb = f"{name}_s[{sc}]", _COMBINE[st.combine]
        val, init = render(st), _expr(st.init, prog, st.roles, row=row, scalar=sc, wide=wide)
        if name in wide:
            init, val = f"T.Cast('float32', {init})", f"T.Cast('float32', {val})"
        code += divisor.take() + threads(f"{acc} = {init}\n")
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


def _named(prog: RowProgram, name: str):
    """The parameter or step buffer called ``name``."""
    for b in [*prog.params, *(s.buffer for s in prog.steps)]:
        if b.name == name:
            return b
    raise Misfit(f"no buffer {name}")


