"""Check a tuned kernel against its reference on fresh random inputs, outputs poisoned before each run.

The reference is the same PrimFunc under a schedule that does not come from the search space and is simple
enough to trust (dlight's Fallback on CUDA: one thread per output element; TVM's plain lowering on llvm). Those
schedules reduce a row in order, one element after another in the kernel's own type: an fp16 softmax over 3648
columns summed that way is 0.10 off the exact one, and on the H200 every tree-reduced (more accurate) tuned record
of it was rejected while a slower record that rounded like the in-order sum was kept. So a kernel computing in
fp16 or bf16 is also computed in float32, and a tuned record passes when it is within its output type's tolerance
of either (``build_references``).
dlight's tiling rules are not a reference: its Matmul rule once computed a padded GEMM's epilogue wrong,
and every correct tuned record of that kernel was rejected against it. Whole models are checked against
onnxruntime elsewhere (``tvmfuse run --verify``, ``tvmfuse bench``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tvmfuse._gpu_rules import reference_schedule
from tvmfuse._tvm import build_context, param_buffers, sblocks, subexprs, tvm
from tvmfuse.kernels import expand
from tvmfuse.plan.tf32 import ATTR as TF32
from tvmfuse.verify import relative_error, tolerance


@dataclass(frozen=True)
class KernelCheck:
    name: str
    rel_error: float
    tolerance: float
    unwritten: int  # output elements still NaN after the run
    reference: str = "kernel"  # the reference it was compared with: "float32" or "kernel" (see build_references)

    @property
    def ok(self) -> bool:
        return self.unwritten == 0 and self.rel_error <= self.tolerance

    def to_json(self) -> dict:
        return {"name": self.name, "rel_error": self.rel_error, "tolerance": self.tolerance,
                "unwritten": self.unwritten, "ok": self.ok, "reference": self.reference}


def param_specs(func) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of each parameter (TVM 0.27: parameters are typed buffer vars; earlier: buffer_map)."""
    return [(str(buf.name), tuple(int(d) for d in buf.shape), str(buf.dtype)) for buf in param_buffers(func)]


def output_names(func) -> set[str]:
    """Parameters the kernel writes (its outputs)."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    names = set()
    for b in sch.get_output_blocks(sch.get_sblock("root")):
        names.update(str(w.source.name) for w in sch.get(b).writes)
    if not names:  # an opaque kernel: the last parameter by convention (FuseTIR puts outputs last)
        names.add(param_specs(func)[-1][0])
    return names


_HALF = re.compile(r"\b(b?float16)\b")

# A quantize epilogue (a float rounded to an 8-bit grid) may land one quantum off where its float is within the last
# bit of a rounding boundary: a tiled schedule contracts multiply-adds the plain one does not (QDQ ResNet-50: 28 of
# 802816 outputs of one conv's kernel, every tuned record and the untuned default alike, rejected as wrong). Such a
# kernel passes with every output within one quantum and at most this share of them off.
QUANTUM_SHARE = 1e-3


def rounds_to_integers(func) -> bool:
    """Whether ``func`` casts a floating-point value to an integer type (a quantize: round, clip, cast)."""
    for block in sblocks(func):
        body = block.body
        if type(body).__name__ != "BufferStore":
            continue
        for e in subexprs(body.value):
            if type(e).__name__ == "Cast" and not str(e.ty).startswith(("float", "bfloat")) \
                    and str(e.value.ty).startswith(("float", "bfloat")):
                return True
    return False


def _quantum_tolerance(out: np.ndarray, ref: np.ndarray) -> float:
    """The relative error of :data:`QUANTUM_SHARE` of ``ref``'s elements one quantum off, where no element of
    ``out`` is further than one quantum from ``ref`` (0 otherwise)."""
    off = np.abs(out.astype(np.int64) - ref.astype(np.int64))
    if off.size == 0 or off.max() > 1:
        return 0.0
    return float(np.sqrt(QUANTUM_SHARE * off.size) / max(np.linalg.norm(ref.astype(np.float64)), 1.0))


def promoted(mod):
    """``mod`` with every fp16 / bf16 buffer, cast and constant in float32 (the module itself where it has none, or
    where the promoted text does not parse back): the kernel's computation without its rounding to half
    precision. Inputs keep their values (each half value is exactly a float32)."""
    text = mod["main"].script()
    if not _HALF.search(text):
        return mod
    try:
        func = tvm.script.from_source(_HALF.sub("float32", text))
    except Exception:  # noqa: BLE001 - TVMScript this rewrite does not foresee: the kernel's own precision
        return mod
    return tvm.IRModule({"main": func})


def reference_module(mod, target_info):
    """``mod`` under the reference schedule for the target (see ``reference_schedule``). For attention that is
    the planner's scalar kernel, an implementation independent of the flash template a tuned record selects."""
    sch = reference_schedule(mod, target_info.target, is_gpu=target_info.is_gpu)
    return mod if sch is None else sch.mod


@dataclass(frozen=True)
class Reference:
    """A built reference of a kernel: its library, the dtypes of its parameters, and what it computes in."""
    lib: object
    dtypes: tuple
    precision: str  # "float32" (a half kernel promoted) or "kernel" (the kernel's own types)


