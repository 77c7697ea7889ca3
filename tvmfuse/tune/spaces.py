"""Search spaces from ``search_spaces/<target>.yaml``: classify each fused kernel, build its MetaSchedule space.

A space file names, per kernel class, a *template* (a schedule function below, whose numeric knobs are
``sample_categorical`` decisions MetaSchedule searches over and whose structural choices are separate
sketches) or ``stock`` (MetaSchedule's post-order-apply space with a named rule set). Every space is
tried once on the CPU before tuning (:func:`select_space`): a template that cannot schedule a kernel,
or a stock rule set that yields no schedule (the tensor-core rule on some shapes), falls back to the
next space, and the choice and the reason are reported.

Kernel classes: ``pointwise`` (injective blocks only), ``row_reduction`` (reductions over the last axis
with prologue/epilogue: add+LayerNorm, RMSNorm, softmax), ``gemm`` and ``conv`` (a multiply-accumulate
reduction with an epilogue), ``attention`` (the planner's online-softmax kernel, ``tvmfuse.kernel``
attribute), ``other``.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from tvmfuse._tvm import ms, tvm
from tvmfuse.errors import TvmfuseError
from tvmfuse.tune.knobs import Knob, names_in, sample, sample_option
from tvmfuse.tune.sketch import DATA_PAR, REDUCE, bind_placeholder, inline_all_but_outputs, iter_types, root_blocks
from tvmfuse.tune.tensorcore import tensorcore_postprocs, template_gemm_tensorcore

# shipped inside the package (a non-editable install has no source tree); ``search_spaces/`` at the top of the
# repository links here, where users read and edit them
SPACES_DIR = Path(__file__).resolve().parents[1] / "search_spaces"
CLASSES = ("pointwise", "row_reduction", "gemm", "conv", "attention", "other")


# ----------------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class ClassSpace:
    name: str
    template: str
    knobs: dict = field(default_factory=dict)
    stock_rules: str | None = None
    fallback_rules: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SpaceFile:
    version: str
    target: str
    classes: dict
    builder_timeout_s: float
    path: Path
    digest: str

    def for_class(self, name: str) -> ClassSpace:
        return self.classes.get(name) or self.classes["other"]


class SpaceError(TvmfuseError):
    exit_code = 2


def _parse_knob(name: str, spec) -> Knob:
    if isinstance(spec, list):
        spec = {"values": spec}
    if not isinstance(spec, dict) or not spec.get("values"):
        raise SpaceError(f"knob '{name}' needs a non-empty 'values' list")
    values = tuple(spec["values"])
    probs = tuple(float(p) for p in spec.get("probs", [1.0 / len(values)] * len(values)))
    if len(probs) != len(values) or any(p < 0 for p in probs) or sum(probs) <= 0:
        raise SpaceError(f"knob '{name}': 'probs' must be as many non-negative weights as 'values'")
    total = sum(probs)
    return Knob(name, values, tuple(p / total for p in probs))


def load_space_file(path: str | Path) -> SpaceFile:
    """Parse and validate one space file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpaceError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(doc, dict) or "version" not in doc or "classes" not in doc:
        raise SpaceError(f"{path}: a space file needs 'version' and 'classes'")
    classes = {}
    for cname, spec in (doc["classes"] or {}).items():
        if cname not in CLASSES:
            raise SpaceError(f"{path}: unknown kernel class '{cname}'", hint="classes: " + ", ".join(CLASSES))
        spec = dict(spec or {})
        template = spec.pop("template", "stock")
        if template != "stock" and template not in TEMPLATES:
            raise SpaceError(f"{path}: class '{cname}': unknown template '{template}'",
                             hint="templates: stock, " + ", ".join(sorted(TEMPLATES)))
        knobs = {k: _parse_knob(k, v) for k, v in (spec.pop("knobs", None) or {}).items()}
        classes[cname] = ClassSpace(cname, template, knobs, spec.pop("stock_rules", None),
                                    spec.pop("fallback_rules", None), spec)
    classes.setdefault("other", ClassSpace("other", "stock", {}, None))
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return SpaceFile(version=str(doc["version"]), target=str(doc.get("target", path.stem)), classes=classes,
                     builder_timeout_s=float(doc.get("builder_timeout_s", 60)), path=path, digest=digest)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> SpaceFile:
    return load_space_file(path)


def load_spaces(target_kind: str, directory: str | Path | None = None) -> SpaceFile:
    """The space file for a target kind (``cuda`` or ``llvm``)."""
    path = Path(directory or SPACES_DIR) / f"{target_kind}.yaml"
    if not path.exists():
        raise SpaceError(f"no search-space file {path}")
    return _load_cached(str(path), path.stat().st_mtime)


# ----------------------------------------------------------------------------------- classification
def classify(func) -> str:
    """The kernel class of a fused PrimFunc (see module docstring)."""
    attrs = func.attrs
    if attrs is not None and "tvmfuse.kernel" in attrs and str(attrs["tvmfuse.kernel"]) == "attention":
        return "attention"
    blocks = root_blocks(func)
    if not blocks:
        return "other"
    reductions = [b for b in blocks if any(int(iv.iter_type) == REDUCE for iv in b.iter_vars)]
    if not reductions:
        if all(all(int(iv.iter_type) == DATA_PAR for iv in b.iter_vars) for b in blocks):
            return "pointwise"
        return "other"
    names = " ".join(b.name_hint.lower() for b in reductions)
    if "conv" in names:
        return "conv"
    if any(w in names for w in ("matmul", "dense", "einsum")):
        return "gemm"
    # a reduction reading two different tensors both indexed by the reduction var is a contraction
    for b in reductions:
        rvars = {str(iv.var.name) for iv in b.iter_vars if int(iv.iter_type) == REDUCE}
        with_r = {r.source.name for r in b.reads if any(names_in(rg.min) & rvars for rg in r.region)}
        if len(with_r) >= 2:
            return "gemm"
    return "row_reduction"


