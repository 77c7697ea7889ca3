"""Fast math at legalization: erf becomes TVM's branch-free rational approximation in every planner; half
sigmoid and silu are computed in fp32 through exp2."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tvmfuse._tvm import TensorType, relax, tvm
from tvmfuse.plan.fastmath import legalize_ops


def _gelu(v: float) -> float:
    return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))


def _legalized_and_run(op, xs, cpu=False):
    """``op`` over a vector like ``xs``, legalized by tvmfuse, built for llvm: (the module, op(xs) in float64)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", TensorType(xs.shape, str(xs.dtype)))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(op(x)))
    mod = legalize_ops(cpu=cpu)(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return mod, vm["main"](tvm.runtime.tensor(xs)).numpy().astype(np.float64)


@pytest.mark.parametrize("op,exact", [(relax.op.erf, math.erf), (relax.op.nn.gelu, _gelu)])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3)])
def test_fast_lowering_is_close_to_the_exact_function(op, exact, dtype, tol):
    xs = np.linspace(-7, 7, 2048).astype(dtype)
    mod, got = _legalized_and_run(op, xs)
    assert "T.erf" not in mod.script()  # no libm call left: the polynomial vectorizes
    ref = np.array([exact(float(v)) for v in xs])
    assert (np.abs(got - ref) / np.maximum(np.abs(ref), 1.0)).max() < tol


@pytest.mark.parametrize("planner", ["tvmfuse", "fuseops"])
def test_planned_gelu_kernel_keeps_its_name_and_loses_the_libm_call(planner, example_model, llvm_target):
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition

    fused, _ = partition(import_model(load_model(example_model)), target=llvm_target, planner=planner)
    gelu = [f for gv, f in fused.functions.items() if "erf" in gv.name_hint]
    assert gelu, [gv.name_hint for gv in fused.functions]
    assert all("T.erf" not in f.script() for f in gelu)


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v)) if v > -700 else 0.0


@pytest.mark.parametrize("op,exact", [(relax.op.sigmoid, _sigmoid), (relax.op.nn.silu, lambda v: v * _sigmoid(v))])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_sigmoid_and_silu_are_within_an_ulp_and_half_ones_run_in_fp32(op, exact, dtype):
    """Over fp16's range (saturating ends included): within one rounding of the exact value in fp16 (fp32 keeps
    TVM's own lowering, 1e-6). A half kernel computes in fp32 through exp2, not in the half type."""
    xs = np.concatenate([np.linspace(-30, 30, 4000), [-65504, -1000, -88, 88, 1000, 65504]]).astype(dtype)
    mod, got = _legalized_and_run(op, xs)
    if dtype == "float16":
        text = mod.script()
        assert "T.exp2" in text and "T.Cast(\"float32\"" in text and "T.sigmoid" not in text
    ref = np.array([exact(float(v)) for v in xs])
    with np.errstate(over="ignore"):   # (fp16's largest value: its spacing is inf)
        ulp = np.spacing(np.abs(ref).astype(dtype)).astype(np.float64) if dtype == "float16" else 1e-6 * np.abs(ref)
    assert (np.abs(got - ref) <= ulp + 1e-30).all(), xs[np.abs(got - ref) > ulp][:5]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_half_division_runs_in_fp32_and_rounds_to_the_half_quotient(dtype):
    """A half division is computed in fp32 and rounded once: the correctly rounded half quotient (numpy's), broadcast
    divisors, zeros, infinities and NaN included; fp32 keeps TVM's lowering."""
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.standard_normal(3000) * 10, [0, -0.0, 1, 65504, -65504, np.inf, np.nan]]).astype(dtype)
    ys = np.concatenate([rng.standard_normal(3000) * 3, [0, 1, 0, 1e-3, 3, 2, 1]]).astype(dtype)
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", TensorType(xs.shape, dtype)), relax.Var("y", TensorType(ys.shape, dtype))
    with bb.function("main", [x, y]):
        q = bb.emit(relax.op.divide(x, y))
        bb.emit_func_output(bb.emit(relax.op.divide(q, relax.const(1.4142135, dtype))))
    mod = legalize_ops()(bb.get())
    assert ('T.Cast("float32"' in mod.script()) == (dtype == "float16")
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ys)).numpy()
    with np.errstate(all="ignore"):
        ref = (xs / ys) / np.array(1.4142135, dtype)
    assert got.dtype == ref.dtype and np.array_equal(got, ref, equal_nan=True)


