"""Software prefetch of the streamed operand of CPU reductions: a TIR pass at the end of TVM's lowering, and the
pipeline that runs it (``PIPELINE``, for ``tvm.compile``'s ``tir_pipeline`` and the tuner's builder).

A late ResNet conv at a few pixels streams a weight of megabytes from memory once a call, contiguous thanks to
the packed layout (``schedule.pack_weights``), with a few FMAs for each vector it loads. The hardware prefetcher
follows such a stream but does not cross a 4 KB page, and the kernel read its weight at 12-14 GB/s where a plain read of the same bytes runs at 17-18 GB/s (the 2-core Xeon of
BENCHMARKS.md). A prefetch of the line ``DISTANCE`` bytes ahead, issued every iteration of the reduction loop,
keeps the stream ahead of the FMAs across page boundaries: ResNet-50's 3x3 512-channel conv at 2x2 pixels went
from 0.60 to 0.51 ms with its weight from memory, and ran as fast with it in cache.

Where: the innermost serial loop of a contraction (a store that reads back the accumulator it overwrites and two
operands), for each load in it whose address advances by at least a cache line an iteration (a packed weight; the
activation broadcast along the channels advances 4 bytes and is left to the hardware). One prefetch per cache
line the load advances. A prefetch never faults, so the lines past a buffer's end cost nothing but the request.
"""
from __future__ import annotations

from tvmfuse._tvm import tvm

PIPELINE = "tvmfuse-llvm"
# bytes ahead of the current load: 4 KB (a page) measured best among 0.5-8 KB in a C model of the conv's loop
# (18.6 GB/s against 13.5 without), and within noise of 1-8 KB in TVM's kernels
DISTANCE = 4096
LINE = 64


def _loads(expr, out: list) -> None:
    """Every tensor load in ``expr`` (its indices' loads too)."""
    kind = type(expr).__name__
    if kind in ("TensorLoad", "BufferLoad"):
        out.append(expr)
        for i in expr.indices:
            _loads(i, out)
        return
    if kind == "Call":
        for a in expr.args:
            _loads(a, out)
        return
    for attr in ("a", "b", "value", "condition", "true_value", "false_value", "base"):
        child = getattr(expr, attr, None) if kind not in ("Var", "IntImm", "FloatImm", "StringImm") else None
        if isinstance(child, tvm.ir.expr.Expr):
            _loads(child, out)


def _has_loop(stmt) -> bool:
    kind = type(stmt).__name__
    if kind == "For":
        return True
    if kind == "SeqStmt":
        return any(_has_loop(s) for s in stmt.seq)
    return any(_has_loop(c) for c in (getattr(stmt, a, None) for a in ("body", "then_case", "else_case"))
               if c is not None)


def _stmts(body) -> list:
    return list(body.seq) if type(body).__name__ == "SeqStmt" else [body]


