"""The row program's reading of a kernel: its parameters, its rows and columns, its steps in order (elementwise,
per-row, reductions over the row), and the TVMScript text of a step's value under a register layout."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tvmfuse.kernels.tirtext import dtype_of, expr_text

CANDIDATES = "tvmfuse.row_program_configs"   # the configs the sketch chose from, ";"-separated names
ANNOTATION = "tvmfuse.row_program"            # the sampled index into them
SOURCE = "tvmfuse.row_program_kernel"         # the kernel as the planner made it (TVMScript): the program is
#   generated from its blocks, which MetaSchedule's postprocessing splits (a reduction's init and update)
_REDUCE = 2
_COMBINE = {"Add": "{a} + {b}", "Max": "T.max({a}, {b})", "Min": "T.min({a}, {b})"}
_WIDEN = ("float16", "bfloat16")   # sums of these accumulate in float32, and their exp runs as a float32 exp2
#                                    (a division by a per-row value, in these or float32, becomes a
#                                    multiplication by its float32 reciprocal)
_LOG2E = 1.4426950408889634
_SHFL = "T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), {v}, {m}, 32, 32)"


class Misfit(ValueError):
    """The kernel is not a row program this template takes (the reason is the message)."""


@dataclass(frozen=True)
class RowConfig:
    threads: int = 32        # threads per row (32: a row per warp)
    rows_per_block: int = 1  # rows per thread block (threadIdx.y)
    lanes: int = 0           # elements a vector; 0: 16 bytes of the widest whole-row parameter. Narrower only
    #                          where no thread count splits the row into 16-byte vectors (a row under 256 fp16)
    mode: int = 0            # where the row lives between its steps: REGISTERS, SHARED or L2 (see STREAMED)
    keep: int = 0            # streamed: the first ``keep`` vectors of each thread's part of the row kept in its
    #                          registers (the rest staged in shared memory or re-read): a row split between the
    #                          register file and shared memory stays on chip where neither alone holds it, and a
    #                          ragged row (no whole number of vectors a thread) held whole in registers
    online: int = 0          # streamed: a max reduction and the sum of exp(x - max) after it in one pass (the
    #                          running max rescales the running sum), one pass over the row less

    @property
    def name(self) -> str:
        return (f"t{self.threads} r{self.rows_per_block}" + (f" v{self.lanes}" if self.lanes else "")
                + (f" m{self.mode}" if self.mode else "") + (f" k{self.keep}" if self.keep else "")
                + (" o1" if self.online else ""))


REGISTERS, SHARED, L2 = 0, 1, 2
# A row too wide for its threads' registers (a vocabulary's 32000 columns) is *streamed*: every step that
# reduces it is a pass over the row, its elementwise steps recomputed inside each pass from the inputs, which
# the first pass copies to shared memory (SHARED, where a row's inputs fit) or which later passes read again
# from global memory, in practice from L2 (L2: a block's row was read microseconds before; the H200 keeps 50 MB).
STREAMED = (SHARED, L2)
# a block's staged row where no target is known: two blocks an SM of the H200's 228 KB (configs.staged_limit)
_SHARED_ROW_BYTES = 110 * 1024
_STREAM_THREADS = (256, 512, 1024)
_COL = "@col@"   # a streamed step's column, until a pass's part puts its own in


def parse_config(name: str) -> RowConfig:
    f = dict((part[0], int(part[1:])) for part in name.split())
    return RowConfig(threads=f["t"], rows_per_block=f["r"], lanes=f.get("v", 0), mode=f.get("m", 0),
                     keep=f.get("k", 0), online=f.get("o", 0))


@dataclass
class _Step:
    kind: str         # "elementwise" | "reduce" | "row"
    buffer: object    # the buffer it writes
    value: object     # the stored value (a reduction's update operand)
    roles: dict       # block iter var name -> "col" | ("lead", i) | "one"
    combine: str = ""
    init: object = None


@dataclass
class RowProgram:
    """A kernel read as a row program: its parameters, the shape ``[rows..., cols]``, and its steps in order."""
    params: list
    lead: tuple
    cols: int
    steps: list
    full: set          # names of buffers of the full shape (parameters and intermediates)
    outputs: list      # parameter buffers written by elementwise steps
    reshaped: list = field(default_factory=list)   # (parameter, whole-row buffer): an output that is a reshape
    #                                                of a whole-row buffer keeping its flat order (GPT-2's
    #                                                LayerNorm -> [rows, cols] for the next GEMM)
    by_col: set = field(default_factory=set)   # parameters read as a row broadcast over the rows (gamma, beta):
    #                                            filled by analyze()'s check of every step's loads

    @property
    def rows(self) -> int:
        return math.prod(self.lead)

    def lanes(self) -> int:
        """Elements per vector: 16 bytes of the widest full-row parameter."""
        widest = max(_bytes(p.dtype) for p in self.params if p.name in self.full)
        return 16 // widest


def _bytes(dtype) -> int:
    """Bytes of one element of ``dtype`` (``float16`` -> 2)."""
    import re

    return max(1, int(re.search(r"(\d+)$", str(dtype)).group(1)) // 8)


def analyze(func) -> RowProgram:
    """``func`` as a row program; raises :class:`Misfit` where it is not one."""
    from tvmfuse._tvm import tirx
    from tvmfuse.kernels.wgmma.analysis import _param_buffers
    from tvmfuse.kernels.sketch import root_blocks

    params = _param_buffers(func)
    blocks = root_blocks(func)
    if not blocks or not params:
        raise Misfit("no blocks")
    names = [p.name for p in params] + [b.writes[0].source.name for b in blocks if len(b.writes) == 1]
    if len(set(names)) < len(names):
        # two buffers of one name (log-softmax's sum and its output are both "compute"): the program names its
        # registers after buffers, so read the kernel as its TVMScript prints it, every name made unique
        from tvmfuse.kernels.wgmma.ptx import parse

        func = parse(func.script())
        params, blocks = _param_buffers(func), root_blocks(func)
    full_shape = None
    for b in blocks:
        if len(b.writes) != 1:
            raise Misfit(f"block {b.name_hint} writes {len(b.writes)} buffers")
        if not any(int(iv.iter_type) == _REDUCE for iv in b.iter_vars):
            shape = tuple(int(d) for d in b.writes[0].source.shape)
            # the largest spatial block's: a per-row one ([rows..., 1], e.g. RMSNorm's mean) can come first
            if full_shape is None or (len(shape), math.prod(shape)) > (len(full_shape), math.prod(full_shape)):
                full_shape = shape
    if full_shape is None or len(full_shape) < 2:
        raise Misfit("no spatial block over [rows, cols]")
    lead, cols = full_shape[:-1], full_shape[-1]
    steps, full, outputs, reshaped = [], set(), [], []
    param_names = {p.name for p in params}
    for p in params:
        if tuple(int(d) for d in p.shape) == full_shape:
            full.add(p.name)
    for b in blocks:
        ivs = b.iter_vars
        types = [int(iv.iter_type) for iv in ivs]
        extents = [int(iv.dom.extent) for iv in ivs]
        buf = b.writes[0].source
        shape = tuple(int(d) for d in buf.shape)
        body = b.body
        if type(body).__name__ != "BufferStore":
            raise Misfit(f"block {b.name_hint}: body is not one store")
        if _REDUCE in types:
            if types.count(_REDUCE) != 1 or types.index(_REDUCE) != len(types) - 1 or extents[-1] != cols:
                raise Misfit(f"block {b.name_hint}: not one reduction over the last axis")
            roles = _lead_roles(ivs[:-1], lead, b.name_hint)
            roles[ivs[-1].var.name] = "col"
            upd, kind = body.value, type(body.value).__name__
            if kind not in _COMBINE:
                raise Misfit(f"block {b.name_hint}: update is not acc = combine(acc, x)")
            operand = upd.b if _is_self(upd.a, buf, body.indices) else upd.a if _is_self(upd.b, buf, body.indices) else None
            if operand is None:
                raise Misfit(f"block {b.name_hint}: update is not acc = combine(acc, x)")
            if b.init is None or type(b.init).__name__ != "BufferStore":
                raise Misfit(f"block {b.name_hint}: no init")
            if shape not in (lead, (*lead, 1)):
                raise Misfit(f"block {b.name_hint}: writes {shape}")
            if buf.name in param_names:
                raise Misfit(f"block {b.name_hint}: a per-row output (the program stores whole rows only)")
            steps.append(_Step("reduce", buf, operand, roles, kind, b.init.value))
        elif buf.name in param_names and (src := _flat_copy_of(b, full, cols)) is not None:
            reshaped.append((buf, src))
        elif (shape == full_shape == tuple(extents) and buf.name not in param_names
              and _flat_copy_of(b, full, cols) is not None):
            # a reshape inside the kernel that keeps the rows' shape (GPT-Neo's view of its final LayerNorm): the same
            # element at the same place, read as such
            roles = _lead_roles(ivs[:-1], lead, b.name_hint)
            roles[ivs[-1].var.name] = "col"
            full.add(buf.name)
            steps.append(_Step("elementwise", buf, tirx.BufferLoad(_buf(body.value), [iv.var for iv in ivs]), roles))
        elif tuple(extents) == full_shape:
            roles = _lead_roles(ivs[:-1], lead, b.name_hint)
            roles[ivs[-1].var.name] = "col"
            if shape != full_shape or [str(i) for i in body.indices] != [iv.var.name for iv in ivs]:
                raise Misfit(f"block {b.name_hint}: not an elementwise store over [rows, cols]")
            full.add(buf.name)
            steps.append(_Step("elementwise", buf, body.value, roles))
            if buf.name in param_names:
                outputs.append(buf)
        elif tuple(e for e in extents) in (lead, (*lead, 1)) and buf.name not in param_names:
            roles = _lead_roles(ivs, lead, b.name_hint)
            steps.append(_Step("row", buf, body.value, roles))
        else:
            raise Misfit(f"block {b.name_hint}: iterates {extents}, not rows x {cols}")
    if not outputs and not reshaped:
        raise Misfit("no output written row by row")
    if not any(s.kind == "reduce" for s in steps):
        raise Misfit("nothing reduced over the rows")
    prog = RowProgram(params, tuple(lead), cols, steps, full, outputs, reshaped)
    for s in steps:   # every load must be one the program can address
        _expr(s.value, prog, s.roles, check=True)
        if s.init is not None:
            _expr(s.init, prog, s.roles, check=True)
    return prog


def _flat_copy_of(block, full: set, cols: int):
    """The name of the whole-row buffer that ``block`` copies in flat order (``out[i...] = src[f(i...)]`` with
    ``flat(f(i...)) == flat(i...)``, rows of ``cols`` either side: a reshape), or None."""
    from tvmfuse._tvm import Analyzer, tirx, tvm

    body, ivs = block.body, block.iter_vars
    extents = [int(iv.dom.extent) for iv in ivs]
    load = body.value
    if (type(load).__name__ not in ("BufferLoad", "TensorLoad") or _buf(load).name not in full or not extents
            or extents[-1] != cols or [str(i) for i in body.indices] != [iv.var.name for iv in ivs]):
        return None
    src = [int(d) for d in _buf(load).shape]
    if math.prod(src) != math.prod(extents):
        return None

    def flat(indices, shape):
        out = tirx.const(0, "int64")
        for idx, ext in zip(indices, shape):
            out = out * ext + tirx.Cast("int64", idx)
        return out

    analyzer = Analyzer()
    for iv, ext in zip(ivs, extents):
        analyzer.bind(iv.var, tvm.ir.Range.from_min_extent(0, ext))
    diff = analyzer.simplify(flat(load.indices, src) - flat([iv.var for iv in ivs], extents))
    return _buf(load).name if type(diff).__name__ == "IntImm" and int(diff) == 0 else None


def _lead_roles(ivs, lead, name) -> dict:
    roles, i = {}, 0
    for iv in ivs:
        ext = int(iv.dom.extent)
        if i < len(lead) and ext == lead[i]:
            roles[iv.var.name] = ("lead", i)
            i += 1
        elif ext == 1:
            roles[iv.var.name] = "one"
        else:
            raise Misfit(f"block {name}: iterator of extent {ext} is not a row axis")
    if i != len(lead):
        raise Misfit(f"block {name}: does not run over every row")
    return roles


def _buf(node):
    """The buffer a load reads (TVM 0.27: ``source``) or a store writes (``buffer``)."""
    return node.source if hasattr(node, "source") else node.buffer


def _is_self(expr, buf, indices) -> bool:
    return (type(expr).__name__ in ("BufferLoad", "TensorLoad") and _buf(expr).same_as(buf)
            and [str(i) for i in expr.indices] == [str(i) for i in indices])


def _access(load, prog: RowProgram, roles: dict) -> str:
    """How a load reads its buffer: "full" (a whole-row element), "col" (a vector broadcast over the rows),
    "row" (one value per row), "scalar"."""
    shape = [int(d) for d in _buf(load).shape]
    got = []
    for idx, ext in zip(load.indices, shape):
        name = str(idx)
        role = roles.get(name)
        if role is None:
            if type(idx).__name__ == "IntImm" and int(idx) == 0 and ext == 1:
                continue
            raise Misfit(f"load of {_buf(load).name} at {name}")
        if role != "one":
            got.append(role)
    lead = [("lead", i) for i in range(len(prog.lead))]
    if got == [*lead, "col"]:
        return "full"
    if got == ["col"]:
        return "col"
    if got == lead:
        return "row"
    if not got:
        return "scalar"
    raise Misfit(f"load of {_buf(load).name}: indices {[str(i) for i in load.indices]}")


def _expr(expr, prog: RowProgram, roles: dict, *, check: bool = False, elem: str = "e", col: str = "c",
          row: str = "row", scalar: str = "0", wide: frozenset = frozenset(), divisor=None, whole=None,
          bcast=None) -> str:
    """TVMScript of a block's value: whole-row buffers as the thread's register ``<name>_r[elem]``, per-row
    buffers as ``<name>_s[0]`` (those in ``wide`` held in float32, cast back), parameters broadcast over the
    rows as the thread's staged ``<name>_c[elem]`` (``check``: recorded in ``prog.by_col``), per-row parameters
    at ``row`` of a flat view. ``divisor(b)``, if given, names a float32 register holding ``1 / b`` for a
    divisor ``b`` that is the same along the row: a float division by it becomes a multiplication.
    ``whole(buffer)`` and ``bcast(buffer)``, if given, write a whole-row and a broadcast load their own way (a
    streamed row's)."""
    def load(node, rec):
        buf = _buf(node)
        how = _access(node, prog, roles)
        if how == "full":
            if buf.name not in prog.full:
                raise Misfit(f"{buf.name} read as a whole row")
            return whole(buf) if whole is not None else f"{buf.name}_r[{elem}]"
        if how == "row" and buf.name in wide:
            return f"T.Cast('{buf.dtype}', {buf.name}_s[{scalar}])"
        if how == "row":
            return f"{buf.name}_s[{scalar}]" if not _is_param(buf, prog) else f"{buf.name}_f[{row}]"
        if not _is_param(buf, prog):
            raise Misfit(f"intermediate {buf.name} read as a broadcast")
        if how == "col":
            if check:
                prog.by_col.add(buf.name)
            return bcast(buf) if bcast is not None else f"{buf.name}_c[{elem}]"
        return f"{buf.name}_f[0]"

    def var(node):
        raise Misfit(f"variable {node.name} outside an index")

    def rewrite(node, rec):
        kind, dtype = type(node).__name__, dtype_of(node)
        if (kind == "Call" and dtype in _WIDEN and str(getattr(node.op, "name", "")) == "tirx.exp"):
            # exp(x) = 2^(x log2 e) in float32 (ex2.approx, 2 ulp): cuda_fp16's hexp spends four compares and
            # four fmas an element correcting special values (its PTX), and at the H200's copy rate an SM has
            # ~33 issue slots an element of an fp16 row (128 a clock / ~3.9 elements a clock)
            return f"T.Cast('{dtype}', T.exp2(T.Cast('float32', {rec(node.args[0])}) * T.float32({_LOG2E!r})))"
        if (divisor is not None and kind == "Div" and dtype in ("float32", *_WIDEN)
                and _row_invariant(node.b, prog, roles)):
            a, inv = rec(node.a), divisor(node.b)
            return f"({a} * {inv})" if dtype == "float32" else f"T.Cast('{dtype}', T.Cast('float32', {a}) * {inv})"
        return None

    return expr_text(expr, load, var, lambda why: Misfit(f"a row step {why}"), rewrite)


class _Varies(Exception):
    pass


def _row_invariant(expr, prog: RowProgram, roles: dict) -> bool:
    """Whether ``expr`` is the same at every element of a row (it reads per-row values and constants only)."""
    def load(node, rec):
        if _access(node, prog, roles) in ("full", "col"):
            raise _Varies
        return ""

    def var(node):
        raise _Varies

    try:
        expr_text(expr, load, var, lambda why: _Varies())
    except _Varies:
        return False
    return True


def _widened(prog: RowProgram) -> frozenset:
    """The per-row sums accumulated in float32: an fp16 sum of a 2048-element row loses a bit at each add."""
    return frozenset(s.buffer.name for s in prog.steps
                     if s.kind == "reduce" and s.combine == "Add" and str(s.buffer.dtype) in _WIDEN)


def _is_param(buf, prog: RowProgram) -> bool:
    return any(p.same_as(buf) for p in prog.params)


