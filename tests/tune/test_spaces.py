"""Search spaces: the YAML files load, each kernel class gets its space, templates yield CUDA code that
nvcc builds (not run here), the fallback is clean, and a tiny llvm tuning run improves on its first try."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
import pytest

from cuda_checks import assert_ptxas_without_spills, assert_shared_vectors_aligned, cuda_source  # noqa: E402
from tvmfuse._tvm import build_context, tvm
from tvmfuse.bench.cases import CASES, SMALL
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.tune.spaces import (CLASSES, SpaceError, classify, load_space_file, load_spaces, sample_schedules,
                                 select_space)

EXPECTED_CLASS = {"pointwise": "pointwise", "swiglu": "pointwise", "add_layernorm": "row_reduction",
                  "softmax": "row_reduction", "gemm_bias_relu": "gemm", "conv_bn_relu": "conv", "attention": "attention"}


class _AttentionKernel:
    """The planner's attention PrimFunc as a workload (its ONNX pattern match is the planner's business)."""

    def __init__(self):
        from tvmfuse.bench.cases import attention_kernel

        self.mod = attention_kernel(B=1, H=2, S=64, D=32)


def _kernels(case: str, target, size: dict | None = None):
    if case == "attention":
        return [_AttentionKernel()]
    model, _, _ = CASES[case](**(SMALL[case] if size is None else size))
    path = Path(tempfile.mkdtemp()) / f"{case}.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=target)
    return extract_kernels(fused, target=target)


def _tir_row_spaces():
    """The CUDA space file with the row program left out of ``row_storage``: where the program takes a row kernel
    it is the only sketch, so the schedule-based row sketches (which serve the kernels it does not take) are
    tested on these kernels through this space."""
    from dataclasses import replace

    from tvmfuse.kernels.knobs import Knob

    spaces = load_spaces("cuda")
    rows = spaces.for_class("row_reduction")
    knob = rows.knobs["row_storage"]
    kept = [(v, p) for v, p in zip(knob.values, knob.probs) if v != "program"]
    total = sum(p for _, p in kept)
    storage = Knob("row_storage", tuple(v for v, _ in kept), tuple(p / total for _, p in kept))
    classes = {**spaces.classes, "row_reduction": replace(rows, knobs={**rows.knobs, "row_storage": storage})}
    return replace(spaces, classes=classes)


def _space_points(kernel, target, seeds, spaces=None):
    """Every sketch of the kernel's space with the decisions seed ``s`` samples, for each seed (no postprocs)."""
    from tvmfuse._tvm import ms

    choice = select_space(kernel.mod, target.target, spaces)
    ctx = ms.TuneContext(mod=kernel.mod, target=target.target, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=1)
    sketches = ctx.generate_design_space()
    for seed in seeds:
        for sketch in sketches:
            sch = tvm.s_tir.Schedule(kernel.mod, seed=seed)
            tvm.s_tir.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            yield choice, sch


def _mma_kernel(case: str, target):
    """The case's GEMM/conv kernel (on GPUs a conv model also has the NCHW -> NHWC transpose of its input); the GEMM
    at 128 rows, past the GEMV template's 64, so the tensor-core sketches tune it."""
    size = dict(M=128, K=64, N=64) if case == "gemm_bias_relu" else None
    return next(k for k in _kernels(case, target, size) if classify(k.mod["main"]) in ("gemm", "conv"))


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


@pytest.fixture(scope="module")
def llvm():
    return resolve_target("llvm")


def test_space_files_load_with_versions_and_every_class():
    for kind in ("cuda", "llvm"):
        sf = load_spaces(kind)
        assert sf.version.startswith(kind + "-") and sf.target == kind
        assert set(sf.classes) == set(CLASSES)
        for cls in sf.classes.values():
            for knob in cls.knobs.values():
                assert len(knob.values) == len(knob.probs) and abs(sum(knob.probs) - 1) < 1e-9
    assert load_spaces("cuda").builder_timeout_s > 30  # nvcc needs more than MetaSchedule's 30 s


