"""Hopper's wgmma GEMM template: which planner kernels it takes (and why not the others), how their epilogue
becomes the kernel's store, how the space samples its tiles and a record selects the kernel a build runs, and
that its kernels build for sm_90a without spills. (CUDA built here, not run: the kernels' numerics are
checked on the H200 by benchmarks/wgmma_gemm.py and benchmarks/bench_gpu.py against PyTorch; see BENCHMARKS.md.)"""
from __future__ import annotations

import dataclasses
import math
import re
import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import (assert_copy_sources_disjoint, cuda_source, assert_ptxas_without_spills,  # noqa: E402
                         assert_shared_offsets_aligned, build_with_record, commit_record, twin_and_kernel_outputs)
from tvmfuse._tvm import ms, tvm  # noqa: E402
from tvmfuse.tune.builder import fast_build
from tvmfuse.bench.cases import CASES  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.kernels import expand  # noqa: E402
from tvmfuse.kernels import wgmma as hopper  # noqa: E402
from tvmfuse.tune import extract_kernels  # noqa: E402
from tvmfuse.tune.spaces import classify, load_spaces, select_space  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                          "max_shared_memory_per_block": 49152, "thread_warp_size": 32})


@pytest.fixture(scope="module")
def cuda():
    target = resolve_target("cuda")
    assert target.target.attrs["arch"] == "sm_90a"   # Hopper builds arch-specific code (wgmma needs it)
    return target


def _gemm_kernels(tmp_path, model, cuda, fp32_tensor_cores=True):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda, fp32_tensor_cores=fp32_tensor_cores)
    return [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) in ("gemm", "conv")]


@pytest.fixture(scope="module")
def gemm_kernel(tmp_path_factory, cuda):
    model, _, _ = CASES["gemm_bias_relu"](M=256, K=256, N=256)
    (k,) = _gemm_kernels(tmp_path_factory.mktemp("gemm"), model, cuda)
    return k


def _sketch(kernel, target, seed=0):
    choice = select_space(kernel.mod, target)
    ctx = ms.TuneContext(mod=kernel.mod, target=target, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=seed)
    return choice, ctx.generate_design_space()


def test_analyze_reads_the_gemm_and_its_epilogue(gemm_kernel):
    spec, info = hopper.analyze(gemm_kernel.mod["main"])
    assert spec == hopper.GemmSpec(batch=(), m=256, n=256, k=256, a_batched=False, b_batched=False, b_kmajor=False)
    assert (info["a"], info["b"]) == (0, 1)
    # cast to fp16, the bias (indexed by the column), ReLU: applied to the accumulator, stored once
    assert info["store"] == "p3[({row}), ({col})] = T.max((T.Cast('float16', {acc}) + p2[({col})]), T.float16(0.0))"


def _linear_gelu_residual(batch=2, m=64, k=128, n=64) -> onnx.ModelProto:
    """[batch, m, k] @ [k, n] (a weight shared by the batch) -> bias -> GELU (erf) -> + residual."""
    b = models._B(5)
    h = b.op("Add", [b.op("MatMul", ["x", b.w(k, n)]), b.const(b.rng.standard_normal(n) * 0.1)])
    h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(1.4142135)])]),
                                                  b.const(1.0)])]), b.const(0.5)])
    return models.to_fp16(b.model({"x": [batch, m, k], "r": [batch, m, n]}, b.op("Add", [h, "r"]), [batch, m, n]))


def test_analyze_folds_a_shared_weight_batch_into_rows_and_keeps_the_epilogue(tmp_path, cuda):
    (k,) = _gemm_kernels(tmp_path, _linear_gelu_residual(), cuda)
    spec, info = hopper.analyze(k.mod["main"])
    assert spec == hopper.GemmSpec((2,), 64, 64, 128, a_batched=True, b_batched=False, b_kmajor=False)
    assert spec.fold_batch and spec.rows == 128 and spec.grid_batch == 1
    *computed, store = info["store"].splitlines()
    # the output and the residual are indexed [row // 64, row % 64, col], the bias by the column; GELU kept
    assert store.startswith("p") and "[(({row} // 64)), ({row} % 64), ({col})] = " in store
    assert "* T.float16(0.5)" in store and store.count("{row} % 64") >= 2
    # erf's argument, clamped, is read 21 times by its polynomial: computed once, into a local buffer
    assert computed and all(line.startswith("ev0_") for line in computed)
    assert "T.alloc_buffer(" in computed[0] and info["store"].count("T.min(") == 1
    # the batched matmul of two activations keeps its batch on the grid
    (k,) = _gemm_kernels(tmp_path, models.to_fp16(models.gemm_epilogue(m=64, k=128, n=64, batched=True)), cuda)
    spec, _ = hopper.analyze(k.mod["main"])
    assert spec.a_batched and spec.b_batched and not spec.fold_batch and spec.grid_batch == 4


def test_analyze_declines_what_the_template_cannot_take(tmp_path, cuda):
    # 20 channels: a 16-byte copy would straddle two filter taps
    conv = models.to_fp16(models.conv_bn_relu(n=1, cin=20, cout=16, hw=16))
    (k,) = _gemm_kernels(tmp_path, conv, cuda)
    with pytest.raises(hopper.Misfit, match="multiple of 8"):
        hopper.analyze(k.mod["main"])
    fp32 = models.gemm_epilogue(m=64, k=128, n=64)   # (on the CUDA cores: unmarked for three TF32 products)
    (k,) = _gemm_kernels(tmp_path, fp32, cuda, fp32_tensor_cores=False)
    with pytest.raises(hopper.Misfit, match="fp16"):
        hopper.analyze(k.mod["main"])


def test_epilogue_logic_translates_to_tvmscript_operators():
    """``and`` / ``or`` in an epilogue become ``T.And`` / ``T.Or`` (``T.and`` is not Python)."""
    from tvmfuse._tvm import tvm as tv

    x = tv.tirx.Var("x", "int32")
    expr = tv.tirx.Or(tv.tirx.And(x > 0, x < 8), tv.tirx.Not(x == 3))
    text = hopper.analysis._script(expr, {"x": "row"}, {}, ("", []))
    assert text == "T.Or(T.And((row > T.int32(0)), (row < T.int32(8))), T.Not((row == T.int32(3))))", text
    hopper.parse(f"""
@T.prim_func(s_tir=True)
def main(a: T.Buffer((8,), "int32")):
    for row in range(8):
        a[row] = T.Select({text}, 1, 0)
""")


def test_an_epilogue_clipped_by_0d_parameters_builds(tmp_path, cuda):
    """fp16 GEMM -> Clip(x, min, max) with min and max as 0-d tensors (MobileNetV2's ReLU6 in an fp16 export):
    the epilogue reads them as 0-d parameters, written ``p[()]`` (``p[]`` is no Python: MobileNetV2 fp16's build
    raised a SyntaxError), and the wgmma kernel builds for sm_90a."""
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((128, 128)).astype("float16"), "w")
    lo, hi = (numpy_helper.from_array(np.array(v, dtype="float16"), n) for v, n in ((0.0, "lo"), (6.0, "hi")))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Clip", ["y0", "lo", "hi"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [128, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [128, 128])], [w, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (k,) = _gemm_kernels(tmp_path, model, cuda)
    func = k.mod["main"]
    assert "T.Buffer((), \"float16\")" in func.script()   # the bounds stay 0-d parameters
    kernel = hopper.default_kernel(func, cuda.target)
    assert kernel is not None and "[()]" in kernel.script()
    tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=SM90A)


