"""The row program (tvmfuse/kernels/rows/): which kernels it takes, that its serial twin computes the planner's
kernel on the CPU, that its CUDA kernels read each input row once in coalesced 16-byte vectors, write each
output element once, keep the row in registers without spills, and that a tuning record selecting it builds
through ``compile``. (Built here, not run: the H200 checks its numerics in the tuner's kernel check.)"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

from cuda_checks import (EMULATE, _at_every_value, _cuda_index_env, assert_ptxas_without_spills,  # noqa: E402
                         build_with_record, cuda_source)
from tvmfuse._tvm import build_context, ms, tvm  # noqa: E402
from tvmfuse.tune.builder import fast_build
from tvmfuse.bench.cases import CASES  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.kernels import rows  # noqa: E402
from tvmfuse.tune import extract_kernels  # noqa: E402
from tvmfuse.kernels.sketch import root_blocks as _blocks_of  # noqa: E402
from tvmfuse.tune.spaces import classify, select_space  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _fused(model, target):
    path = Path(tempfile.mkdtemp()) / "m.onnx"
    onnx.save(model, path)
    return partition(import_model(load_model(path)), target=target)[0]


def _row_kernels(case: str, target, **size):
    if case == "bert":
        from tvmfuse.bench.models import SMALL_MODELS, bert_base

        model = bert_base(**SMALL_MODELS["bert_base"])[0]
    else:
        model = CASES[case](**size)[0]
    fused = _fused(model, target)
    return fused, [k for k in extract_kernels(fused, target=target) if classify(k.mod["main"]) == "row_reduction"]


def _run(func, inputs):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=EMULATE)
    args = [tvm.runtime.tensor(a.copy()) for a in inputs]
    args[-1] = tvm.runtime.tensor(np.full(inputs[-1].shape, np.nan, inputs[-1].dtype))
    lib["main"](*args)
    return args[-1].numpy().astype("float64")


@pytest.mark.parametrize("case,size", [("softmax", dict(M=16, N=512)), ("add_layernorm", dict(M=8, N=1024)),
                                       ("bert", {})])
def test_the_serial_twin_computes_the_planners_kernel(case, size, cuda):
    """The twin (one thread per row, the same steps, element order and expression translation as the CUDA
    program) built for the CPU equals the planner's kernel: softmax, add+LayerNorm (a per-row mean between two
    reductions, gamma and beta broadcast over the rows), BERT's softmax over [B, H, S, S] and its LayerNorm
    over [B, S, D]. Where the program sums fp16 in float32 (softmax; the planner's kernel sums in fp16) the two
    differ by the planner's rounding, well under 1%, and a mapping error would be of order one."""
    _, kernels = _row_kernels(case, cuda, **size)
    assert kernels
    rng = np.random.default_rng(0)
    for k in kernels:
        func = k.mod["main"]
        prog = rows.analyze(func)
        assert prog.outputs and any(s.kind == "reduce" for s in prog.steps)
        if case == "add_layernorm":
            assert [s.kind for s in prog.steps] == ["elementwise", "reduce", "row", "reduce", "elementwise"]
            assert len(prog.by_col) == 2   # gamma, beta
        inputs = [rng.standard_normal([int(d) for d in b.shape]).astype(str(b.dtype))
                  for b in prog.params]
        want, got = _run(func, inputs), _run(rows.kernel_for(func, None), inputs)
        assert not np.isnan(got).any()
        if rows._widened(prog):
            assert case != "add_layernorm"   # its LayerNorm sums in float32 already
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, k.name
        else:
            assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), k.name


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm", "Softmax"])
def test_fp32_norms_from_onnx_ops_become_row_programs(kind, cuda):
    """(x + r) -> RMSNorm (decomposed: Pow, ReduceMean, Sqrt, Div, Mul), LayerNormalization or Softmax, in fp32
    (4 lanes a vector): the twin equals the planner's kernel, so does the emulation of every CUDA config (its
    threads as loops: the element-to-thread mapping, the butterfly of the warp shuffles, the words across
    warps), and a CUDA config builds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    fused = _fused(models.add_norm(kind, m=16, n=512), cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    func = k.mod["main"]
    prog = rows.analyze(func)
    assert prog.lanes() == 4
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal([int(d) for d in b.shape]).astype(str(b.dtype)) for b in prog.params]
    want, got = _run(func, inputs), _run(rows.kernel_for(func, None), inputs)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert {c.threads for c in rows.configs(prog)} == {32, 64, 128}   # 512 columns, 4 lanes: up to 4 warps
    for cfg in rows.configs(prog):
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6, cfg
    cfg = rows.configs(prog)[0]
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    assert "float4" in src and "__shfl_xor_sync" in src


def test_rmsnorm_whose_first_spatial_block_is_per_row(cuda):
    """LLaMA's RMSNorm as the planner fuses it when the squares come from another kernel: mean(x2) -> + eps ->
    sqrt -> 1 / -> x * that -> * w. Its first spatial block is per row ([rows, 1]); the row shape comes from the
    largest one (the kernel was declined before: "not one reduction over the last axis"). The twin and every
    config's emulation equal the planner's kernel."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    b, n = models._B(9), 512
    mean = b.op("ReduceMean", ["x2"], axes=[-1], keepdims=1)
    inv = b.op("Div", [b.const(1.0), b.op("Sqrt", [b.op("Add", [mean, b.const(1e-6)])])])
    y = b.op("Mul", [b.op("Mul", ["x", inv]), b.const(1 + 0.1 * b.rng.standard_normal(n))])
    fused = _fused(b.model({"x2": [16, n], "x": [16, n]}, y, [16, n]), cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    func = k.mod["main"]
    prog = rows.analyze(func)
    assert (prog.rows, prog.cols) == (16, n) and [s.kind for s in prog.steps][:2] == ["reduce", "row"]
    rng = np.random.default_rng(3)
    x2, x, w, out = [rng.standard_normal([int(d) for d in p.shape]).astype("float32") for p in prog.params]
    inputs = [x * x, x, w, out]
    want = _run(func, inputs)
    assert np.abs(_run(rows.kernel_for(func, None), inputs) - want).max() <= 1e-6 * np.abs(want).max()
    for cfg in rows.configs(prog):
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6, cfg


def _layernorm_then(tail: str, n: int = 256):
    """LayerNorm over [2, 8, n], then GPT-2's reshape to [16, n] (the rows' flat order kept) or a transpose of
    the two leading axes (rows reordered): the planner's row kernel of it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    b = models._B(11)
    y = b.op("LayerNormalization", ["x", b.const(1 + 0.1 * b.rng.standard_normal(n)),
                                    b.const(0.1 * b.rng.standard_normal(n))], axis=-1, epsilon=1e-5)
    if tail == "reshape":
        out, shape = b.op("Reshape", [y, models._int64(b, [16, n])]), [16, n]
    elif tail == "view":   # GPT-Neo's last LayerNorm: a view to the shape it has, then an elementwise op (its cast)
        view = b.op("Reshape", [y, models._int64(b, [2, 8, n])])
        out, shape = b.op("Mul", [view, b.const(np.float32(0.5))]), [2, 8, n]
    else:
        out, shape = b.op("Transpose", [y], perm=[1, 0, 2]), [8, 2, n]
    cuda = resolve_target("cuda")
    fused = _fused(b.model({"x": [2, 8, n]}, out, shape), cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    return k.mod["main"]


def test_a_reshape_that_keeps_the_rows_flat_order_is_stored_from_the_rows_registers(tmp_path, cuda):
    """GPT-2's LayerNorm feeds its GEMM through a reshape to [rows, cols] in the same kernel: the program stores
    the output from the normalized row's registers (the index maps' flat forms are equal: TVM's analyzer
    proves it), and equals the planner's kernel, every config emulated; the CUDA stores cover each output
    element once. A transpose of the rows is declined."""
    func = _layernorm_then("reshape")
    prog = rows.analyze(func)
    assert not prog.outputs and [(o.name, src) for o, src in prog.reshaped] == [
        ("T_reshape_intermediate", "T_layer_norm_intermediate")]
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in prog.params]
    want = _run(func, inputs)
    assert np.abs(_run(rows.kernel_for(func, None), inputs) - want).max() <= 1e-6 * np.abs(want).max()
    for cfg in rows.configs(prog):
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6, cfg
    cfg = rows.default_config(prog)
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__'):]
    _stores_cover_each_element_once(body, "T_reshape_intermediate_f_ptr", 16, 256, cfg, "float4", 4)   # (fp32)
    with pytest.raises(rows.Misfit):
        rows.analyze(_layernorm_then("transpose"))


def test_a_view_to_the_rows_own_shape_inside_the_kernel_is_read_in_place(cuda):
    """GPT-Neo views its last LayerNorm's output to the shape it has before the output's cast: the reshape block's
    load (an index map whose flat form is the identity) is the same element, so the program takes the kernel (it
    was declined: dlight's reduction rule ran it) and equals the planner's kernel, every config emulated."""
    func = _layernorm_then("view")
    prog = rows.analyze(func)
    assert [s.kind for s in prog.steps][-2:] == ["elementwise", "elementwise"] and len(prog.outputs) == 1
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in prog.params]
    want = _run(func, inputs)
    for cfg in rows.configs(prog):
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), cfg


def test_a_row_too_short_for_16_byte_vectors_takes_the_widest_narrower_ones(cuda):
    """add+LayerNorm over 64 fp16 columns: no thread count of 32 or more splits it into 8-lane vectors, so the
    configs take 2-lane ones (`v2`; a config's name round-trips), every one's emulation equals the planner's
    kernel, and the CUDA program reads and writes a row with one 4-byte vector per thread, each output element
    once. A 2048-column row keeps its 16-byte configs only."""
    _, (k,) = _row_kernels("add_layernorm", cuda, M=64, N=64)
    func = k.mod["main"]
    prog = rows.analyze(func)
    cfgs = rows.configs(prog)
    assert cfgs and {c.lanes for c in cfgs} == {2} and {c.threads for c in cfgs} == {32}
    assert all(rows.parse_config(c.name) == c for c in cfgs) and cfgs[0].name == "t32 r1 v2"
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in prog.params]
    want = _run(func, inputs)
    for cfg in cfgs:
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), cfg
    cfg = rows.default_config(prog)
    assert cfg == rows.RowConfig(32, 4, 2)
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__'):]
    assert re.search(r"\*\(half2\*\)\(x_r_ptr \+ 0\) = \*\(half2\*\)\(x_f_ptr \+ .*threadIdx\.x\) \* 2\)", body)
    _stores_cover_each_element_once(body, "T_layer_norm_intermediate_f_ptr", 64, 64, cfg, "half2", 2)
    _, (long,) = _row_kernels("softmax", cuda, M=16, N=2048)
    assert {c.lanes for c in rows.configs(rows.analyze(long.mod["main"]))} == {0}


def test_the_emulated_fp16_softmax_is_as_close_to_the_exact_one_as_a_reduction_tree_gets(cuda):
    """fp16 softmax over 2048 columns, emulated under configs of one warp, two and eight warps a row, against the
    exact (fp64) softmax. The planner's kernel sums the row's exponentials one after another in fp16 and is
    3.9e-2 off; the program sums them in float32, takes exp as 2^(x log2 e) in float32 and multiplies by the
    sum's reciprocal: 4.7e-4 off, about twice the rounding of the exact softmax to fp16 (2.1e-4)."""
    _, (k,) = _row_kernels("softmax", cuda, M=16, N=2048)
    func = k.mod["main"]
    prog = rows.analyze(func)
    x = np.random.default_rng(2).standard_normal([16, 2048]).astype("float16")
    e = np.exp(x.astype("float64") - x.max(-1, keepdims=True))
    exact = e / e.sum(-1, keepdims=True)
    for name in ("t32 r1", "t32 r4", "t64 r2", "t256 r2"):
        cfg = rows.parse_config(name)
        assert cfg in rows.configs(prog)
        got = _run(rows.kernel_for(func, cfg, emulate=True), [x, np.zeros_like(x)])
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-3, name
    assert np.linalg.norm(_run(func, [x, np.zeros_like(x)]) - exact) / np.linalg.norm(exact) > 1e-2


def test_kernels_that_are_not_row_programs_are_declined(cuda):
    for case, size in (("gemm_bias_relu", dict(M=64, K=64, N=64)), ("pointwise", dict(M=16, N=64))):
        for k in extract_kernels(_fused(CASES[case](**size)[0], cuda), target=cuda):
            with pytest.raises(rows.Misfit):   # a GEMM's reduction reads two tensors; a pointwise kernel has none
                rows.analyze(k.mod["main"])


def _stores_cover_each_element_once(src: str, ptr: str, rows_: int, cols: int, cfg, vec: str = "uint4",
                                    lanes: int = 8) -> None:
    per_block = cfg.rows_per_block
    ranges, python = _cuda_index_env(src)
    ranges["tx"] = range(cfg.threads)
    ranges["bx"] = range(min(ranges["bx"].stop, rows_ // per_block))
    ranges["ty"] = range(per_block)
    seen = np.zeros(ranges["bx"].stop * per_block * cols, dtype=np.int64)
    stores = re.findall(r"\*\(" + vec + r"\*\)\(" + ptr + r" \+ (.+?)\) = ", src)
    assert stores
    for expr in stores:
        idx = _at_every_value(python(expr), ranges).ravel()
        assert (idx % lanes == 0).all()
        for lane in range(lanes):
            np.add.at(seen, idx + lane, 1)
    assert (seen == 1).all(), (seen.min(), seen.max())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,cols,cfg", [("softmax", 2048, "t32 r1"), ("softmax", 2048, "t64 r2"),
                                           ("add_layernorm", 8192, "t256 r1"), ("add_layernorm", 8192, "t128 r2")])
def test_the_cuda_program_reads_rows_once_coalesced_and_keeps_them_in_registers(tmp_path, case, cols, cfg, cuda):
    _, (k,) = _row_kernels(case, cuda, M=64, N=cols)
    func, cfg = k.mod["main"], rows.parse_config(cfg)
    prog = rows.analyze(func)
    assert cfg in rows.configs(prog)
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__'):]
    # each input row: one 16-byte vector per step, consecutive threads on consecutive vectors
    for ptr in (["x_f_ptr", "r_f_ptr"] if case == "add_layernorm" else ["x_f_ptr"]):   # (flat views)
        loads = [ln for ln in body.splitlines() if f"{ptr} +" in ln]
        assert len(loads) == cols // (8 * cfg.threads), loads[:2]
        assert all(re.search(r"\*\(uint4\*\)\(" + ptr + r" \+ .*\(\(int\)threadIdx\.x\) \* 8\)", ln) for ln in loads)
    out = prog.outputs[0].name
    _stores_cover_each_element_once(body, f"{out}_f_ptr", 64, cols, cfg)
    assert "__shfl_xor_sync" in body
    # per element: no division (a per-row divisor's reciprocal, once a thread) and no hexp (its special-value
    # fixes cost eight instructions an element)
    assert len(re.findall(r" / ", body)) <= 1 and "hexp" not in body
    shared = [int(n) for n in re.findall(r"__shared__ \w+ \w+\[(\d+)\]", body)]
    assert all(n <= 32 for n in shared), shared   # a word per warp and reduction, no staged rows
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def test_a_record_that_selects_the_program_builds_it(tmp_path, cuda):
    """The space's `program` sketch annotates a config; a tuning record of it builds, through ``compile``, the
    row program (the builder swaps the kernel), and the build counts the kernel as tuned."""
    fused, (k,) = _row_kernels("softmax", cuda, M=64, N=2048)
    choice = select_space(k.mod, cuda.target)
    ctx = ms.TuneContext(mod=k.mod, target=cuda.target, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=1)
    sketches = ctx.generate_design_space()
    programs = [s for s in sketches if rows.ANNOTATION in str(s.trace)]
    assert len(programs) == 1 and len(sketches) == 1   # where the program takes a kernel, its only sketch
    built = build_with_record(tmp_path / "r.db", cuda, fused, k, programs[0].trace)
    assert [kk.schedule for kk in built.kernels] == ["tuned"] and built.untuned == []
    src = cuda_source(built.executable)
    assert "x_r_ptr" in src and "__shfl_xor_sync" in src
    from tvmfuse.inspect import InspectConfig, inspect_database

    report = inspect_database(InspectConfig(db=tmp_path / "r.db", target="cuda"))
    (cfg,) = [k["row_program_config"] for k in report["kernels"]]
    assert cfg in [c.name for c in rows.configs(rows.analyze(k.mod["main"]))]
    # what MetaSchedule's builder gets: the candidate after the postprocessors (which split each reduction into
    # init and update blocks, so the program comes from the kernel recorded in the annotation)
    postprocs = list(ctx.space_generator.postprocs)
    for p in postprocs:
        p._initialize_with_tune_context(ctx)
    sch = tvm.s_tir.Schedule(k.mod, seed=5)
    tvm.s_tir.Trace(programs[0].trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
    sch.enter_postproc()
    assert all(p.apply(sch) for p in postprocs)
    assert any(b.name_hint.endswith("_init") for b in _blocks_of(sch.mod["main"]))
    src = fast_build(sch.mod, cuda.target, None).imports[0].inspect_source()
    assert "x_r_ptr" in src and "__shfl_xor_sync" in src


def test_an_untuned_cuda_build_and_the_tuners_baseline_run_the_default_row_program(tmp_path, cuda):
    """Without a record a row kernel on CUDA runs the row program at its default config (dlight's schedule ran
    softmax 65536x2048 at 269 us on the H200, the program at 129-132 us), reported as untuned; the tuner's
    baseline, the schedule it measures first and keeps, is the sketch at that config. The default is a row a
    warp where the slices fit, up to 128 threads a block, else the fewest threads."""
    from tvmfuse.compile.build import build
    from tvmfuse.tune.defaults import default_template_schedule

    fused, (k,) = _row_kernels("softmax", cuda, M=64, N=2048)
    prog = rows.analyze(k.mod["main"])
    assert rows.default_config(prog) == rows.RowConfig(32, 4)
    result = build(fused, target=cuda)
    assert [s.schedule for s in result.kernels] == ["rows-default"] and result.untuned == [k.name]
    src = cuda_source(result.executable)
    assert "x_r_ptr" in src and "__shfl_xor_sync" in src and "__launch_bounds__(128)" in src
    sch = default_template_schedule(k.mod, cuda.target)
    assert rows.annotated(sch.mod["main"])[1] == rows.RowConfig(32, 4)
    _, (ln,) = _row_kernels("add_layernorm", cuda, M=16, N=8192)   # 8192 fp16 columns: 64 a thread at 128
    assert rows.default_config(rows.analyze(ln.mod["main"])) == rows.RowConfig(128, 1)
    (gemm,) = extract_kernels(_fused(CASES["gemm_bias_relu"](M=64, K=64, N=64)[0], cuda), target=cuda)
    assert rows.default_kernel(gemm.mod["main"]) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_rows_gpu_script_builds_every_config_without_spills():
    """benchmarks/rows_gpu.py (the H200 measurement of the row program) builds each config of add+LayerNorm's row
    kernel (the one with the most registers a thread) for sm_90a without a GPU; ptxas reports no spills."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rows_gpu.py"
    out = subprocess.run([sys.executable, str(script), "--cases", "add_layernorm", "--small", "--build-only"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout[out.stdout.index("add_layernorm 16 x 8192"):].splitlines()[2:]
    assert len(table) >= 4 and all("0 bytes spill stores" in ln for ln in table), table


def _exact_softmax(x):
    e = np.exp(x.astype("float64") - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("cols", [5000, 4099])
def test_a_row_too_wide_for_registers_is_offered_streamed_and_every_streamed_config_computes_it(cols, cuda):
    """fp16 softmax over 5000 and 4099 columns: no thread count splits the row into slices a thread's registers
    hold; the space offers it streamed (the untuned build leaves a row this narrow to dlight, faster there on the
    H200 than the streamed row, and streams from 16384 columns), and every streamed config
    (shared memory or re-read from L2; 4099 is no whole number of vectors, so each row has an unaligned head and
    tail) computes the exact softmax to the rounding of its fp16 output when its threads run as loops. Untuned,
    the row is held whole in the registers of the fewest threads that take it in 32 elements each (its ragged
    last vectors guarded)."""
    _, (k,) = _row_kernels("softmax", cuda, M=5, N=cols)
    func = k.mod["main"]
    prog = rows.analyze(func)
    assert not [c for c in rows.configs(prog) if c.mode == rows.REGISTERS]
    assert rows.default_config(prog) == rows.RowConfig(256 if cols == 5000 else 128, 1, 0, rows.SHARED,
                                                       3 if cols == 5000 else 4, 1)
    streamed = rows.configs(prog)
    assert {c.mode for c in streamed} == {rows.SHARED, rows.L2} and all(rows.parse_config(c.name) == c for c in streamed)
    x = np.random.default_rng(3).standard_normal([5, cols]).astype("float16")
    exact = _exact_softmax(x)
    for cfg in streamed:
        if cfg.online:   # (test_online_and_kept_streamed_rows_compute_softmax_and_log_softmax)
            continue
        got = _run(rows.kernel_for(func, cfg, emulate=True), [x, np.zeros_like(x)])
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-3, cfg


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_streamed_norms_with_an_unaligned_row_equal_the_planners_kernel(kind, cuda):
    """(x + r) -> LayerNorm / RMSNorm in fp32 over 4099 columns (each row starts at another alignment): every
    streamed config's emulation (two inputs, a per-row mean between two reductions, gamma broadcast, the sum
    recomputed in each pass) equals the planner's kernel to fp32 rounding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    fused = _fused(models.add_norm(kind, m=3, n=4099), cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    func = k.mod["main"]
    prog = rows.analyze(func)
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal([int(d) for d in b.shape]).astype(str(b.dtype)) for b in prog.params]
    want = _run(func, inputs)
    cfgs = rows.streamed_configs(prog)
    assert cfgs
    for cfg in cfgs:
        got = _run(rows.kernel_for(func, cfg, emulate=True), inputs)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6, cfg


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_vocabulary_wide_softmax_builds_with_aligned_vectors_and_a_dynamic_shared_row(tmp_path, cuda):
    """fp16 softmax over a 50257-wide vocabulary (odd: no row after the first starts 16-byte aligned): the
    untuned config stages the 100 KB row in dynamic shared memory, loads the row's aligned interior as 16-byte
    vectors (an index TVM proves aligned, or it would load element by element) and builds without spills."""
    _, (k,) = _row_kernels("softmax", cuda, M=4, N=50257)
    func = k.mod["main"]
    cfg = rows.default_config(rows.analyze(func))
    assert cfg == rows.RowConfig(1024, 1, 0, rows.SHARED)   # plain passes: the online pair was slower staged
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__'):]
    assert "extern __shared__" in body
    assert re.search(r"\*\(uint4\*\)\(x_v_ptr \+ 0\) = \*\(uint4\*\)\(x_f_ptr \+ ", body)
    assert re.search(r"\*\(uint4\*\)\(T_softmax_norm_f_ptr \+ ", body)
    assert "make_uint4(x_f_ptr" not in body   # (a gather: TVM could not prove the vector aligned)
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def _softmax_kernel(op: str, m: int, n: int, cuda):
    """The planner's row kernel of an fp16 ``Softmax`` or ``LogSoftmax`` over [m, n]."""
    from onnx import TensorProto, helper

    x, y = (helper.make_tensor_value_info(v, TensorProto.FLOAT16, [m, n]) for v in "xy")
    model = helper.make_model(helper.make_graph([helper.make_node(op, ["x"], ["y"], axis=-1)], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    (k,) = [k for k in extract_kernels(_fused(model, cuda), target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    return k.mod["main"]


@pytest.mark.parametrize("op,m,n", [("Softmax", 1, 4099), ("LogSoftmax", 9, 12007)])
def test_online_and_kept_streamed_rows_compute_softmax_and_log_softmax(op, m, n, cuda):
    """fp16 softmax over one row and log-softmax (whose sum and output buffers share a name, read as printed)
    over nine, of odd widths (each row after the first starts unaligned; no thread count splits them evenly): the max
    and the sum of exp(x - max) fuse into one online pass, and every online config and every config keeping
    vectors in registers (the rest staged or re-read; the whole row held, ragged) computes the exact result
    to fp16 rounding when its threads run as loops."""
    func = _softmax_kernel(op, m, n, cuda)
    prog = rows.analyze(func)
    assert rows.online_pairs(prog) == ({0: 2} if op == "Softmax" else {0: 1})
    x = 3 * np.random.default_rng(6).standard_normal([m, n]).astype("float16")
    exact = _exact_softmax(x)
    exact = exact if op == "Softmax" else np.log(exact)
    cfgs = [c for c in rows.configs(prog) if c.mode and c.online and (c.keep or c.threads == 256)]
    assert {c.mode for c in cfgs if c.keep} == ({rows.SHARED} if n < 8192 else {rows.SHARED, rows.L2})
    assert any(c.keep * c.threads * 8 >= n for c in cfgs) and any(0 < c.keep * c.threads * 8 < n for c in cfgs)
    for cfg in cfgs:
        got = _run(rows.kernel_for(func, cfg, emulate=True), [x, np.zeros_like(x)])
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-3, cfg


def test_streamed_defaults_follow_the_gpus_room():
    """What an untuned build streams: a ragged RMSNorm row narrower than 16384 whole in registers (dlight's
    schedule before), softmax rows staged two an SM in plain passes (the online pass was slower there on the
    H200), a 128256-wide row (256 KB, more than a
    block's shared memory) on chip, 2 vectors a thread in registers and the rest staged, one block an SM, where
    re-reading it would overflow the L2 (132 SMs x 2 rows x 256 KB > 50 MB), and re-read through L2 keeping 4
    vectors a thread where the L2 holds two rows an SM; LayerNorm keeps no online pair, and at 4099 columns (two
    reductions) dlight's schedule, which was faster on the H200 than its ragged row; RMSNorm's one reduction
    takes the ragged row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from rows_gpu import row_kernel

    ln = rows.analyze(row_kernel("layernorm", dict(M=16, N=4099)))
    rms = rows.analyze(row_kernel("rmsnorm", dict(M=16, N=4099)))
    assert rows.online_pairs(ln) == {} and rows.default_config(ln) is None   # two reductions: dlight's schedule
    assert rows.default_config(rms) == rows.parse_config("t128 r1 m1 k4")
    for n, want in ((32000, "t512 r1 m1"), (50257, "t1024 r1 m1"), (128256, "t1024 r1 m1 k2 o1")):
        assert rows.default_config(rows.analyze(row_kernel("softmax", dict(M=4, N=n)))).name == want, n
    wide = rows.analyze(row_kernel("softmax", dict(M=4, N=128256)))
    big_l2 = rows.Room(l2_bytes=256 << 20)
    assert rows.default_config(wide, room=big_l2).name == "t1024 r1 m2 k4 o1"
    assert rows.default_config(wide) in rows.configs(wide)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,n", [("softmax", 128256), ("rmsnorm", 4099)])
def test_the_new_streamed_defaults_build_without_spills(tmp_path, case, n):
    """The defaults above build for sm_90a without spills: the 128256-wide row's registers and dynamic shared
    memory (218.5 KB, over the 48 KB a block gets without opting in: TVM's CUDA runtime sets the function's
    dynamic shared memory attribute at launch), the ragged RMSNorm's row in registers (only its head and tail,
    under 16 bytes each, in shared memory)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from rows_gpu import row_kernel

    func = row_kernel(case, dict(M=4, N=n))
    cfg = rows.default_config(rows.analyze(func))
    with build_context():
        src = tvm.compile(tvm.IRModule({"main": rows.kernel_for(func, cfg).with_attr("global_symbol", "main")}),
                          target=SM90A).mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__'):]
    assert "extern __shared__" in body and "x_k_ptr[" in body   # (the kept vectors: a local array in registers)
    assert re.search(r"\*\(uint4\*\)\(x_v_ptr \+ 0\) = \*\(uint4\*\)\(x_f_ptr \+ ", body)
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def test_a_row_no_register_config_takes_is_still_searched_over_the_programs_configs(cuda):
    """A LayerNorm of a width no thread count splits into whole vectors (848 = 16 x 53), narrower than 16384:
    its untuned build keeps dlight's schedule (dlight measured faster than the streamed default there), but the
    template takes it, so the search offers the program's streamed configs against that default."""
    from tvmfuse.kernels import get
    from tvmfuse.tune.defaults import config_schedules

    _, (k,) = _row_kernels("layernorm", cuda, M=32, N=848)
    template = get("rows")
    assert template.default_config(k.mod["main"], cuda.target) is None
    assert template.default_kernel(k.mod["main"], cuda.target) is None
    assert template.fits(k.mod["main"], cuda.target) is None
    schedules = config_schedules(k.mod, cuda.target, "rows")
    assert schedules and all(" m" in name for name in schedules), list(schedules)