def test_bad_space_file_is_refused(tmp_path):
    bad = tmp_path / "cuda.yaml"
    bad.write_text("version: x\nclasses:\n  pointwise: {template: no_such_template}\n")
    with pytest.raises(SpaceError, match="unknown template"):
        load_space_file(bad)
    bad.write_text("version: x\nclasses:\n  pointwise:\n    template: pointwise\n    knobs:\n"
                   "      threads: {values: [1, 2], probs: [1.0]}\n")
    with pytest.raises(SpaceError, match="probs"):
        load_space_file(bad)


@pytest.mark.parametrize("case", sorted(EXPECTED_CLASS))
def test_each_kernel_is_classified(case, cuda):
    kernels = _kernels(case, cuda)
    assert kernels
    assert classify(kernels[0].mod["main"]) == EXPECTED_CLASS[case]


@pytest.mark.parametrize("case,features", [
    ("pointwise", ["threadIdx.x", "blockIdx.x"]),
    ("swiglu", ["threadIdx.x"]),
    ("add_layernorm", ["__shfl_down_sync"]),   # the row program (its only sketch): warp-shuffle reductions
    ("softmax", ["__shfl_down_sync"]),
    ("attention", ["threadIdx.x"]),
])
def test_cuda_templates_yield_schedules_that_build(case, features, cuda):
    (kernel,) = _kernels(case, cuda)
    choice = select_space(kernel.mod, cuda.target)
    assert choice.source.startswith("template:"), choice
    assert choice.version == load_spaces("cuda").version
    mods = sample_schedules(kernel.mod, cuda.target, choice, n=4, seed=3)
    assert len(mods) >= 2
    sources = []
    for m in mods:
        lib = tvm.compile(m, target=cuda.target)  # CUDA C built by the CUDA compiler; not run here
        sources.append(lib.mod.imports[0].inspect_source())
    for feat in features:
        assert any(feat in s for s in sources), feat


@pytest.mark.parametrize("case", ["gemm_bias_relu", "conv_bn_relu"])
def test_tensorcore_template_builds_tensor_core_kernels_with_the_epilogue_fused(case, cuda):
    # sm_90 without the arch-specific features: the mma/wmma sketches (on sm_90a a GEMM that fits gets wgmma's)
    sm90 = tvm.target.Target({**cuda.target.export(), "arch": "sm_90"})
    kernel = _mma_kernel(case, cuda)
    choice = select_space(kernel.mod, sm90)
    assert choice.source == "template:gemm_tensorcore", choice
    mods = sample_schedules(kernel.mod, sm90, choice, n=8, seed=2)
    assert len(mods) >= 6  # the verifier keeps nearly every sample (the stock tensor-core space kept none)
    sources = []
    for m in mods:
        with build_context():
            src = tvm.compile(m, target=sm90).mod.imports[0].inspect_source()
        sources.append(src)
        assert ("wmma::mma_sync" in src or "mma.sync.aligned.m16n8k16" in src) and "buf_dyn_shmem" in src
        # GEMM and epilogue in one kernel (one definition; the source also declares it): one store of the result
        assert len(re.findall(r"__global__[^;{]*\{", src)) == 1
    # the pipeline sketches: registers (double buffering) and cp.async multistage
    assert any("cp.async.cg.shared.global" in s and "cp.async.wait_group" in s for s in sources)
    assert any("cp.async" not in s for s in sources)
    # both instruction families: wmma fragments, and ldmatrix + mma.sync on the warp-register layout, whose
    # shared tiles are XOR-swizzled (TVM's InjectPermutedLayout) instead of padded
    assert any("wmma::mma_sync" in s for s in sources)
    mma = [s for s in sources if "ldmatrix" in s and "mma.sync.aligned.m16n8k16" in s]
    assert mma and all(" ^ " in s for s in mma)
    if case == "gemm_bias_relu":  # B is [K, N]: loaded in its global order, 16-byte vectors, no gathers
        assert not any("make_half4(c1_ptr" in s for s in sources)


def test_pointwise_space_reaches_16_byte_vectors(cuda):
    (kernel,) = _kernels("pointwise", cuda)
    choice = select_space(kernel.mod, cuda.target)
    sources = [tvm.compile(m, target=cuda.target).mod.imports[0].inspect_source()
               for m in sample_schedules(kernel.mod, cuda.target, choice, n=8, seed=1)]
    assert any("uint4" in s for s in sources)  # 8 fp16 lanes = one 16-byte load/store


