"""The wgmma template in TF32 (``--precision tf32``): fp32 operands read by ``wgmma ... k8 .tf32`` from the same
shared tiles as the fp16 kernel. wgmma cannot run here, so: the kernel is generated as the fp16 kernel of twice the
K, which the H200 ran and checked (the same bytes of A and B land in the same shared bytes, every other statement
is the same, only the wgmma instruction differs); its scalar twin equals the planner's fp32 function on the CPU
(spec, transposed weight, conv gather, epilogue); and it builds for sm_90a without spills."""
from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import (assert_ptxas_without_spills, copy_bytes, cuda_source, kernel_text,  # noqa: E402
                         thread_chunks, twin_and_kernel_outputs, wgmma_source)
from tvmfuse._tvm import PrimFunc, tvm  # noqa: E402
from tvmfuse.compile import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import wgmma as hopper  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.tf32 import ATTR  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
NVCC = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _kernels(tmp_path, model, cuda) -> list:
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda, precision="tf32")
    return [f for f in fused.functions.values() if isinstance(f, PrimFunc) and (f.attrs or {}).get(ATTR)]


def _linear_gelu(batch=2, m=96, k=128, n=192) -> onnx.ModelProto:
    """[batch, m, k] @ [k, n] -> bias -> GELU (erf) -> + residual (192 rows: a partial 128-row tile)."""
    b = models._B(5)
    h = b.op("Add", [b.op("MatMul", ["x", b.w(k, n, scale=0.1)]), b.const(b.rng.standard_normal(n) * 0.1)])
    h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(1.4142135)])]),
                                                  b.const(1.0)])]), b.const(0.5)])
    return b.model({"x": [batch, m, k], "r": [batch, m, n]}, b.op("Add", [h, "r"]), [batch, m, n])