# ------------------------------------------------------------------------------------------ templates
def _dtype_bytes(dtype) -> int:
    return max(1, tvm.runtime.DataType(str(dtype)).bits // 8)


def _vector_knob(knob: Knob, inner: int, dtype_bytes: int) -> Knob:
    return knob.filtered(lambda v: inner % int(v) == 0 and int(v) * dtype_bytes <= 16)


def template_pointwise(sch, space: ClassSpace, info: dict) -> list:
    """Injective kernels: inline the chain, fuse, split [rows, vectors_per_thread, threads, lanes]."""
    inline_all_but_outputs(sch)
    root = sch.get_sblock("root")
    outs = sch.get_output_blocks(root)
    if len(outs) != 1 or len(sch.get_child_blocks(root)) != 1:
        raise ValueError("pointwise template: needs one fused block")
    block = outs[0]
    buf = sch.get(block).writes[0].source
    shape = [int(d) for d in buf.shape]
    total, inner = 1, shape[-1]
    for d in shape:
        total *= d
    ebytes = _dtype_bytes(buf.dtype)
    vec_k = _vector_knob(space.knobs["vector_lanes"], inner, ebytes)
    thr_k = space.knobs["threads"].filtered(lambda t: int(t) <= max(32, total))
    per_k = space.knobs["vectors_per_thread"]
    sketches = []
    transpose = _transposed_input(sch, block, shape)
    modes = space.knobs.get("loop", Knob("loop", ("one-shot",), (1.0,))).values
    if transpose is not None:
        # the flat sketches ran the conv case's transpose at 16-25% of the copy ceiling on the H200 (the tiled one
        # at 96%): one flat sketch stays beside the tiled one, so that half the search goes to it
        modes = modes[:1]
    for mode in modes:
        s = sch.copy()
        blk = s.get_sblock(s.get(block).name_hint)
        if len(shape) > 1 and [int(iv.dom.extent) for iv in s.get(blk).iter_vars] == shape:
            # one flat iterator: the register caches are then indexed by it directly (see _flatten_copy)
            s.transform_block_layout(blk, _flat_map(shape))
        loops = s.get_loops(blk)
        fused = s.fuse(*loops) if len(loops) > 1 else loops[0]
        vec = sample(s, vec_k)
        outer, lanes = s.split(fused, [None, vec])
        threads = sample(s, thr_k)
        if mode == "grid-stride":
            # grid = waves x SMs blocks; each thread strides over the whole tensor
            sms = int(info.get("sm_count", 132))
            wk = space.knobs["grid_stride_waves"]
            blocks = sample(s, Knob("grid_blocks", tuple(int(w) * sms for w in wk.values), wk.probs))
            it_bx, tx = s.split(outer, [None, threads])
            it, bx = s.split(it_bx, [None, blocks])
            s.reorder(bx, tx, it, lanes)
            s.bind(bx, "blockIdx.x")
            s.bind(tx, "threadIdx.x")
        else:
            per = sample(s, per_k)
            bx, p, tx = s.split(outer, [None, per, threads])
            s.reorder(bx, tx, p, lanes)
            s.bind(bx, "blockIdx.x")
            s.bind(tx, "threadIdx.x")
            it = p
        # full-size operands go through registers as vectors; broadcast ones (a bias row) are read in place:
        # a register cache of them is addressed modulo the row, which TVM cannot compact to the thread's share
        full = [str(r.source.name) for r in s.get(blk).reads if [int(d) for d in r.source.shape] == shape]
        _stage_through_registers(s, blk, it, lanes, reads=full)
        if "unroll" in space.knobs:
            s.annotate(s.get_sblock("root"), "meta_schedule.unroll_explicit", sample(s, space.knobs["unroll"]))
        sketches.append(s)
    if transpose is not None:
        sketches.append(_transpose_sketch(sch.copy(), sch.get(block).name_hint, transpose, space, shape, ebytes))
    return sketches


def _transposed_input(sch, block, shape: list[int]):
    """``(input name, output axis, input axis)`` when the block reads a full-size input whose innermost index
    is another output axis than the output's innermost (NCHW -> NHWC: ``y[n, h, w, c] = x[n, c, h, w]``):
    ``output axis`` is the one the input's innermost indexes (w), ``input axis`` the input's dimension that the
    output's innermost indexes (c). None for any other kernel."""
    stmt = sch.get(block)
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(ivars) != len(shape) or len(shape) < 2:
        return None
    size = math.prod(shape)
    for r in stmt.reads:
        if math.prod(int(d) for d in r.source.shape) != size:
            continue
        last = r.region[-1]
        if int(last.extent) != 1 or not isinstance(last.min, tvm.tirx.Var):
            continue
        axis = next((i for i, v in enumerate(ivars) if v.same_as(last.min)), None)
        in_axis = next((i for i, rg in enumerate(r.region) if int(rg.extent) == 1 and
                        isinstance(rg.min, tvm.tirx.Var) and rg.min.same_as(ivars[-1])), None)
        if axis is not None and axis != len(shape) - 1 and in_axis is not None:
            return str(r.source.name), axis, in_axis
    return None


def _tiles(extent: int, candidates=(64, 32, 16, 8)) -> tuple[int, ...]:
    """Tile sizes for one side of a transpose: the whole extent when it is small, else divisors."""
    tiles = tuple(t for t in candidates if extent % t == 0 and t < extent)
    return ((extent,) if extent <= max(candidates) else ()) + tiles or (extent,)


def _transpose_sketch(s, name: str, transpose: tuple[str, int, int], space: ClassSpace, shape: list[int],
                      ebytes: int):
    """A transpose through a shared-memory tile: read coalesced along the input's innermost axis, write
    coalesced along the output's.

    The flat pointwise sketches read an NCHW input 2 bytes at a time with a stride of H x W elements when they
    write NHWC: on the H200 the 64 x 256 x 56 x 56 fp16 transpose of the conv case ran 212 us, 23%
    of the copy ceiling. Here a block owns a ``tile_a x tile_b`` tile (``a`` = the output axis that is the
    input's innermost, ``b`` = the output's innermost), copies it into shared memory with vector loads along
    ``a``, and writes it with vector stores along ``b``; rows of the tile are padded by one bank word so the
    column reads do not conflict.
    """
    src, a, in_axis = transpose
    blk = s.get_sblock(name)
    loops = s.get_loops(blk)
    last = len(shape) - 1
    tiles_a, tiles_b = _tiles(shape[a]), _tiles(shape[last], (64, 32))
    # the widest tiles first: on the H200 the conv case's transpose ran 55 us (96% of the copy)
    # with 56 x 64 tiles (a whole row of w, 64 channels) and 125-179 us with 8-wide ones
    ta = sample(s, Knob.leaning("transpose_tile_a", tiles_a, 0.8))
    tb = sample(s, Knob.leaning("transpose_tile_b", tiles_b, 0.8))
    ao, ai = s.split(loops[a], [None, ta])
    bo, bi = s.split(loops[last], [None, tb])
    others = [lp for i, lp in enumerate(loops) if i not in (a, last)]
    s.reorder(*others, ao, bo, ai, bi)
    bx = s.fuse(*others, ao, bo)
    s.bind(bx, "blockIdx.x")
    threads = sample(s, space.knobs["threads"].filtered(lambda t: int(t) <= 256))
    # the staged tile: loads along the input's innermost axis
    cache = s.cache_read(blk, src, "shared")
    s.compute_at(cache, bx)
    s.storage_align(cache, 0, in_axis, 64 // ebytes, 4 // ebytes)  # row stride = an odd number of bank words
    inner = s.get_loops(cache)[1:]
    fused = s.fuse(*inner) if len(inner) > 1 else inner[0]
    # an odd number of words per row keeps each row's start 4-byte aligned, no more: the tile is filled with
    # 4-byte loads (16-byte ones are misaligned on odd rows: the H200 killed every such candidate)
    word = max(1, 4 // ebytes)   # elements per 4-byte word
    vin = word if math.gcd(*tiles_a) % word == 0 else 1
    _, tx, lanes = s.split(fused, [None, threads, vin])
    s.bind(tx, "threadIdx.x")
    s.vectorize(lanes)
    # the output: stores along its innermost axis
    fused = s.fuse(ai, bi)
    # at most 4 lanes: the gathered lanes' int32 index vector of 8 (32 bytes) fails TVM's VerifyGPUCode, which
    # rejected about a third of this sketch's candidates
    vout = sample(s, _vector_knob(space.knobs["vector_lanes"], math.gcd(*tiles_b), ebytes).filtered(
        lambda v: int(v) <= 4))
    _, tx, lanes = s.split(fused, [None, threads, vout])
    s.bind(tx, "threadIdx.x")
    s.vectorize(lanes)
    return s


def _vectorize_under(s, block, anchor) -> None:
    """Fuse and vectorize the loops of ``block`` that lie under ``anchor``."""
    loops = s.get_loops(block)
    anchor_sref = s.get_sref(anchor)
    idx = next(i for i, lp in enumerate(loops) if s.get_sref(lp).same_as(anchor_sref))
    inner = loops[idx + 1:]
    if not inner:
        return
    lp = s.fuse(*inner) if len(inner) > 1 else inner[0]
    s.vectorize(lp)


def _fuse_leading(dims: list[int], n: int):
    """The index map ``(i0, ..., i_{n-1}, *rest) -> (i0 * d1 * ... * d_{n-1} + ... + i_{n-1}, *rest)``."""
    def fuse(*idx):
        f = idx[0]
        for i, extent in zip(idx[1:n], dims[1:n]):
            f = f * extent + i
        return (f, *idx[n:])

    return tvm.tirx.IndexMap.from_func(fuse, ndim=len(dims))


def _flat_map(dims: list[int]):
    return _fuse_leading(dims, len(dims))


def _flatten_copy(s, copy, which: tuple) -> None:
    """Make a register cache one-dimensional, buffer and copy block: ``(i, j, ...) -> i * J + j ...``.

    A thread's vector of a row-major tensor is addressed through a fused index as ``(f // N, f % N)``; on
    multi-dimensional caches TVM could not prove that region to be ``vec`` elements when a row spans
    several thread blocks (``bx * 2048 - (bx // 4) * 8192`` against ``(bx % 4) * 2048``): it kept the whole
    tensor as each thread's array (a 16384 x 8192 SwiGLU asked for 268 million registers per thread) or
    left loops of min/max extent that cannot be vectorized. Flat, the index simplifies back to ``f``.
    ``copy`` is the cache block (fresh, at the root); ``which`` names its local buffer.
    """
    kind, index = which
    stmt = s.get(copy)
    buf = (stmt.writes if kind == "write" else stmt.reads)[index].source
    dims = [int(d) for d in buf.shape]
    if len(dims) < 2 or [int(iv.dom.extent) for iv in stmt.iter_vars] != dims:
        return
    try:
        s.transform_block_layout(copy, _flat_map(dims))
    except tvm.s_tir.ScheduleError:
        # the copy shares its loops with the block it caches (a cache_write under that block's thread
        # loops, as in the row template): those indices carry no fused division, nothing to flatten
        return
    s.transform_layout(copy, which, _flat_map(dims))


def _stage_through_registers(s, block, anchor, lanes, *, reads=True, flatten=True) -> None:
    """Vector loads into registers, scalar math, one vector store.

    TVM's vectorizer scalarizes a whole loop when its body calls something it cannot vectorize (erf,
    exp, sigmoid): the loads and stores then go out 2 bytes at a time. Staging each input's lanes in a
    local buffer (a vectorized copy), computing in an unrolled loop and writing through a local buffer
    (a vectorized copy) keeps the 16-byte accesses whatever the arithmetic.

    ``flatten``: flatten the register caches (see :func:`_flatten_copy`). Not for a row kernel: there the
    copy is bounded per row, and a flat index hides a column split that does not divide the row (768
    columns as 2 x 64 threads x 8 lanes): the store's bound became the whole tensor's, so the last
    threads wrote their unused lanes over the next row's first columns (BERT's LayerNorm on the H200: relative error 0.58, caught by the kernel check).
    """
    if reads is True:
        names = [str(r.source.name) for r in s.get(block).reads]
    else:
        names = list(reads or [])
    for name in names:
        cr = s.cache_read(block, name, "local", consumer_blocks=[block])
        if flatten:
            _flatten_copy(s, cr, ("write", 0))
        s.compute_at(cr, anchor, preserve_unit_loops=True)
        _vectorize_under(s, cr, anchor)
    cw = s.cache_write(block, 0, "local")
    if flatten:
        _flatten_copy(s, cw, ("read", 0))
    s.reverse_compute_at(cw, anchor, preserve_unit_loops=True)
    _vectorize_under(s, cw, anchor)
    s.unroll(lanes)


def _flatten_rows(s, shape: list[int]) -> None:
    """Give every block of a row kernel with more than one leading axis (softmax over [B, H, S, S]) a single
    row iterator: ``(i0, ..., i_{n-2}, k) -> (row, k)``.

    Computing the per-row blocks at a loop fused from several leading loops otherwise makes TVM estimate
    their regions from the fused index's divisions and modulos, which gives loops with min/max extents
    that can no longer be bound to threads.
    """
    lead = shape[:-1]
    if len(lead) < 2:
        return
    # the intermediates (per-row statistics, staged rows) first: a fused row must index them directly, or
    # compute_at cannot invert the division/modulo that would address them
    root = s.get_sblock("root")
    local = {str(buf.name) for buf in s.get(root).alloc_buffers}
    for b in s.get_child_blocks(root):
        buf = s.get(b).writes[0].source
        dims = [int(d) for d in buf.shape]
        if str(buf.name) in local and dims[:len(lead)] == lead:
            s.transform_layout(b, ("write", 0), _fuse_leading(dims, len(lead)))
    for b in s.get_child_blocks(root):
        ivs = s.get(b).iter_vars
        if len(ivs) != len(shape) or [int(iv.dom.extent) for iv in ivs[:-1]] != lead:
            continue
        if any(int(iv.iter_type) != DATA_PAR for iv in ivs[:-1]):
            continue
        s.transform_block_layout(b, _fuse_leading(shape, len(lead)))


def _split_columns(s, loop, threads, lanes, contiguous: bool):
    """Split a row's column loop into (thread, vector step, lanes) loops, returned in that order. Contiguous:
    column = (thread, step, lane), each thread a slice of its own (what keeps a row in registers); else
    column = (step, thread, lane), each step's vectors contiguous across the threads (coalesced)."""
    if contiguous:
        return tuple(s.split(loop, [threads, None, lanes]))
    step, lane = s.split(loop, [None, lanes])
    step, tx = s.split(step, [None, threads])
    return tx, step, lane


def template_row_reduction(sch, space: ClassSpace, info: dict) -> list:
    """Reductions over the last axis: ``rows_per_block`` rows per thread block (threadIdx.y), each reduced by
    its own ``threads`` threads (a row per warp at 32).

    Sketch ``shared``: the row (the prologue's result, or the input the reductions read) is staged in
    shared memory with vectorized loads, the reductions read it from there (cross-thread reductions
    lower to warp shuffles), the epilogue writes with vectorized stores. Sketch ``registers``: the same
    rows staged in registers instead: each thread owns a contiguous ``cols / threads`` slice of its row
    (at most ``row_register_elements``), loaded once with vector loads; every pass reads the thread's
    own registers, and only the cross-thread reductions meet (warp shuffles, one small shared buffer):
    one read and one write of HBM per element, no shared-memory passes or barriers between them.
    Sketch ``recompute``: no staging, each pass re-reads the inputs.
    """
    root = sch.get_sblock("root")
    outs = sch.get_output_blocks(root)
    if len(outs) != 1:
        raise ValueError("row_reduction template: needs one output block")
    out_name = sch.get(outs[0]).name_hint
    out_buf = sch.get(outs[0]).writes[0].source
    shape = [int(d) for d in out_buf.shape]
    if len(shape) < 2 or any(t != DATA_PAR for t in iter_types(sch, outs[0])):
        raise ValueError("row_reduction template: output must be a spatial block with >= 2 dims")
    cols = shape[-1]
    ebytes = _dtype_bytes(out_buf.dtype)
    # full-row spatial blocks read by a reduction: candidates for staging (the prologue, e.g. x + r)
    prologue = []
    for b in sch.get_child_blocks(root):
        name = sch.get(b).name_hint
        if name == out_name or REDUCE in iter_types(sch, b):
            continue
        wbuf = sch.get(b).writes[0].source
        if [int(d) for d in wbuf.shape] == shape and any(REDUCE in iter_types(sch, c) for c in sch.get_consumers(b)):
            prologue.append((name, wbuf))
    # (Softmax's exp(x - max) is staged too, written over x in place. Recomputing it from the staged x in the
    # sum and output passes instead removes a barrier per step, but ran 1.26x slower on the H200:
    # 232 vs 184 us at 32 threads x 1 row, 65536 x 2048.)
    max_shared = int(space.extra.get("max_shared_bytes", 49152))
    storages = list(space.knobs.get("row_storage", Knob("row_storage", ("shared", "recompute"), (0.5, 0.5))).values)
    sketches = []
    for storage in storages:
        if storage == "program":
            continue
        s = sch.copy()
        in_registers = storage == "registers"
        staging = storage == "shared" or in_registers
        scope = "local" if in_registers else "shared"
        keep = {n for n, _ in prologue} if staging else set()
        inline_all_but_outputs(s, keep=keep)
        root_s = s.get_sblock("root")
        _flatten_rows(s, shape)
        blocks = s.get_child_blocks(root_s)
        out = s.get_sblock(out_name)
        reds = [b for b in blocks if REDUCE in iter_types(s, b)]
        if not reds:
            raise ValueError("row_reduction template: no reduction left")
        staged_bytes = 0
        staged = []
        if staging:
            for b in blocks:
                if s.get(b).name_hint in keep:
                    s.set_scope(b, 0, scope)
                    staged.append(b)
                    staged_bytes += cols * _dtype_bytes(s.get(b).writes[0].source.dtype)
            # Full-row inputs a reduction reads straight from HBM are staged too (softmax's max reads x before
            # its exp prologue exists; RMSNorm's sum of squares reads x): each is then read from HBM once,
            # with vector loads, and every later pass reads shared memory (unstaged, softmax's max pass reads x
            # with 2-byte loads and the exp pass reads it again).
            for red in reds:
                for region in s.get(red).reads:
                    src = region.source
                    if [int(d) for d in src.shape] != shape or src.scope() != "global":
                        continue
                    cb = s.cache_read(red, str(src.name), scope)  # every consumer reads the staged row
                    staged.append(cb)
                    staged_bytes += cols * _dtype_bytes(src.dtype)
            if not staged or (storage == "shared" and staged_bytes > max_shared):
                continue
        # the row loop: fuse the output's leading loops; rows_per_block rows share a block (threadIdx.y)
        loops = s.get_loops(out)
        row = s.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        n_rows = int(s.get(row).extent)
        col = s.get_loops(out)[-1]
        threads_k = space.knobs["threads"].filtered(lambda t: int(t) <= max(32, cols))
        vec_k = _vector_knob(space.knobs["vector_lanes"], cols, max(ebytes, 2))
        if in_registers:
            # each thread's slice: whole vectors (of the widest lanes, so any sampled width divides it), and
            # at most row_register_elements per staged row
            widest = max(int(v) for v in vec_k.values)
            most = int(space.extra.get("row_register_elements", 64))
            threads_k = threads_k.filtered(lambda t: cols % (int(t) * widest) == 0 and cols // int(t) <= most)
            if not threads_k.values:
                continue
        threads = sample(s, threads_k)
        vec = sample(s, vec_k)
        tx, co, lanes = _split_columns(s, col, threads, vec, in_registers)
        rows_k = space.knobs.get("rows_per_block")
        ty = None
        if rows_k is not None:
            per_row = max(1, staged_bytes)
            rows_k = rows_k.filtered(lambda r: n_rows % int(r) == 0 and int(r) * per_row <= max_shared)
            rpb = sample(s, rows_k)
            row, ty = s.split(row, [None, rpb])
            s.bind(ty, "threadIdx.y")
        s.bind(row, "blockIdx.x")
        s.bind(tx, "threadIdx.x")
        # Sketch `recompute` computes each row's producers under its threadIdx.y loop. Sketch `shared` cannot:
        # a shared buffer is visible to the whole block, so compute_at relaxes threadIdx.y and every warp would
        # compute every row of the block (the H200: 2 rows per block ran 1.3-1.6x slower, 4 rows
        # 2.6-3x). Its producers go under the block loop instead, their row loop bound to threadIdx.y: each
        # warp group stages and reduces its own row, and more rows are in flight per SM than one-row blocks
        # (at most 32 resident per SM) allow.
        anchor = ty if ty is not None and storage != "shared" else row
        for b in reversed([b for b in s.get_child_blocks(root_s) if s.get(b).name_hint != out_name]):
            s.compute_at(b, anchor, preserve_unit_loops=True)
        for b in s.get_child_blocks(root_s):
            name = s.get(b).name_hint
            if name == out_name:
                continue
            if ty is not None and anchor is row:
                rows = s.get_loops(b)[1]  # the block's own rows (rows_per_block of them), when it is per row
                if int(s.get(rows).extent) == int(s.get(ty).extent) and len(s.get_loops(b)) > 2:
                    s.bind(rows, "threadIdx.y")
            types = iter_types(s, b)
            inner = s.get_loops(b)[-1]
            if REDUCE in types:
                s.set_scope(b, 0, "local")
                if in_registers:   # over the thread's own slice, then across the threads
                    rtx, _ = s.split(inner, [threads, None])
                else:
                    _, rtx = s.split(inner, [None, threads])
                s.bind(rtx, "threadIdx.x")
            else:
                btx, _, bl = _split_columns(s, inner, threads, vec, in_registers)
                s.bind(btx, "threadIdx.x")
                s.vectorize(bl)
        # the epilogue: vector loads of its row operands into registers, scalar math, one vector store
        red_out = {str(s.get(b).writes[0].source.name) for b in s.get_child_blocks(root_s)
                   if REDUCE in iter_types(s, b)}
        row_reads = [str(r.source.name) for r in s.get(out).reads
                     if str(r.source.name) not in red_out and len(r.source.shape) >= 1
                     and int(r.source.shape[-1]) == cols]
        _stage_through_registers(s, out, co if in_registers else tx, lanes, reads=row_reads, flatten=False)
        if "unroll" in space.knobs:
            s.annotate(root_s, "meta_schedule.unroll_explicit", sample(s, space.knobs["unroll"]))
        sketches.append(s)
    if "program" in storages and info.get("target_kind") == "cuda":   # last: the others keep their places
        program = _row_program_sketch(sch, space)
        if program is not None:
            sketches.append(program)
    if not sketches:
        raise ValueError("row_reduction template: no sketch fits")
    return sketches


def _row_program_sketch(sch, space: ClassSpace):
    """Sketch ``program`` of a row kernel (``tvmfuse.tune.rows``): one of the row program's configs sampled (the
    ``threads`` and ``rows_per_block`` knobs) and annotated on the root block, every block's loops bound as they
    are (the builder swaps the whole PrimFunc for the program, generated from these blocks). None where the
    kernel is not a row program or no config fits."""
    import tvmfuse.tune.rows as rows
    try:
        prog = rows.analyze(sch.mod["main"])
    except rows.Misfit:
        return None
    knobs = {"threads": space.knobs.get("threads"), "rows_per_block": space.knobs.get("rows_per_block")}
    options = rows.configs(prog, **{k: v.values for k, v in knobs.items() if v is not None},
                           max_elements=int(space.extra.get("row_register_elements", 64)))
    if not options:
        return None
    s = sch.copy()
    root = s.get_sblock("root")
    rows.annotate(s, root, sch.mod["main"], options, sample_option(s, options, knobs))
    bind_placeholder(s)
    return s


def template_attention(sch, space: ClassSpace, info: dict) -> list:
    """The planner's online-softmax attention.

    On CUDA, where its shape fits the tensor-core flash template (``tvmfuse.tune.flash``), the sketch samples
    one of the template's tile configs (the ``flash_*`` knobs, as an index into the configs that fit) and
    annotates it on the root block; the builder swaps the kernel for that flash kernel. The PrimFunc itself
    keeps the scalar schedule below (one query row per thread, its accumulator in registers), which is what
    every other target and shape runs.
    """
    from tvmfuse.plan.attention import tiled_gpu_misfit
    import tvmfuse.tune.flash as flash
    root = sch.get_sblock("root")
    spec = flash.spec_of(sch.mod["main"])
    if info.get("target_kind") == "cuda" and spec is not None and tiled_gpu_misfit(spec) is None:
        knobs = {k: space.knobs.get(f"flash_{k}")
                 for k in ("warps", "m_tiles", "block_n", "stages", "wgmma", "overlap")}
        choices = {k: v.values for k, v in knobs.items() if v is not None}
        # Hopper's wgmma kernels (and their overlapped variant) need the arch-specific target
        for k in ("wgmma", "overlap"):
            choices[k] = tuple(bool(v) for v in choices.get(k, (False,))
                               if not v or info.get("target_arch") == "sm_90a") or (False,)
        options = flash.configs(spec, **choices,
                                max_shared_bytes=int(space.extra.get("flash_max_shared_bytes", 100 * 1024)))
        if options:
            index = sample_option(sch, options, knobs)
            sch.annotate(root, flash.CANDIDATES, ";".join(c.name for c in options))
            sch.annotate(root, flash.ANNOTATION, index)
    blocks = sch.get_child_blocks(root)
    if len(blocks) != 1:
        raise ValueError("attention template: needs the planner's single attention block")
    loops = sch.get_loops(blocks[0])
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    threads = sample(sch, space.knobs["threads"])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if "unroll" in space.knobs:
        sch.annotate(root, "meta_schedule.unroll_explicit", sample(sch, space.knobs["unroll"]))
    return [sch]


@dataclass(frozen=True)
class Template:
    """A schedule template as a space file names it.

    ``schedule(sch, space, info)`` returns the sketches; ``postprocs(space)`` the MetaSchedule postprocs its
    candidates go through (None: the target's defaults); ``tensor_cores``: its traces tensorize, so the
    tensor intrinsics must be registered before they are applied.
    """

    schedule: Callable
    postprocs: Callable | None = None
    tensor_cores: bool = False


def _tensorcore_postprocs(space: ClassSpace) -> list:
    return tensorcore_postprocs(int(space.extra.get("max_dynamic_shared_bytes", 49152)))


TEMPLATES: dict[str, Template] = {
    "pointwise": Template(template_pointwise),
    "row_reduction": Template(template_row_reduction),
    "attention": Template(template_attention),
    "gemm_tensorcore": Template(template_gemm_tensorcore, _tensorcore_postprocs, tensor_cores=True),
}


# ------------------------------------------------------------------------------------ space selection
@dataclass(frozen=True)
class SpaceChoice:
    """What a kernel is tuned in: ``generator`` for ``extracted_tasks_to_tune_contexts(space=...)``."""

    kernel_class: str
    source: str            # template:<name> | stock:<rules> | stock:<fallback> (after <reason>)
    generator: object      # ms SpaceGenerator, or the string "post-order-apply"
    version: str
    note: str = ""

    def to_json(self) -> dict:
        return {"class": self.kernel_class, "space": self.source, "version": self.version, "note": self.note}


def _schedule_fn(template: Template, space: ClassSpace, info: dict, target_kind: str):
    def fn(sch):
        return template.schedule(sch, space, info)

    postprocs = template.postprocs(space) if template.postprocs else target_kind
    return ms.space_generator.ScheduleFn(fn, sch_rules=[], postprocs=postprocs, mutator_probs=target_kind)


def _stock(rules: str | None, target_kind: str):
    kind = rules or target_kind
    return ms.space_generator.PostOrderApply(sch_rules=kind, postprocs=kind, mutator_probs=kind)


def _dry_run(generator, mod, target, tensor_cores: bool) -> int:
    """Generate the design space once on the CPU; the number of sketches (raises if it fails)."""
    from tvmfuse._tvm import ensure_tensor_intrinsics

    ensure_tensor_intrinsics(target.kind.name, tensor_cores=tensor_cores)
    return len(_context(mod, target, generator).generate_design_space())


def select_space(mod, target, spaces: SpaceFile | None = None) -> SpaceChoice:
    """Classify the kernel ``mod`` (``main`` = the fused PrimFunc) and build its space, falling back cleanly."""
    kind = target.kind.name
    spaces = spaces or load_spaces(kind)
    func = mod["main"]
    cls = classify(func)
    space = spaces.for_class(cls)
    info = {"sm_count": int(space.extra.get("sm_count", 132)), "target_kind": kind,
            "target_arch": str(target.attrs.get("arch", ""))}
    # (source, make the generator, its traces tensorize); MetaSchedule names its tensor-core rule sets *-tensorcore
    attempts: list[tuple[str, Callable, bool]] = []
    if space.template != "stock":
        tmpl = TEMPLATES[space.template]
        attempts.append((f"template:{space.template}", lambda: _schedule_fn(tmpl, space, info, kind),
                         tmpl.tensor_cores))
    else:
        rules = space.stock_rules or kind
        attempts.append((f"stock:{rules}", lambda: _stock(space.stock_rules, kind), "tensorcore" in rules))
    if space.fallback_rules:
        attempts.append((f"stock:{space.fallback_rules}", lambda: _stock(space.fallback_rules, kind),
                         "tensorcore" in space.fallback_rules))
    if not any(src == f"stock:{kind}" for src, _, _ in attempts):
        attempts.append((f"stock:{kind}", lambda: _stock(kind, kind), False))
    notes = []
    for source, make, tensor_cores in attempts:
        try:
            gen = make()
            if source == f"stock:{kind}":  # the target's own space: the last resort, not dry-run
                return SpaceChoice(cls, source, gen, spaces.version, "; ".join(notes))
            n = _dry_run(gen, mod, target, tensor_cores)
        except Exception as err:  # noqa: BLE001 - a space that cannot schedule this kernel: try the next
            notes.append(f"{source} failed: {(str(err).strip().splitlines() or [type(err).__name__])[-1][:160]}")
            continue
        if n == 0:
            notes.append(f"{source} yielded no schedule")
            continue
        return SpaceChoice(cls, source, gen, spaces.version, "; ".join(notes))
    # nothing worked: MetaSchedule's target default (the tuner reports what happens)
    return SpaceChoice(cls, "post-order-apply", "post-order-apply", spaces.version, "; ".join(notes))


def _context(mod, target, generator, seed: int = -1):
    """A MetaSchedule tune context over ``generator``'s space (to list its sketches and post-process them);
    ``seed`` -1: MetaSchedule's own."""
    return ms.TuneContext(mod=mod, target=target, space_generator=generator,
                          search_strategy=ms.search_strategy.ReplayTrace(), task_name="sketches", rand_state=seed)


def _postprocessor(ctx):
    """``apply(sch) -> bool``: the space's postprocessors run on a candidate as MetaSchedule runs them (False
    where one rejects it, e.g. too many threads)."""
    postprocs = list(ctx.space_generator.postprocs)
    for p in postprocs:
        p._initialize_with_tune_context(ctx)

    def apply(sch) -> bool:
        sch.enter_postproc()
        return all(p.apply(sch) for p in postprocs)

    return apply


def _config_schedule(mod, target, choose, source: str, candidates: str, spaces: SpaceFile | None = None):
    """The sketch of ``mod``'s space on CUDA that annotates config ``candidates`` (the flash, wgmma and row-program
    templates), where the space comes from the template ``source``, with its config decided by ``choose`` (the
    candidates' names -> an index, or None): a Schedule whose trace a database can keep, or None."""
    if target.kind.name != "cuda":
        return None
    choice = select_space(mod, target, spaces)
    if choice.source != source:
        return None
    sketch = next((s for s in _context(mod, target, choice.generator).generate_design_space() if candidates in s.mod["main"].body.block.annotations),
                  None)   # (flash, wgmma: the only sketch; the row program: the last of four)
    if sketch is None:
        return None
    index = choose(str(sketch.mod["main"].body.block.annotations[candidates]).split(";"))
    if index is None:
        return None
    first = next(i for i in sketch.trace.insts if i.kind.name == "SampleCategorical")  # the config comes first
    trace = sketch.trace.with_decision(first, index, remove_postproc=True)
    sch = tvm.s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    return sch


def flash_schedule(mod, target, choose, spaces: SpaceFile | None = None):
    """An attention kernel's flash sketch on CUDA with its config decided by ``choose`` (see
    :func:`_config_schedule`); None where the flash template does not apply or ``choose`` declines."""
    import tvmfuse.tune.flash as flash
    if flash.spec_of(mod["main"]) is None:
        return None
    return _config_schedule(mod, target, choose, "template:attention", flash.CANDIDATES, spaces)


def flash_default_schedule(mod, target, spaces: SpaceFile | None = None):
    """:func:`flash_schedule` at the untuned build's config (``tvmfuse.tune.flash.default_config``), or None
    when the space's candidates leave it out."""
    import tvmfuse.tune.flash as flash
    import tvmfuse.tune.hopper as hopper
    spec = flash.spec_of(mod["main"])
    if spec is None:
        return None
    return flash_schedule(mod, target, _pick(flash.default_config(spec, wgmma=hopper.supports(target)).name), spaces)


def wgmma_default_schedule(mod, target, spaces: SpaceFile | None = None):
    """A GEMM's or conv's wgmma sketch on sm_90a at the untuned build's config (``tvmfuse.tune.hopper.untuned_config``),
    or None where that build has no wgmma kernel or the space's candidates leave its config out."""
    import tvmfuse.tune.hopper as hopper
    found = hopper.untuned_config(mod["main"], target)
    if found is None:
        return None
    return _config_schedule(mod, target, _pick(found[2].name), "template:gemm_tensorcore", hopper.CANDIDATES,
                            spaces)


def _pick(name: str):
    """A ``choose`` for :func:`_config_schedule`: the index of the candidate ``name``, None if absent."""
    return lambda names: names.index(name) if name in names else None


def rows_default_schedule(mod, target, spaces: SpaceFile | None = None):
    """A row kernel's row-program sketch on CUDA at the untuned build's config (``tvmfuse.tune.rows.untuned_config``),
    or None where the kernel is not a row program or the space's candidates leave its config out."""
    import tvmfuse.tune.rows as rows
    cfg = rows.untuned_config(mod["main"])
    if cfg is None:
        return None
    return _config_schedule(mod, target, _pick(cfg.name), "template:row_reduction", rows.CANDIDATES, spaces)


def pointwise_default_schedule(mod, target, spaces: SpaceFile | None = None):
    """A pointwise kernel's one-shot sketch on CUDA at the knob values of its class's ``untuned`` entry (vector
    lanes: the widest the space offers), or None: another kernel class, a transpose (its tiled sketch is the one
    that runs well), or an ``untuned`` value the kernel's candidates leave out."""
    if target.kind.name != "cuda" or classify(mod["main"]) != "pointwise":   # (before select_space's dry run)
        return None
    spaces = spaces or load_spaces("cuda")
    untuned = spaces.for_class("pointwise").extra.get("untuned")
    choice = select_space(mod, target, spaces)
    if choice.source != "template:pointwise" or not untuned:
        return None
    probe = tvm.s_tir.Schedule(mod)
    inline_all_but_outputs(probe)
    (block,) = probe.get_output_blocks(probe.get_sblock("root"))
    if _transposed_input(probe, block, [int(d) for d in probe.get(block).writes[0].source.shape]) is not None:
        return None
    ctx = _context(mod, target, choice.generator)
    sketch = ctx.generate_design_space()[0]   # one-shot: lanes, threads, vectors a thread, unroll, in this order
    cats = [i for i in sketch.trace.insts if i.kind.name == "SampleCategorical"]
    want = [None, untuned.get("threads"), untuned.get("vectors_per_thread"), untuned.get("unroll")]
    if len(cats) != len(want):
        return None
    trace = sketch.trace
    for inst, value in zip(cats, want):
        candidates = [int(c) for c in inst.attrs[0]]
        value = max(candidates) if value is None else int(value)
        if value not in candidates:
            return None
        trace = trace.with_decision(inst, candidates.index(value), remove_postproc=True)
    sch = tvm.s_tir.Schedule(mod)
    trace.apply_to_schedule(sch, remove_postproc=True)
    # post-processed (the unroll annotation becomes loop pragmas); the template kernels above need none: the
    # builder swaps them whole
    return sch if _postprocessor(ctx)(sch) else None


def default_template_schedule(mod, target, spaces: SpaceFile | None = None):
    """The schedule an untuned CUDA build gives a template kernel (flash attention, a wgmma GEMM on sm_90a, a row
    program, a pointwise kernel) as a traced sketch, or None for other kernels."""
    return (flash_default_schedule(mod, target, spaces) or wgmma_default_schedule(mod, target, spaces)
            or rows_default_schedule(mod, target, spaces) or pointwise_default_schedule(mod, target, spaces))


def sample_schedules(mod, target, choice: SpaceChoice, n: int = 4, seed: int = 0) -> list:
    """``n`` random points of a kernel's space, post-processed as MetaSchedule would build them.

    Returns scheduled IRModules, with template kernels swapped in (:func:`tvmfuse.tune.expand.expand`) as the
    builder swaps them (the ones whose post-processing rejected them, e.g. too many threads, are skipped, as
    MetaSchedule skips them).
    """
    from tvmfuse.tune.expand import expand

    gen = choice.generator
    if isinstance(gen, str):
        gen = _stock(None, target.kind.name)
    ctx = _context(mod, target, gen, seed)
    sketches = ctx.generate_design_space()
    postprocess = _postprocessor(ctx)
    out = []
    tries = 0
    while len(out) < n and tries < 8 * n:
        sketch = sketches[tries % len(sketches)]
        tries += 1
        sch = tvm.s_tir.Schedule(mod, seed=seed + tries)
        tvm.s_tir.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        if postprocess(sch):
            out.append(expand(sch.mod))
    return out