def test_failing_template_falls_back_cleanly(tmp_path, cuda):
    (tmp_path / "cuda.yaml").write_text(
        "version: test-1\nclasses:\n  pointwise: {template: row_reduction, fallback_rules: cuda,\n"
        "    knobs: {threads: [128], vector_lanes: [1], row_storage: [shared]}}\n")
    (kernel,) = _kernels("pointwise", cuda)
    choice = select_space(kernel.mod, cuda.target, load_space_file(tmp_path / "cuda.yaml"))
    assert choice.source == "stock:cuda"
    assert "template:row_reduction failed" in choice.note
    assert sample_schedules(kernel.mod, cuda.target, choice, n=1)


def test_llvm_tunes_contractions_over_the_cpu_sketch_and_the_rest_over_the_stock_space(llvm):
    for case, source in (("pointwise", "stock:llvm"), ("gemm_bias_relu", "template:cpu_contraction")):
        (kernel, *_) = _kernels(case, llvm)
        assert select_space(kernel.mod, llvm.target).source == source


def test_tiny_llvm_tuning_improves_on_its_first_candidate(tmp_path, llvm):
    import json

    from tvmfuse.db import open_database
    from tvmfuse.tune import TuneConfig, tune_kernels

    model, _, _ = CASES["gemm_bias_relu"](M=128, K=128, N=128)
    path = tmp_path / "mm.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=llvm)
    kernels = extract_kernels(fused, target=llvm)
    db = open_database(tmp_path / "t.db", target=llvm)
    try:
        (res,) = tune_kernels(kernels[:1], target=llvm, database=db,
                              config=TuneConfig(trials=12, trials_per_kernel=12, trials_per_round=4, population=16))
        records = db.records(db.workload_id(kernels[0].mod))
        assert {r.space_version for r in records} == {load_spaces("llvm").version}
    finally:
        db.close()
    assert res.status == "tuned" and res.space["space"] == "template:cpu_contraction"
    assert len(res.curve) == 12
    ok = [r for r in records if not r.failed]
    # the first candidate is the default schedule (what an untuned build runs: the CPU default, parallel and
    # vectorised), measured and kept as a record
    assert len(records) == 13
    first = json.dumps(records[0].trace)
    assert "Parallel" in first and "Vectorize" in first, first
    assert res.baseline_s == pytest.approx(records[0].mean_secs)
    # the search measured many different schedules, and the best kept is never slower than the default
    assert len({json.dumps(r.trace, sort_keys=True) for r in ok}) >= 6
    assert res.best_s <= res.baseline_s
    assert res.best_s == pytest.approx(min(r.mean_secs for r in ok))
    curve = [b for _, b in res.curve if b is not None]
    assert curve and all(b <= a for a, b in zip(curve, curve[1:]))


@pytest.mark.parametrize("store, marker", [("wmma_store", "wmma::mma_sync"),
                                           ("tvmfuse_mma_store", "mma.sync.aligned.m16n8k16")])
def test_tensorcore_records_round_trip_through_the_database(tmp_path, cuda, store, marker):
    """Its traces hold transform_layout IndexMaps, which TVM 0.27's own record JSON converter rejects; and the
    mma sketch's store into static shared memory is tvmfuse's intrinsic, not one TVM registers."""
    from tvmfuse._tvm import ms
    from cuda_checks import commit_record

    kernel = _mma_kernel("conv_bn_relu", cuda)
    # (sm_90 without the arch-specific features: the mma/wmma sketches; on sm_90a the conv of 16 channels is wgmma's)
    sm90 = tvm.target.Target({**cuda.target.export(), "arch": "sm_90"})
    choice = select_space(kernel.mod, sm90)
    ctx = ms.TuneContext(mod=kernel.mod, target=sm90, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=3)
    sketch = [s for s in ctx.generate_design_space() if store in str(s.trace)][-1]  # the cp.async one
    commit_record(tmp_path / "t.db", cuda, kernel, sketch.trace)
    # read back in a fresh process, where nothing has registered the intrinsics the trace names (builds from a
    # carried-in database on the GPU machine failed that way: the wmma ones, then tvmfuse's mma store)
    script = (
        "import sys\n"
        "from tvmfuse._tvm import tvm\n"
        "from tvmfuse.db import open_database\n"
        "from tvmfuse.target import resolve_target\n"
        "cuda = resolve_target('cuda')\n"
        "mod = tvm.ir.load_json(open(sys.argv[2]).read())\n"
        "db = open_database(sys.argv[1], target=cuda)\n"
        "with cuda.target:\n"
        "    sch = db.ms_database.query_schedule(mod, cuda.target, 't')\n"
        "src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()\n"
        f"print({marker!r} in src)\n")
    (tmp_path / "mod.json").write_text(tvm.ir.save_json(kernel.mod))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "t.db"), str(tmp_path / "mod.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")