def _conv(n=2, cin=64, cout=128, hw=9, k=3, stride=2, pad=1) -> onnx.ModelProto:
    b = models._B(11)
    c = b.op("Conv", ["x", b.w(cout, cin, k, k, scale=0.1), b.const(b.rng.standard_normal(cout) * 0.1)],
             kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
    out = (hw + 2 * pad - k) // stride + 1
    return b.model({"x": [n, cin, hw, hw]}, b.op("Relu", [c]), [n, cout, out, out])


CASES = {
    "linear_gelu_residual": _linear_gelu,
    "conv3x3_bn_relu": lambda: models.conv_bn_relu(n=2, cin=64, cout=64, hw=16),
    "conv3x3_stride2_odd": _conv,   # 2 x 5 x 5 = 50 rows: a partial tile, padded windows
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_twin_of_a_tf32_kernel_computes_the_planners_function(tmp_path, cuda, case):
    (func,) = _kernels(tmp_path, CASES[case](), cuda)
    spec, info = hopper.analyze(func)
    assert spec.dtype == "float32" and spec.b_kmajor and hopper.configs(spec)
    # convs stay implicit GEMMs: in fp32 the strided one's 50 pixels ran as im2col + GEMM (no fp32 conv template)
    assert (spec.conv is not None) == case.startswith("conv")
    assert spec.rows % 64 or case != "conv3x3_stride2_odd"
    assert hopper.GemmSpec.from_json(spec.to_json()) == spec
    assert hopper.untuned_config(func, cuda.target) is not None
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert not np.isnan(outs[0]).any()
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 1e-5


def _source(spec, cfg, dtype: str) -> str:
    """The CUDA source of ``spec``'s kernel at ``cfg``, operands of ``dtype``, output fp32."""
    return wgmma_source(spec, cfg, dtype)


GEOMETRY = hopper.ConvGeometry(2, 9, 9, 32, 5, 5, 3, 3, (2, 2), (1, 1), (1, 1))   # 50 rows, padded windows


@NVCC
@pytest.mark.parametrize("cfg,conv", [("g2 m1 n128 k64 s4 r1 z128 f1", False), ("g1 m1 n64 k64 s3 r1 z0 f0", False),
                                      ("g2 m1 n128 k64 s4 r1 z128 f0", True), ("g1 m2 n64 k64 s4 r1 z128 f1", True)])
def test_a_tf32_kernel_moves_the_bytes_of_the_fp16_kernel_of_twice_the_k(tmp_path, cfg, conv):
    cfg = hopper.parse_config(cfg)
    if conv:
        tf32 = hopper.GemmSpec((), 50, 128, 9 * 32, False, False, True, GEOMETRY, dtype="float32")
        fp16 = dataclasses.replace(tf32, k=9 * 64, conv=dataclasses.replace(GEOMETRY, c=64), dtype="float16")
    else:
        tf32 = hopper.GemmSpec((), 1000, 256, 512, False, False, True, dtype="float32")
        fp16 = dataclasses.replace(tf32, k=1024, dtype="float16")
    assert cfg in hopper.configs(tf32, swizzle=(128, 0)) and hopper.configs(tf32) == hopper.configs(fp16)
    src32, src16 = _source(tf32, cfg, "float32"), _source(fp16, cfg, "float16")
    assert "wgmma.mma_async.sync.aligned.m64n%dk8.f32.tf32.tf32" % cfg.block_n in src32
    assert copy_bytes(src32) == copy_bytes(src16) and len(copy_bytes(src32)) > 1000
    # each thread rounds to TF32 the chunks it copies (and those it fills with zeros by plain stores: rows past
    # the last, a conv's padding), after its wait and before the barrier that hands the stage to the wgmmas
    copied = thread_chunks(src32, r"ptx_cp_async_legacy_cg_16_\d_\d|tvmfuse_cp_async_zfill")
    rounded = thread_chunks(src32, "tvmfuse_round_tf32_16b")
    assert copied <= rounded and len(copied) > 1000
    assert all(at % 16 == 0 and 0 <= at < cfg.shared_bytes() for _, at in rounded)
    assert rounded == copied or "} else {" in src32
    text = kernel_text(src32)
    rounds = [i for i, line in enumerate(text) if "tvmfuse_round_tf32_16b(" in line]
    wait = next(i for i, line in enumerate(text) if "cp_async_wait_group" in line and i > text.index(
        next(line for line in text if "for (int ko = 0;" in line)))
    assert rounds and wait < min(rounds) and max(rounds) < next(i for i in range(wait, len(text))
                                                                 if "fence_proxy" in text[i])
    # and every other line is the fp16 kernel's (the shared buffer declared where its base address is taken)
    def other(lines):
        return [ln for ln in lines if not re.search(r"tvmfuse_round_tf32_16b\(|smem_base|extern __shared__", ln)]

    assert other(text) == other(kernel_text(src16))
    # B rounded at compile time (a weight): the kernel rounds only A's chunks
    decls = [f"a: T.Buffer({(tf32.conv.n, tf32.conv.h, tf32.conv.w, tf32.conv.c) if conv else (tf32.rows, tf32.k)}, "
             f"'float32')", f"b: T.Buffer(({tf32.n}, {tf32.k}), 'float32')",
             f"c: T.Buffer(({tf32.rows}, {tf32.n}), 'float32')"]
    func = hopper.parse(hopper.gemm_source(tf32, cfg, decls, "a", "b", "c[{row}, {col}] = {acc}", rounded=("b",)))
    only_a = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A) \
        .mod.imports[0].inspect_source()
    a_bytes = 2 * cfg.stages * cfg.block_m * cfg.block_k
    assert thread_chunks(only_a, "tvmfuse_round_tf32_16b") == {(t, at) for t, at in rounded if at < a_bytes}
    assert_ptxas_without_spills(src32, tmp_path, "sm_90a")


def test_tf32_takes_no_tma_config():
    """A TMA tile lands in shared memory without passing a thread that could round it, and wgmma truncates fp32 to
    TF32 (toward zero: a bias every product shares); only the cp.async kernel, which rounds, is offered."""
    tf32 = hopper.GemmSpec((), 2048, 512, 512, False, False, True, dtype="float32")
    fp16 = dataclasses.replace(tf32, k=1024, dtype="float16")
    assert hopper.configs(fp16, tma=(1,)) and not hopper.configs(tf32, tma=(1,))
    assert hopper.configs(tf32, tma=(0, 1)) == hopper.configs(tf32) and not hopper.default_config(tf32).tma


def test_tf32_takes_k_major_operands_only():
    kn = hopper.GemmSpec((), 1024, 256, 512, False, False, False, dtype="float32")
    assert hopper.configs(kn) == [] and hopper.configs(dataclasses.replace(kn, b_kmajor=True))


@pytest.mark.slow
def test_an_untuned_tf32_build_runs_the_wgmma_kernels_in_tf32(tmp_path, cuda):
    """BERT-shaped projections in tf32 build for sm_90a with the wgmma default on every GEMM it fits."""
    path = tmp_path / "m.onnx"
    onnx.save(_linear_gelu(batch=2, m=128, k=256, n=512), path)
    fused, _ = partition(import_model(load_model(path)), target=cuda, precision="tf32")
    result = build(fused, target=cuda, database=None)
    assert [k.schedule for k in result.kernels if "matmul" in k.name] == ["wgmma-default"]
    assert ".tf32.tf32" in cuda_source(result.executable)
