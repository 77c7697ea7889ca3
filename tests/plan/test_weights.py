"""fp16 weights whose columns leave their rows off 16-byte boundaries (a 50257-word vocabulary) are stored K-major
at compile time on a GPU, so the tensor-core template reads them, and the model still computes what onnxruntime
does."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import models
from tvmfuse._tvm import PrimFunc
from tvmfuse.frontend import import_model, load_model
from tvmfuse.kernels import wgmma as hopper
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target, vector_lanes
from tvmfuse.verify import relative_error, run_onnxruntime


def _lm_head(m=128, k=96, n=51) -> onnx.ModelProto:
    """x @ W + b, W stored [K, N] with N odd (a vocabulary's logits), in fp16."""
    b = models._B(5)
    y = b.op("Add", [b.op("MatMul", ["x", b.w(k, n, scale=0.1)]), b.const(b.rng.standard_normal(n) * 0.1)])
    return models.to_fp16(b.model({"x": [m, k]}, y, [m, n]))


def _plan(tmp_path, model, target):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return partition(import_model(load_model(path)), target=target)


def _gemm(fused) -> PrimFunc:
    (func,) = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "matmul" in gv.name_hint]
    return func


@pytest.mark.parametrize("n", [51, 50257])
def test_an_odd_vocabulary_weight_is_stored_k_major_for_the_tensor_cores(tmp_path, n):
    cuda = resolve_target("cuda")
    fused, plan = _plan(tmp_path, _lm_head(m=128, k=96, n=n), cuda)
    func = _gemm(fused)
    assert tuple(int(d) for d in func.params[1].shape) == (n, 96)
    assert any(r.startswith("fp16: 1 kernel's weights of columns no multiple of 8") for r in plan.rewrites)
    spec, _ = hopper.analyze(func)
    assert spec.b_kmajor and spec.n == n and hopper.configs(spec)
    assert not hopper.whole_tiles(spec, hopper.default_config(spec))   # (N 51: a partial tile column)
    assert hopper.untuned_config(func, cuda.target) is not None


def test_weights_whose_rows_align_small_gemms_and_cpu_builds_are_left_as_stored(tmp_path, llvm_target):
    fused, plan = _plan(tmp_path, _lm_head(n=64), resolve_target("cuda"))
    assert tuple(int(d) for d in _gemm(fused).params[1].shape) == (96, 64)
    assert not any(r.startswith("fp16:") for r in plan.rewrites)
    fused, plan = _plan(tmp_path, _lm_head(), llvm_target)
    # (the CPU keeps [K, N], its columns padded to whole vectors where that costs little: AVX2's 8 lanes, not 16)
    lanes = vector_lanes(llvm_target.target)
    assert tuple(int(d) for d in _gemm(fused).params[1].shape) == (96, 51 if lanes == 16 else -(-51 // lanes) * lanes)
    # a GEMM of 64 rows or fewer streams its weight as stored (the GEMV template reads [K, N] at any N)
    fused, plan = _plan(tmp_path, _lm_head(m=64), resolve_target("cuda"))
    assert tuple(int(d) for d in _gemm(fused).params[1].shape) == (96, 51)


def test_the_k_major_weight_computes_what_onnxruntime_does(tmp_path, llvm_target):
    """The kernel and its calls change together: the module planned for the GPU, built for the CPU (its kernels'
    TIR), equals onnxruntime on the same input."""
    model = _lm_head()
    fused, _ = _plan(tmp_path, model, resolve_target("cuda"))
    x = np.random.default_rng(0).standard_normal((128, 96)).astype("float16")
    got = models.run_built(fused, llvm_target, x)
    (ref,) = run_onnxruntime(tmp_path / "m.onnx", {"x": x})
    assert relative_error(got, ref) < 2e-3
