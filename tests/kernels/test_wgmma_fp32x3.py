"""fp32 GEMMs and convs on Hopper's tensor cores in three TF32 products (the wgmma template's ``float32x3``, what an
fp32 build runs on sm_90a). wgmma cannot run here, so: the split's arithmetic is checked in numpy (fp32's accuracy
where one TF32 product has fp16's); the kernel is the TF32 kernel with every copied chunk split into its parts and
three wgmmas a slice, built for sm_90a without spills; the planner marks an fp32 build's tensor-core kernels so and
their scalar twin computes the planner's function; ``fp32_tensor_cores=False`` keeps them on the CUDA cores."""
from __future__ import annotations

import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import (assert_ptxas_without_spills, copy_bytes, cuda_source, thread_chunks,  # noqa: E402
                         twin_and_kernel_outputs, wgmma_source)
from tvmfuse._tvm import PrimFunc, tvm  # noqa: E402
from tvmfuse.compile import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import wgmma as hopper  # noqa: E402
from tvmfuse.kernels.wgmma.config import small_offset  # noqa: E402
from tvmfuse.kernels.wgmma.ptx import SPLIT_TF32  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.tf32 import ATTR, ROUNDED, X3  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.verify import tf32_rounded  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
NVCC = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def test_three_tf32_products_keep_fp32s_accuracy_where_one_has_fp16s():
    """The split the kernel makes (big = the value rounded to TF32, small = the rest rounded to TF32), and the three
    products it sums in fp32, against float64: within a few fp32 roundings of it, as cuBLAS's fp32 GEMM is; one
    TF32 product lands near fp16's 1e-3."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 768)).astype(np.float32)
    w = (rng.standard_normal((768, 96)) / 768 ** 0.5).astype(np.float32)
    exact = a.astype(np.float64) @ w.astype(np.float64)

    def parts(x):
        big = tf32_rounded(x)
        return big, tf32_rounded((x - big).astype(np.float32))

    (ab, as_), (wb, ws) = parts(a), parts(w)
    # big + small keeps 22 of a value's 24 mantissa bits
    assert np.all(np.abs((ab.astype(np.float64) + as_) - a) <= np.abs(a) * 2.0 ** -21)
    # each product of two TF32 values is exact in fp32; the tensor core sums them in fp32
    x3 = (as_ @ wb).astype(np.float32) + (ab @ ws).astype(np.float32) + (ab @ wb).astype(np.float32)
    fp32 = a @ w
    one = tf32_rounded(a) @ tf32_rounded(w)
    err = lambda c: float(np.linalg.norm(c - exact) / np.linalg.norm(exact))  # noqa: E731
    assert err(x3) < 4 * err(fp32) + 1e-7 and err(x3) < 1e-6, (err(x3), err(fp32))
    assert err(one) > 1e-4


def _source(spec, cfg) -> str:
    return wgmma_source(spec, cfg, "float32")


GEOMETRY = hopper.ConvGeometry(2, 9, 9, 32, 5, 5, 3, 3, (2, 2), (1, 1), (1, 1))   # 50 rows, padded windows


@NVCC
@pytest.mark.parametrize("cfg,conv", [("g2 m1 n128 k64 s3 r1 z128 f0", False), ("g1 m1 n64 k64 s4 r1 z128 f0", True)])
def test_an_fp32x3_kernel_splits_every_chunk_it_copies_and_issues_three_wgmmas(tmp_path, cfg, conv):
    cfg = hopper.parse_config(cfg)
    if conv:
        x3 = hopper.GemmSpec((), 50, 128, 9 * 32, False, False, True, GEOMETRY, dtype="float32x3")
    else:
        x3 = hopper.GemmSpec((), 1000, 256, 512, False, False, True, dtype="float32x3")
    tf32 = hopper.GemmSpec(**{**x3.__dict__, "dtype": "float32"})
    assert x3.x3 and x3.halves().tf32 and x3.halves().dtype == "tf32x3"
    assert cfg in hopper.configs(x3) and set(hopper.configs(x3)) <= set(hopper.configs(tf32))
    assert all(hopper.config.kernel_shared_bytes(x3, c) <= 227 * 1024 for c in hopper.configs(x3))
    # each K step's three products sum into their own accumulators (the step's first product replaces them), added to
    # the kernel's on the CUDA cores once the step's wgmmas are done: no batch in flight
    assert not any(c.inflight for c in hopper.configs(x3))
    text = hopper.gemm_source(x3, cfg, ["a: T.Buffer((1,), 'float32')"] * 3, "a", "b", "c[{row}, {col}] = {acc}")
    loop = text[text.index("for ko in"):]
    assert loop.count("T.ptx.pred(0)") == cfg.m_tiles and "acc2[" in loop
    assert loop.index("wait_group.sync.aligned(0)") < loop.index("acc[i] = acc[i] + acc2[i]")
    # the next step's tile is split while this step's wgmmas run: after their commit, before their wait (step 0's
    # in the prologue)
    commit, wait = loop.index("wgmma.commit_group"), loop.index("wgmma.wait_group.sync.aligned(0)")
    assert commit < loop.index(SPLIT_TF32) < wait and f"(ko + 1) % {cfg.stages}" in loop[commit:wait]
    assert SPLIT_TF32 in text[:text.index("for ko in")] and SPLIT_TF32 not in loop[:commit]
    src, ref = _source(x3, cfg), _source(tf32, cfg)
    # the same copies; three wgmmas where TF32 issues one
    assert copy_bytes(src) == copy_bytes(ref)
    calls = lambda s: len(re.findall(r"tvm_builtin_ptx_wgmma_tf32\w*\(acc", s))  # noqa: E731
    assert calls(src) == 3 * calls(ref) > 0
    # every chunk a thread copied (or zero-filled) is split, its small part a second set of stages further on
    copied = thread_chunks(src, r"ptx_cp_async_legacy_cg_16_\d_\d|tvmfuse_cp_async_zfill")
    split = thread_chunks(src, SPLIT_TF32)
    assert copied <= split and split == thread_chunks(ref, "tvmfuse_round_tf32_16b")
    lo = small_offset(x3.halves(), cfg) * 2
    assert lo == cfg.shared_bytes() and lo % 1024 == 0   # (the 128-byte swizzle repeats every 1024 bytes)
    assert f"+ (uint){lo})" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def _fp32_kernels(tmp_path, model, cuda, precision="model", **kw) -> list:
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, plan = partition(import_model(load_model(path, precision=precision)), target=cuda, precision=precision, **kw)
    return [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "matmul" in gv.name_hint], plan


def _linear_gelu(batch=2, m=96, k=128, n=192) -> onnx.ModelProto:
    b = models._B(5)
    h = b.op("Add", [b.op("MatMul", ["x", b.w(k, n, scale=0.1)]), b.const(b.rng.standard_normal(n) * 0.1)])
    h = b.op("Mul", [h, b.op("Sigmoid", [h])])
    return b.model({"x": [batch, m, k], "r": [batch, m, n]}, b.op("Add", [h, "r"]), [batch, m, n])


def test_an_fp32_build_on_hopper_marks_its_gemms_for_three_tf32_products(tmp_path, cuda):
    (func,), plan = _fp32_kernels(tmp_path, _linear_gelu(), cuda)
    assert func.attrs.get(X3) and not func.attrs.get(ATTR) and not func.attrs.get(ROUNDED)
    assert any(r.startswith("fp32x3: 1 GEMM/conv kernels") and "transposed to [N, K]" in r for r in plan.rewrites)
    spec, _ = hopper.analyze(func)
    assert spec.dtype == "float32x3" and spec.b_kmajor and hopper.untuned_config(func, cuda.target) is not None
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 1e-5
    # kept on the CUDA cores when asked (--precision fp32-strict), and off Hopper
    for kw in ({"fp32_tensor_cores": False}, {"precision": "fp32-strict"}):
        (simt,), plan = _fp32_kernels(tmp_path, _linear_gelu(), cuda, **kw)
        assert not (simt.attrs.get(X3) or simt.attrs.get(ATTR)) and not any("fp32x3" in r for r in plan.rewrites)
    sm80 = resolve_target({"kind": "cuda", "arch": "sm_80"})
    (old,), plan = _fp32_kernels(tmp_path, _linear_gelu(), sm80)
    assert not old.attrs.get(X3) and not any("fp32x3" in r for r in plan.rewrites)


def test_an_fp32_1d_conv_on_hopper_is_a_conv_of_height_1_in_three_tf32_products(tmp_path, cuda):
    """Whisper's stem (NCW, 80 channels, stride 2) runs NWC with OWI filters on GPUs, which the wgmma conv template
    reads as an NHWC conv of height 1: marked fp32x3 as any fp32 conv, and the scalar twin equals the kernel."""
    b = models._B(7)
    c = b.op("Conv", ["x", b.w(64, 80, 3, scale=0.1), b.const(b.rng.standard_normal(64) * 0.1)],
             kernel_shape=[3], strides=[2], pads=[1, 1])
    model = b.model({"x": [2, 80, 41]}, b.op("Relu", [c]), [2, 64, 21])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, plan = partition(import_model(load_model(path)), target=cuda)
    (func,) = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "conv1d" in gv.name_hint]
    assert func.attrs.get(X3) and "conv1d_nwc" in func.script()
    spec, _ = hopper.analyze(func)
    g = spec.conv
    assert spec.dtype == "float32x3" and (g.h, g.oh, g.r, g.s, g.c, g.w, g.ow) == (1, 1, 1, 3, 80, 41, 21)
    assert g.stride == (1, 2) and g.pad == (0, 1) and spec.rows == 42 and hopper.untuned_config(func, cuda.target)
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 1e-5


@pytest.mark.slow
def test_an_untuned_fp32_build_runs_its_gemms_in_three_tf32_products(tmp_path, cuda):
    path = tmp_path / "m.onnx"
    onnx.save(_linear_gelu(batch=2, m=256, k=256, n=512), path)   # (a small GEMM stays the GEMV template's, exact)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    result = build(fused, target=cuda, database=None)
    assert [k.schedule for k in result.kernels if "matmul" in k.name] == ["wgmma-default"]
    src = cuda_source(result.executable)
    assert ".tf32.tf32" in src and f"{SPLIT_TF32}(" in src


def _evaluate(expr: str, **names) -> int:
    """A TVMScript index expression of the kernel's, in Python integers."""
    T = type("T", (), {"bitwise_xor": staticmethod(lambda a, b: a ^ b)})
    return eval(expr, {"T": T}, names)  # noqa: S307 - the template's own arithmetic


