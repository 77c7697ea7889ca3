"""Check a tuned kernel against its reference on fresh random inputs, outputs poisoned before each run.

The reference is the same PrimFunc under a schedule that does not come from the search space and is simple
enough to trust (dlight's Fallback on CUDA: one thread per output element; TVM's plain lowering on llvm).
dlight's tiling rules are not a reference: its Matmul rule once computed a padded GEMM's epilogue wrong,
and every correct tuned record of that kernel was rejected against it. Whole models are checked against
onnxruntime elsewhere (``tvmfuse run --verify``, ``tvmfuse bench``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmfuse._tvm import build_context, reference_schedule, tvm
from tvmfuse.kernels import expand
from tvmfuse.verify import relative_error, tolerance


@dataclass(frozen=True)
class KernelCheck:
    name: str
    rel_error: float
    tolerance: float
    unwritten: int  # output elements still NaN after the run

    @property
    def ok(self) -> bool:
        return self.unwritten == 0 and self.rel_error <= self.tolerance

    def to_json(self) -> dict:
        return {"name": self.name, "rel_error": self.rel_error, "tolerance": self.tolerance,
                "unwritten": self.unwritten, "ok": self.ok}


def _params(func) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of each parameter (TVM 0.27: parameters are typed buffer vars; earlier: buffer_map)."""
    out = []
    for p in func.params:
        buf = func.buffer_map[p] if hasattr(func, "buffer_map") else p
        out.append((str(buf.name), tuple(int(d) for d in buf.shape), str(buf.dtype)))
    return out


def output_names(func) -> set[str]:
    """Parameters the kernel writes (its outputs)."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    names = set()
    for b in sch.get_output_blocks(sch.get_sblock("root")):
        names.update(str(w.source.name) for w in sch.get(b).writes)
    if not names:  # an opaque kernel: the last parameter by convention (FuseTIR puts outputs last)
        names.add(_params(func)[-1][0])
    return names


def reference_module(mod, target_info):
    """``mod`` under the reference schedule for the target (see ``reference_schedule``). For attention that is
    the planner's scalar kernel, an implementation independent of the flash template a tuned record selects."""
    sch = reference_schedule(mod, target_info.target, is_gpu=target_info.is_gpu)
    return mod if sch is None else sch.mod


def random_args(func, rng) -> tuple[list[np.ndarray], list[int]]:
    outs = output_names(func)
    arrays, out_idx = [], []
    for i, (name, shape, dtype) in enumerate(_params(func)):
        if name in outs:
            out_idx.append(i)
            arrays.append(np.full(shape, np.nan, dtype) if np.issubdtype(np.dtype(dtype), np.floating)
                          else np.full(shape, -7, dtype))
        elif np.issubdtype(np.dtype(dtype), np.floating):
            arrays.append(rng.standard_normal(shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, 4, size=shape).astype(dtype))
    return arrays, out_idx


def run_kernel(lib, arrays: list[np.ndarray], out_idx: list[int], dev) -> list[np.ndarray]:
    """Run a built kernel on copies of ``arrays``; outputs are poisoned (NaN) on the device first."""
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    lib["main"](*args)
    dev.sync()
    return [args[i].numpy() for i in out_idx]


def check_kernel(mod, tuned_mod, target_info, *, name: str = "main", seed: int = 0,
                 ref_lib=None, tuned_lib=None) -> KernelCheck:
    """Build (unless given) and compare ``tuned_mod`` with the reference schedule of ``mod``."""
    func = mod["main"]
    dev = target_info.tvm_device()
    with build_context():
        if ref_lib is None:
            ref_lib = tvm.compile(reference_module(mod, target_info), target=target_info.target)
        if tuned_lib is None:
            tuned_lib = tvm.compile(expand(tuned_mod), target=target_info.target)
    rng = np.random.default_rng(seed)
    arrays, out_idx = random_args(func, rng)
    ref = run_kernel(ref_lib, arrays, out_idx, dev)
    got = run_kernel(tuned_lib, arrays, out_idx, dev)
    worst, unwritten, tol = 0.0, 0, 0.0
    for o, r in zip(got, ref):
        if np.issubdtype(o.dtype, np.floating):
            unwritten += int(np.count_nonzero(np.isnan(o) & ~np.isnan(r)))
        else:
            unwritten += int(np.count_nonzero((o == -7) & (r != -7)))
        worst = max(worst, relative_error(o, r))
        tol = max(tol, tolerance(str(r.dtype)))
    return KernelCheck(name, worst, tol, unwritten)
