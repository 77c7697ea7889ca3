"""What a stored workload's IR tells: buffer shapes, the bytes it moves, its FLOPs, and a pattern name."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tvmfuse._tvm import PrimFunc, estimate_flops, sblocks, tvm


@dataclass(frozen=True)
class BufferInfo:
    """One parameter buffer of a kernel: ``role`` is "input" or "output" (the buffers the body writes)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "role": self.role,
                "bytes": self.nbytes}


def _main_func(mod) -> PrimFunc:
    if isinstance(mod, PrimFunc):
        return mod
    funcs = [f for _, f in mod.functions.items() if isinstance(f, PrimFunc)]
    return mod["main"] if any(gv.name_hint == "main" for gv in mod.get_global_vars()) else funcs[0]


def _written(func: PrimFunc) -> set[str]:
    """The buffers the kernel's blocks write (their write regions: TVM 0.27 has no TIR visitor in Python)."""
    return {str(w.source.name) for block in sblocks(func) for w in block.writes}


def buffers(mod) -> list[BufferInfo]:
    """The kernel's parameter buffers (TVM 0.27: a PrimFunc's params carry ``.shape`` and ``.dtype``)."""
    func = _main_func(mod)
    params = [p for p in func.params if getattr(p, "shape", None) is not None]
    try:
        written = _written(func)
    except Exception:  # noqa: BLE001 - an IR we cannot walk: fall back to "the last parameter is the output"
        written = set()
    out = []
    for i, p in enumerate(params):
        name = str(p.name)
        role = "output" if (name in written if written else i == len(params) - 1) else "input"
        out.append(BufferInfo(name=name, shape=tuple(int(d) for d in p.shape), dtype=str(p.dtype), role=role))
    if out and not any(b.role == "output" for b in out):
        last = out[-1]
        out[-1] = BufferInfo(last.name, last.shape, last.dtype, "output")
    return out


def hbm_bytes(bufs: list[BufferInfo]) -> int:
    """Fewest bytes a kernel moves: each input read once, each output written once."""
    return sum(b.nbytes for b in bufs)


def flops(mod) -> float | None:
    """TVM's static FLOP estimate, or None when it cannot estimate this IR."""
    try:  # the estimator takes the module (it fails on a bare PrimFunc here)
        value = estimate_flops(mod if isinstance(mod, tvm.IRModule) else tvm.IRModule({"main": mod}))
    except Exception:  # noqa: BLE001
        return None
    return value if value > 0 else None


# Operator names as they appear in fused kernel names (FuseOps/FuseTIR join them with "_").
_GEMM = ("matmul", "dense", "batch_matmul", "linear")
_CONV = ("conv1d", "conv2d", "conv3d", "conv2d_transpose", "conv1d_transpose")
_NORM = ("layer_norm", "rms_norm", "group_norm", "log_softmax", "softmax", "instance_norm")
_REDUCE = ("sum", "mean", "max", "min", "variance")
_OPS = sorted(_GEMM + _CONV + _NORM + _REDUCE, key=len, reverse=True)


def ops_from_name(name: str) -> list[str]:
    """Split a kernel name like ``fused_matmul_add_relu1`` into the operators it was named after."""
    rest = re.sub(r"\d+$", "", name)
    rest = rest[len("fused_"):] if rest.startswith("fused_") else rest
    ops: list[str] = []
    while rest:
        op = next((o for o in _OPS if rest == o or rest.startswith(o + "_")), None)
        op = op or rest.split("_", 1)[0]
        ops.append(op)
        rest = rest[len(op) + 1:]
    return ops


def pattern_from_name(name: str) -> str:
    """The planner's pattern as far as a kernel's name tells it (plan/patterns.py's names, first match wins).

    A name cannot tell "gating" or "horizontal_gemm" (they need the graph): those read as their anchor's
    pattern. Give the ONNX model to get the planner's own answer.
    """
    ops = ops_from_name(name)
    kinds = ["gemm" if o in _GEMM else "conv" if o in _CONV else "norm" if o in _NORM else
             "reduce" if o in _REDUCE else "pointwise" for o in ops]
    if "attention" in name:
        return "attention"
    if len(ops) <= 1:
        return "single"
    if "conv" in kinds:
        return "conv_epilogue"
    if "gemm" in kinds:
        return "gemm_epilogue"
    first = next((i for i, k in enumerate(kinds) if k in ("norm", "reduce")), None)
    if first is not None:
        return "norm_prologue" if first > 0 else "normalization"
    return "pointwise_chain"