def test_configs_divide_the_shape_and_respect_shared_memory():
    spec = hopper.GemmSpec((), 8192, 8192, 8192, False, False, False)
    options = hopper.configs(spec)
    # a GEMM's default loads its tiles by TMA (H200, 2026-12-01: 1845 us against cp.async's 2025); TMA kernels
    # wait for their wgmma batch (in flight they computed wrong results) and take no conv (gathered rows)
    assert hopper.default_config(spec) == hopper.parse_config("g2 m1 n256 k64 s4 r8 z128 f0 t1")
    both = hopper.configs(spec, tma=(0, 1))
    assert {c.tma for c in both} == {0, 1} and not any(c.tma and c.inflight for c in both)
    assert all(not c.tma for c in options)   # the template's choices without the space's knob: cp.async
    # a stride-1 conv too (its output pixels in 8 x 8 patches: H200, 2026-12-01, 362 us against cp.async's 482);
    # strided ones, or ones whose patches would leave more than 15% idle, keep cp.async; dilated ones may take TMA
    # when tuned (checked there) but not untuned (not yet run on a GPU)
    conv = hopper.GemmSpec((), 200704, 256, 2304, False, False, True,
                           hopper.ConvGeometry(64, 56, 56, 256, 56, 56, 3, 3, (1, 1), (1, 1), (1, 1)))
    assert hopper.pixel_tile(conv) == (8, 8) and any(c.tma for c in hopper.configs(conv, tma=(0, 1)))
    assert hopper.default_config(conv) == hopper.parse_config("g2 m1 n256 k64 s4 r8 z128 f0 t1")
    strided = hopper.GemmSpec((), 64 * 28 * 28, 256, 2304, False, False, True,
                              hopper.ConvGeometry(64, 56, 56, 256, 28, 28, 3, 3, (2, 2), (1, 1), (1, 1)))
    small = hopper.GemmSpec((), 32 * 49, 512, 4608, False, False, True,
                            hopper.ConvGeometry(32, 7, 7, 512, 7, 7, 3, 3, (1, 1), (1, 1), (1, 1)))
    for other in (strided, small):
        assert hopper.pixel_tile(other) is None and not any(c.tma for c in hopper.configs(other, tma=(0, 1)))
    dilated = hopper.GemmSpec((), 2 * 16 * 16, 64, 1152, False, False, True,
                              hopper.ConvGeometry(2, 16, 16, 128, 16, 16, 3, 3, (1, 1), (2, 2), (2, 2)))
    assert any(c.tma for c in hopper.configs(dilated, tma=(0, 1))) and not hopper.default_config(dilated).tma
    # persistent blocks are a TMA kernel's option (measured equal to one block per tile, 2026-12-01)
    everything = hopper.configs(spec, tma=(0, 1), persistent=(0, 1))
    assert any(c.persistent for c in everything) and all(c.tma for c in everything if c.persistent)
    assert not hopper.default_config(spec).persistent
    for c in both:
        assert c.shared_bytes() <= 227 * 1024 and c.m_tiles * c.block_n // 2 <= 128
        assert hopper.parse_config(c.name) == c
    small = hopper.GemmSpec((), 192, 384, 128, False, False, True)   # 3 row tiles of 64, K two steps of 64
    for c in hopper.configs(small):
        assert 384 % c.block_n == 0 and c.stages - c.inflight - 1 <= 2
        assert -(-192 // c.block_m) % c.raster == 0   # a partial last tile row counts as a tile row
    assert {c.block_m for c in hopper.configs(small)} == {64, 128, 256}
    # rows need not divide (the last tile row is predicated); columns and K need not either where the operands'
    # rows stay 16-byte aligned (cp.async configs, zero-filled past the end), and never in a TMA config
    assert hopper.configs(hopper.GemmSpec((), 100, 256, 256, False, False, True))
    for n, k, kmajor in ((100, 256, True), (256, 96, True), (1000, 1000, False), (50, 24, True), (50257, 768, True)):
        ragged = hopper.configs(hopper.GemmSpec((), 128, n, k, False, False, kmajor), tma=(0, 1))
        assert ragged and not any(c.tma for c in ragged), (n, k)
    for n, k, kmajor in ((256, 100, True), (100, 256, False), (50257, 768, False)):
        assert not hopper.configs(hopper.GemmSpec((), 128, n, k, False, False, kmajor)), (n, k)
    # the default keeps whole tiles where some width has them (N 384: 128 wide, not 256 with a partial third)
    assert hopper.default_config(hopper.GemmSpec((), 8192, 384, 4096, False, False, True)).block_n == 128
    assert hopper.default_config(hopper.GemmSpec((), 8192, 96, 24, False, False, True), 132).block_n in (64, 128)
    # f1 also where A's copies are predicated (their main-loop copies zero-fill without a branch), at 4+ stages
    padded = hopper.ConvGeometry(2, 8, 8, 64, 8, 8, 3, 3, (1, 1), (1, 1), (1, 1))
    assert {c.stages for c in hopper.configs(hopper.GemmSpec((), 128, 64, 576, False, False, True, padded))
            if c.inflight} == {4, 5}
    assert any(c.inflight for c in hopper.configs(hopper.GemmSpec((), 100, 256, 256, False, False, True)))
    assert any(c.inflight for c in hopper.configs(hopper.GemmSpec((), 128, 256, 256, False, False, True)))
    # a single K step: only the shallowest pipeline (its missing prologue tiles are empty cp.async groups)
    assert {c.stages for c in hopper.configs(hopper.GemmSpec((), 128, 256, 64, False, False, True))} == {3}


def _run_stores(stores: str, acc, c, pm: int, pn: int, store, T) -> None:
    """Run the kernel's epilogue ``stores`` (TVMScript, executed as Python) for tile (``pm``, ``pn``) as every thread
    of the block would: each thread's registers taken from the block's accumulator tile ``acc`` in wgmma's fragment
    layout, each store ``out[row, col] = value`` handed to ``store(key, value)``. A staged epilogue runs phase by
    phase between its barriers, every thread through one phase before any starts the next, its shared fp32 tile
    ``sacc`` a dict (a read of an element no thread wrote fails)."""
    class Out:
        def __setitem__(self, key, value):
            store(key, value)

    phases = [compile("\n".join(ln for ln in text.splitlines() if not ln.startswith("T.evaluate("))
                      .replace("T.unroll(", "range(").replace("T.vectorized(", "range("), "stores", "exec")
              for text in stores.split('T.tvm_storage_sync("shared")\n')]
    sacc: dict = {}
    for code in phases:
        for tx in range(128 * c.warpgroups):
            lane, warp, wg = tx % 32, tx % 128 // 32, tx // 128
            regs = {}
            for t in range(c.m_tiles):
                for i in range(c.block_n // 2):   # wgmma's accumulator fragment of a 64 x N tile
                    regs[t * c.block_n // 2 + i] = acc[(wg * c.m_tiles + t) * 64 + warp * 16 + lane // 4
                                                       + 8 * (i // 2 % 2), i // 4 * 8 + lane % 4 * 2 + i % 2]
            exec(code, {"T": T, "out": Out(), "acc": regs, "sacc": sacc, "tx": tx, "pm": pm, "pn": pn})
    if c.staged:   # the staged tile's rows hold the block's columns, nothing past them
        assert len(sacc) == c.block_m * c.block_n and all(k % c.staged_stride < c.block_n for k in sacc)


@pytest.mark.parametrize("m,n,k,b_kmajor,cfg", [
    (100, 96, 24, True, "g1 m1 n128 k64 s3 r1 z128 f0"),    # MobileNet's 1x1 conv: one partial K step and column
    (130, 1000, 200, False, "g2 m1 n256 k64 s4 r1 z128 f1"),   # a classifier: N-major B, K 3 steps and 8
    (64, 50, 72, True, "g1 m2 n64 k64 s3 r1 z128 f0"),     # N not a multiple of 8 (K-major B only)
    (70, 51, 200, True, "g2 m1 n64 k64 s4 r1 z128 f1"),    # N odd (a vocabulary): one column at a time
    ((2, 6, 24), 40, None, True, "g1 m1 n64 k64 s4 r1 z128 f1"),   # 3x3 conv of 24 channels: steps span taps
    ((1, 9, 40, 2), 48, None, True, "g2 m1 n64 k64 s3 r1 z128 f0"),   # stride 2, 40 channels: K 360
    (100, 144, 24, True, "g1 m1 n144 k64 s3 r1 z128 f0"),   # one exact tile column of a narrow N
    ((2, 6, 24), 40, None, True, "g1 m1 n48 k64 s4 r1 z128 f1"),   # the same for a conv's 40 filters
    (100, 144, 24, True, "g2 m1 n64 k64 s3 r1 z128 f0 e1"),   # stores staged in shared memory, a partial row
    (70, 51, 200, True, "g1 m2 n64 k64 s4 r1 z128 f1 e1"),    # staged, N odd, a batch in flight
    (130, 1000, 200, False, "g2 m1 n256 k64 s4 r1 z128 f1 e1"),   # staged, 256 wide
    ((1, 9, 40, 2), 80, None, True, "g2 m1 n64 k64 s4 r1 z128 f1 e1"),   # staged, a strided conv of 80 filters
], ids=["pointwise_conv", "classifier", "n50", "n51", "conv24", "conv40_stride2", "exact144", "conv_exact48",
        "staged", "staged_n51", "staged_classifier", "staged_conv"])
def test_ragged_tiles_copy_zeros_past_the_end_and_store_only_the_output(m, n, k, b_kmajor, cfg):
    """The cp.async kernel's data path for columns, K and conv channels that are no whole number of tiles, emulated
    from the generated expressions (wgmma cannot run here): each block's K steps fill A's and B's shared tiles
    chunk by chunk from :func:`hopper.cp_async.tile_reads` (a chunk whose predicate fails is zero; one that holds
    must lie inside its operand's row, a conv's inside one pixel's channels), the tiles read back through the
    layout multiply, and the kernel's epilogue (its TVMScript, executed as Python) stores each thread's
    accumulators. The output must be the GEMM, every element written once and nothing past it."""
    import numpy as np

    from tvmfuse.kernels.wgmma import config as wcfg
    from tvmfuse.kernels.wgmma.cp_async import tile_reads

    rng = np.random.default_rng(0)
    if isinstance(m, tuple):   # (images, size, channels[, stride]): a padded 3x3 conv, its A the NHWC input
        images, hw, ch, *stride = m
        st = stride[0] if stride else 1
        g = hopper.ConvGeometry(images, hw, hw, ch, (hw - 1) // st + 1, (hw - 1) // st + 1, 3, 3, (st, st), (1, 1),
                                (1, 1))
        spec = hopper.GemmSpec((), images * g.oh * g.ow, n, 9 * ch, False, False, True, conv=g)
        m, k = spec.rows, spec.k
        x = rng.standard_normal((images, hw, hw, ch))
        xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        a = np.stack([xp[:, r:r + st * (g.oh - 1) + 1:st, s:s + st * (g.ow - 1) + 1:st, :]
                      for r in range(3) for s in range(3)], axis=3).reshape(m, k)   # im2col, K in (r, s, c)
        flat, row_len = {"A": x.ravel()}, {"A": ch, "B": k}
    else:
        spec = hopper.GemmSpec((), m, n, k, False, False, b_kmajor)
        a = rng.standard_normal((m, k))
        flat, row_len = {"A": a.ravel()}, {"A": k, "B": k if b_kmajor else n}
    c = hopper.parse_config(cfg)
    assert c in hopper.configs(spec, stages=(3, 4), raster=(1,), staged=(0, 1))
    b = rng.standard_normal((n, k) if b_kmajor else (k, n))
    flat["B"] = b.ravel()

    class T:   # what the generated expressions call
        And = staticmethod(lambda x, y: x and y)
        bitwise_xor = staticmethod(lambda x, y: x ^ y)

    out = np.full((m, n), np.nan)
    writes = np.zeros((m, n), int)
    _, stores = hopper.mma._mma_and_store(spec, c, "out[{row}, {col}] = {acc}", "pm", "pn", 0)
    for pm in range(wcfg.tiles_m(spec, c)):
        for pn in range(wcfg.tiles_n(spec, c)):
            acc = np.zeros((c.block_m, c.block_n))
            for j in range(wcfg.k_steps(spec, c)):
                tiles = []
                for (src, elems, chunk, glob), outer in zip(tile_reads(spec, c, "A", "B", "pm", "pn", "j"),
                                                           (c.block_m, c.block_n)):
                    kmajor = src == "A" or b_kmajor
                    tile = np.full((outer, 64) if kmajor else (64, outer), np.nan)
                    for ci in range(elems // 8):
                        o, kk, _ = (eval(e, {"T": T}, {"ci": ci}) for e in chunk("ci"))
                        pred, at = glob(str(o), str(kk))
                        env = {"T": T, "pm": pm, "pn": pn, "j": j}
                        got = np.zeros(8)
                        if pred is None or eval(pred, env):
                            at = eval(at, env)
                            assert at // row_len[src] == (at + 7) // row_len[src] and at + 8 <= flat[src].size
                            got = flat[src][at:at + 8]
                        if kmajor:
                            tile[o, kk:kk + 8] = got
                        else:
                            tile[kk, o:o + 8] = got
                    tiles.append(tile)
                ta, tb = tiles
                assert not np.isnan(ta).any() and not np.isnan(tb).any()   # every chunk of the tile filled
                acc += ta @ (tb.T if b_kmajor else tb)
            def store(key, value):
                assert key[0] < m and key[1] < n, key
                out[key] = value
                writes[key] += 1
            _run_stores(stores, acc, c, pm, pn, store, T)
    assert (writes == 1).all(), (writes != 1).sum()
    np.testing.assert_allclose(out, a @ (b.T if b_kmajor else b), rtol=1e-9, atol=1e-9)


def test_the_space_offers_the_wgmma_sketch_only_where_it_fits(gemm_kernel, cuda):
    choice, sketches = _sketch(gemm_kernel, cuda.target)
    assert choice.source == "template:gemm_tensorcore"
    (sketch,) = sketches
    ann = sketch.mod["main"].body.block.annotations
    names = str(ann[hopper.CANDIDATES]).split(";")
    spec = hopper.GemmSpec.from_json(json.dumps(json.loads(str(ann[hopper.SPEC]))["spec"]))
    assert [c.name for c in hopper.configs(spec, **_knob_values())] == names
    # on sm_90 (no arch-specific features) the same kernel gets the mma / wmma sketches
    choice, sketches = _sketch(gemm_kernel, SM90)
    assert len(sketches) > 1 and all(hopper.CANDIDATES not in s.mod["main"].body.block.annotations for s in sketches)


def test_a_conv_gets_the_implicit_gemm_sketch_alone_on_sm90a(tmp_path, cuda):
    """On sm_90a a conv with 64-channel K steps gets the wgmma implicit-GEMM sketch, as a GEMM does, without the
    mma/wmma sketches beside it (on sm_90 it gets those). Its sampled kernel expands and builds."""
    (kernel,) = _gemm_kernels(tmp_path, models.to_fp16(models.conv_bn_relu(n=2, cin=64, cout=64, hw=8)), cuda)
    choice, sketches = _sketch(kernel, cuda.target)
    assert choice.source == "template:gemm_tensorcore"
    wgmma = [s for s in sketches if hopper.CANDIDATES in s.mod["main"].body.block.annotations]
    assert len(wgmma) == 1 and len(sketches) == 1
    spec, _, cfg = hopper.annotated(wgmma[0].mod["main"])
    assert spec.conv is not None and (spec.rows, spec.n, spec.k) == (128, 64, 576)
    lib = fast_build(wgmma[0].mod, cuda.target, None)
    src = lib.imports[0].inspect_source()
    assert f"m64n{cfg.block_n}k16" in src and "cp.async" in src
    _, sketches = _sketch(kernel, SM90)
    assert sketches and all(hopper.CANDIDATES not in s.mod["main"].body.block.annotations for s in sketches)


def _knob_values() -> dict:
    knobs = load_spaces("cuda").for_class("gemm").knobs
    return {k: knobs[f"wgmma_{k}"].values for k in hopper.sketch._KNOBS}


def test_the_sampled_config_is_the_kernel_the_builder_compiles(gemm_kernel, cuda):
    _, (sketch,) = _sketch(gemm_kernel, cuda.target)
    names = str(sketch.mod["main"].body.block.annotations[hopper.CANDIDATES]).split(";")
    seen = set()
    for seed in range(1, 9):
        sch = tvm.s_tir.Schedule(gemm_kernel.mod, seed=seed)
        tvm.s_tir.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)   # decisions resampled
        ann = sch.mod["main"].body.block.annotations
        cfg = hopper.parse_config(names[int(ann[hopper.ANNOTATION])])
        seen.add(cfg)
        kernel = expand(sch.mod)["main"]
        text = kernel.script()
        assert f"m64n{cfg.block_n}k16" in text and f"thread_binding({cfg.threads}" in text
    assert len(seen) > 1   # the config is a decision of the trace, not fixed
    lib = fast_build(sch.mod, cuda.target, None)   # MetaSchedule's builder expands the annotated kernel
    assert "wgmma.mma_async" in lib.imports[0].inspect_source()


@pytest.mark.parametrize("dtype", ["float16", "float32x3"])
def test_a_raster_group_that_does_not_divide_the_tile_rows_is_refused(dtype):
    """Tiles walk in groups of ``raster`` tile rows; 1576 rows are 13 tiles of 128, and groups of 8 left tiles of the
    last group unwritten (NaN in an H100 run of an explicit config). The space never offers it; an explicit config
    is an error, not a wrong kernel."""
    spec = hopper.GemmSpec((), 1576, 768, 768, False, False, True, dtype=dtype)
    bad, good = (hopper.parse_config(f"g2 m1 n128 k64 s3 r{r} z128 f0") for r in (8, 1))
    assert hopper.tiles_m(spec, bad) == 13 and bad not in hopper.configs(spec) and good in hopper.configs(spec)
    decls = ["a: T.Buffer((1576, 768), 'float32')", "b: T.Buffer((768, 768), 'float32')",
             "c: T.Buffer((1576, 768), 'float32')"]
    store = "c[{row}, {col}] = {acc}"
    with pytest.raises(ValueError, match="groups of 8 tile rows do not divide the 13 tile rows"):
        hopper.gemm_source(spec, bad, decls, "a", "b", store)
    hopper.gemm_source(spec, good, decls, "a", "b", store)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg,b_kmajor", [("g2 m1 n256 k64 s3 r8 z128 f0", False), ("g2 m2 n128 k64 s4 r1 z128 f0", True),
                                          ("g1 m1 n64 k64 s3 r1 z0 f0", False), ("g2 m1 n256 k64 s4 r8 z128 f1", False),
                                          ("g2 m1 n256 k64 s3 r8 z128 f0 e1", True),
                                          ("g1 m2 n128 k64 s4 r1 z128 f1 e1", False)])
def test_wgmma_kernels_build_for_sm90a_without_register_spills(tmp_path, cfg, b_kmajor):
    """No spills, and the wgmma instructions stay asynchronous. With a batch in flight across K steps (f1), a
    branch around the refill made ptxas serialize them (C7514, nvcc 13.0; why f1 ran slower on the H200): f1
    kernels now refill unconditionally (the last steps copy the last tile again into a stage nobody reads)."""
    spec = hopper.GemmSpec((), 1024, 1024, 1024, False, False, b_kmajor)
    b_shape = (1024, 1024)
    decls = ["a: T.Buffer((1024, 1024), 'float16')", f"b: T.Buffer({b_shape}, 'float16')",
             "c: T.Buffer((1024, 1024), 'float16')"]
    func = hopper.parse(hopper.gemm_source(spec, hopper.parse_config(cfg), decls, "a", "b",
                                           "c[{row}, {col}] = T.Cast('float16', {acc})"))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned" in src and "cp.async" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")
    assert ("if (ko <" in src) == (" f0" in cfg)
    if cfg.endswith("e1"):   # staged: float2 pairs into shared memory and back, half2 stores
        assert "*(float2*)(((float*)smem_ptr)" in src and "*(half2*)(c_ptr" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_an_erf_gelu_epilogue_computes_each_value_once_an_element(tmp_path, cuda):
    """The conversions between half and float are inline assembly in CUDA's headers, which nvcc does not merge:
    inlined into the store, erf's argument (the product plus the bias, over sqrt(2), converted) was recomputed at
    each of its 21 reads, and with the stores unrolled RoBERTa's fp16 GEMM + erf-GELU compiled to 41,000 SASS
    instructions (the plain GEMM: 976) and ran 20x slower than the GEMM on the H100. Computed once, an element
    stored takes a few conversions (172 before)."""
    import re
    import subprocess

    (k,) = _gemm_kernels(tmp_path, _linear_gelu_residual(m=128, k=128, n=128), cuda)
    func = k.mod["main"]
    spec, info = hopper.analyze(func)
    kernel = hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], hopper.configs(spec)[0])
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=SM90A)
    cu = tmp_path / "k.cu"
    cu.write_text(lib.mod.imports[0].inspect_source())
    subprocess.run(["nvcc", "-arch=sm_90a", "-ptx", "-O3", "-o", str(tmp_path / "k.ptx"), str(cu)], check=True,
                   capture_output=True)
    ptx = (tmp_path / "k.ptx").read_text()
    stored = sum({"v2": 2, "v4": 4}.get(w, 1) for w in re.findall(r"\bst\.global\.(v2|v4)?", ptx))
    assert stored and len(re.findall(r"\bcvt\.", ptx)) <= 8 * stored