def test_tensorcore_samples_apply_when_the_tile_rows_are_odd(cuda):
    """M = 7 x 256 (ResNet-50's 32 x 7 x 7 convs): a raster group that does not divide the 7 tile rows made
    tensorize fail inside MetaSchedule's search and abort the kernel's tuning on the H200."""
    # (K 36 keeps A's rows off 16 bytes: the wgmma template declines it, the mma sketches take it)
    (kernel,) = _kernels("gemm_bias_relu", cuda, dict(M=7 * 256, K=36, N=32))
    # every sampled point of every sketch applies (before the fix, seed 3 failed)
    for choice, sch in _space_points(kernel, cuda, range(1, 25)):
        assert choice.source == "template:gemm_tensorcore", choice
        assert any(inst.kind.name == "Tensorize" for inst in sch.trace.insts)


def test_row_template_takes_4d_softmax_and_3d_layernorm(cuda):
    """BERT's softmax over [B, H, S, S] fell back to the stock space on the H200 (90 us for 50 MB, 13% of the
    copy ceiling): its per-row blocks, computed at a loop fused from three, got min/max loop extents."""
    from tvmfuse.bench.models import SMALL_MODELS, bert_base

    # (head dim 18: no flash kernel takes it, so the attention stays unfused and its softmax is a row kernel)
    model, _, _ = bert_base(**{**SMALL_MODELS["bert_base"], "hidden": 36})
    path = Path(tempfile.mkdtemp()) / "bert.onnx"
    onnx.save(model, path)
    kernels = extract_kernels(partition(import_model(load_model(path)), target=cuda)[0], target=cuda)
    rows = [k for k in kernels if classify(k.mod["main"]) == "row_reduction"]
    assert {k.name for k in rows} >= {"softmax", "layer_norm"}
    for k in rows:
        choice = select_space(k.mod, cuda.target)
        assert choice.source == "template:row_reduction", (k.name, choice)
        mods = sample_schedules(k.mod, cuda.target, choice, n=2, seed=1)
        assert mods
        for m in mods:
            assert "__shfl_down_sync" in tvm.compile(m, target=cuda.target).mod.imports[0].inspect_source()


@pytest.mark.parametrize("case", ["pointwise", "swiglu"])
def test_pointwise_candidates_at_anchor_size_keep_a_few_registers_per_thread(case, cuda):
    """At 16384 x 8192 (a row spans several thread blocks) most candidates used to ask for the whole tensor
    as each thread's register array (268 million elements) or failed to vectorize: the register caches were
    addressed through the fused index's division and modulo, which TVM could not compact."""
    (kernel,) = _kernels(case, cuda, {})  # the anchors' size
    for choice, sch in _space_points(kernel, cuda, range(1, 7)):
        assert choice.source == "template:pointwise", choice
        with build_context():
            src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
        sizes = [int(n) for n in re.findall(r"_local_ptr\[(\d+)\];", src)]
        assert sizes and max(sizes) <= 8, sizes


def test_softmax_shared_sketch_reads_its_input_once_with_vector_loads(cuda):
    """Softmax's max pass read x straight from HBM with 2-byte loads and the exp pass read it again; the
    row is now staged once (16-byte loads) and every pass reads shared memory."""
    (kernel,) = _kernels("softmax", cuda)
    choice = select_space(kernel.mod, cuda.target, _tir_row_spaces())
    staged = []
    for m in sample_schedules(kernel.mod, cuda.target, choice, n=6, seed=5):
        with build_context():
            src = tvm.compile(m, target=cuda.target).mod.imports[0].inspect_source()
        if "x_shared" in src:
            # x leaves HBM only in the copy into shared memory (16-byte vectors at vector_lanes 8)
            loads = [ln for ln in src.splitlines() if "x_ptr" in ln and "main_kernel" not in ln]
            assert loads and all("x_shared_ptr" in ln for ln in loads), loads
            staged.extend(loads)
    assert any("uint4" in ln for ln in staged), staged


