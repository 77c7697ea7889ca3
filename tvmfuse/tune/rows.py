"""A row kernel written whole: each row in its threads' registers, read once, coalesced, written once.

A row-reduction kernel of the planner (softmax, add+LayerNorm, RMSNorm: spatial blocks over ``[rows..., N]``,
reductions over the last axis, per-row blocks between them) becomes one *row program*: ``threads`` threads own
a row (``rows_per_block`` rows per thread block), thread ``t`` holds the row's elements ``(j * threads + t) *
lanes + v`` (``j`` a vector step, ``v`` a lane) in registers, so every step's loads and stores are 16-byte
vectors contiguous across the threads. Every block of the kernel then runs on those registers in order:
spatial blocks element by element, reductions over the thread's elements and then across the threads (warp
shuffles; across warps through a few words of shared memory), per-row blocks once per thread. HBM sees each
input element read once and each output element written once.

The schedule-based ``registers`` sketch of ``tvmfuse.tune.spaces`` cannot lay a row out like this: TVM 0.27
compacts a thread's register cache only to a contiguous slice (an interleaved one keeps the whole row, 2048
registers), so its loads were strided, and it ran slower than the shared-memory sketch on the H200.

Like the flash and wgmma templates, a sketch annotates the kernel's root block with a config and the builder
swaps the PrimFunc for the program (:func:`expand`). The annotation also carries the kernel as the planner made
it, and the program is generated from that: MetaSchedule's postprocessing rewrites the sketch's own blocks
(it splits each reduction into an init and an update block).
"""
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

    @property
    def name(self) -> str:
        return (f"t{self.threads} r{self.rows_per_block}" + (f" v{self.lanes}" if self.lanes else "")
                + (f" m{self.mode}" if self.mode else ""))


REGISTERS, SHARED, L2 = 0, 1, 2
# A row too wide for its threads' registers (a vocabulary's 32000 columns) is *streamed*: every step that
# reduces it is a pass over the row, its elementwise steps recomputed inside each pass from the inputs, which
# the first pass copies to shared memory (SHARED, where a row's inputs fit) or which later passes read again
# from global memory, in practice from L2 (L2: a block's row was read microseconds before; the H200 keeps 50 MB).
STREAMED = (SHARED, L2)
_SHARED_ROW_BYTES = 110 * 1024   # a block's staged row: two blocks an SM of the H200's 228 KB
_STREAM_THREADS = (256, 512, 1024)
_COL = "@col@"   # a streamed step's column, until a pass's part puts its own in


def parse_config(name: str) -> RowConfig:
    f = dict((part[0], int(part[1:])) for part in name.split())
    return RowConfig(threads=f["t"], rows_per_block=f["r"], lanes=f.get("v", 0), mode=f.get("m", 0))


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
    from tvmfuse.kernels.wgmma.analysis import _param_buffers
    from tvmfuse.kernels.sketch import root_blocks

    params = _param_buffers(func)
    blocks = root_blocks(func)
    if not blocks or not params:
        raise Misfit("no blocks")
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


def configs(prog: RowProgram, *, threads=(32, 64, 128, 256, 512), rows_per_block=(1, 2, 4, 8),
            max_elements: int = 64) -> list[RowConfig]:
    """The configs whose threads split the row into whole vectors, at most ``max_elements`` per thread: 16-byte
    vectors, or where no thread count takes those (a short row), the widest narrower ones some thread count
    takes."""
    lanes, out = prog.lanes(), []
    while lanes >= 1 and not out:
        for t in threads:
            t = int(t)
            if prog.cols % (t * lanes) or prog.cols // t > max_elements:
                continue
            for r in rows_per_block:
                r = int(r)
                # at most 512 threads a block: 128 registers each (1024 threads leave 64, and 128 threads x 8
                # rows of add+LayerNorm's 64-element slices spilled)
                if prog.rows % r == 0 and t * r <= 512:
                    out.append(RowConfig(t, r, 0 if lanes == prog.lanes() else lanes))
        lanes //= 2
    if prog.cols >= _STREAM_FROM or not out:
        out += streamed_configs(prog, threads)
    return out


_STREAM_FROM = 4096   # columns from which the space also offers streamed rows
# columns from which a row no register config takes is streamed untuned; narrower ones keep dlight's schedule,
# which beat the streamed row there on the H200 (LayerNorm 16384 x 4099 fp16: dlight 83 us, streamed 110 us;
# softmax 2048 x 32000: dlight 237 us, streamed 71 us)
_STREAM_DEFAULT_FROM = 16384