def test_gemm_stores_are_staged_by_default_where_whole_lines_fit():
    """The untuned default stages a cp.async fp16 GEMM's stores where N >= 64 and the fp32 tile fits in the stages'
    shared memory (H100: 1.2-2.1x on memory-bound GEMMs); not at N 24 (measured slower), not in a TMA kernel, not in
    a conv or a TF32 GEMM (never run staged on a GPU); configs offer both where asked."""
    staged = hopper.default_config(hopper.GemmSpec((), 100352, 144, 24, False, False, True))
    assert staged.staged and not staged.tma
    assert staged.shared_bytes() == dataclasses.replace(staged, staged=0).shared_bytes()
    assert not hopper.default_config(hopper.GemmSpec((), 100352, 24, 144, False, False, True)).staged
    tf32 = hopper.GemmSpec((), 100352, 144, 24, False, False, True, dtype="float32")
    assert not hopper.default_config(tf32).staged and not hopper.default_config(tf32).tma   # never run staged
    assert hopper.default_config(hopper.GemmSpec((), 8192, 8192, 8192, False, False, True)).tma
    assert not hopper.default_config(hopper.GemmSpec((), 8192, 8192, 8192, False, False, True)).staged
    geo = hopper.ConvGeometry(32, 28, 28, 96, 28, 28, 3, 3, (1, 1), (1, 1), (1, 1))
    assert not hopper.default_config(hopper.GemmSpec((), 32 * 784, 64, 864, False, False, True, geo)).staged
    spec = hopper.GemmSpec((), 4096, 1000, 2048, False, False, True)
    both = hopper.configs(spec, staged=(0, 1))
    assert {c.staged for c in both} == {0, 1} and not any(c.staged for c in hopper.configs(spec))
    for c in both:
        assert c.shared_bytes() >= 4 * c.block_m * (c.block_n + 8) * c.staged and hopper.parse_config(c.name) == c
    assert not any(c.staged and c.tma for c in hopper.configs(hopper.GemmSpec((), 8192, 8192, 8192, False, False,
                                                                               True), tma=(0, 1), staged=(0, 1)))