@pytest.mark.parametrize("case,cols", [("softmax", 2048), ("add_layernorm", 8192)])
def test_registers_row_sketch_reads_each_element_once_into_its_threads_registers(tmp_path, case, cols, cuda):
    """The `registers` sketch: each thread holds a contiguous slice of its row (cols / threads elements, at most
    row_register_elements) loaded once from HBM with vector loads; every later pass reads those registers,
    only the cross-thread reductions meet in shared memory (a few words), and nothing spills."""
    (kernel,) = [k for k in _kernels(case, cuda, dict(M=64, N=cols)) if classify(k.mod["main"]) == "row_reduction"]
    most = load_spaces("cuda").for_class("row_reduction").extra["row_register_elements"]
    seen = []
    for _, sch in _space_points(kernel, cuda, range(1, 5), _tir_row_spaces()):
        with build_context():
            src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
        body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
        staged = re.findall(r"half (\w+)_local_ptr\[(\d+)\];", body)
        rows = [(name, int(n)) for name, n in staged if int(n) > 8]   # the row slices (vector caches hold <= 8)
        if not rows or re.search(r"__shared__ alignas\(\d+\) half \w+\[(\d{3,})\]", body):
            continue   # the shared or recompute sketch
        threads = int(re.search(r"__launch_bounds__\((\d+)\)", body).group(1))
        for _, n in rows:
            assert n <= most and cols % n == 0 and threads % (cols // n) == 0, (rows, threads)
        # each input row is read from HBM at exactly one place (the loop filling the slice; add+LayerNorm's
        # x + r is computed there), with vector loads
        inputs = ["x_ptr", "r_ptr"] if case == "add_layernorm" else ["x_ptr"]
        for ptr in inputs:
            loads = [ln for ln in body.splitlines() if f"{ptr} +" in ln]
            assert len(loads) == 1 and re.search(r"\*\((half2|half4|uint2|uint4)\*\)\(" + ptr, loads[0]), loads
        shared = [int(n) for n in re.findall(r"__shared__ alignas\(\d+\) \w+ \w+\[(\d+)\]", body)]
        assert all(n <= 32 for n in shared), shared
        assert "__shfl_down_sync" in body
        assert_ptxas_without_spills(src, tmp_path, "sm_90a")
        seen.append((threads, rows))
    assert seen, "no registers candidate sampled"


def test_shared_row_sketch_gives_each_warp_group_its_own_row(cuda):
    """Several rows per block in the shared sketch used to make every warp stage and reduce every row of the
    block (compute_at relaxes threadIdx.y for a shared buffer; 2 rows ran 1.3-1.6x slower on the H200). Now
    each threadIdx.y owns a row of the staged buffer."""
    (kernel,) = _kernels("softmax", cuda)
    cols = 256
    multi = 0
    for choice, sch in _space_points(kernel, cuda, range(1, 13), _tir_row_spaces()):
        with build_context():
            src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
        (size,) = [int(n) for n in re.findall(r"__shared__ alignas\(64\) half x_shared_ptr\[(\d+)\];", src)] or [0]
        if not size:
            continue  # the recompute sketch
        rows = size // cols
        if rows > 1:
            multi += 1
            writes = [ln for ln in src.splitlines() if re.search(r"x_shared_ptr.* = .*x_ptr", ln)]
            assert writes and all(f"threadIdx.y) * {cols}" in ln for ln in writes), writes
    assert multi, "no multi-row candidate sampled"


def test_row_store_stays_in_its_row_when_the_threads_do_not_divide_it(cuda):
    """768 columns as 64 threads x 8 lanes: two column steps, the second half empty. The register cache of the
    output was flattened to one index over the whole tensor, so the store's bound became the tensor's and the
    empty lanes were written over the next row's first columns (BERT's LayerNorm on the H200: relative error
    0.58). Every store must sit under the guard of the computation it stores, at a column inside the row."""
    (kernel,) = _kernels("add_layernorm", cuda, dict(M=64, N=768))
    choice = select_space(kernel.mod, cuda.target, _tir_row_spaces())
    from tvmfuse._tvm import ms

    ctx = ms.TuneContext(mod=kernel.mod, target=cuda.target, space_generator=choice.generator,
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name="t", rand_state=1)
    sketch = ctx.generate_design_space()[0]  # the `shared` sketch
    trace = sketch.trace
    # the template samples threads, vector lanes, rows per block, unroll, in that order
    for inst, value in zip([i for i in trace.insts if i.kind.name == "SampleCategorical"], (64, 8, 1, 0)):
        trace = trace.with_decision(inst, [int(v) for v in inst.attrs[0]].index(value), remove_postproc=True)
    sch = tvm.s_tir.Schedule(kernel.mod, seed=1)
    trace.apply_to_schedule(sch, remove_postproc=True)
    with build_context():
        src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
    assert "__launch_bounds__(64)" in src
    lines = src.splitlines()
    stores = [i for i, ln in enumerate(lines) if re.search(r"^\s*\*\(uint4\*\)\(\w+_ptr \+ .*\) = \*\(uint4\*\)\(\w+_local_ptr", ln)]
    assert stores, "no vector store of the output"
    for i in stores:
        assert "% 768" not in lines[i], lines[i]           # a flat index wrapping into the next row
        guard = lines[i - 1].strip()
        assert guard.startswith("if (") and "< 3)" in guard, guard  # 3 of the 4 column steps hold data


def _shared_kernel(static_halves: int, dyn_halves: int):
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def f(A: T.Buffer((65536,), "float16"), B: T.Buffer((65536,), "float16")):
        with T.sblock("root"):
            S = T.sblock_alloc_buffer((static_halves,), "float16", scope="shared")
            D = T.sblock_alloc_buffer((dyn_halves,), "float16", scope="shared.dyn")
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                for i in range(static_halves // 128):
                    with T.sblock("s"):
                        v = T.axis.spatial(static_halves, i * 128 + tx)
                        S[v] = A[v]
                for i in range(dyn_halves // 128):
                    with T.sblock("d"):
                        v = T.axis.spatial(dyn_halves, i * 128 + tx)
                        D[v] = A[v] + S[v % static_halves]
                for i in range(dyn_halves // 128):
                    with T.sblock("o"):
                        v = T.axis.spatial(dyn_halves, i * 128 + tx)
                        B[v] = D[v]
    return f


@pytest.mark.parametrize("static_kb, dyn_kb, ok", [(14, 45, False), (14, 64.5, True), (8, 16, True), (60, 16, False),
                                                    (40, 200, False)])
def test_shared_memory_check_matches_what_launches(static_kb, dyn_kb, ok, cuda):
    """On the H200 7 of 26 GEMM/conv candidates died at launch (CUDA_ERROR_INVALID_VALUE) with, e.g., 14 KB static
    + 45 KB dynamic shared memory: TVM's runtime opts a kernel into more than 48 KB only when the dynamic part
    alone exceeds 48 KB. Such candidates are now rejected before they are built, as is a total over 227 KB."""
    from tvmfuse.kernels.tensorcore.postprocs import verify_gpu_kernel

    f = _shared_kernel(int(static_kb * 512), int(dyn_kb * 512))
    assert verify_gpu_kernel(f, cuda.target, max_shared_bytes=232448) is ok


def test_nchw_to_nhwc_transpose_gets_a_shared_memory_tile_sketch(cuda):
    """The conv case's NCHW -> NHWC input transpose ran at 23% of the copy ceiling on the H200 (212 us): every
    flat candidate read x 2 bytes at a time with a stride of H x W. The tiled sketch reads rows of the input's
    innermost axis into shared memory with vector loads and writes the output's innermost axis with vector
    stores."""
    (kernel,) = [k for k in _kernels("conv_bn_relu", cuda, {"layout": "NCHW"}) if k.name == "transpose"]
    tiled = []
    for choice, sch in _space_points(kernel, cuda, range(1, 7)):
        assert choice.source == "template:pointwise", choice
        with build_context():
            src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
        if "x_shared_ptr" not in src:
            continue
        loads = [ln for ln in src.splitlines() if "= *(" in ln and "(x_ptr +" in ln]
        stores = [ln for ln in src.splitlines() if "T_transpose_ptr" in ln and " = " in ln and "__global__" not in ln]
        assert loads and all("x_shared_ptr" in ln.split(" = ")[0] for ln in loads), loads
        assert stores and all(re.match(r"\s*(\*\((half\d|uint\d)\*\)\(|)T_transpose_ptr", ln) for ln in stores), stores
        # rows padded to an odd number of words: the tile's vector stores fit that (16-byte ones did not, and
        # killed every such candidate on the H200)
        assert assert_shared_vectors_aligned(src) >= 1
        tiled.append(src)
    assert len(tiled) >= 2


def test_transpose_gpu_script_samples_both_sketches_without_a_gpu():
    """benchmarks/transpose_gpu.py (the H200 measurement of the conv case's transpose) builds its sampled points
    here with --build-only: half of them come from the tiled sketch (one flat sketch beside it for transposes)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "transpose_gpu.py"
    out = subprocess.run([sys.executable, str(script), "--build-only", "--points", "6"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-1500:]
    assert sorted(out.stdout.split()) == ["flat"] * 3 + ["tiled"] * 3, out.stdout


def test_transpose_sketch_with_a_second_operand(cuda):
    """y = r + transpose(x): the staged tile is x's, whichever operand the block reads first."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64, 8, 8])
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT16, [2, 8, 8, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8, 8, 64])
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]), helper.make_node("Add", ["r", "t"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, r], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = Path(tempfile.mkdtemp()) / "transpose_add.onnx"
    onnx.save(model, path)
    (kernel,) = extract_kernels(partition(import_model(load_model(path)), target=cuda)[0], target=cuda)
    tiled = 0
    for choice, sch in _space_points(kernel, cuda, range(1, 3)):
        with build_context():
            src = tvm.compile(sch.mod, target=cuda.target).mod.imports[0].inspect_source()
        if "x_shared" in src:
            tiled += 1
            # a tile of 32 or 64 channels x the 8 columns of w, each channel's row padded from 8 to 34 elements
            # (17 four-byte words: an odd count, so a column read hits 32 different banks)
            (size,) = [int(n) for n in re.findall(r"half x_shared_ptr\[(\d+)\];", src)]
            assert size in (32 * 34, 64 * 34), size
    assert tiled


def test_an_untuned_cuda_build_and_the_tuners_baseline_run_the_pointwise_default(tmp_path, cuda):
    """Without a record a pointwise kernel on CUDA runs the pointwise template at the space's `untuned` knobs
    (16-byte vectors, 128 threads, a vector a thread, unroll 16: the H200's best for SwiGLU and the gelu chain,
    2026-11-30, where dlight's schedule took 2.6x as long), reported as untuned; the tuner's baseline is that
    schedule, post-processed. A transpose keeps dlight (its fast sketch is the tiled one), as does a kernel whose
    space has no `untuned` entry."""
    from tvmfuse.compile.build import build
    from tvmfuse.tune.defaults import default_template_schedule, template_default_schedule

    model, _, _ = CASES["swiglu"](M=64, N=1024)
    path = tmp_path / "s.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    (kernel,) = extract_kernels(fused, target=cuda)
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["pointwise-default"] and result.untuned == [kernel.name]
    src = cuda_source(result.executable)
    body = src[src.index('extern "C" __global__'):]   # (TVM's prelude defines hexp)
    assert "__launch_bounds__(128)" in body and "*(uint4*)(a_ptr" in body and "exp2f" in body and "hexp" not in body
    sch = default_template_schedule(kernel.mod, cuda.target)
    cats = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    assert [int(i.attrs[0][int(sch.trace.get_decision(i))]) for i in cats] == [8, 128, 1, 16]
    assert "enter_postproc" in str(sch.trace) and "meta_schedule.unroll_explicit" not in sch.mod.script()
    (transpose,) = [k for k in _kernels("conv_bn_relu", cuda, {"layout": "NCHW"}) if k.name == "transpose"]
    assert template_default_schedule(transpose.mod, cuda.target, "pointwise") is None
    bare = tmp_path / "cuda.yaml"
    text = load_spaces("cuda").path.read_text()
    bare.write_text(re.sub(r"\n +untuned: \{[^}]*\}", "", text))
    assert "untuned" not in load_space_file(bare).for_class("pointwise").extra
    assert template_default_schedule(kernel.mod, cuda.target, "pointwise", load_space_file(bare)) is None
