"""Relax-level fix-ups applied right after TVM's ONNX import.

fp16 accumulation: TVM 0.27 imports an fp16 Conv/MatMul/Gemm as ``conv2d``/``matmul`` with an fp16
``out_dtype``, so the reduction accumulates in fp16. onnxruntime, cuDNN and cuBLAS accumulate fp16
products in fp32; summing hundreds of fp16 terms in fp16 drifts (resnet50 fp16 at 64x64: 0.19 relative
error against fp32, where onnxruntime's own fp16 run is at 0.07). We set ``out_dtype="float32"`` and cast
the result back to fp16: the model's types are unchanged, the accumulator is fp32.

fp16 means over more than 65504 elements: TVM legalizes ``mean``/``variance`` as a sum divided by the element
count in the input's type, and 65536 is no fp16 number (the import of an RMSNorm over 65536 fp16 columns
raised). Such a mean runs in fp32 and its result is cast back.
"""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm

_CONV = {"relax.nn.conv1d": relax.op.nn.conv1d, "relax.nn.conv2d": relax.op.nn.conv2d,
         "relax.nn.conv3d": relax.op.nn.conv3d}


_MEANS = {"relax.mean": relax.op.mean, "relax.variance": relax.op.variance}
_FP16_MAX = 65504


def _count(call) -> int:
    """Elements each output of a mean / variance averages (0 where the input's shape is not static)."""
    shape = getattr(getattr(call.args[0], "ty", None), "shape", None)
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return 0
    axes = range(len(dims)) if call.attrs.axis is None else [int(i) % len(dims) for i in call.attrs.axis]
    n = 1
    for i in axes:
        n *= dims[i]
    return n


def _dtype(expr) -> str:
    ty = getattr(expr, "ty", None)
    return str(getattr(ty, "dtype", "")) if ty is not None else ""


@relax.expr_functor.mutator
class _Fp32Accumulate(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.count = 0

    def visit_call_(self, call):  # noqa: N802 - TVM's visitor naming
        call = self.builder_.normalize(super().visit_call_(call))
        op = getattr(call.op, "name", None)
        if op in _MEANS and _dtype(call) == "float16" and _count(call) > _FP16_MAX:
            self.count += 1
            a = call.attrs
            axis = None if a.axis is None else [int(i) for i in a.axis]
            wide = _MEANS[op](relax.op.astype(call.args[0], "float32"), axis=axis, keepdims=bool(a.keepdims))
            return relax.op.astype(wide, "float16")
        if (op != "relax.matmul" and op not in _CONV) or _dtype(call) != "float16" or _dtype(call.args[0]) != "float16":
            return call
        if op == "relax.matmul":
            wide = relax.op.matmul(call.args[0], call.args[1], out_dtype="float32")
        else:
            a = call.attrs
            wide = _CONV[op](call.args[0], call.args[1], strides=a.strides, padding=a.padding, dilation=a.dilation,
                             groups=a.groups, data_layout=a.data_layout, kernel_layout=a.kernel_layout,
                             out_layout=a.out_layout, out_dtype="float32")
        self.count += 1
        return relax.op.astype(wide, "float16")


def fp32_accumulation(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """Rewrite fp16 conv/matmul in every Relax function to accumulate in fp32, and fp16 means over more elements
    than fp16 counts to run in fp32; return (mod, rewrites)."""
    mutator = _Fp32Accumulate(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get(), mutator.count