def test_a_conv_by_cp_async_defaults_to_one_64_row_tile_a_warpgroup():
    """ResNet-50's 3 x 3 convs at batch 32 (224^2 images): every cp.async default is one 64-row tile a warpgroup
    (a warpgroup of two ran 1.5-3x slower on the H100), 64 x 128 where the grid is short of the SMs (14^2 x 256:
    31.4 against 60.6 us); a GEMM of the same rows keeps its 128 x 128 tile by one warpgroup."""
    for n, c, hw, f, stride in ((32, 256, 14, 256, 1), (32, 512, 7, 512, 1), (32, 128, 56, 128, 2),
                                (32, 64, 56, 64, 1), (32, 8, 224, 64, 2)):
        o = (hw + 2 - 3) // stride + 1
        geo = hopper.ConvGeometry(n, hw, hw, c, o, o, 3, 3, (stride, stride), (1, 1), (1, 1))
        cfg = hopper.default_config(hopper.GemmSpec((), n * o * o, f, 9 * c, False, False, True, geo), 132)
        assert cfg.tma or cfg.m_tiles == 1, (hw, c, cfg.name)
    geo = hopper.ConvGeometry(32, 14, 14, 256, 14, 14, 3, 3, (1, 1), (1, 1), (1, 1))
    assert hopper.default_config(hopper.GemmSpec((), 6272, 256, 2304, False, False, True, geo), 132) == \
        hopper.parse_config("g1 m1 n128 k64 s3 r1 z128 f0")
    gemm = hopper.default_config(hopper.GemmSpec((), 6272, 256, 2304, False, False, True), 132)
    assert (gemm.warpgroups, gemm.m_tiles, gemm.block_n) == (1, 2, 128)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_grid_too_small_for_the_gpu_takes_smaller_tiles(tmp_path):
    """ResNet-50's 3 x 3 convs at batch 32 on 64 x 64 images (512 x 256 outputs, K 2304) were 4 blocks of 128 x 256
    on the H200's 132 SMs; the default now takes 64-row tiles there, and keeps the measured tiles where the grid
    fills the GPU (a large GEMM, BERT-base's projections)."""
    from tvmfuse.kernels.wgmma.config import grid_time

    geo = hopper.ConvGeometry(32, 4, 4, 256, 4, 4, 3, 3, (1, 1), (1, 1), (1, 1))
    conv = hopper.GemmSpec((), 512, 256, 2304, False, False, True, geo)
    small = hopper.default_config(conv, 132)
    assert small.block_m * small.block_n <= 64 * 128 and not small.tma
    assert grid_time(conv, small, 132) * 2 <= grid_time(conv, hopper.default_config(conv, 4), 132)
    assert hopper.default_config(conv, 4).block_n == 256   # 4 SMs: 4 big tiles fill them
    for m, n, k in ((8192, 8192, 8192), (4096, 2304, 768), (4096, 768, 768)):
        spec = hopper.GemmSpec((), m, n, k, False, False, False)
        assert hopper.default_config(spec, 132) == hopper.parse_config("g2 m1 n256 k64 s4 r8 z128 f0 t1")
    decls = ["a: T.Buffer((512, 2304), 'float16')", "b: T.Buffer((2304, 256), 'float16')",
             "c: T.Buffer((512, 256), 'float16')"]
    gemm = hopper.GemmSpec((), 512, 256, 2304, False, False, False)
    # a GEMM's stores are staged, a conv's not; a GEMM's small grid runs the deepest pipeline (36 K steps: 5 stages,
    # a batch in flight), a conv's 3 stages; both split K over the idle SMs (16 tiles x 6, 6 K steps a split)
    assert hopper.default_config(gemm, 132) == dataclasses.replace(small, staged=1, stages=5, inflight=1)
    assert small.stages == 3 and not small.inflight and small.split == 6
    # at most half the K steps deep: 7 steps keep 3 stages; K of 4 steps or fewer leaves TMA (output-bound)
    assert hopper.default_config(hopper.GemmSpec((), 512, 256, 448, False, False, False), 132).stages == 3
    short = hopper.default_config(hopper.GemmSpec((), 1194, 12288, 128, False, False, False), 132)
    assert not short.tma and short.staged
    for cfg in (small, hopper.default_config(gemm, 132)):
        func = hopper.parse(hopper.gemm_source(gemm, cfg, decls, "a", "b",
                                               "c[{row}, {col}] = T.Cast('float16', {acc})"))
        src = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A).mod.imports[0]
        assert_ptxas_without_spills(src.inspect_source(), tmp_path, "sm_90a")


def test_a_tuned_record_selects_the_wgmma_kernel_a_build_runs(tmp_path, cuda):
    from tvmfuse.inspect import InspectConfig, inspect_database

    model, _, _ = CASES["gemm_bias_relu"](M=256, K=256, N=256)
    path = tmp_path / "g.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    (kernel,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "gemm"]
    _, (sketch,) = _sketch(kernel, cuda.target)
    names = str(sketch.mod["main"].body.block.annotations[hopper.CANDIDATES]).split(";")
    spec, _ = hopper.analyze(kernel.mod["main"])
    pick = next(i for i, n in enumerate(names) if hopper.parse_config(n) != hopper.default_config(spec))
    inst = next(i for i in sketch.trace.insts if i.kind.name == "SampleCategorical")
    trace = sketch.trace.with_decision(inst, pick, remove_postproc=True)
    cfg = hopper.parse_config(names[pick])
    result = build_with_record(tmp_path / "t.db", cuda, fused, kernel, trace)
    assert [k.schedule for k in result.kernels] == ["tuned"]
    src = cuda_source(result.executable)
    assert f"__launch_bounds__({cfg.threads})" in src and f"m64n{cfg.block_n}k16" in src
    report = inspect_database(InspectConfig(db=tmp_path / "t.db", target="cuda"))
    assert [k["wgmma_config"] for k in report["kernels"]] == [cfg.name]


