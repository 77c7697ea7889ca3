"""The GEMV template: which planner kernels it takes (GEMMs of at most 16 rows, fp16 or fp32, a [K, N] or [N, K]
weight) and which it declines; its kernels against the planner's own PrimFunc on the CPU (the emulation, the same
index arithmetic with the threads as loops) across configs, K splits and tails; its CUDA kernels built by nvcc
with 16-byte loads and no spills; the space's sketch and an untuned CUDA build running it. (Built here, not run:
benchmarks/gemv_gpu.py times and checks them on the H200.)"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import EMULATE, cuda_source, ptxas_logs  # noqa: E402
from tvmfuse._tvm import ms, tvm  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import expand, gemv, registry  # noqa: E402
from tvmfuse.kernels.wgmma.analysis import _param_buffers  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.tune import extract_kernels  # noqa: E402
from tvmfuse.tune.spaces import classify, load_spaces, select_space  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _matmul_model(m, k, n, *, act="Relu", dtype=TensorProto.FLOAT16, lead=()) -> onnx.ModelProto:
    """x[*lead, m, k] @ W[K, N] + bias (+ ReLU): ONNX MatMul, W an initializer."""
    rng = np.random.default_rng(m * 1000 + n)
    np_t = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np_t)
    bias = rng.standard_normal(n).astype(np_t)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")]
    inputs = [helper.make_tensor_value_info("x", dtype, [*lead, m, k])]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["h"])]
    if act == "Relu":
        nodes.append(helper.make_node("Relu", ["h"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["h"], ["y"]))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", dtype, [*lead, m, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _nk_func(m, k, n, dtype="float16"):
    """A planner-shaped GEMM whose weight is stored [N, K] (a Linear's; the frontend folds a constant Gemm
    transB weight into a [K, N] copy, so no small ONNX model yields one): the multiply-accumulate block,
    then bias + ReLU."""
    from tvm import te

    x, w, b = te.placeholder((m, k), dtype, "x"), te.placeholder((n, k), dtype, "w"), te.placeholder((n,), dtype, "b")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype("float32") * w[j, r].astype("float32"), axis=r),
                   name="matmul")
    y = te.compute((m, n), lambda i, j: te.max(c[i, j].astype(dtype) + b[j], tvm.tirx.const(0, dtype)), name="relu")
    return te.create_prim_func([x, w, b, y])


def _kernels(tmp_path, model, cuda, cls=("gemm",)):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    return fused, [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) in cls]


def _one(tmp_path, model, cuda):
    _, ks = _kernels(tmp_path, model, cuda)
    assert len(ks) == 1
    return ks[0].mod["main"]


def _run_llvm(func, args):
    lib = tvm.compile(tvm.IRModule({"main": func}), target=EMULATE)
    nd = [tvm.runtime.tensor(a, tvm.cpu()) for a in args]
    lib["main"](*nd)
    return nd[-1].numpy().astype(np.float64)


def _check(func, cfgs):
    """Each config's emulated kernel against the planner's PrimFunc, both built for llvm, on the same inputs."""
    spec, info = gemv.analyze(func)
    rng = np.random.default_rng(0)
    args = [(rng.standard_normal([int(d) for d in b.shape]) * 0.5).astype(str(b.dtype)) for b in _param_buffers(func)]
    ref = _run_llvm(func, [a.copy() for a in args])
    tol = 2e-3 if info["dtype"] == "float16" else 1e-5
    for cfg in cfgs:
        got = _run_llvm(gemv.kernel_for(func, spec, info, cfg, emulate=True), [a.copy() for a in args])
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < tol, (cfg.name, err)


def test_fits_small_m_gemms_in_both_layouts_and_dtypes(tmp_path, cuda):
    f = _one(tmp_path, _matmul_model(3, 256, 700), cuda)
    spec, info = gemv.analyze(f)
    assert (spec.rows, spec.n, spec.k, spec.b_kmajor, info["dtype"]) == (3, 700, 256, False, "float16")
    assert "T.max(" in info["store"]   # bias + ReLU applied to the sum, at the one store
    assert registry()[1].name == "gemv" and registry()[1].fits(f, cuda.target) is None
    spec, info = gemv.analyze(_nk_func(5, 96, 40))
    assert spec.b_kmajor and (spec.rows, spec.n, spec.k) == (5, 40, 96)
    spec, info = gemv.analyze(_one(tmp_path, _matmul_model(2, 64, 48, dtype=TensorProto.FLOAT), cuda))
    assert info["dtype"] == "float32"
    # a shared weight: the leading dims fold into M (2 x 8 = 16 rows: still in)
    spec, _ = gemv.analyze(_one(tmp_path, _matmul_model(8, 64, 48, lead=(2,)), cuda))
    assert spec.rows == 16


def test_declines_m17_without_tensor_cores_m65_convs_and_non_matmuls(tmp_path, cuda):
    """Past 16 rows only an fp16 [K, N] weight (the tensor-core kernel, up to 64 rows) and a small fp32 GEMM: M = 17
    declined in fp32 where its outputs pass half a wave of dlight's tiles and for an fp16 [N, K] weight, M = 65 in
    fp16; M = 17 and 64 of an fp16 [K, N] weight taken, every row in one block."""
    tmpl = next(t for t in registry() if t.name == "gemv")
    for f in (_one(tmp_path, _matmul_model(17, 64, 8192, dtype=TensorProto.FLOAT), cuda), _nk_func(17, 64, 48),
              _one(tmp_path, _matmul_model(65, 64, 48), cuda)):
        assert "M = " in tmpl.fits(f, cuda.target)
        assert tmpl.default_kernel(f, cuda.target) is None and tmpl.configs(f, cuda.target) == []
    for m in (17, 64):
        f = _one(tmp_path, _matmul_model(m, 64, 48), cuda)
        assert tmpl.fits(f, cuda.target) is None
        d = gemv.untuned(f, cuda.target)[2]
        assert d.mma and d.rows == m, d.name
        assert all(c.mma for c in tmpl.configs(f, cuda.target) if c.rows > 16)
    _, (conv,) = _kernels(tmp_path, models.to_fp16(models.conv_bn_relu(n=1, cin=64, cout=64, hw=8)), cuda, ("conv",))
    assert tmpl.fits(conv.mod["main"], cuda.target) is not None
    _, (norm,) = _kernels(tmp_path, models.to_fp16(models.add_norm("LayerNorm", m=4, n=96)), cuda,
                          ("row_reduction",))
    assert tmpl.fits(norm.mod["main"], cuda.target) is not None
    assert "cuda" in tmpl.fits(f, tvm.target.Target("llvm"))


def test_configs_follow_the_shape():
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    spec = GemmSpec((), 3, 700, 256, False, False, False)
    cfgs = gemv.configs(spec, "float16")
    assert cfgs and all(700 % c.lanes == 0 and c.rows <= 3 for c in cfgs)   # 700 columns: 4-lane vectors at most
    assert all(gemv.register_words(spec, c, "float16") <= 160 for c in cfgs)
    for m, k, n in [(1, 4096, 11008), (16, 4096, 11008), (1, 4096, 4096), (64, 4096, 4096)]:
        for kmajor in (False, True):
            s = GemmSpec((), m, n, k, False, False, kmajor)
            d = gemv.default_config(s, "float16")
            assert d in gemv.configs(s, "float16") and d.lanes >= 4   # 8- or 16-byte vectors
            assert gemv.parse_config(d.name) == d


def test_defaults_read_the_weight_once_for_every_m_up_to_16():
    """Every row of M in the block that reads a weight tile (one row tile: the weight leaves HBM once), a config
    the space file offers, its cost within the rule's tie of the cheapest of the space's one-pass configs; both layouts, shapes nobody
    tuned for, and a GPU of another SM count."""
    from tvmfuse.kernels.gemv.config import _MMA_THREADS, _MMA_UNROLL, streamed_bytes
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    space = load_spaces("cuda").for_class("gemm")
    for m in range(1, 17):
        for k, n in [(4096, 11008), (2880, 5120), (1000, 1500)]:
            for kmajor in (False, True):
                s = GemmSpec((), m, n, k, False, False, kmajor)
                offered = gemv.space_configs(s, "float16", space)
                for sms in (132, 108) if m % 3 == 1 else (132,):   # the other GPU at a third of the M's
                    d = gemv.default_config(s, "float16", sms)
                    assert -(-m // d.rows) == 1, (m, k, n, kmajor, d.name)
                    assert d in offered, (m, k, n, kmajor, d.name)
                    # against the one-pass configs whose rows of the weight fill whole bursts, as the rule's do (a
                    # tensor-core warp reads 8 vectors of a row)
                    rivals = [c for c in offered if c.rows == m and (kmajor or (8 if c.mma else c.threads_n)
                                                                     * c.lanes * 2 >= 64)]
                    # (within the rule's 10% tie, among the block shapes its tensor-core default takes)
                    rivals = [c for c in rivals if not c.mma or (c.threads in _MMA_THREADS and c.unroll in _MMA_UNROLL)]
                    cost = streamed_bytes(s, d, "float16", sms)
                    assert all(cost <= 1.1 * streamed_bytes(s, c, "float16", sms) for c in rivals), d.name
    for m in (17, 40, 64):   # an fp16 [K, N] weight past 16 rows: the tensor-core kernel, every row in one block
        for k, n in [(4096, 11008), (1000, 1500)]:
            s = GemmSpec((), m, n, k, False, False, False)
            d = gemv.default_config(s, "float16")
            assert d.mma and d.rows == m and d in gemv.space_configs(s, "float16", space), (m, k, n, d.name)


def test_register_estimate_tracks_ptxas(tmp_path, cuda):
    """The default rule's register estimate (occupancy, bytes in flight) against ptxas on defaults of 1, 5 and 16
    rows and on tensor-core ring configs of 1 and 16 rows (ptxas holds one or two steps of a ring's reads, as it
    chooses): never below ptxas by more than one 8-register allocation unit (the rule's occupancy would then be
    optimistic), and at most twice it ([N, K]: ptxas keeps fewer of x's vectors live than the estimate)."""
    from tvmfuse.kernels.gemv.config import registers

    C = gemv.GemvConfig
    rings = {16: [C(8, 128, 1, 2, 16, 2, 1, 2), C(4, 128, 4, 1, 16, 2, 1, 4), C(8, 64, 1, 1, 16, 4, 1, 2),
                  C(4, 128, 1, 1, 16, 4, 1, 4)],
             1: [C(8, 128, 1, 1, 1, 1, 1, 4), C(4, 128, 1, 1, 1, 2, 1, 4), C(8, 128, 1, 1, 1, 2, 1, 2)]}
    cases = []
    for m, f in ((16, _one(tmp_path, _matmul_model(16, 512, 1024), cuda)),
                 (5, _one(tmp_path, _matmul_model(5, 512, 1024), cuda)),
                 (1, _one(tmp_path, _matmul_model(1, 512, 1024), cuda)), (0, _nk_func(16, 512, 1024))):
        spec, info = gemv.analyze(f)
        for cfg in [gemv.default_config(spec, info["dtype"])] + rings.get(m, []):
            cases.append((spec, cfg, info["dtype"], _cuda_of(f, spec, info, cfg, cuda.target)))
    for (spec, cfg, dtype, _), log in zip(cases, _nvcc_all([c[3] for c in cases], tmp_path)):
        used = max(int(r) for r in re.findall(r"Used (\d+) registers", log))
        assert used - 8 <= registers(spec, cfg, dtype) <= 2 * used, (cfg.name, used)


def test_kernels_match_the_planners_function_across_configs(tmp_path, cuda):
    """[K, N]: 3 rows (a block of 2 leaves a row tail), 700 columns (a tail block), K 200 (not a multiple of
    the K step), splits that leave the last blocks short; [N, K] likewise; fp32."""
    C = gemv.GemvConfig
    f = _one(tmp_path, _matmul_model(3, 200, 700), cuda)
    _check(f, [gemv.default_config(*_spec_dtype(f)), C(4, 256, 32, 1, 3, 4), C(4, 128, 8, 2, 2, 2),
               C(2, 64, 32, 3, 1, 8), C(4, 256, 16, 4, 3, 1)])
    f = _nk_func(5, 328, 37)
    _check(f, [gemv.default_config(*_spec_dtype(f)), C(8, 128, 2, 1, 5, 1), C(4, 64, 3, 2, 2, 2), C(2, 256, 1, 1, 4, 1)])
    f = _one(tmp_path, _matmul_model(2, 96, 48, dtype=TensorProto.FLOAT, act="none"), cuda)
    _check(f, [gemv.default_config(*_spec_dtype(f)), C(4, 64, 4, 2, 2, 2)])


def test_all_rows_in_one_block_match_across_layouts_tails_and_splits(tmp_path, cuda):
    """M = 3, 5 and 16 held whole by each block (the default's one pass over the weight): [K, N] with N and K off
    every vector and step (100 and 36 columns: tail blocks; K 200 and 330), [N, K] with 37 and 21 columns and K
    off the warp's step, with and without a K split (3: the last split blocks short), the defaults among them."""
    C = gemv.GemvConfig
    for m, k, n in [(16, 200, 100), (5, 330, 36), (3, 200, 100)]:
        f = _one(tmp_path, _matmul_model(m, k, n), cuda)
        d = gemv.default_config(*_spec_dtype(f))
        assert d.rows == m
        _check(f, [d, C(4, 128, 8, 1, m, 4), C(4, 256, 4, 3, m, 8), C(2, 64, 32, 2, m, 2)])
    for m, k, n in [(16, 328, 37), (5, 600, 21), (3, 200, 37)]:
        f = _nk_func(m, k, n)
        d = gemv.default_config(*_spec_dtype(f))
        assert d.rows == m
        _check(f, [d, C(8, 128, 2, 1, m, 1), C(4, 64, 4, 2, m, 1), C(2, 256, 1, 3, m, 2)])


def test_mma_fragment_layouts_are_ptxs_and_tvms():
    """The fragment maps the emulated mma reads its operands through (source.MMA_A / MMA_B / MMA_C: matrix element ->
    lane, element of the lane's fragment) against the PTX ISA's table for m16n8k16 .f16 (groupID = lane >> 2,
    threadID_in_group = lane % 4; a_i: row groupID + 8 for i in {2, 3, 6, 7}, column 2 tig + (i & 1) + 8 for i >= 4;
    b_i: row 2 tig + (i & 1) + 8 for i >= 2, column groupID; c_i: row groupID + 8 for i >= 2, column 2 tig +
    (i & 1)) and against TVM's own ldmatrix / mma layout (the 16 x 16 map its tensorized m16n8k16 schedules use,
    whose first n8 half holds B's and C's elements 0, 1, 4, 5 / 0..3)."""
    import ast
    import importlib.util

    from tvmfuse.kernels.gemv.source import MMA_A, MMA_B, MMA_C

    # TVM's function read from its source (importing the module registers every tensor intrinsic: a minute here)
    origin = importlib.util.find_spec("tvm.s_tir.tensor_intrin.cuda").origin
    (fn,) = [n for n in ast.parse(Path(origin).read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name == "shared_16x16_to_ldmatrix_32x8_layout"]
    scope: dict = {}
    exec(compile(ast.Module([fn], []), origin, "exec"), scope)   # noqa: S102 - TVM's own two-line function
    tvm_map = scope[fn.name]

    def at(maps, **kw):
        return tuple(eval(x.format(**kw)) for x in maps)   # noqa: S307 - our own integer expressions

    for lane in range(32):
        g, tig = lane >> 2, lane % 4
        for i in range(8):
            assert at(MMA_A, row=g + 8 * (i in (2, 3, 6, 7)), k=2 * tig + (i & 1) + 8 * (i >= 4)) == (lane, i)
        for i in range(4):
            assert at(MMA_B, col=g, k=2 * tig + (i & 1) + 8 * (i >= 2)) == (lane, i)
            assert at(MMA_C, row=g + 8 * (i >= 2), col=2 * tig + (i & 1)) == (lane, i)
    half = {0: 0, 1: 1, 4: 2, 5: 3}   # TVM's 16 x 16 B (as N x K) and C: the first n8 tile's elements
    for r in range(16):
        for c in range(16):
            assert at(MMA_A, row=r, k=c) == tuple(int(v) for v in tvm_map(r, c))
            if c < 8:
                lane, e = (int(v) for v in tvm_map(c, r))
                assert at(MMA_B, col=c, k=r) == (lane, half[e])
                lane, e = (int(v) for v in tvm_map(r, c))
                assert at(MMA_C, row=r, col=c) == (lane, e)


def test_mma_kernels_match_the_planners_function_with_tails(tmp_path, cuda):
    """The tensor-core kernel emulated (its threads as loops, each mma computed from the operands the fragment
    layouts put in each lane) against the planner's PrimFunc: M = 1, 3, 8 and 16 (one n8 tile, a padded one, two),
    odd K (its last k16 step masked, in the last warp along K) and N off the warp's 8 x lanes columns (tail warps
    past N), warps along K summed through shared memory, K splits (the last blocks short), fewer rows a block than M."""
    C = gemv.GemvConfig
    cases = [((1, 203, 104), [C(8, 64, 1, 1, 1, 1, 1), C(4, 128, 2, 2, 1, 2, 1)]),
             ((3, 333, 100), [C(4, 128, 2, 1, 3, 1, 1), C(2, 64, 2, 3, 3, 2, 1), C(4, 64, 1, 1, 2, 1, 1)]),
             ((8, 197, 72), [C(8, 128, 1, 1, 8, 2, 1)]),
             ((16, 161, 104), [C(8, 64, 1, 2, 16, 1, 1), C(4, 128, 1, 1, 16, 1, 1)])]
    for (m, k, n), cfgs in cases:
        f = _one(tmp_path, _matmul_model(m, k, n), cuda)
        spec, dtype = _spec_dtype(f)
        assert all(gemv.config.fits_shape(spec, c, dtype) for c in cfgs), [c.name for c in cfgs]
        _check(f, cfgs)
    # no tensor-core configs for an [N, K] weight, fp32, or N that no 2-lane vector divides; no ring where 4 does
    # not divide K (x's 8-byte copies)
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    assert {c.stages for c in gemv.configs(GemmSpec((), 3, 100, 333, False, False, False), "float16")} == {1}

    assert not any(c.mma for c in gemv.configs(GemmSpec((), 4, 96, 64, False, False, True), "float16"))
    assert not any(c.mma for c in gemv.configs(GemmSpec((), 4, 96, 64, False, False, False), "float32"))
    assert not any(c.mma for c in gemv.configs(GemmSpec((), 4, 97, 64, False, False, False), "float16"))


def test_mma_ring_kernels_match_the_planners_function_with_tails(tmp_path, cuda):
    """The tensor-core kernel with its cp.async ring (stages 2-4), emulated (each copy a plain copy into the lane's
    slot, read back stages - 1 iterations later): a wrong slot, a refill before its read or a missed last iteration
    reads another iteration's weight. M = 1, 3, 8 and 16; K with a masked last k16 step; warps along K whose
    iteration counts differ (some none: fewer iterations than stages); K splits; N off the warp's columns;
    the warps' partials in the ring's memory."""
    C = gemv.GemvConfig
    cases = [((1, 100, 104), [C(8, 128, 1, 1, 1, 1, 1, 4), C(8, 64, 1, 1, 1, 2, 1, 2)]),
             ((3, 332, 100), [C(4, 128, 2, 1, 3, 1, 1, 3), C(2, 64, 2, 3, 3, 2, 1, 2), C(4, 64, 1, 1, 2, 1, 1, 4)]),
             ((8, 196, 72), [C(8, 64, 1, 1, 8, 2, 1, 3)]),
             ((16, 164, 104), [C(8, 64, 1, 2, 16, 1, 1, 4), C(4, 128, 1, 1, 16, 1, 1, 2)])]
    for (m, k, n), cfgs in cases:
        f = _one(tmp_path, _matmul_model(m, k, n), cuda)
        spec, dtype = _spec_dtype(f)
        assert all(gemv.config.fits_shape(spec, c, dtype) for c in cfgs), [c.name for c in cfgs]
        _check(f, cfgs)


def test_mma_kernels_with_x_staged_match_and_build(tmp_path, cuda):
    """The tensor-core kernel with x's tile staged in shared memory (``xs``), emulated (each group's copies a phase
    before its reads, in the buffer of the iteration's parity): a wrong buffer, row or K offset reads another
    iteration's or row's x. M = 1, 3, 16 and 40 (padded n8 tiles, rows past M clamped); K with a masked last k16
    step (read from global memory, past the staged iterations); groups of 1-4 warps along N, warps along K whose
    iteration counts differ, K splits, fewer rows a block than M. Then in CUDA: the 16-byte copies, a group's
    named barrier (a warp's sync for a group of one), no spills; none where 8 does not divide K or with a ring."""
    C = gemv.GemvConfig
    cases = [((1, 200, 104), [C(8, 128, 1, 1, 1, 1, 1, 1, 1), C(8, 128, 2, 1, 1, 2, 1, 1, 1)]),
             ((3, 336, 100), [C(4, 128, 2, 1, 3, 1, 1, 1, 1), C(2, 64, 2, 3, 3, 2, 1, 1, 1),
                              C(4, 64, 1, 1, 2, 1, 1, 1, 1)]),
             ((16, 168, 104), [C(8, 64, 1, 2, 16, 1, 1, 1, 1), C(4, 128, 4, 1, 16, 2, 1, 1, 1)]),
             ((40, 168, 104), [C(4, 128, 2, 1, 40, 2, 1, 1, 1), C(4, 64, 1, 1, 24, 1, 1, 1, 1)])]
    for (m, k, n), cfgs in cases:
        f = _one(tmp_path, _matmul_model(m, k, n), cuda)
        spec, dtype = _spec_dtype(f)
        assert all(gemv.config.fits_shape(spec, c, dtype) for c in cfgs), [c.name for c in cfgs]
        _check(f, cfgs)
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    assert not any(c.xs for c in gemv.configs(GemmSpec((), 16, 104, 164, False, False, False), "float16"))
    assert all(c.stages == 1 for c in gemv.configs(GemmSpec((), 16, 104, 168, False, False, False), "float16")
               if c.xs)
    assert gemv.parse_config("v8 t128 n4 s8 m16 u2 p1 c1 x1") == C(8, 128, 4, 8, 16, 2, 1, 1, 1)
    f = _one(tmp_path, _matmul_model(64, 512, 1024), cuda)
    spec, info = gemv.analyze(f)
    cfgs = [C(8, 128, 4, 1, 16, 2, 1, 1, 1), C(8, 128, 1, 2, 16, 2, 1, 1, 1), C(4, 128, 4, 1, 64, 2, 1, 1, 1),
            C(4, 128, 1, 1, 64, 2, 1, 1, 1)]
    srcs = [_cuda_of(f, spec, info, c, cuda.target) for c in cfgs]
    for c, src in zip(cfgs, srcs):
        assert "cp.async.cg.shared.global [%0], [%1], 16;" in src and "cp.async.wait_group 1;" in src, c.name
        body = src[src.index("for (int it = 0;"):]
        sync = "tvmfuse_bar_sync(" if c.threads_n > 1 else "__syncwarp()"
        assert body[:body.index("wait_group_0()")].count(sync) == 2, c.name
        assert "__syncthreads()" not in body[:body.index("wait_group_0()")], c.name
        # the warps' partials reuse the tiles' memory: one dynamic allocation (a static one beside it past 48 KB in
        # all failed at launch on the H100: 64 x 4096 x 4096, v4 t128 n1 s4 m64 x1)
        assert not re.search(r"^\s*__shared__", src, re.M), c.name
    _nvcc_all(srcs, tmp_path)


def test_mma_kernels_of_up_to_64_rows_match_and_build(tmp_path, cuda):
    """17-64 rows on tensor cores: 40 rows (five n8 tiles, the last padded) in one block through the ring and without
    it, and in two blocks of 24 (the second's rows past M); 64 rows (eight tiles); emulated against the planner's
    PrimFunc, and 64-row kernels built by nvcc with no spills."""
    C = gemv.GemvConfig
    f = _one(tmp_path, _matmul_model(40, 164, 104), cuda)
    _check(f, [C(4, 128, 1, 1, 40, 1, 1, 2), C(2, 64, 1, 2, 40, 2, 1, 1), C(4, 64, 1, 1, 24, 1, 1, 3)])
    f = _one(tmp_path, _matmul_model(64, 96, 72), cuda)
    _check(f, [C(4, 64, 1, 1, 64, 1, 1, 2), gemv.default_config(*_spec_dtype(f))])
    f = _one(tmp_path, _matmul_model(64, 512, 1024), cuda)
    spec, info = gemv.analyze(f)
    cfgs = [gemv.default_config(spec, info["dtype"]), C(4, 128, 1, 2, 64, 1, 1, 4), C(2, 128, 1, 1, 64, 2, 1, 1)]
    assert all(gemv.config.fits_shape(spec, c, "float16") for c in cfgs)
    _nvcc_all([_cuda_of(f, spec, info, c, cuda.target) for c in cfgs], tmp_path)


def test_mma_kernels_build_with_mma_sync_and_no_spills(tmp_path, cuda):
    """The tensor-core configs in CUDA: the weight in 16-byte loads, one mma.sync a tile, n8 tile and k16 step,
    built by nvcc for sm_90a with no spills: 16 rows (two n8 tiles), warps along K (their partials in shared
    memory) and a K split (the second kernel), and 3 rows with odd K (the masked tail)."""
    f = _one(tmp_path, _matmul_model(16, 512, 1024), cuda)
    spec, info = gemv.analyze(f)
    C = gemv.GemvConfig
    srcs = []
    for c in (C(8, 256, 2, 2, 16, 4, 1), C(8, 128, 4, 1, 16, 2, 1)):
        src = _cuda_of(f, spec, info, c, cuda.target)
        assert re.search(r"\*\(uint4\*\)\(w_ptr \+ \d+\) = \*\(uint4\*\)\(b_f_ptr", src), c.name
        n = src.count("mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(acc")   # calls: tiles x n8 tiles x steps
        assert n == (c.lanes // 2) * 2 * c.unroll, (c.name, n)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
        assert src.count("__global__") == 2 * (1 + (c.split > 1))
        srcs.append(src)
    # the ring: 16-byte copies through L2 (8-byte ones where a lane's vector is 4 lanes), the main loop without a
    # barrier (its warps along K may run different iteration counts: the first barrier is the partials', after
    # the wait for every copy), partials in the ring's memory (4 warps along K), a K split
    for c in (C(8, 128, 1, 2, 16, 2, 1, 2), C(4, 128, 4, 1, 16, 2, 1, 4)):
        src = _cuda_of(f, spec, info, c, cuda.target)
        size = 2 * c.lanes
        assert f"cp.async.{'cg' if size == 16 else 'ca'}.shared.global [%0], [%1], {size};" in src, c.name
        assert f"cp.async.wait_group {c.stages - 1};" in src and "cp.async.commit_group;" in src, c.name
        body = src[src.index("for (int it = 0;"):]
        assert "__syncthreads()" not in body[:body.index("wait_group_0()")], c.name
        assert ("__syncthreads()" in body) == (gemv.config.warps_k(c) > 1), c.name   # the partials' barriers
        n = src.count("mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(acc")
        assert n == (c.lanes // 2) * 2 * c.unroll, (c.name, n)
        assert src.count("__global__") == 2 * (1 + (c.split > 1))
        srcs.append(src)
    f = _one(tmp_path, _matmul_model(3, 203, 104), cuda)
    spec, info = gemv.analyze(f)
    srcs.append(_cuda_of(f, spec, info, C(8, 64, 1, 1, 3, 2, 1), cuda.target))
    f = _one(tmp_path, _matmul_model(3, 204, 104), cuda)   # the ring with a masked last step
    spec, info = gemv.analyze(f)
    srcs.append(_cuda_of(f, spec, info, C(8, 64, 1, 1, 3, 2, 1, 3), cuda.target))
    _nvcc_all(srcs, tmp_path)


def test_defaults_take_tensor_cores_where_multiply_adds_outlast_the_stream():
    """The rule's kernel for the H200's decode shapes: tensor cores at 8 and 16 rows (fp32 multiply-adds a row of M
    each would take longer than the weight's stream), both kernels' names round-trip, and an [N, K] weight keeps
    the CUDA-core kernel."""
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    for m, k, n in [(16, 4096, 11008), (8, 11008, 4096)]:
        d = gemv.default_config(GemmSpec((), m, n, k, False, False, False), "float16")
        assert d.mma == 1 and d.rows == m and gemv.parse_config(d.name) == d, d.name
        assert not gemv.default_config(GemmSpec((), m, n, k, False, False, True), "float16").mma
    assert gemv.parse_config("v8 t256 n4 s1 m1 u8") == gemv.GemvConfig(8, 256, 4, 1, 1, 8)
    assert gemv.parse_config("v8 t128 n1 s2 m16 u2 p3 c1") == gemv.GemvConfig(8, 128, 1, 2, 16, 2, 1, 3)


def test_defaults_keep_one_and_two_rows_on_cuda_cores_and_keep_every_sm_streaming():
    """Shapes nobody tuned for: 1-2 rows on CUDA cores (a multiply-add a weight element and row costs them less
    than the tensor-core kernel's slower stream), from 6 rows on tensor cores, with bytes in flight an SM (averaged
    over all SMs, the idle ones included) at the Little's-law line (32 KB: 4.2 TB/s x ~1 us over 132 SMs) or above."""
    from tvmfuse.kernels.gemv.config import inflight_bytes
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    for k, n in [(2880, 5120), (5120, 13824), (3584, 18944)]:
        for m in (1, 2):
            assert not gemv.default_config(GemmSpec((), m, n, k, False, False, False), "float16").mma, (m, k, n)
        for m in (1, 2, 4, 6, 11, 16):   # 4 rows: either kernel (CUDA cores measured faster at 4 x 4096 x 4096)
            s = GemmSpec((), m, n, k, False, False, False)
            d = gemv.default_config(s, "float16")
            assert d.rows == m and (d.mma == 1 or m <= 4), (m, k, n, d.name)
            assert inflight_bytes(s, d, "float16") >= 32 * 1024, (m, k, n, d.name)


def _spec_dtype(f):
    spec, info = gemv.analyze(f)
    return spec, info["dtype"]


# Each distinct kernel built once a session (the tests share sources: a default is also a rival or a sample)
_PTXAS: dict[str, str] = {}
_CUDA: dict[tuple, str] = {}


def _nvcc_all(srcs: list[str], tmp_path) -> list[str]:
    """nvcc for sm_90a on every source (batched: ``ptxas_logs``), no spills, no stack frame; ptxas's report of each
    (a source built before in the session: its report then)."""
    new = list(dict.fromkeys(s for s in srcs if s not in _PTXAS))
    if new:
        _PTXAS.update(zip(new, ptxas_logs(new, tmp_path, "sm_90a")))
    return [_PTXAS[s] for s in srcs]


def _cuda_of(func, spec, info, cfg, target):
    key = (str(func.script()), spec, cfg, str(target))
    if key not in _CUDA:
        _CUDA[key] = cuda_source(tvm.compile(tvm.IRModule({"main": gemv.kernel_for(func, spec, info, cfg)}),
                                             target=target))
    return _CUDA[key]


def _cover(cfgs: list, count: int) -> list:
    """At most ``count`` of ``cfgs`` (at least the few that cover every value): first, configs that bring a knob's
    value not yet among those taken, then an even stride through the rest. Every knob's every value is built;
    the combinations are sampled."""
    taken, seen = [], set()
    for c in cfgs:
        pairs = set(dataclasses.asdict(c).items())
        if not pairs <= seen:
            taken.append(c)
            seen |= pairs
    rest = [c for c in cfgs if c not in taken]
    room = max(0, count - len(taken))
    return taken + [rest[int(i * len(rest) / room)] for i in range(min(room, len(rest)))]


def test_cuda_kernels_build_with_16_byte_loads_and_no_spills(tmp_path, cuda):
    for f in (_one(tmp_path, _matmul_model(16, 512, 1024), cuda), _nk_func(16, 512, 1024)):
        spec, info = gemv.analyze(f)
        cfg = gemv.default_config(spec, info["dtype"])
        assert cfg.rows == 16   # the weight read once
        srcs = []
        # the default (on tensor cores for [K, N]), a CUDA-core config with a K split, the default split in two
        for c in (cfg, gemv.GemvConfig(8, 256, 2 if spec.b_kmajor else 32, 4, 16 if spec.b_kmajor else 8, 2),
                  dataclasses.replace(cfg, split=2)):
            src = _cuda_of(f, spec, info, c, cuda.target)
            vec = "uint4" if c.lanes == 8 else "half4"   # the weight in 16- or 8-byte loads (or copies: the ring)
            if c.mma and c.stages > 1:
                assert f"shared.global [%0], [%1], {2 * c.lanes};" in src, c.name
            else:
                assert re.search(rf"\*\({vec}\*\)\(w_ptr \+ \d+\) = \*\({vec}\*\)\(b_f_ptr", src), (c.name, vec)
            assert src.count("__global__") == 2 * (1 + (c.split > 1))   # (declaration + definition) a kernel
            srcs.append(src)
        _nvcc_all(srcs, tmp_path)


def test_512_thread_configs_of_16_rows_stay_under_their_launch_bound(tmp_path, cuda):
    """At 512 threads a block the launch bound leaves ptxas 128 registers a thread: the space offers a CUDA-core
    config of 16 rows there only where the register estimate fits (v4 t512 n32 s1 m16 u8 spilled), and those it
    offers build without spills."""
    f = _one(tmp_path, _matmul_model(16, 512, 1024), cuda)
    spec, info = gemv.analyze(f)
    cfgs = [c for c in gemv.space_configs(spec, info["dtype"], load_spaces("cuda").for_class("gemm"))
            if c.threads == 512 and c.rows == 16 and not c.mma]
    assert cfgs and gemv.GemvConfig(4, 512, 32, 1, 16, 8) not in cfgs
    _nvcc_all([_cuda_of(f, spec, info, c, cuda.target) for c in _cover(cfgs, 4)], tmp_path)


@pytest.mark.slow
def test_every_config_of_a_small_gemv_builds_with_nvcc(tmp_path, cuda):
    space = load_spaces("cuda").for_class("gemm")
    for f in (_one(tmp_path, _matmul_model(1, 128, 64), cuda), _nk_func(1, 128, 64)):
        spec, info = gemv.analyze(f)
        cfgs = gemv.space_configs(spec, info["dtype"], space)
        assert cfgs
        # each kernel's configs (CUDA cores; tensor cores, whose stages are a knob of their own) sampled so every
        # knob's every value is among them: the whole space is nvcc's minutes
        sample = []
        for p in (0, 1):
            sample += _cover([c for c in cfgs if c.mma == p], 12)
        assert {c.stages for c in sample if c.mma} == ({1, 2, 3, 4} if not spec.b_kmajor else set())
        _nvcc_all([_cuda_of(f, spec, info, c, cuda.target) for c in sample], tmp_path)


def test_the_gemm_space_samples_gemv_and_the_builder_swaps_its_kernel(tmp_path, cuda):
    f_mod = _kernels(tmp_path, _matmul_model(3, 256, 700), cuda)[1][0].mod
    choice = select_space(f_mod, cuda.target)
    assert choice.source == "template:gemm_tensorcore"
    ctx = ms.TuneContext(mod=f_mod, target=cuda.target, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=0)
    (sketch,) = ctx.generate_design_space()   # the GEMV sketch alone
    found = gemv.annotated(sketch.mod["main"])
    assert found is not None and found[2] in gemv.configs(found[0], "float16")
    src = cuda_source(tvm.compile(expand(sketch.mod), target=cuda.target))
    # the GEMV kernel swapped in (its column blocks, K split; the placeholder binds x only)
    assert "blockIdx.y" in src or "blockIdx.z" in src
    # an M = 65 GEMM keeps the tensor-core sketches; M = 24 (fp16 [K, N]) has the GEMV sketch and wgmma's beside it
    for m, with_gemv in ((65, False), (24, True)):
        big = _kernels(tmp_path, _matmul_model(m, 64, 64), cuda)[1][0].mod
        ctx = ms.TuneContext(mod=big, target=cuda.target, space_generator=select_space(big, cuda.target).generator,
                             search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=0)
        found = [gemv.annotated(s.mod["main"]) is not None for s in ctx.generate_design_space()]
        assert found.count(True) == with_gemv and found.count(False) >= 1, (m, found)


def test_a_tiny_model_compiled_for_cuda_runs_the_gemv_template(tmp_path, cuda):
    """MatMul 3x256 @ 256x700 + bias + Relu: the untuned CUDA build's GEMM is the GEMV template's default."""
    from tvmfuse.compile.build import build
    from tvmfuse.tune.defaults import default_template_schedule

    fused, (kernel,) = _kernels(tmp_path, _matmul_model(3, 256, 700), cuda)
    spec, info = gemv.analyze(kernel.mod["main"])
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["gemv-default"]
    src = cuda_source(result.executable)
    assert "*(half4*)(w_ptr" in src   # 700 columns: 4-lane (8-byte) fp16 vectors of the weight
    sch = default_template_schedule(kernel.mod, cuda.target)
    assert gemv.annotated(sch.mod["main"])[2] == gemv.default_config(spec, info["dtype"])


@pytest.mark.slow
def test_the_gpu_script_builds_its_kernels_without_a_gpu():
    """benchmarks/gemv_gpu.py --dry-run --small: every shape's default, both kernels' best by the rule and a sample
    of 2 configs, with and without the bias + SiLU epilogue, built for CUDA and through ptxas with no spills (the
    H200 run has one attempt; the kernels themselves are the other tests')."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/gemv_gpu.py", "--dry-run", "--small", "--configs", "2"], cwd=root,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"dry run: built (\d+) of \1 kernels", out.stdout), out.stdout[-500:]


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_zoo_gemms_take_it_and_match_their_planner_functions(name, cuda):
    """The tiny zoo models' GEMMs (a few tokens: all at most 16 rows) with their real epilogues (bias, GELU,
    heads split off by a reshape + transpose): each one's default kernel, emulated, against its PrimFunc."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / f"tiny_{name}.float32.onnx"
    fused, _ = partition(import_model(load_model(fixture)), target=cuda)
    gemms = [k.mod["main"] for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "gemm"]
    taken = [f for f in gemms if gemv.untuned(f, cuda.target) is not None]
    assert len(taken) >= 3
    for f in taken:
        _check(f, [gemv.untuned(f, cuda.target)[2]])


def test_a_small_fp32_gemm_of_up_to_256_rows_runs_in_groups_of_16_rows(tmp_path, cuda):
    """A 1x1 conv of MobileNetV2 at batch 1 as a GEMM (64 pixels, 384 -> 64 channels, fp32): dlight's matmul tiled it
    into 2 blocks; the template takes it, 16 rows a block, and 257 rows or an output past half a wave it declines."""
    tmpl = next(t for t in registry() if t.name == "gemv")
    f = _one(tmp_path, _matmul_model(64, 384, 64, dtype=TensorProto.FLOAT), cuda)
    assert tmpl.fits(f, cuda.target) is None
    d = gemv.untuned(f, cuda.target)[2]
    assert not d.mma and d.rows == gemv.MAX_ROWS, d.name
    for m, n in ((257, 64), (128, 2048)):
        f = _one(tmp_path, _matmul_model(m, 64, n, dtype=TensorProto.FLOAT), cuda)
        assert "M = " in tmpl.fits(f, cuda.target)