def _staged_bytes(prog: RowProgram) -> int:
    """Bytes of one row of every whole-row input: what SHARED stages per block."""
    outs = [o.name for o in prog.outputs]
    return sum(prog.cols * _bytes(p.dtype) for p in prog.params if p.name in prog.full and p.name not in outs)


def streamed_configs(prog: RowProgram, threads=_STREAM_THREADS) -> list[RowConfig]:
    """Configs that stream the row (any width, a row a block): SHARED where a row's inputs fit the block's
    shared memory, L2 always."""
    modes = (SHARED, L2) if _staged_bytes(prog) <= _SHARED_ROW_BYTES else (L2,)
    return [RowConfig(int(t), 1, 0, m) for m in modes for t in threads if int(t) in _STREAM_THREADS]


def default_config(prog: RowProgram) -> RowConfig | None:
    """The config an untuned CUDA build runs: the fewest threads a row whose slices fit (a row a warp where
    they do: no barrier), and rows a block up to 128 threads; a row too wide for registers (from 16384 columns)
    streamed, staged in shared memory where it fits, with the fewest threads that take it in at most 8 vectors
    each. None where no config fits, or none of the registers' fits a row narrower than that."""
    fits = [c for c in configs(prog) if c.mode == REGISTERS]
    if not fits and prog.cols < _STREAM_DEFAULT_FROM:
        return None
    if not fits:
        streamed = streamed_configs(prog)
        vectors = prog.cols // prog.lanes()
        mode = min(c.mode for c in streamed)
        threads = next((t for t in _STREAM_THREADS if -(-vectors // t) <= 8), _STREAM_THREADS[-1])
        return next(c for c in streamed if c.mode == mode and c.threads == threads)
    fewest = min(c.threads for c in fits)
    return max((c for c in fits if c.threads == fewest and c.threads * c.rows_per_block <= max(128, fewest)),
               key=lambda c: c.rows_per_block)


def untuned_config(func) -> RowConfig | None:
    """:func:`default_config` of ``func``'s program: what an untuned CUDA build runs and the tuner measures first;
    None where ``func`` is not a row program or no config fits."""
    try:
        return default_config(analyze(func))
    except (Misfit, TypeError):   # (TypeError: a symbolic extent, which no config can split)
        return None


def default_kernel(func):
    """The row program of ``func`` under :func:`untuned_config`, or None."""
    cfg = untuned_config(func)
    return None if cfg is None else kernel_for(func, cfg)


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


def row_source(prog: RowProgram, cfg: RowConfig | None, emulate: bool = False) -> str:
    """TVMScript of the program under ``cfg``. ``emulate``: the same program with its threads as serial loops
    (each thread's registers a slice of an array, the warp shuffles as the butterfly they compute, the shared
    words across warps as an array), which builds for any target, so the CPU checks the element-to-thread
    mapping, the reductions' order and the index arithmetic numerically. ``cfg`` None: the emulation at one
    thread per row."""
    if cfg is not None and cfg.mode in STREAMED:
        return _stream_source(prog, cfg, emulate)
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


def _stream_source(prog: RowProgram, cfg: RowConfig, emulate: bool) -> str:
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


def kernel_for(func, cfg: RowConfig | None, emulate: bool = False):
    """The row program of ``func`` under ``cfg`` as a PrimFunc (``emulate``, or ``cfg`` None: the emulation, see
    :func:`row_source`)."""
    from tvmfuse.kernels.wgmma.ptx import parse

    return parse(row_source(analyze(func), cfg, emulate))


def annotate(sch, root, func, options: list[RowConfig], index) -> None:
    """Record on ``root`` the planner's kernel ``func``, the configs and the sampled ``index`` into them."""
    sch.annotate(root, SOURCE, func.script())
    sch.annotate(root, CANDIDATES, ";".join(c.name for c in options))
    sch.annotate(root, ANNOTATION, index)


def annotated(func):
    """(the planner's kernel, the config) a row-program sketch annotated on ``func``'s root block, or None."""
    from tvmfuse.kernels.annotations import chosen, root_annotations
    from tvmfuse.kernels.wgmma.ptx import parse

    notes = root_annotations(func, SOURCE, CANDIDATES, ANNOTATION)
    if notes is None:
        return None
    return parse(str(notes[SOURCE])), parse_config(chosen(notes[CANDIDATES], notes[ANNOTATION], "row program"))


def expand(mod):
    """``mod`` with every row-program-annotated PrimFunc replaced by its program."""
    from tvmfuse.kernels.annotations import swap_kernels

    def program(gv, func):
        found = annotated(func)
        return None if found is None else kernel_for(*found).with_attr("global_symbol", gv.name_hint)

    return swap_kernels(mod, program)
