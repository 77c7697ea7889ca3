"""TIR expressions as TVMScript text: how the hand-written templates (``wgmma``, the row program) carry a kernel's
arithmetic (an epilogue, a row's steps) into the kernels they write."""
from __future__ import annotations

BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "FloorDiv": "//", "FloorMod": "%", "LT": "<",
           "LE": "<=", "GT": ">", "GE": ">=", "EQ": "==", "NE": "!="}
FUNCS = {"Max": "T.max", "Min": "T.min"}
_CALLS = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "erf", "sqrt", "rsqrt", "fabs", "pow", "floor", "ceil",
          "round", "cos", "sin", "if_then_else")


def dtype_of(expr) -> str:
    """An expression's dtype (TVM 0.27: ``ty``; earlier: ``dtype``)."""
    return str(expr.ty if hasattr(expr, "ty") else expr.dtype)


def expr_text(expr, load, var, misfit, rewrite=None) -> str:
    """TVMScript text of ``expr``: a buffer load through ``load(node, rec)`` and a variable through ``var(node)``
    (``rec`` translates a sub-expression, e.g. an index); constants, casts, arithmetic, comparisons, logic,
    selects and the elementwise math calls as themselves. Anything else raises ``misfit(reason)``.
    ``rewrite(node, rec)``, if given, may translate a node its own way: its text, or None for the node as
    itself."""
    kind = type(expr).__name__
    rec = lambda e: expr_text(e, load, var, misfit, rewrite)  # noqa: E731
    if rewrite is not None:
        text = rewrite(expr, rec)
        if text is not None:
            return text
    if kind in ("TensorLoad", "BufferLoad"):
        return load(expr, rec)
    if kind == "Var":
        return var(expr)
    if kind in ("IntImm", "FloatImm"):
        value = int(expr.value) if kind == "IntImm" else float(expr.value)
        return f"T.{dtype_of(expr)}({value!r})" if dtype_of(expr) != "bool" else repr(bool(value))
    if kind == "Cast":
        return f"T.Cast('{dtype_of(expr)}', {rec(expr.value)})"
    if kind in BINARY:
        return f"({rec(expr.a)} {BINARY[kind]} {rec(expr.b)})"
    if kind in FUNCS:
        return f"{FUNCS[kind]}({rec(expr.a)}, {rec(expr.b)})"
    if kind in ("And", "Or"):
        return f"T.{kind}({rec(expr.a)}, {rec(expr.b)})"
    if kind == "Not":
        return f"T.Not({rec(expr.a)})"
    if kind == "Select":
        return f"T.Select({rec(expr.condition)}, {rec(expr.true_value)}, {rec(expr.false_value)})"
    op = str(getattr(getattr(expr, "op", None), "name", ""))
    if kind == "Call" and op.startswith("tirx.") and op[5:] in _CALLS:
        return f"T.{op[5:]}({', '.join(rec(a) for a in expr.args)})"
    raise misfit(f"uses {kind} {op}".strip())