def _prefetches(loop) -> list:
    """The prefetch statements for the innermost serial ``loop``: none unless its body is a contraction's straight
    line of bindings and stores (guarded ones too)."""
    from tvm.sym.analyzer import Analyzer
    from tvm.sym.pattern import detect_linear_equation

    analyzer = Analyzer()
    stores: list = []

    def scan(stmts) -> bool:
        for s in stmts:
            kind = type(s).__name__
            if kind == "Bind":   # the index arithmetic CSE hoisted: inlined into the addresses below
                analyzer.bind(s.var, s.value)
            elif kind == "BufferStore":
                stores.append(s)
            elif kind == "IfThenElse":   # a guarded row of a ragged tile
                if not scan(_stmts(s.then_case)) or (s.else_case is not None and not scan(_stmts(s.else_case))):
                    return False
            else:
                return False
        return True

    if not scan(_stmts(loop.body)):
        return []

    def stride(ld):
        """(the load's address with the body's bindings inlined, its element's bytes, the bytes it advances an
        iteration), or None."""
        if len(ld.indices) != 1:   # after FlattenBuffer every buffer is one-dimensional
            return None
        index = ld.indices[0]
        first = analyzer.simplify(index.base if type(index).__name__ == "Ramp" else index)
        coef = detect_linear_equation(first, [loop.loop_var])
        if len(coef) != 2 or type(coef[0]).__name__ != "IntImm":
            return None
        elem = tvm.runtime.DataType(str(ld.source.dtype)).bits // 8
        return first, elem, int(coef[0].value) * elem

    contracts, streamed = False, []
    for s in stores:
        found: list = []
        _loads(s.value, found)
        moving = [(ld, st) for ld in found if not ld.source.same_as(s.buffer) and (st := stride(ld)) and st[2]]
        # a multiply-accumulate: the accumulator read back, and two operands that move with the loop (a GEMM's or
        # conv's); a row reduction (softmax's sum, LayerNorm's with its mean) moves along one row, which the
        # hardware prefetcher streams on its own
        if any(ld.source.same_as(s.buffer) for ld in found) and len({str(ld.source.name) for ld, _ in moving}) >= 2:
            contracts = True
        streamed += moving
    if not contracts:
        return []
    out, seen = [], set()
    for ld, (first, elem, step) in streamed:
        # the address is valid at the end of the body, outside any guard: the bindings are inlined
        key = (str(ld.source.name), str(first))
        if step < LINE or key in seen:
            continue
        seen.add(key)
        for line in range(0, step, LINE):
            ahead = tvm.tirx.const((DISTANCE + line) // elem, str(first.ty))
            out.append(tvm.tirx.Evaluate(tvm.tirx.call_llvm_intrin(
                "void", "llvm.prefetch.p0", tvm.tirx.address_of(tvm.tirx.BufferLoad(ld.source, [first + ahead])),
                tvm.tirx.const(0, "int32"),    # a read
                tvm.tirx.const(3, "int32"),    # kept in every cache level
                tvm.tirx.const(1, "int32"))))  # data
    return out


def _visit(stmt):
    kind = type(stmt).__name__
    tirx = tvm.tirx
    if kind == "SeqStmt":
        new = [_visit(s) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(new, stmt.seq)) else tirx.SeqStmt(new)
    if kind == "For":
        if int(stmt.kind) == int(tirx.ForKind.SERIAL) and not _has_loop(stmt.body):
            extra = _prefetches(stmt)
            body = tirx.SeqStmt(_stmts(stmt.body) + extra) if extra else stmt.body
        else:
            body = _visit(stmt.body)
        if body.same_as(stmt.body):
            return stmt
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                        stmt.annotations)
    if kind == "AttrStmt":
        body = _visit(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if kind == "IfThenElse":
        then = _visit(stmt.then_case)
        other = _visit(stmt.else_case) if stmt.else_case is not None else None
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then, other)
    return stmt


def insert_prefetch(mod):
    """``mod`` (lowered TIR) with the prefetches above in each function's reduction loops."""
    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            body = _visit(func.body)
            if not body.same_as(func.body):
                updates[gv] = func.with_body(body)
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def _pipeline(**_kwargs):
    """TVM's default TIR pipeline followed by the prefetch pass, with its finalization passes."""
    from tvm.tirx import compilation_pipeline

    lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("s_tir")
    prefetch = tvm.transform.module_pass(lambda mod, _ctx: insert_prefetch(mod), opt_level=0,
                                         name="tvmfuse.InsertPrefetch")
    return tvm.transform.Sequential([lower, prefetch]), finalize_host, finalize_device


def tir_pipeline(target) -> str:
    """The TIR pipeline's name for ``tvm.compile`` / ``tvm.driver.build`` on ``target``: tvmfuse's (registered
    here, in each process that builds) for llvm, TVM's default elsewhere."""
    if isinstance(target, str):
        target = tvm.target.Target(target)
    if target is None or target.kind.name != "llvm":
        return "default"
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.PIPELINE_MAP.setdefault(PIPELINE, _pipeline)
    return PIPELINE