def test_an_untuned_hopper_build_and_the_tuners_baseline_run_the_default_wgmma_kernel(tmp_path, cuda):
    """Without a record a GEMM on sm_90a runs the wgmma template at its default tiles (dlight's GEMM schedule
    has no tensor cores), and the tuner's baseline, the record that keeps a build from being slower than the
    untuned one, is that same kernel. Since the H200 ran and checked them (2026-11-30), convs, partial row
    tiles and head-splitting epilogues take it too."""
    from tvmfuse.compile.build import build
    from tvmfuse.tune.defaults import default_template_schedule

    model, _, _ = CASES["gemm_bias_relu"](M=256, K=256, N=256)
    onnx.save(model, tmp_path / "g.onnx")
    fused, _ = partition(import_model(load_model(tmp_path / "g.onnx")), target=cuda)
    (kernel,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "gemm"]
    spec, _ = hopper.analyze(kernel.mod["main"])
    want = hopper.default_config(spec)
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["wgmma-default"]
    src = cuda_source(result.executable)
    assert f"__launch_bounds__({want.threads})" in src and f"m64n{want.block_n}k16" in src
    sch = default_template_schedule(kernel.mod, cuda.target)
    assert hopper.annotated(sch.mod["main"])[2] == want
    assert default_template_schedule(kernel.mod, SM90) is None and hopper.default_kernel(kernel.mod["main"], SM90) is None
    # a conv and a GEMM whose rows end in a partial tile: the same, at the default config of their spec
    # (grids that fill the H200's SMs and K past 4 steps: smaller ones take smaller cp.async tiles, the next test)
    (conv,) = _gemm_kernels(tmp_path, models.to_fp16(models.conv_bn_relu(n=16, cin=64, cout=256, hw=64)), cuda)
    (tail,) = _gemm_kernels(tmp_path, CASES["gemm_bias_relu"](M=4192, K=512, N=1024)[0], cuda)
    for k in (conv, tail):
        spec, _ = hopper.analyze(k.mod["main"])
        assert hopper.untuned_config(k.mod["main"], cuda.target)[2] == hopper.default_config(spec)
        src = tvm.compile(tvm.IRModule({"main": hopper.default_kernel(k.mod["main"], cuda.target)}),
                          target=SM90A).mod.imports[0].inspect_source()
        assert "wgmma.mma_async" in src
        # both by TMA: the conv's input in 8 x 8 pixel patches (a 4-D box), the GEMM's rows in 3-D boxes
        assert ("cp.async.bulk.tensor.4d" in src) == (k is conv) and "cp.async.bulk.tensor.3d" in src
        assert hopper.annotated(default_template_schedule(k.mod, cuda.target).mod["main"])[2] == hopper.default_config(spec)


