"""``--precision tf32``: the planner marks the fp32 GEMM and conv kernels for the tensor cores and stores their
weights K-major (wgmma reads TF32 operands K-major only), and the model still computes what onnxruntime does."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import models
from tvmfuse._tvm import PrimFunc
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.plan.tf32 import ATTR, ROUNDED, tf32_rounded
from tvmfuse.target import resolve_target
from tvmfuse.verify import relative_error, run_onnxruntime


def _two_linears(m=64, k=128, n=192) -> onnx.ModelProto:
    """x @ W1 + b -> GELU (erf) -> @ W2 -> + x: two GEMM kernels, each weight stored [K, N]."""
    b = models._B(3)
    h = b.op("Add", [b.op("MatMul", ["x", b.w(k, n, scale=0.1)]), b.const(b.rng.standard_normal(n) * 0.1)])
    h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(1.4142135)])]),
                                                  b.const(1.0)])]), b.const(0.5)])
    y = b.op("Add", [b.op("MatMul", [h, b.w(n, k, scale=0.1)]), "x"])
    return b.model({"x": [m, k]}, y, [m, k])


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _plan(tmp_path, model, target, tf32, fp32_tensor_cores=True):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return partition(import_model(load_model(path)), target=target, precision="tf32" if tf32 else "model",
                     fp32_tensor_cores=fp32_tensor_cores)


def _gemms(fused) -> dict:
    return {gv.name_hint: f for gv, f in fused.functions.items()
            if isinstance(f, PrimFunc) and "matmul" in gv.name_hint}


def test_tf32_marks_the_gemms_and_stores_their_weights_k_major(tmp_path, cuda, llvm_target):
    model = _two_linears()
    fused, plan = _plan(tmp_path, model, cuda, tf32=True)
    gemms = _gemms(fused)
    assert len(gemms) == 2 and all(f.attrs.get(ATTR) for f in gemms.values())
    # each weight parameter is [N, K] now: W1 [128, 192] -> [192, 128], W2 [192, 128] -> [128, 192]
    shapes = sorted(tuple(int(d) for d in f.params[1].shape) for f in gemms.values())
    assert shapes == [(128, 192), (192, 128)]
    assert any(r.startswith("tf32: 2 GEMM/conv kernels") and "transposed to [N, K]" in r for r in plan.rewrites)
    # fp32 as stored, and off a GPU tf32 changes nothing
    plain, plain_plan = _plan(tmp_path, model, cuda, tf32=False)
    assert not any(f.attrs.get(ATTR) for f in _gemms(plain).values())
    assert not any(r.startswith("tf32") for r in plain_plan.rewrites)
    on_cpu, cpu_plan = _plan(tmp_path, model, llvm_target, tf32=True)
    assert not any((f.attrs or {}).get(ATTR) for f in _gemms(on_cpu).values())
    assert "tf32: no tensor cores on this target; GEMMs and convs run in fp32" in cpu_plan.rewrites


def test_the_weights_are_rounded_to_tf32_at_compile_time(tmp_path, cuda):
    """The constant operand of each GEMM (its weight) is rounded once, here, to nearest (cvt.rna's rounding), and the
    kernel is told so (it rounds only the activations it reads)."""
    fused, plan = _plan(tmp_path, _two_linears(), cuda, tf32=True)
    from tvmfuse._tvm import RelaxConstant, const_numpy
    from tvmfuse.plan.graph import kernel_calls

    by_name = {gv.name_hint: gv for gv in fused.functions}
    for name, func in _gemms(fused).items():
        assert [int(i) for i in func.attrs[ROUNDED]] == [1]   # (x is parameter 0, the weight 1)
        for args in kernel_calls(fused["main"])[by_name[name]]:
            assert isinstance(args[1], RelaxConstant) and not isinstance(args[0], RelaxConstant)
            w = const_numpy(args[1])
            assert not (w.view(np.uint32) & 0x1FFF).any()
    assert any("2 kernels' constant operands rounded to TF32" in r for r in plan.rewrites)
    # nearest, ties away from zero, as cvt.rna.tf32.f32; infinities and NaN kept
    x = np.array([1 + 2 ** -11, 1 + 2 ** -11 - 2 ** -23, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, np.inf, -np.inf],
                 np.float32)
    assert tf32_rounded(x)[:4].tolist() == [1 + 2 ** -10, 1.0, -(1 + 2 ** -10), 1 + 4 * 2 ** -11]
    assert np.isinf(tf32_rounded(x)[4:]).all() and np.isnan(tf32_rounded(np.array([np.nan], np.float32))).all()


def test_the_transposed_weights_compute_what_onnxruntime_does(tmp_path, cuda, llvm_target):
    """The kernels and their calls change together: the module planned for the GPU in tf32, built for the CPU (its
    kernels' TIR, fp32), equals onnxruntime on the same input with the weights rounded to TF32 as the planner
    rounds them."""
    from onnx import numpy_helper

    model = _two_linears()
    fused, _ = _plan(tmp_path, model, cuda, tf32=True)
    for init in model.graph.initializer:   # (the two weights; the biases are no GEMM operands)
        w = numpy_helper.to_array(init)
        if w.ndim == 2:
            init.CopyFrom(numpy_helper.from_array(tf32_rounded(w), init.name))
    onnx.save(model, tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((64, 128)).astype("float32")
    got = models.run_built(fused, llvm_target, x)
    (ref,) = run_onnxruntime(tmp_path / "m.onnx", {"x": x})
    assert relative_error(got, ref) < 1e-5


def test_a_conv_is_marked_and_its_filters_are_left_k_major(tmp_path, cuda):
    fused, plan = _plan(tmp_path, models.conv_bn_relu(n=2, cin=64, cout=64, hw=16), cuda, tf32=True)
    convs = {gv.name_hint: f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "conv" in gv.name_hint}
    assert convs and all(f.attrs.get(ATTR) for f in convs.values())
    note = next(r for r in plan.rewrites if r.startswith("tf32"))
    assert "transposed" not in note   # OHWI filters: K (r, s, c) contiguous already


def test_plan_and_inspect_re_plan_in_the_precision_tune_used(tmp_path):
    """``tvmfuse plan`` and ``tvmfuse inspect --model`` re-plan as ``tune`` did: with ``--precision`` (a tf32 or fp16
    tune's kernels are other workloads than the model's own); a bad precision is one line and exit 2."""
    import json
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    onnx.save(_two_linears(), path)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                              timeout=300)

    proc = cli("plan", str(path), "--target", "cuda", "--precision", "tf32", "--json")
    assert proc.returncode == 0, proc.stderr
    assert any(r.startswith("tf32: 2 GEMM/conv kernels") for r in json.loads(proc.stdout)["rewrites"])
    proc = cli("inspect", str(tmp_path / "none.db"), "--model", str(path), "--precision", "fp8")
    assert proc.returncode == 2 and "unknown precision" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_stem_runs_as_im2col_and_a_tensor_core_gemm_in_tf32_as_in_fp16(tmp_path, cuda):
    """A 3-channel 7x7 stem: no conv template takes its 3 channels, so in fp16, in tf32 and in fp32 on Hopper (three
    TF32 products) it runs as im2col rows by the filter, a GEMM the tensor cores take; in fp32 on the CUDA cores it
    stays a conv (their rules)."""
    b = models._B(9)
    c = b.op("Conv", ["x", b.w(64, 3, 7, 7, scale=0.1)], kernel_shape=[7, 7], strides=[2, 2], pads=[3, 3, 3, 3])
    model = b.model({"x": [1, 3, 64, 64]}, b.op("Relu", [c]), [1, 64, 32, 32])   # 1024 pixels: not "a few"
    _, tf32 = _plan(tmp_path, model, cuda, tf32=True)
    _, fp32 = _plan(tmp_path, model, cuda, tf32=False)
    _, simt = _plan(tmp_path, model, cuda, tf32=False, fp32_tensor_cores=False)
    assert any("runs as im2col + GEMM" in r for r in tf32.rewrites)
    assert any("runs as im2col + GEMM" in r for r in fp32.rewrites)
    assert any("fp32x3: 1 GEMM/conv kernels" in r for r in fp32.rewrites), fp32.rewrites
    assert not any("runs as im2col + GEMM" in r for r in simt.rewrites)


def test_only_kernels_a_tensor_core_template_takes_are_marked_and_rounded(tmp_path, cuda):
    """A depthwise conv (CUDA cores' row reduction) and a one-row GEMM (the GEMV template's CUDA cores) stay fp32,
    unmarked, so no constant of theirs is rounded (the planner rounds only the marked kernels' operands): TF32
    operands there would cost accuracy and gain nothing. The 1 x 1 conv beside them is marked; on sm_80 (no
    wgmma) nothing is."""
    def dw_pw():
        b = models._B(5)
        dw = b.op("Conv", ["x", b.w(32, 1, 3, 3)], group=32, pads=[1, 1, 1, 1])
        pw = b.op("Conv", [b.op("Relu", [dw]), b.w(64, 32, 1, 1)])
        return b.model({"x": [2, 32, 16, 16]}, pw, [2, 64, 16, 16])

    def marked(fused):
        return {gv.name_hint for gv, f in fused.functions.items()
                if isinstance(f, PrimFunc) and ((f.attrs or {}).get(ATTR) or (f.attrs or {}).get(ROUNDED))}

    fused, plan = _plan(tmp_path, dw_pw(), cuda, tf32=True)
    assert len(marked(fused)) == 1 and "matmul" in next(iter(marked(fused)))
    assert any("1 GEMM/conv kernels kept in fp32" in r for r in plan.rewrites), plan.rewrites
    b = models._B(6)
    fused, plan = _plan(tmp_path, b.model({"x": [1, 256]}, b.op("MatMul", ["x", b.w(256, 512)]), [1, 512]), cuda,
                        tf32=True)
    assert not marked(fused)
    assert "tf32: none of the 1 GEMM/conv kernels runs on tensor cores here; all stay fp32" in plan.rewrites
    fused, _ = _plan(tmp_path, dw_pw(), resolve_target('{"kind": "cuda", "arch": "sm_80"}'), tf32=True)
    assert not marked(fused)


def test_the_planners_tensor_core_reading_agrees_with_the_templates(tmp_path, cuda):
    """The planner marks a GEMM or conv kernel by its structure (tvmfuse.plan.tf32.on_tensor_cores); the kernel
    templates decide by their own analysis: on each kernel of these models, marked exactly where wgmma takes the
    marked kernel and the GEMV template does not."""
    from tvmfuse.kernels import get
    from tvmfuse.plan.weights import mac_block

    b = models._B(7)
    bmm = b.model({"x": [4, 64, 96], "z": [4, 96, 80]}, b.op("MatMul", ["x", "z"]), [4, 64, 80])
    g = models._B(8)
    dw = g.op("Conv", ["x", g.w(64, 1, 3, 3)], group=64, pads=[1, 1, 1, 1])
    grouped = g.op("Conv", [dw, g.w(64, 16, 1, 1)], group=4)
    convs = g.model({"x": [2, 64, 16, 16]}, g.op("Conv", [grouped, g.w(32, 64, 3, 3)], pads=[1, 1, 1, 1]),
                    [2, 32, 16, 16])
    c = models._B(9)
    stem = c.model({"x": [1, 3, 64, 64]}, c.op("Conv", ["x", c.w(64, 3, 7, 7)], kernel_shape=[7, 7], strides=[2, 2],
                                                pads=[3, 3, 3, 3]), [1, 64, 32, 32])
    seen = 0
    for model in (_two_linears(), bmm, convs, stem, models.conv_bn_relu(n=2, cin=64, cout=64, hw=16)):
        fused, _ = _plan(tmp_path, model, cuda, tf32=True)
        for gv, f in fused.functions.items():
            if not isinstance(f, PrimFunc) or mac_block(f)[0] is None:
                continue
            marked = f if (f.attrs or {}).get(ATTR) else f.with_attr(ATTR, True)
            takes = (get("wgmma").fits(marked, cuda.target) is None
                     and get("gemv").fits(marked, cuda.target) is not None)
            assert bool((f.attrs or {}).get(ATTR)) == takes, gv.name_hint
            seen += 1
    assert seen >= 8