@pytest.mark.parametrize("cfg", ["g2 m1 n128 k64 s4 r1 z128 f0 a1", "g2 m2 n64 k64 s3 r1 z128 f0 a1",
                                 "g1 m1 n128 k64 s4 r1 z128 f0 a1"])
def test_a_from_registers_reads_the_fragments_wgmma_expects_where_the_copies_put_them(tmp_path, cfg):
    """``a_regs``: each thread reads its A fragments from the stage the block's copies filled. Emulated here: every
    thread's 16-byte copies put A's rows in the 128-byte swizzled tile (the kernel's chunk layout), then every
    thread's register r of m-tile t and slice kk must hold A[row, k] of wgmma's register layout of m64k8 TF32
    (CuTe's ALayout_64x8: rows warp * 16 + lane / 4 (+ 8), columns lane % 4 (+ 4)). Built for Hopper without
    spills, with A's small parts never in shared memory."""
    from tvmfuse.kernels.wgmma.layout import tile_layout
    from tvmfuse.kernels.wgmma.mma import a_fragment_at

    cfg = hopper.parse_config(cfg)
    spec = hopper.GemmSpec((), 1000, 256, 512, False, False, True, dtype="float32x3")
    halves = spec.halves()
    bm, bk = cfg.block_m, cfg.block_k // 2   # the A tile in fp32: bm rows of 32
    a = np.arange(bm * bk, dtype=np.float64).reshape(bm, bk)
    chunk, _ = tile_layout(cfg.swizzle, True, bm, cfg.block_k)
    smem = np.full(cfg.stages * bm * bk, -1.0)
    for c in range(bm * bk // 4):   # each 16-byte chunk: 4 floats of one row, at the chunk's offset in halves
        r, k, off = (_evaluate(e, c=c) for e in chunk("c"))
        smem[off // 2:off // 2 + 4] = a[r, k // 2:k // 2 + 4]
    at = a_fragment_at(halves, cfg, step="0")
    for tx in range(cfg.threads):
        lane, warp, wg = tx % 32, tx % 128 // 32, tx // 128
        for t in range(cfg.m_tiles):
            for kk in range(bk // 8):
                for r in range(4):
                    row = (wg * cfg.m_tiles + t) * 64 + warp * 16 + lane // 4 + r % 2 * 8
                    col = kk * 8 + lane % 4 + r // 2 * 4
                    assert smem[_evaluate(at, tx=tx, t=t, kk=kk, r=r)] == a[row, col], (tx, t, kk, r)
    text = hopper.gemm_source(spec, cfg, ["a: T.Buffer((1,), 'float32')"] * 3, "a", "b", "c[{row}, {col}] = {acc}")
    loop = text[text.index("for ko in"):]
    assert "asmall[" in loop and loop.index("abig[") < loop.index("wgmma.fence") < loop.index("mma_async")
    src = _source(spec, cfg)
    assert "wgmma_tf32_rs_" in src
    # only B's copied chunks are split in shared memory
    assert thread_chunks(src, SPLIT_TF32) < thread_chunks(_source(spec, replace(cfg, a_regs=0)), SPLIT_TF32)
    # B's small stages right after B's (1024-byte aligned): 4 stages of 128 x 128 tiles fit (196 KB; 262 with A's)
    lo = small_offset(halves, cfg) * 2
    assert lo == 2 * cfg.stages * cfg.block_k * cfg.block_n and (lo + 2 * cfg.stages * cfg.block_k * bm) % 1024 == 0
    assert hopper.config.kernel_shared_bytes(halves, cfg) == cfg.shared_bytes() + lo <= 227 * 1024
    assert f"+ (uint){lo})" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def test_the_space_offers_a_from_registers_to_x3_kernels_only():
    """``wgmma_a_regs``: the x3 cp.async configs of 128-byte swizzled K steps come with A in registers too; fp16 and
    TF32 kernels, whose A needs no split, never do."""
    from tvmfuse.tune.spaces import load_spaces

    knob = load_spaces("cuda").classes["gemm"].knobs["wgmma_a_regs"]
    assert set(knob.values) == {0, 1}
    dims = ((), 1576, 768, 768, False, False, True)
    x3 = hopper.configs(hopper.GemmSpec(*dims, dtype="float32x3"), a_regs=knob.values)
    with_regs = [c for c in x3 if c.a_regs]
    assert with_regs and all(not c.tma and c.swizzle == 128 and c.block_k == 64 for c in with_regs)
    # A's small parts out of shared memory: 4 stages of 128 x 128 fit only with A in registers
    four = hopper.parse_config("g2 m1 n128 k64 s4 r1 z128 f0")
    assert replace(four, a_regs=1) in x3 and four not in x3
    for dtype in ("float16", "float32"):
        assert not any(c.a_regs for c in hopper.configs(hopper.GemmSpec(*dims, dtype=dtype), a_regs=(0, 1)))
    # the untuned default keeps A in shared memory until a ragged M tile has run on a GPU
    assert not hopper.default_config(hopper.GemmSpec(*dims, dtype="float32x3")).a_regs
