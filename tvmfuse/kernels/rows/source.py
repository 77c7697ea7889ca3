"""The row program with the row in its threads' registers: TVMScript of the kernel, and the pieces a streamed
row shares with it (the reduction across threads, per-row reciprocals, the kernel's frame)."""
from __future__ import annotations

import math

from tvmfuse.kernels.rows.program import _COMBINE, _SHFL, RowConfig, RowProgram, _buf, _expr, _widened


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + ln + "\n" if ln.strip() else "\n" for ln in text.splitlines())


class _Reciprocals:
    """The float32 reciprocals of a row's per-row divisors, each computed once per thread: a float division by a
    value the same along the row becomes a multiplication. ``take()`` hands over the code computing those first
    asked for since the last call, to be emitted before the code that uses them; ``allocs`` their registers."""

    def __init__(self, prog: RowProgram, *, row: str, sc: str, wide: frozenset, per: int, scope: str, threads):
        self.prog, self.row, self.sc, self.wide, self.per, self.scope, self.threads = (
            prog, row, sc, wide, per, scope, threads)
        self.names: dict = {}   # a divisor's float32 text -> the register holding its reciprocal
        self.allocs: list = []
        self._code = ""

    def __call__(self, b, roles) -> str:
        if type(b).__name__ in ("BufferLoad", "TensorLoad") and _buf(b).name in self.wide:
            text = f"{_buf(b).name}_s[{self.sc}]"
        else:
            text = f"T.Cast('float32', {_expr(b, self.prog, roles, row=self.row, scalar=self.sc, wide=self.wide)})"
        if text not in self.names:
            self.names[text] = name = f"inv_{len(self.names)}"
            self.allocs.append(f"{name} = T.alloc_buffer(({self.per},), 'float32'{self.scope})\n")
            self._code += self.threads(f"{name}[{self.sc}] = T.float32(1) / {text}\n")
        return f"{self.names[text]}[{self.sc}]"

    def take(self) -> str:
        code, self._code = self._code, ""
        return code