def test_inspect_reads_mma_gemm_records_without_the_tensor_intrinsics(tmp_path, cuda):
    """Only a wgmma trace is replayed to name its tiles: an mma-template trace tensorizes, and replaying it in a
    process that has not registered the tensor intrinsics (the CLI's) failed (the H200's BERT database)."""
    # K 36: no wgmma tile (A's rows are not 16-byte aligned), mma sketches (128 rows: a GEMM of 64 or fewer is the
    # GEMV template's)
    model, _, _ = CASES["gemm_bias_relu"](M=128, K=36, N=80)
    (kernel,) = _gemm_kernels(tmp_path, model, cuda)
    _, sketches = _sketch(kernel, cuda.target)
    sketch = sketches[0]
    assert hopper.CANDIDATES not in sketch.mod["main"].body.block.annotations
    assert any(i.kind.name == "Tensorize" for i in sketch.trace.insts)
    commit_record(tmp_path / "t.db", cuda, kernel, sketch.trace)
    script = ("import json, sys\n"
              "from tvmfuse.inspect import InspectConfig, inspect_database\n"
              "r = inspect_database(InspectConfig(db=sys.argv[1], target='cuda'))\n"
              "print(json.dumps([k['wgmma_config'] for k in r['kernels']]))\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "t.db")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [None]


def _head_split(batch=2, m=128, k=128, heads=2) -> onnx.ModelProto:
    """A projection whose epilogue splits heads: ([batch, m, k] @ [k, n] + bias) reshaped to
    [batch, m, heads, n / heads] and transposed to [batch, heads, m, n / heads] (BERT's Q/K/V)."""
    b = models._B(9)
    p = b.op("Add", [b.op("MatMul", ["x", b.w(k, k)]), b.const(b.rng.standard_normal(k) * 0.1)])
    r = b.op("Reshape", [p, models._int64(b, [batch, m, heads, k // heads])])
    y = b.op("Transpose", [r], perm=[0, 2, 1, 3])
    return models.to_fp16(b.model({"x": [batch, m, k]}, y, [batch, heads, m, k // heads]))


_KMAJOR = """
@T.prim_func(s_tir=True)
def main(x: T.Buffer((128, 128), "float16"), w: T.Buffer((192, 128), "float16"), bias: T.Buffer((192,), "float16"),
         y: T.Buffer((128, 192), "float16")):
    T.func_attr({"tirx.noalias": True})
    acc = T.sblock_alloc_buffer((128, 192))
    for i0, i1, k in T.grid(128, 192, 128):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i0, i1, k])
            with T.init():
                acc[vi, vj] = T.float32(0)
            acc[vi, vj] = acc[vi, vj] + T.Cast("float32", x[vi, vk]) * T.Cast("float32", w[vj, vk])
    for i0, i1 in T.grid(128, 192):
        with T.sblock("epilogue"):
            vi, vj = T.axis.remap("SS", [i0, i1])
            y[vi, vj] = T.max(T.Cast("float16", acc[vi, vj]) + bias[vj], T.float16(0))
"""


def _conv(n=2, cin=64, cout=64, hw=8, k=3, stride=1, pad=1, dilation=1) -> onnx.ModelProto:
    """Conv (+ bias) -> ReLU, NCHW in and out (the GPU plan runs it channels-last, the output transposed back)."""
    b = models._B(11)
    c = b.op("Conv", ["x", b.w(cout, cin, k, k, scale=0.1), b.const(b.rng.standard_normal(cout) * 0.1)],
             kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4, dilations=[dilation, dilation])
    out = (hw + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    return models.to_fp16(b.model({"x": [n, cin, hw, hw]}, b.op("Relu", [c]), [n, cout, out, out]))


def _conv1d(n=2, cin=64, cout=128, width=33, k=3, stride=2, pad=1) -> onnx.ModelProto:
    """A 1-D Conv (+ bias) -> GELU over frames, NCW in and out (Whisper's stem; the GPU plan runs it NWC)."""
    b = models._B(12)
    c = b.op("Conv", ["x", b.w(cout, cin, k, scale=0.1), b.const(b.rng.standard_normal(cout) * 0.1)],
             kernel_shape=[k], strides=[stride], pads=[pad] * 2)
    out = (width + 2 * pad - k) // stride + 1
    return models.to_fp16(b.model({"x": [n, cin, width]}, b.op("Relu", [c]), [n, cout, out]))


_CONVS = {   # (model, what the spec must say)
    "conv3x3_bn_relu": (lambda: models.to_fp16(models.conv_bn_relu(n=2, cin=64, cout=64, hw=8)),
                        dict(r=3, stride=(1, 1), pad=(1, 1), padded=True, tail=False)),
    "conv3x3_stride2_odd": (lambda: _conv(cin=64, cout=128, hw=9, stride=2),   # 2 x 5 x 5 = 50 rows: a tail
                            dict(r=3, stride=(2, 2), pad=(1, 1), padded=True, tail=True)),
    "conv1x1_stride2": (lambda: _conv(cin=128, cout=64, hw=16, k=1, stride=2, pad=0),
                        dict(r=1, stride=(2, 2), pad=(0, 0), padded=False, tail=False)),
    # K = 64: fewer steps than stages; a 1x1 stride-1 conv reads its input as a matrix: the template's GEMM
    "conv1x1_one_k_step": (lambda: _conv(cin=64, cout=64, hw=8, k=1, pad=0), dict(gemm=True, tail=False)),
    "conv1x1_7x7_gemm": (lambda: _conv(n=3, cin=128, cout=128, hw=7, k=1, pad=0),   # 147 rows: a partial tile
                         dict(gemm=True, tail=True)),
    "conv3x3_dilated": (lambda: _conv(n=1, cin=64, cout=64, hw=7, pad=2, dilation=2),
                        dict(r=3, stride=(1, 1), pad=(2, 2), dilation=(2, 2), padded=True, tail=True)),
    "conv_residual": (lambda: models.to_fp16(models.conv_bn_relu_residual(n=1, c=64, hw=8)),
                      dict(r=3, pad=(1, 1), padded=True, tail=False)),
    # 1-D convs, NWC: convs of height 1 (2 x 17 = 34 rows; Whisper's stem, 80 mel channels, 2 x 40 rows)
    "conv1d_stride2": (_conv1d, dict(h=1, oh=1, r=1, s=3, stride=(1, 2), pad=(0, 1), padded=True, tail=True)),
    "conv1d_80_channels": (lambda: _conv1d(cin=80, cout=64, width=40, stride=1),
                           dict(h=1, oh=1, r=1, s=3, c=80, stride=(1, 1), pad=(0, 1), padded=True, tail=True)),
}


@pytest.mark.parametrize("case", ["gemm_bias_relu", "gelu_residual", "head_split", "batched", "transposed_weight",
                                  "stem_padded", "patch_embed_padded", *_CONVS])
def test_the_kernels_addressing_and_epilogue_compute_the_fused_kernel(tmp_path, cuda, case):
    """wgmma cannot run here, so the kernel's scalar twin (the same spec, flat A/B addressing, batch folding,
    implicit-GEMM gather with its zero fill, row-tail predicates and epilogue store, one element per iteration)
    is built for the CPU and must equal the planner's PrimFunc on the same random inputs. A wrong spec, conv
    geometry, index inversion or epilogue translation shows up here."""
    import numpy as np

    if case == "transposed_weight":   # a weight stored [N, K] (K-major B): written as TIR, since the planner's
        func = hopper.parse(_KMAJOR)   # imports transpose constant weights to [K, N]
    else:
        model = {"gemm_bias_relu": lambda: CASES["gemm_bias_relu"](M=128, K=128, N=128)[0],
                 "gelu_residual": _linear_gelu_residual, "head_split": _head_split,
                 "batched": lambda: models.to_fp16(models.gemm_epilogue(m=64, k=128, n=64, batched=True)),
                 # a 3-channel 7x7 stride-2 stem: a conv on its channels padded to 8 (K 392: K steps span taps)
                 "stem_padded": lambda: _conv(n=2, cin=3, cout=64, hw=16, k=7, stride=2, pad=3),
                 # SegFormer's overlapping patch embedding: 7x7, stride 4, padding 3, on channels padded to 8
                 "patch_embed_padded": lambda: _conv(n=2, cin=3, cout=64, hw=16, k=7, stride=4, pad=3),
                 **{name: make for name, (make, _) in _CONVS.items()}}[case]()
        (kernel,) = _gemm_kernels(tmp_path, model, cuda)
        func = kernel.mod["main"]
    spec, info = hopper.analyze(func)
    assert hopper.configs(spec), spec   # the shapes are ones the template takes
    if case == "transposed_weight":
        assert spec.b_kmajor
    if case == "head_split":
        assert "// T.int64(64)" in info["store"] and "% T.int64(64)" in info["store"]
        assert info["reindexed"] and hopper.default_kernel(func, cuda.target) is not None
    elif case in ("stem_padded", "patch_embed_padded"):
        g, o = spec.conv, 8 if case == "stem_padded" else 4
        assert (spec.rows, spec.k, spec.n, g.c, g.r, g.pad) == (2 * o * o, 392, 64, 8, 7, (3, 3))
        assert g.stride == ((2, 2) if case == "stem_padded" else (4, 4))
    elif case not in _CONVS:
        assert not info["reindexed"]
    assert hopper.untuned_config(func, cuda.target) is not None
    if case in _CONVS and _CONVS[case][1].get("gemm"):
        assert spec.conv is None and spec.b_kmajor and (spec.rows % 64 != 0) == _CONVS[case][1]["tail"], spec
        assert hopper.configs(spec, tma=(1,))   # TMA loads A at any image size (a 7x7 conv had no pixel patches)
    elif case in _CONVS:
        want = dict(_CONVS[case][1])
        padded, tail = want.pop("padded"), want.pop("tail")
        g = spec.conv
        assert g is not None and spec.b_kmajor and {f: getattr(g, f) for f in want} == want, g
        assert g.padded == padded and (spec.rows % 64 != 0) == tail and spec.k == g.r * g.s * g.c
        assert hopper.GemmSpec.from_json(spec.to_json()) == spec
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert not np.isnan(outs[0]).any()
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 2e-3
    # the copies and descriptors land 16-byte aligned inside the shared tiles (a misaligned one only shows on
    # the GPU, as an illegal access), for a config of each tile shape and in-flight depth (the stage count only
    # multiplies the slot, raster orders the tiles); and the kernel itself builds for Hopper
    shapes = {(c.block_m, c.block_n, c.inflight): c for c in hopper.configs(spec)}
    for cfg in shapes.values():
        assert assert_shared_offsets_aligned(hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], cfg))
    kernel_func = hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], hopper.configs(spec)[0])
    src = tvm.compile(tvm.IRModule({"main": kernel_func.with_attr("global_symbol", "main")}),
                      target=SM90A).mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in src
    assert assert_copy_sources_disjoint(src) >= 4
    if case in ("conv3x3_bn_relu", "conv3x3_stride2_odd"):
        # the gather's predicates and zero fill keep the wgmmas asynchronous: with a batch in flight (f1) too,
        # whose main-loop copies zero-fill without a branch (a branch made ptxas serialize them, C7514)
        assert_ptxas_without_spills(src, tmp_path, "sm_90a")
        f1 = next(c for c in hopper.configs(spec) if c.inflight)
        src = tvm.compile(tvm.IRModule({"main": hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], f1)
                                        .with_attr("global_symbol", "main")}), target=SM90A).mod.imports[0].inspect_source()
        assert hopper.ZFILL in src and "if (" not in src[src.index("for (int ko = 0;"):src.index("wgmma_wait_group")]
        assert_ptxas_without_spills(src, tmp_path, "sm_90a")
        assert_copy_sources_disjoint(src)
        # 3 stages with a batch in flight (outside the space, but the template takes it): one tile ahead, so the
        # prologue copies A's tile before B's and A's zero-filling main-loop copies were its only later use; the
        # shared-memory planner then laid B over A (wrong results on the H200, 2026-11-30)
        s3 = dataclasses.replace(f1, stages=3)
        src = tvm.compile(tvm.IRModule({"main": hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], s3)
                                        .with_attr("global_symbol", "main")}), target=SM90A).mod.imports[0].inspect_source()
        assert assert_copy_sources_disjoint(src) >= 4


def _lm_head(m=128, k=200, n=51) -> onnx.ModelProto:
    """x @ W + b in fp16, W stored [K, N] with N odd: the planner stores it K-major (``plan.weights``)."""
    b = models._B(5)
    y = b.op("Add", [b.op("MatMul", ["x", b.w(k, n, scale=0.1)]), b.const(b.rng.standard_normal(n) * 0.1)])
    return models.to_fp16(b.model({"x": [m, k]}, y, [m, n]))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case", ["pointwise_conv", "odd_vocabulary", "conv3x3_24"])
def test_ragged_columns_and_k_take_the_cp_async_kernel(tmp_path, cuda, case):
    """MobileNet's and EfficientNet's 1x1 convs (24, 40, 96 channels), convs of 24 channels and a vocabulary of odd
    size fell back to dlight's CUDA-core schedule: no 64-wide tile divided their channels. They take a partial K
    step and a partial tile column (200 or 216 deep, 40 or 51 out here): cp.async configs only (TMA copies whole boxes),
    the scalar twin equal to the planner's kernel, and the kernel built for Hopper without spills, its main-loop
    copies zero-filling without a branch where a batch is in flight."""
    import numpy as np

    model = {"pointwise_conv": lambda: _conv(n=2, cin=200, cout=40, hw=8, k=1, pad=0), "odd_vocabulary": _lm_head,
             "conv3x3_24": lambda: _conv(n=2, cin=24, cout=40, hw=8, k=3, pad=1)}[case]()
    (kernel,) = _gemm_kernels(tmp_path, model, cuda)
    func = kernel.mod["main"]
    spec, info = hopper.analyze(func)
    want = {"pointwise_conv": (200, 40), "odd_vocabulary": (200, 51), "conv3x3_24": (216, 40)}[case]
    assert (spec.rows, spec.k, spec.n, spec.b_kmajor) == (128, *want, True)
    assert (spec.conv is not None) == (case == "conv3x3_24")
    assert hopper.configs(spec) and not hopper.configs(spec, tma=(1,))
    assert hopper.untuned_config(func, cuda.target) is not None
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 2e-3
    f1 = next(c for c in hopper.configs(spec) if c.inflight)
    # one narrow tile column of N rounded up (40: 48), where it is no standard width (51: 64 is)
    exact = [c for c in hopper.configs(spec) if c.block_n not in (64, 128, 256)][:1]
    assert bool(exact) == (spec.n == 40) and hopper.default_config(spec).block_n in (64, 128, 256)
    for cfg in (hopper.default_config(spec), f1, *exact):
        built = hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], cfg)
        assert assert_shared_offsets_aligned(built)
        src = tvm.compile(tvm.IRModule({"main": built.with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
        assert "wgmma.mma_async" in src
        assert_ptxas_without_spills(src, tmp_path, "sm_90a")
        if cfg.inflight:
            loop = src[src.index("for (int ko = 0;"):src.index("wgmma_wait_group")]
            assert hopper.ZFILL in src and "if (" not in loop


def _chunk_triples(chunk, count: int) -> set:
    """{(outer index, k index, element offset)} of a tile's 16-byte chunks under :func:`hopper.tile_layout`'s
    ``chunk`` (TVMScript expressions of the chunk number, evaluated here)."""
    env = {"T": type("T", (), {"bitwise_xor": staticmethod(lambda a, b: a ^ b)})}
    return {tuple(eval(e, env, {"c": c}) for e in chunk("c")) for c in range(count)}


def _tma_triples(load_list, box, outer_dim: int, k_dim: int, origin) -> set:
    """The same triples for the TMA loads ``load_list`` ((tile offset, [c0, c1, c2]) as numbers) of ``box``
    (innermost first), each landing 128-byte swizzled: box row ``r``'s 16-byte chunk ``c`` at chunk ``r * 8 +
    (c ^ r % 8)`` (the PTX ISA's 128-byte swizzle on a 1024-byte aligned tile). ``outer_dim`` / ``k_dim``: which
    tensor dimension is the tile's outer (rows or columns) and K index; ``origin`` their values at the tile's
    corner."""
    out = set()
    for off, coords in load_list:
        for r in range(box[1]):
            for c in range(box[0] // 8):
                at = list(coords)
                at[0] += c * 8
                at[1] += r
                out.add((at[outer_dim] - origin[0], at[k_dim] - origin[1], off + r * 64 + (c ^ r % 8) * 8))
    return out


@pytest.mark.parametrize("spec", [
    hopper.GemmSpec((), 1024, 512, 256, False, False, False),      # B stored [K, N]: one 64 x 64 box per 64 columns
    hopper.GemmSpec((), 1000, 512, 256, False, False, True),       # B stored [N, K]; rows end in a partial tile
    hopper.GemmSpec((4,), 192, 256, 128, True, True, True),        # batched A and B (attention-like)
    hopper.GemmSpec((2, 3), 64, 256, 128, True, False, False),     # a batch folded into the rows (shared weight)
], ids=["nmajor", "kmajor_tail", "batched", "folded"])
def test_tma_boxes_fill_the_tiles_the_wgmma_descriptors_read(spec):
    """The TMA kernel's loads cannot run here, so each tensor map and load is emulated: every element of each box
    must land where :func:`hopper.tile_layout` (the layout the wgmma descriptors read, checked on the H200 since
    the cp.async kernels) puts that element of the tile, for A and B of every TMA config's tile shape; the maps'
    dims and byte strides must be the row-major tensors'; and the stage's expected bytes must be the boxes'."""
    shapes = {(c.block_m, c.block_n): c for c in hopper.configs(spec, tma=(1,))}
    assert shapes and all(c.tma and not c.inflight for c in shapes.values())
    for cfg in shapes.values():
        maps = hopper.tma_maps(spec, cfg)
        pm, pn, j, bz = 1 if spec.rows > cfg.block_m else 0, spec.n // cfg.block_n - 1, spec.k // 64 - 1, 0
        if spec.grid_batch > 1:
            bz = spec.grid_batch - 1
        env = {"bz": bz}
        for name, m in maps.items():
            dims, strides = m["dims"], m["strides"]
            assert strides == [2 * dims[0], 2 * dims[0] * dims[1]]   # contiguous, innermost first
            assert max(m["box"][:2]) <= 256 and m["box"][0] * 2 == 128   # TMA's box limits, one swizzle row
            loads = [(off, [eval(c, {}, {**env, "pm": pm, "pn": pn, "j": j}) for c in coords])
                     for off, coords in m["coords"]("pm", "pn", "j")]
            assert all(c[2] == (bz if dims[2] > 1 else 0) for _, c in loads)
            if name == "a":
                want = _chunk_triples(hopper.tile_layout(128, True, cfg.block_m, 64)[0], cfg.block_m * 8)
                got = _tma_triples(loads, m["box"], 1, 0, (pm * cfg.block_m, j * 64))
                rows = spec.m if spec.a_batched and not spec.fold_batch else spec.rows
                assert dims[:2] == [spec.k, rows]
            else:
                want = _chunk_triples(hopper.tile_layout(128, spec.b_kmajor, cfg.block_n, 64)[0], cfg.block_n * 8)
                outer, k = (1, 0) if spec.b_kmajor else (0, 1)
                got = _tma_triples(loads, m["box"], outer, k, (pn * cfg.block_n, j * 64))
                assert dims[:2] == ([spec.k, spec.n] if spec.b_kmajor else [spec.n, spec.k])
            assert got == want, (name, cfg.name)
        boxes = sum(math.prod(m["box"]) * len(m["coords"]("0", "0", "0")) for m in maps.values())
        assert boxes == cfg.block_k * (cfg.block_m + cfg.block_n)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg,b_kmajor,mnk", [("g2 m1 n256 k64 s4 r8 z128 f0 t1", False, (1024, 1024, 1024)),
                                              ("g2 m2 n128 k64 s4 r1 z128 f0 t1", True, (1024, 1024, 1024)),
                                              ("g1 m1 n128 k64 s3 r1 z128 f0 t1", False, (1024, 1024, 1024)),
                                              ("g2 m1 n256 k64 s4 r8 z128 f0 t1 p1", True, (4000, 2048, 512))])
def test_tma_kernels_build_for_sm90a_with_their_maps_and_shared_memory(tmp_path, cfg, b_kmajor, mnk):
    """The TMA kernel as built: the host encodes both tensor maps and passes them by value; the loads are TMA
    (no cp.async) completing on mbarriers; no block-wide barrier after the mbarriers' setup; the launch asks for
    all the shared memory the stages and mbarriers take (TVM sized the buffer to its highest plain access and,
    with none, gave the launch no dynamic shared memory); two computing warpgroups take the producer's
    registers; no spills and asynchronous wgmmas. A persistent kernel launches one block per SM, and its blocks
    walk 1 or 2 of the 256 tiles (the last tile row partial)."""
    m, n, k = mnk
    spec = hopper.GemmSpec((), m, n, k, False, False, b_kmajor)
    c = hopper.parse_config(cfg)
    assert c in hopper.configs(spec, tma=(0, 1), persistent=(0, 1))
    decls = [f"a: T.Buffer(({m}, {k}), 'float16')", f"b: T.Buffer({(n, k) if b_kmajor else (k, n)}, 'float16')",
             f"c: T.Buffer(({m}, {n}), 'float16')"]
    func = hopper.parse(hopper.gemm_source(spec, c, decls, "a", "b", "c[{row}, {col}] = T.Cast('float16', {acc})"))
    tiles = -(-m // c.block_m) * (n // c.block_n)
    assert f'thread_binding({min(tiles, hopper.SMS) if c.persistent else tiles}, thread="blockIdx.x")' in func.script()
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A)
    src, host = lib.mod.imports[0].inspect_source(), lib.mod.inspect_source()
    kernel_def = next(ln for ln in src.splitlines() if ln.startswith('extern "C" __global__') and ln.endswith("{"))
    assert kernel_def.count("const __grid_constant__ CUtensorMap") == 2 and "runtime.cuTensorMapEncodeTiled" in host
    assert "cp.async.bulk.tensor.3d" in src and "cp.async.cg" not in src and "mbarrier.try_wait.parity" in src
    assert src.count("__syncthreads()") == 1
    assert f"__launch_bounds__({c.threads})" in src and c.threads == 128 * (c.warpgroups + 1)
    assert re.search(rf"\b{c.shared_bytes()}\b", host), c.shared_bytes()
    assert ("setmaxnreg.inc" in src) == (c.warpgroups == 2)
    assert ("for (int it = 0; it < 2;" in src) == bool(c.persistent)
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def _conv_geometry(n, hw, c, k=3, pad=1, dilation=1) -> hopper.ConvGeometry:
    out = hw + 2 * pad - dilation * (k - 1)
    return hopper.ConvGeometry(n, hw, hw, c, out, out, k, k, (1, 1), (pad, pad), (dilation, dilation))


@pytest.mark.parametrize("geometry,f,cfg", [
    ((1, 30, 64), 64, "g2 m1 n64 k64 s4 r1 z128 f0 t1"),     # 2 x 32 patches: the last column idle; 15 patches, so
    #                                                           the last block's second patch is past the image
    ((2, 16, 128, 3, 2, 2), 64, "g2 m2 n64 k64 s3 r1 z128 f0 t1"),   # 8 x 8 patches, dilation 2, two steps a tap
], ids=["partial_patches", "dilated"])
def test_tma_conv_loads_and_stores_compute_the_conv(geometry, f, cfg):
    """The TMA conv cannot run here, so its data path is emulated from the generated expressions: each block's A
    tile is filled from the input by its tensor map's boxes (the coordinates evaluated from :func:`hopper.tma_maps`'
    text; outside the input, zeros, as TMA fills), B's from the filter likewise, the tiles multiplied, each thread's
    accumulators taken in wgmma's fragment layout, and the kernel's epilogue (its TVMScript, executed as Python)
    stores them. The output must be the conv, and nothing outside it written twice or left unwritten."""
    import numpy as np

    g = _conv_geometry(*geometry)
    spec = hopper.GemmSpec((), g.n * g.oh * g.ow, f, g.r * g.s * g.c, False, False, True, conv=g)
    c = hopper.parse_config(cfg)
    assert c in hopper.configs(spec, tma=(1,), stages=(3, 4), raster=(1,))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((g.n, g.h, g.w, g.c))
    w = rng.standard_normal((f, g.r, g.s, g.c))
    ref = np.zeros((g.n, g.oh, g.ow, f))
    (dh, dw), (pt, pl) = g.dilation, g.pad
    xp = np.pad(x, ((0, 0), (pt, pt), (pl, pl), (0, 0)))
    for r in range(g.r):
        for s in range(g.s):
            ref += xp[:, r * dh:r * dh + g.oh, s * dw:s * dw + g.ow, :] @ w[:, r, s, :].T
    maps = hopper.tma_maps(spec, c)
    a_map, b_map = maps["a"], maps["b"]
    assert a_map["dims"] == [g.c, g.w, g.h, g.n] and a_map["box"][0] == 64 and a_map["box"][3] == 1
    bw, bh = a_map["box"][1:3]
    wf = w.reshape(f, -1)
    out = np.full((spec.rows, f), np.nan)
    writes = np.zeros((spec.rows, f), int)
    _, stores = hopper.mma._mma_and_store(spec, c, "out[{row}, {col}] = {acc}", "pm", "pn", 0)

    class T:   # what the epilogue's predicates call
        And = staticmethod(lambda a, b: a and b)

    tiles_m = hopper.config.tiles_m(spec, c)
    for pm in range(tiles_m):
        for pn in range(f // c.block_n):
            acc = np.zeros((c.block_m, c.block_n))
            for j in range(spec.k // 64):
                a = np.zeros((c.block_m, 64))
                for off, coords in a_map["coords"]("pm", "pn", "j"):
                    c0, c1, c2, c3 = (eval(e, {}, {"pm": pm, "pn": pn, "j": j}) for e in coords)
                    for hh in range(bh):
                        for ww in range(bw):
                            y, xx = c2 + hh, c1 + ww
                            if 0 <= c3 < g.n and 0 <= y < g.h and 0 <= xx < g.w:
                                a[off // (64 * 64) * 64 + hh * bw + ww] = x[c3, y, xx, c0:c0 + 64]
                ((_, (k0, n0, _)),) = [(o, [eval(e, {}, {"pm": pm, "pn": pn, "j": j}) for e in cs])
                                       for o, cs in b_map["coords"]("pm", "pn", "j")]
                acc += a @ wf[n0:n0 + c.block_n, k0:k0 + 64].T
            def store(key, value):
                out[key] = value
                writes[key] += 1
            _run_stores(stores, acc, c, pm, pn, store, T)
    assert (writes == 1).all(), (writes == 0).sum()
    np.testing.assert_allclose(out, ref.reshape(spec.rows, f), rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_k_split_is_offered_where_tiles_leave_sms_idle_and_builds_two_kernels(tmp_path):
    """A skinny GEMM (64 x 11008 x 4096: 43-172 tiles on 132 SMs) is offered K splits up to two blocks an SM,
    each at least two K steps; a GEMM that fills the SMs, a TMA config and a batched GEMM are not. The split
    kernel: block kz reads A's and B's K from kz * per steps (A at kz * 2048 elements, B at kz * 2048 rows), stores
    fp32 partials, and a second kernel sums them and applies the epilogue; built for sm_90a without spills."""
    from tvmfuse.kernels.wgmma.config import configs, k_steps, splits, tiles_m, tiles_n

    skinny = hopper.GemmSpec((), 64, 11008, 4096, False, False, False)
    offered = [c for c in configs(skinny, staged=(0, 1), split=(1, 2, 3, 4, 6, 8)) if c.split > 1]
    # 86 tiles of 128 columns split 2 or 3 ways (3 x 86 = 258 <= 264), 43 of 256 up to 6; never 8
    assert {c.split for c in offered} == {2, 3, 4, 6}
    for c in offered:
        assert not c.tma and tiles_m(skinny, c) * tiles_n(skinny, c) * c.split <= 2 * 132
        assert -(-k_steps(skinny, c) // c.split) >= max(2, c.stages - 1)
    big = hopper.GemmSpec((), 4096, 4096, 4096, False, False, False)
    assert not any(c.split > 1 for c in configs(big, split=(1, 2, 4)))
    batched = hopper.GemmSpec((4,), 64, 1024, 4096, True, True, False)
    assert not any(c.split > 1 for c in configs(batched, split=(1, 2, 4)))
    geo = hopper.ConvGeometry(1, 7, 7, 512, 7, 7, 3, 3, (1, 1), (1, 1), (1, 1))
    conv = hopper.GemmSpec((), 49, 512, 4608, False, False, True, geo)
    assert all(splits(conv, c, 2) for c in configs(conv))   # a conv's cp.async configs split as a GEMM's
    cfg = hopper.parse_config("g1 m1 n128 k64 s4 r1 z128 f1 e1 d2")
    assert cfg in offered and cfg.name.endswith(" d2")
    decls = ["a: T.Buffer((64, 4096), 'float16')", "b: T.Buffer((4096, 11008), 'float16')",
             "bias: T.Buffer((11008,), 'float16')", "c: T.Buffer((64, 11008), 'float16')"]
    store = "c[{row}, {col}] = T.Cast('float16', T.max({acc} + T.Cast('float32', bias[{col}]), T.float32(0)))"
    func = hopper.parse(hopper.gemm_source(skinny, cfg, decls, "a", "b", store))
    exe = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A)
    # the host allocates the partials, nothing else (a `bz = 0` the kernel once assigned was a device buffer the host
    # wrote: a segfault at launch on the H100)
    host = exe.mod.inspect_source("ll")
    assert len(re.findall(r"= tail call ptr %\d+\(i32 2, i32 %dev_id, i64 (\d+)", host)) == 1
    assert re.search(rf"%part = tail call ptr %\d+\(i32 2, i32 %dev_id, i64 {2 * 64 * 11008 * 4},", host)
    src = exe.mod.imports[0].inspect_source()
    assert src.count("__global__ void") == 4   # two kernels, each declared and defined
    assert "((int)blockIdx.y) * 2048)" in src and f"((int)blockIdx.y) * {2048 * 11008})" in src
    total = src[src.index("main_kernel_1(half"):]
    assert "part_ptr" in total and "bias_ptr" in total and "max(" in total
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")
    with pytest.raises(ValueError, match="K split"):
        hopper.gemm_source(skinny, cfg, decls, "a", "b", "c[{row}, {col}] = T.Cast('float16', {acc0} * {acc1})")


def test_a_skinny_gemm_defaults_to_the_k_split_that_fills_the_sms_once():
    """17-64 rows against a long K: 128 x 256 tiles by cp.async (4 stages, a batch in flight) split over the most
    blocks of one wave, each split at least 5 K steps; none past 64 rows, for batched or TF32 GEMMs, where a split
    would leave under 5 steps or fill under half the SMs, or where the caller says no split (a gated epilogue).
    Other fp16 GEMMs and convs whose tiles leave SMs idle split their default's K over up to two blocks an SM."""
    from tvmfuse.kernels.wgmma.config import default_config, skinny_config

    def pick(m, k, n, **kw):
        return default_config(hopper.GemmSpec((), m, n, k, False, False, False), **kw)

    base = "g2 m1 n256 k64 s4 r1 z128 f1"
    assert pick(32, 4096, 11008).name == base + " d3"      # 43 tiles x 3 = 129 blocks on 132 SMs
    assert pick(64, 4096, 4096).name == base + " d8"       # 16 x 8 = 128, 8 K steps a split
    assert pick(20, 2048, 5632).name == base + " d6"       # 22 x 6 = 132, 5.3 K steps a split (d8: 4)
    assert pick(24, 5120, 13824).name == base + " d2"      # 54 tiles
    # 2 tiles x 6: under half the SMs, no skinny split; the small-grid rule's 64 x 64 tiles split over the idle SMs
    assert pick(64, 2048, 512).name == "g1 m1 n64 k64 s5 r1 z128 f1 e1 d6"   # 8 tiles x 6, 5.3 K steps a split
    assert pick(32, 4096, 11008, sm_count=66).split == 1   # 43 x 2 past one wave of 66 SMs: the small-grid rule
    assert pick(32, 4096, 11008, split=False).split == 1
    assert pick(65, 4096, 4096).split == 1 and pick(33, 384, 768).split == 1   # 65 rows; 6 K steps
    assert pick(32, 4096, 32000).split == 1                # 125 tiles fill the SMs already
    assert skinny_config(hopper.GemmSpec((4,), 32, 4096, 4096, True, True, False)) is None
    assert skinny_config(hopper.GemmSpec((), 32, 4096, 4096, False, False, True, dtype="float32")) is None

    def conv(b, c, hw, stride=1):
        o = (hw + 2 - 3) // stride + 1
        geo = hopper.ConvGeometry(b, hw, hw, c, o, o, 3, 3, (stride, stride), (1, 1), (1, 1))
        return default_config(hopper.GemmSpec((), b * o * o, c, 9 * c, False, False, True, geo))

    assert conv(32, 512, 7).name == "g1 m1 n128 k64 s3 r1 z128 f0 d2"   # 100 tiles x 2 <= 2 an SM
    assert conv(32, 512, 14, stride=2).split == 2
    assert conv(32, 256, 14).split == 1 and conv(32, 128, 28).split == 1   # 196 tiles; TMA


def test_a_skinny_planner_gemm_runs_wgmmas_k_split_untuned_and_16_rows_the_gemv(tmp_path, cuda):
    """An untuned Hopper build of a GEMM of 32 rows (2048 -> 4096) runs the wgmma template's K split (the GEMV
    template declines it there, and its traced default in the GEMM space is that split); at 16 rows the GEMV's."""
    from tvmfuse.kernels import default_schedule, gemv, untuned_kernel

    space = load_spaces("cuda").for_class("gemm")
    for m, source in ((32, "wgmma-default"), (16, "gemv-default")):
        (kernel,) = _gemm_kernels(tmp_path, CASES["gemm_bias_relu"](M=m, K=2048, N=4096)[0], cuda)
        func = kernel.mod["main"]
        assert untuned_kernel(func, cuda.target)[0] == source
        assert (gemv.untuned(func, cuda.target) is None) == (m == 32)
        assert hopper.untuned_config(func, cuda.target)[2].name == "g2 m1 n256 k64 s4 r1 z128 f1 d6"
        if m == 32:
            sch = default_schedule(kernel.mod, cuda.target, space)
            assert hopper.annotated(sch.mod["main"])[2].name == "g2 m1 n256 k64 s4 r1 z128 f1 d6"


def test_the_search_reaches_a_k_split_and_the_builder_expands_it(tmp_path, cuda):
    """A planner GEMM of 32 rows against a 2048 x 1024 weight (8 tile columns on 132 SMs): the wgmma sketch's
    candidates include K splits, a trace whose decision draws one expands to the split kernel (its blocks along y,
    the partials' buffer, the sum), which MetaSchedule's builder compiles; a GEMM that fills the SMs gets none."""
    (kernel,) = _gemm_kernels(tmp_path, CASES["gemm_bias_relu"](M=32, K=2048, N=1024)[0], cuda)
    _, sketches = _sketch(kernel, cuda.target)
    sketch = next(s for s in sketches if hopper.CANDIDATES in s.mod["main"].body.block.annotations)
    names = str(sketch.mod["main"].body.block.annotations[hopper.CANDIDATES]).split(";")
    assert {hopper.parse_config(n).split for n in names} >= {1, 2, 4, 8}
    for seed in range(1, 64):   # decisions resampled until one draws a split
        sch = tvm.s_tir.Schedule(kernel.mod, seed=seed)
        tvm.s_tir.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        cfg = hopper.parse_config(names[int(sch.mod["main"].body.block.annotations[hopper.ANNOTATION])])
        if cfg.split > 1:
            break
    assert cfg.split > 1
    text = expand(sch.mod)["main"].script()
    assert f'T.thread_binding({cfg.split}, thread="blockIdx.y")' in text and "part" in text
    lib = fast_build(sch.mod, cuda.target, None)
    assert lib.imports[0].inspect_source().count("__global__ void") == 4
    (big,) = _gemm_kernels(tmp_path, CASES["gemm_bias_relu"](M=4096, K=512, N=4096)[0], cuda)
    _, sketches = _sketch(big, cuda.target)
    names = [n for s in sketches if hopper.CANDIDATES in s.mod["main"].body.block.annotations
             for n in str(s.mod["main"].body.block.annotations[hopper.CANDIDATES]).split(";")]
    assert names and not any(hopper.parse_config(n).split > 1 for n in names)