def build_references(mod, target_info) -> list[Reference]:
    """The references a tuned record is held to: the kernel in float32 first, where it computes in half precision,
    then the kernel in its own types. A record passes against either: the float32 one admits the records that
    round less than the in-order reference (a tree-reduced fp16 sum), the own-precision one those that round like
    the untuned kernel (a CPU's in-order fp16 sum of a long row), which is no worse than what an untuned build
    runs."""
    wide = promoted(mod)
    # nothing in half precision: the kernel's own reference is the float32 one
    candidates = [("kernel", mod)] if wide is mod else [("float32", wide), ("kernel", mod)]
    refs = []
    with build_context():
        for precision, ref_mod in candidates:
            lib = tvm.compile(reference_module(ref_mod, target_info), target=target_info.target)
            refs.append(Reference(lib, tuple(d for _, _, d in param_specs(ref_mod["main"])), precision))
    return refs


def gathered_rows(func) -> int | None:
    """The fewest rows along an axis that a block of the kernel reads whole at each of its iterations: a gather's
    table, or read at an index that is a loaded value (an affine read covers one element an iteration), or None.

    Random integer inputs must stay inside them: RoBERTa's token-type table has 2 rows (1 in roberta-base), and
    indices of 0..3 read past it in the kernel and in its reference alike, so every record of its embedding kernel
    was rejected ("no valid record")."""
    found = []
    for block in sblocks(func):
        # a one-row table (roberta-base's token types) reads like a broadcast: counted where the block also reads
        # integers, the indices (a false one only makes the integers zeros, a weaker check but a valid one)
        indexed = any(not str(r.source.dtype).startswith(("float", "bfloat")) for r in block.reads)
        for region in block.reads:
            for axis, rng in enumerate(region.region):
                extent, dim = rng.extent, region.source.shape[axis]
                if not isinstance(dim, tvm.tirx.IntImm):
                    continue
                whole = isinstance(extent, tvm.tirx.IntImm) and int(extent) == int(dim) and (int(dim) > 1 or indexed)
                if whole or any(isinstance(e, tvm.ir.expr.TensorLoad) for e in subexprs(rng.min)):
                    found.append(int(dim))
    return min(found) if found else None


def _unwritten(dtype) -> int:
    """The value an integer output starts as, to tell unwritten elements: -7, or 249 where the type is unsigned
    (a quantized uint8 tensor, its zero point)."""
    return -7 if np.issubdtype(np.dtype(dtype), np.signedinteger) else 249


def random_args(func, rng) -> tuple[list[np.ndarray], list[int]]:
    outs = output_names(func)
    rows = gathered_rows(func)
    high = 4 if rows is None else max(1, min(4, rows))
    arrays, out_idx = [], []
    for i, (name, shape, dtype) in enumerate(param_specs(func)):
        if name in outs:
            out_idx.append(i)
            arrays.append(np.full(shape, np.nan, dtype) if np.issubdtype(np.dtype(dtype), np.floating)
                          else np.full(shape, _unwritten(dtype), dtype))
        elif np.issubdtype(np.dtype(dtype), np.floating):
            arrays.append(rng.standard_normal(shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, high, size=shape).astype(dtype))
    return arrays, out_idx


def run_kernel(lib, arrays: list[np.ndarray], out_idx: list[int], dev, dtypes=None) -> list[np.ndarray]:
    """Run a built kernel on copies of ``arrays`` (each converted to its parameter's dtype in ``dtypes``, where
    given: the float32 reference of a half kernel); outputs are poisoned (NaN) on the device first."""
    if dtypes is not None:
        arrays = [a.astype(d) for a, d in zip(arrays, dtypes)]
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    lib["main"](*args)
    dev.sync()
    return [args[i].numpy() for i in out_idx]


def check_kernel(mod, tuned_mod, target_info, *, name: str = "main", seed: int = 0,
                 refs: list[Reference] | None = None, tuned_lib=None) -> KernelCheck:
    """Build (unless given) and compare ``tuned_mod`` with the references of ``mod`` (see ``build_references``);
    the check reports the reference that it matched best."""
    func = mod["main"]
    dev = target_info.tvm_device()
    if refs is None:
        refs = build_references(mod, target_info)
    if tuned_lib is None:
        with build_context():
            tuned_lib = tvm.compile(expand(tuned_mod), target=target_info.target)
    rng = np.random.default_rng(seed)
    arrays, out_idx = random_args(func, rng)
    got = run_kernel(tuned_lib, arrays, out_idx, dev)
    tf32 = bool(func.attrs is not None and func.attrs.get(TF32))
    quantizes = rounds_to_integers(func)
    best = None
    for ref_of in refs:
        ref = run_kernel(ref_of.lib, arrays, out_idx, dev, dtypes=ref_of.dtypes)
        worst, unwritten, tol = 0.0, 0, 0.0
        for o, r in zip(got, ref):
            if np.issubdtype(o.dtype, np.floating):
                unwritten += int(np.count_nonzero(np.isnan(o) & ~np.isnan(r)))
            else:
                mark = _unwritten(o.dtype)
                unwritten += int(np.count_nonzero((o == mark) & (r != mark)))
            worst = max(worst, relative_error(o, r))
            tol = max(tol, tolerance(str(o.dtype)))   # the tuned kernel's output type, not a float32 reference's
            if tf32:   # its products in TF32, the 10-bit mantissa of fp16, against the fp32 reference
                tol = max(tol, tolerance("float16"))
            if quantizes and not np.issubdtype(o.dtype, np.floating):
                tol = max(tol, _quantum_tolerance(o, r))
        result = KernelCheck(name, worst, tol, unwritten, ref_of.precision)
        if best is None or (result.ok, -result.rel_error) > (best.ok, -best.rel_error):
            best = result
    return best