@pytest.mark.parametrize("exponent", [3.0, 2.0, -2.0, 0.5, 1.5])
def test_power_by_a_constant_matches_numpy_for_negative_bases(exponent):
    xs = np.linspace(-3, 3, 257).astype("float32")
    mod, got = _legalized_and_run(lambda x: relax.op.power(x, relax.const(exponent, "float32")), xs)
    with np.errstate(all="ignore"):
        ref = np.power(xs.astype(np.float64), exponent)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    finite = np.isfinite(ref)
    assert np.allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-6)
    if exponent == int(exponent):  # integer exponents are multiplications: no pow call for nvcc's fast math
        assert "T.pow" not in mod.script()


def test_power_by_a_tensor_keeps_the_sign_of_negative_bases():
    bb = relax.BlockBuilder()
    xs = np.array([-2, -2, -2, 0, 0, 3, -0.5, 2], "float32")
    ys = np.array([3, 2, 0.5, 0, 2, -1, -3, 1.5], "float32")
    x, y = relax.Var("x", TensorType(xs.shape, "float32")), relax.Var("y", TensorType(ys.shape, "float32"))
    with bb.function("main", [x, y]):
        bb.emit_func_output(bb.emit(relax.op.power(x, y)))
    mod = legalize_ops()(bb.get())
    # the pow that remains reads |x|: __powf (nvcc --use_fast_math) is exp2(y * log2(x)), NaN for x < 0
    assert set(re.findall(r"T\.pow\((T\.\w+)\(", mod.script())) == {"T.fabs"}
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ys)).numpy()
    with np.errstate(all="ignore"):
        ref = np.power(xs, ys)
    assert np.allclose(got, ref, equal_nan=True)


def _np_softmax(x, log=False):
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True)) if log else np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.parametrize("op,exact,libm", [
    (relax.op.exp, np.exp, "T.exp("), (relax.op.tanh, np.tanh, "T.tanh("),
    (relax.op.sigmoid, lambda x: 1 / (1 + np.exp(-x)), "T.exp("),
    (relax.op.nn.silu, lambda x: x / (1 + np.exp(-x)), "T.exp("),
    (lambda x: relax.op.nn.softmax(x, axis=-1), _np_softmax, "T.exp("),
    (lambda x: relax.op.nn.log_softmax(x, axis=-1), lambda x: _np_softmax(x, log=True), "T.exp(")])
def test_cpu_lowerings_leave_no_libm_call_and_stay_within_fp32_tolerance(op, exact, libm):
    """On llvm, fp32 exp / tanh / sigmoid / silu / softmax / log-softmax are polynomials LLVM vectorises (no per-lane libm
    call), within 1e-5 of float64 over the range softmax and the activations see; -inf, inf and NaN keep their
    meaning (a masked score's exp is 0)."""
    xs = np.linspace(-80, 80, 4096).astype("float32").reshape(8, 512)
    mod, got = _legalized_and_run(op, xs, cpu=True)
    assert libm not in mod.script()
    ref = exact(xs.astype(np.float64))
    assert (np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)).max() < 1e-5 or np.allclose(got, ref, rtol=1e-5,
                                                                                            atol=1e-30)
    _, plain = _legalized_and_run(op, xs, cpu=False)
    assert (np.abs(got - plain) / np.maximum(np.abs(plain), 1.0)).max() < 1e-5
    specials = np.array([[-np.inf, 0.0, 1.0, np.nan]], "float32")
    if op is relax.op.exp:
        _, got = _legalized_and_run(op, specials, cpu=True)
        assert got[0, 0] == 0 and got[0, 1] == 1 and np.isnan(got[0, 3])


def test_gpu_legalization_keeps_the_exact_functions():
    """CUDA builds keep exp and tanh (nvcc's fast math maps them to its intrinsics): the llvm lowerings are CPU only."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", TensorType((4, 64), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.nn.softmax(relax.op.tanh(x), axis=-1)))
    text = legalize_ops()(bb.get()).script()
    assert "T.exp(" in text and "T.tanh(" in text