def register_source(prog: RowProgram, cfg: RowConfig | None, emulate: bool = False) -> str:
    """TVMScript of the program under ``cfg``. ``emulate``: the same program with its threads as serial loops
    (each thread's registers a slice of an array, the warp shuffles as the butterfly they compute, the shared
    words across warps as an array), which builds for any target, so the CPU checks the element-to-thread
    mapping, the reductions' order and the index arithmetic numerically. ``cfg`` None: the emulation at one
    thread per row."""
    emulate = emulate or cfg is None
    T_, RPB = (cfg.threads, cfg.rows_per_block) if cfg else (1, 1)
    unroll, vec = ("T.serial", "T.serial") if emulate else ("T.unroll", "T.vectorized")
    L = cfg.lanes if cfg and cfg.lanes else prog.lanes()
    if cfg is None:   # one thread a row: the widest vectors that split it
        L = math.gcd(L, prog.cols)
    N, R = prog.cols, prog.rows
    E, S, W = N // T_, N // T_ // L, T_ // 32
    at = f"tx * {E} + " if emulate else ""     # a thread's registers: its slice of the emulation's arrays
    elem, sc = f"{at}j * {L} + v", ("tx" if emulate else "0")
    col = f"(j * {T_} + tx) * {L} + v"
    row = f"(bx * {RPB} + ty)"

    def threads(code: str) -> str:   # code every thread runs
        return f"for tx in T.serial({T_}):\n" + _indent(code, 4) if emulate else code

    def steps(code: str, lanes: str = unroll) -> str:   # over the thread's elements, a step's lanes at a time
        return f"for j in {unroll}({S}):\n    for v in {lanes}({L}):\n" + _indent(code, 8)

    views = _flat_views(prog)
    # registers: the whole-row parameters read, every whole-row intermediate, the broadcast rows; a scalar per
    # per-row value; a shared word per warp and reduction
    reads_full = sorted(p.name for p in prog.params if p.name in prog.full and not any(p.same_as(o) for o in prog.outputs))
    dtypes = {p.name: p.dtype for p in prog.params}
    dtypes.update({s.buffer.name: s.buffer.dtype for s in prog.steps})
    wide = _widened(prog)
    acc_dtype = {s.buffer.name: ("float32" if s.buffer.name in wide else s.buffer.dtype) for s in prog.steps}
    scope, shared = ("", "") if emulate else (", scope='local'", ", scope='shared'")
    per = T_ if emulate else 1
    body = ""
    for name in dict.fromkeys(reads_full + [s.buffer.name for s in prog.steps if s.kind == "elementwise"]):
        body += f"{name}_r = T.alloc_buffer(({per * E},), '{dtypes[name]}'{scope})\n"
    for name in sorted(prog.by_col):
        body += f"{name}_c = T.alloc_buffer(({per * E},), '{dtypes[name]}'{scope})\n"
    for n, s in enumerate(prog.steps):
        acc_t = acc_dtype[s.buffer.name]
        if s.kind != "elementwise":
            body += f"{s.buffer.name}_s = T.alloc_buffer(({per},), '{acc_t}'{scope})\n"
        if s.kind == "reduce" and emulate:
            body += f"{s.buffer.name}_x = T.alloc_buffer(({per},), '{acc_t}')\n"
        if s.kind == "reduce" and W > 1:
            body += f"red_{n} = T.alloc_buffer(({RPB * W},), '{acc_t}'{shared})\n"
    # one coalesced 16-byte vector per step
    loads = "".join(steps(f"{name}_r[{elem}] = {name}_f[{row} * {N} + {col}]\n", vec) for name in reads_full)
    loads += "".join(steps(f"{name}_c[{elem}] = {name}_f[{col}]\n", vec) for name in sorted(prog.by_col))
    code = threads(loads)
    divisor = _Reciprocals(prog, row=row, sc=sc, wide=wide, per=per, scope=scope, threads=threads)

    for n, s in enumerate(prog.steps):
        name = s.buffer.name
        if s.kind == "elementwise":
            val = _expr(s.value, prog, s.roles, elem=elem, col=col, row=row, scalar=sc, wide=wide,
                        divisor=lambda b, roles=s.roles: divisor(b, roles))
            code += divisor.take() + threads(steps(f"{name}_r[{elem}] = {val}\n"))
            continue
        val = _expr(s.value, prog, s.roles, elem=elem, col=col, row=row, scalar=sc, wide=wide)
        if s.kind == "row":
            code += threads(f"{name}_s[{sc}] = {val}\n")
            continue
        acc, comb = f"{name}_s[{sc}]", _COMBINE[s.combine]
        init = _expr(s.init, prog, s.roles, row=row, scalar=sc, wide=wide)
        if name in wide:
            init, val = f"T.Cast('float32', {init})", f"T.Cast('float32', {val})"
        code += threads(f"{acc} = {init}\n" + steps(f"{acc} = {comb.format(a=acc, b=val)}\n"))
        code += _across_threads(name, n, comb, T_, emulate, unroll, threads)
    body += "".join(divisor.allocs) + code
    stores = [(o.name, o.name) for o in prog.outputs] + [(o.name, src) for o, src in prog.reshaped]
    body += threads("".join(steps(f"{o}_f[{row} * {N} + {col}] = {src}_r[{elem}]\n", vec) for o, src in stores))
    return _kernel(prog, R // RPB, RPB, T_, views, body, emulate)


def _across_threads(name: str, n: int, comb: str, threads_: int, emulate: bool, unroll: str, threads) -> str:
    """Code combining the row's per-thread partials of reduction ``n`` (into ``<name>_s``) into one value every
    thread of the row holds: warp shuffles, then a word per warp in shared memory (``red_<n>``)."""
    acc, W = f"{name}_s[{'tx' if emulate else '0'}]", threads_ // 32
    code = ""
    for m in (16, 8, 4, 2, 1)[5 - int(math.log2(min(threads_, 32))):]:   # within each warp
        if emulate:   # every lane combines its value with lane ^ m's, both as they were
            code += threads(f"{name}_x[tx] = {comb.format(a=acc, b=f'{name}_s[T.bitwise_xor(tx, {m})]')}\n")
            code += threads(f"{acc} = {name}_x[tx]\n")
        else:
            code += f"{acc} = {comb.format(a=acc, b=_SHFL.format(v=acc, m=m))}\n"
    if W > 1:   # across the row's warps: a word each in shared memory
        if emulate:
            code += f"for w in T.serial({W}):\n    red_{n}[ty * {W} + w] = {name}_s[w * 32]\n"
        else:
            code += (f"if tx % 32 == 0:\n    red_{n}[ty * {W} + tx // 32] = {acc}\n"
                     f"T.tvm_storage_sync('shared')\n")
        wsum = f"for w in {unroll}(1, {W}):\n    {acc} = {comb.format(a=acc, b=f'red_{n}[ty * {W} + w]')}\n"
        code += threads(f"{acc} = red_{n}[ty * {W}]\n" + wsum)
    return code


def _kernel(prog: RowProgram, blocks: int, rows_per_block: int, threads_: int, views: str, body: str,
            emulate: bool) -> str:
    """The PrimFunc's TVMScript: ``body`` under the block and thread loops (serial ones in the emulation)."""
    decls = [f"{p.name}: T.Buffer({tuple(int(d) for d in p.shape)!r}, '{p.dtype}')" for p in prog.params]
    if emulate:
        loops = f"for bx in T.serial({blocks}):\n    for ty in T.serial({rows_per_block}):\n"
        inner, attrs = 8, '{"tirx.noalias": True}'
    else:
        loops = (f"for bx in T.thread_binding({blocks}, thread='blockIdx.x'):\n"
                 f"    for ty in T.thread_binding({rows_per_block}, thread='threadIdx.y'):\n"
                 f"        for tx in T.thread_binding({threads_}, thread='threadIdx.x'):\n")
        inner, attrs = 12, '{"tirx.noalias": True, "tirx.is_scheduled": True}'
    return (f"@T.prim_func(s_tir=True)\ndef main({', '.join(decls)}):\n    T.func_attr({attrs})\n"
            + _indent(views, 4) + _indent(loops, 4) + _indent(body, 4 + inner))


def _flat_views(prog: RowProgram) -> str:
    return "".join(f"{p.name}_f = T.decl_buffer(({math.prod(int(d) for d in p.shape)},), '{p.dtype}', "
                   f"data={p.name}.data)\n" for p in prog.params)


