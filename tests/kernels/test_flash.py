"""The tensor-core flash-attention template: where the planner forms attention on GPUs, how the search space
samples its tiles, how a record selects the kernel a build runs, and that every kernel builds for sm_90
without register spills. (CUDA built here, not run: the kernels' numerics are checked on the H200 by
benchmarks/flash_gpu.py and benchmarks/bench_gpu.py, against PyTorch in fp32, every config; see BENCHMARKS.md.)"""
from __future__ import annotations

import re
from dataclasses import replace
import shutil
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import (assert_copy_sources_disjoint, cuda_source, assert_ptxas_without_spills,  # noqa: E402
                         assert_shared_offsets_aligned, build_with_record)
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.tune.builder import fast_build
from tvmfuse.compile.build import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec, tiled_gpu_misfit  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.tune import extract_kernels  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.kernels.flash.softmax import kt_vector  # noqa: E402
from tvmfuse.tune.defaults import config_schedule, template_default_schedule  # noqa: E402
from tvmfuse.tune.spaces import load_spaces  # noqa: E402

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _fp16_attention(tmp_path, seq=64, dim=16, mask=True, fp16=True):
    model = models.attention(seq=seq, dim=dim, mask=mask)
    if fp16:
        model = models.to_fp16(model)
    path = tmp_path / f"attention_{seq}_{dim}_{int(fp16)}.onnx"
    onnx.save(model, path)
    return import_model(load_model(path))


def _attention_funcs(fused):
    return [f for f in fused.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and SPEC_ATTR in f.attrs]


def test_gpu_plans_fuse_attention_where_the_flash_template_fits(tmp_path, cuda):
    fused, plan = partition(_fp16_attention(tmp_path), target=cuda)
    assert [g.pattern for g in plan.groups] == ["attention"]
    (func,) = _attention_funcs(fused)
    spec = AttentionSpec.from_json(str(func.attrs[SPEC_ATTR]))
    assert (spec.batch, spec.seq_q, spec.seq_k, spec.head_dim, spec.dtype) == ((2, 3), 64, 64, 16, "float16")
    assert spec.mask_shape == (2, 1, 1, 64)


def test_ragged_sequences_fuse_and_build_the_guarded_mma_sync_kernel(tmp_path, cuda):
    """48 tokens: no whole tile of rows or keys; the Hopper kernels take whole tiles only, so the default is an
    mma.sync one, its last tiles guarded (rows past the end not stored, keys past the end -inf)."""
    fused, plan = partition(_fp16_attention(tmp_path, seq=48, dim=16), target=cuda)
    assert [g.pattern for g in plan.groups] == ["attention"]
    (func,) = _attention_funcs(fused)
    spec = flash.spec_of(func)
    cfg = flash.default_config(spec, wgmma=True)
    assert not cfg.wgmma and all(not c.wgmma for c in flash.all_configs(spec, wgmma=True))
    src = flash.flash_source(spec, cfg)
    assert "< 48" in src and "T.float32('-inf')" in src
    result = build(fused, target=cuda)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in cuda_source(result.executable)
    # Kᵀ's rows of 1500 or 197 keys do not keep 16-byte vectors aligned: its copies narrow to 4 and 1 halves; cp.async
    # copies 8 bytes of them where two stages are offered, and none under its least 4
    for keys, width in ((1500, 4), (197, 1), (1000, 8)):
        kt = AttentionSpec(batch=(2, 8), seq_q=keys, seq_k=keys, head_dim=64, head_dim_v=64, dtype="float16",
                           scale=0.125, mask_shape=None, k_rows=False)
        assert tiled_gpu_misfit(kt) is None and kt_vector(kt) == width
        two = [c for c in flash.all_configs(kt, wgmma=True) if c.stages == 2]
        assert bool(two) == (width >= 2)
        assert f"for e in T.vectorized({width}):" in flash.flash_source(kt, flash.FlashConfig(4, 64, 1, 1))
        if two:
            assert f", {2 * width}))" in flash.flash_source(kt, two[0])


@pytest.mark.parametrize("seq,dim,fp16,why", [(48, 24, True, "head dims 24/24 (the template takes multiples of 16"),
                                              # (fp32 on Hopper: the TF32 kernel in three products, then the CUDA
                                              # cores' kernel)
                                              (64, 18, False, "head dims 18/18 (the template takes multiples of 8 up "
                                                              "to 128); head dims 18/18 (the CUDA-core flash kernel "
                                                              "takes multiples of 4)")])
def test_gpu_plans_leave_attention_unfused_where_it_does_not_fit(tmp_path, cuda, seq, dim, fp16, why):
    """(fp32 attention the CUDA-core kernel takes is fused: tests/kernels/test_flash_simt.py)"""
    fused, plan = partition(_fp16_attention(tmp_path, seq=seq, dim=dim, fp16=fp16), target=cuda)
    assert not plan.by_pattern("attention")
    assert any(r.reason.startswith("attention not fused: ") and why in r.reason and r.ops[-2:] == ("softmax", "matmul")
               for r in plan.rejected), [r.reason for r in plan.rejected]
    assert not _attention_funcs(fused)


def test_untuned_gpu_build_runs_the_default_flash_kernel(tmp_path, cuda):
    fused, _ = partition(_fp16_attention(tmp_path, seq=128, dim=32), target=cuda)
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["flash-default"]
    assert result.untuned == [result.kernels[0].name]  # untuned is reported as untuned
    src = cuda_source(result.executable)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src and "ldmatrix" in src
    assert "__shfl_xor_sync" in src
    # no buffer anywhere holds a 128 x 128 score tile: the biggest shared array is a K/V/Q tile
    sizes = [int(n) for n in re.findall(r"\w+_ptr\[(\d+)\]", src)]
    assert sizes and max(sizes) < 128 * 128


def _attention_kernel(tmp_path, cuda, seq=128, dim=32):
    fused, _ = partition(_fp16_attention(tmp_path, seq=seq, dim=dim), target=cuda)
    (kernel,) = [k for k in extract_kernels(fused, target=cuda) if SPEC_ATTR in k.mod["main"].attrs]
    return fused, kernel


def _sketch_with(kernel, cuda, index: int):
    """The attention space's sketch with its flash config decision set to ``index``."""
    sch = config_schedule(kernel.mod, cuda.target, "flash", lambda names: index)
    assert sch is not None
    return sch


def test_the_space_samples_flash_tiles_from_the_yaml_knobs(tmp_path, cuda):
    _, kernel = _attention_kernel(tmp_path, cuda)
    spec = flash.spec_of(kernel.mod["main"])
    space = load_spaces("cuda").for_class("attention")
    expected = flash.configs(spec, **{k: space.knobs[f"flash_{k}"].values
                                      for k in ("warps", "m_tiles", "block_n", "stages")},
                             max_shared_bytes=int(space.extra["flash_max_shared_bytes"]))
    assert len(expected) >= 4
    picked = set()
    for index in (0, len(expected) - 1):
        sch = _sketch_with(kernel, cuda, index)
        cfg = flash.annotated_config(sch.mod["main"])
        assert cfg == expected[index]
        picked.add(cfg)
        kernel_func = flash.expand(sch.mod)["main"]
        assert kernel_func.attrs["tvmfuse.kernel"] == "attention_flash"
        # the builder MetaSchedule measures candidates with swaps the kernel in before compiling
        src = fast_build(sch.mod, SM90, None).imports[0].inspect_source()
        assert f"__launch_bounds__({32 * cfg.warps})" in src
        assert ("cp.async.cg.shared.global" in src) == (cfg.stages == 2)
    assert len(picked) == 2


def test_a_tuned_record_selects_the_flash_kernel_a_build_runs(tmp_path, cuda):
    fused, kernel = _attention_kernel(tmp_path, cuda)
    spec = flash.spec_of(kernel.mod["main"])
    sch = _sketch_with(kernel, cuda, 1)
    cfg = flash.annotated_config(sch.mod["main"])
    assert cfg != flash.default_config(spec)  # so the build below cannot pass on the default
    result = build_with_record(tmp_path / "t.db", cuda, fused, kernel, sch.trace)
    assert [k.schedule for k in result.kernels] == ["tuned"]
    src = cuda_source(result.executable)
    assert f"__launch_bounds__({32 * cfg.warps})" in src and "mma.sync" in src
    # and `tvmfuse inspect` names the tiles the record selects
    from tvmfuse.inspect import InspectConfig, inspect_database

    report = inspect_database(InspectConfig(db=tmp_path / "t.db", target="cuda"))
    assert [k["flash_config"] for k in report["kernels"]] == [cfg.name]


def test_the_tuners_baseline_for_attention_is_the_flash_default(tmp_path, cuda):
    """The tuner measures and keeps what an untuned build would run: for attention on CUDA that is the flash
    template's default tiles (the scalar kernel, dlight's schedule, is only the correctness reference)."""

    _, kernel = _attention_kernel(tmp_path, cuda)
    sch = template_default_schedule(kernel.mod, cuda.target, "flash")
    assert flash.annotated_config(sch.mod["main"]) == flash.default_config(flash.spec_of(kernel.mod["main"]))
    assert template_default_schedule(kernel.mod, resolve_target("llvm").target, "flash") is None


def test_a_config_index_outside_the_recorded_candidates_is_a_clear_error():
    names = "w4 m1 n32 s1;w8 m2 n64 s2"
    assert flash.config_at(names, 1) == flash.FlashConfig(warps=8, block_n=64, stages=2, m_tiles=2)
    with pytest.raises(ValueError, match="flash config 5 of 2 candidates"):
        flash.config_at(names, 5)


@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 96, 112, 128])
@pytest.mark.parametrize("seq", [(64, 32), (128, 96), (4096, 4096)])
def test_every_shape_the_planner_fuses_on_gpus_has_a_tile_config(d, seq):
    """The planner's fit check and the template's configs must agree, or a build would find no kernel."""
    from tvmfuse.plan.attention import tiled_gpu_misfit

    spec = AttentionSpec(batch=(2,), seq_q=seq[0], seq_k=seq[1], head_dim=d, head_dim_v=d, dtype="float16",
                         scale=None, mask_shape=None)
    assert tiled_gpu_misfit(spec) is None
    assert flash.configs(spec)
    if seq[1] < 4096:   # every config offered generates its kernel (a 32x48 K tile is 192 vectors for 128 threads)
        for cfg in flash.configs(spec):
            flash.flash_primfunc(spec, cfg)
    assert "up to 128" in tiled_gpu_misfit(AttentionSpec(**{**spec.__dict__, "head_dim": 256, "head_dim_v": 256}))


SPECS = {
    "rows+mask": AttentionSpec(batch=(2, 4), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64, dtype="float16",
                               scale=0.125, mask_shape=(2, 1, 1, 256), k_rows=True),
    "kT": AttentionSpec(batch=(8,), seq_q=128, seq_k=192, head_dim=128, head_dim_v=128, dtype="float16",
                        scale=None, mask_shape=(128, 192), scale_first=False, k_rows=False),
    # ViT-base's 197 tokens: a ragged last tile of rows and of keys, guarded
    "ragged": AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64, head_dim_v=64, dtype="float16",
                            scale=0.125, mask_shape=None, k_rows=True),
    # 1000 keys with Kᵀ given: its 8-key vectors stay whole
    "ragged-kT": AttentionSpec(batch=(2, 8), seq_q=1000, seq_k=1000, head_dim=64, head_dim_v=64, dtype="float16",
                               scale=0.125, mask_shape=(2, 1, 1, 1000), k_rows=False),
    # ViT's 197 tokens with Kᵀ given (as the exporters give it): Kᵀ copied one half at a time
    "vit-kT": AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64, head_dim_v=64, dtype="float16",
                            scale=0.125, mask_shape=None, k_rows=False),
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,cfg", [("rows+mask", flash.FlashConfig(4, 64, 2, 1)),
                                      ("rows+mask", flash.FlashConfig(8, 32, 1, 2)),
                                      ("kT", flash.FlashConfig(4, 32, 2, 2)),
                                      ("kT", flash.FlashConfig(8, 64, 1, 1)),
                                      ("ragged", flash.FlashConfig(4, 32, 1, 2)),
                                      ("ragged", flash.FlashConfig(8, 128, 2, 1)),
                                      ("ragged-kT", flash.FlashConfig(4, 64, 2, 2)),
                                      ("vit-kT", flash.FlashConfig(4, 32, 1, 2))])
def test_flash_kernels_build_for_sm90_without_register_spills(tmp_path, case, cfg):
    spec = SPECS[case]
    assert cfg in flash.configs(spec)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90)
    src = lib.mod.imports[0].inspect_source()
    assert src.count("mma.sync") >= 2 and ("ldmatrix.sync.aligned.m8n8.x4.trans" in src)
    assert_ptxas_without_spills(src, tmp_path, "sm_90")


# ------------------------------------------------------------------------------------ Hopper (wgmma) kernels
SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def test_wgmma_configs_take_head_dims_of_64_and_one_tile_per_warpgroup():
    spec = SPECS["rows+mask"]
    hopper = flash.configs(spec, wgmma=(True,))
    assert hopper and all(c.wgmma and c.m_tiles == 1 and c.block_n in (64, 128) for c in hopper)
    assert not any(c.wgmma for c in flash.configs(spec))   # mma.sync only unless asked
    assert {c.name for c in flash.configs(spec, wgmma=(True, False))} == {c.name for c in hopper + flash.configs(spec)}
    for c in hopper:
        assert flash.parse_config(c.name) == c and c.name.endswith(" h")
    d16 = AttentionSpec(batch=(2,), seq_q=128, seq_k=128, head_dim=16, head_dim_v=16, dtype="float16", scale=None,
                        mask_shape=None)
    assert not flash.configs(d16, wgmma=(True,))
    # the warp-specialized kernel first (whole 128-row tiles), else the cp.async one
    assert flash.default_config(spec, wgmma=True) == flash.parse_config("w8 m1 n128 s2 hto")
    assert flash.default_config(replace(spec, seq_q=192), wgmma=True) == flash.parse_config("w4 m1 n64 s1 h")
    assert flash.default_config(replace(spec, causal=True), wgmma=True) == flash.parse_config("w4 m1 n64 s1 h")
    assert not flash.default_config(d16, wgmma=True).wgmma   # falls back to the mma.sync default


def test_on_sm90a_the_space_offers_wgmma_tiles_and_the_default_is_one(tmp_path, cuda):

    assert cuda.target.attrs["arch"] == "sm_90a"
    _, kernel = _attention_kernel(tmp_path, cuda, seq=128, dim=64)
    names = []
    config_schedule(kernel.mod, cuda.target, "flash", lambda n: names.extend(n) or 0)
    assert {n.split()[-1] for n in names} >= {"h", "hp", "ht", "htp", "hto"} and any(n.endswith("s1") for n in names)
    sch = template_default_schedule(kernel.mod, cuda.target, "flash")
    cfg = flash.annotated_config(sch.mod["main"])
    assert cfg == flash.parse_config("w8 m1 n128 s2 hto")
    src = fast_build(sch.mod, cuda.target, None).imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in src and "__launch_bounds__(384)" in src
    assert "cp.async.bulk.tensor" in src
    # a plain sm_90 target gets mma.sync tiles only
    sm90 = tvm.target.Target({**{k: v for k, v in cuda.target.export().items() if k in (
        "kind", "max_threads_per_block", "max_shared_memory_per_block", "thread_warp_size")}, "arch": "sm_90"})
    names = []
    config_schedule(kernel.mod, sm90, "flash", lambda n: names.extend(n) or 0)
    assert names and not any(n.split()[-1].startswith("h") for n in names)


def test_untuned_hopper_build_runs_the_wgmma_flash_kernel(tmp_path, cuda):
    fused, _ = partition(_fp16_attention(tmp_path, seq=128, dim=64), target=cuda)
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["flash-default"]
    src = cuda_source(result.executable)
    assert "wgmma.mma_async" in src and "cp.async" in src


def test_overlapped_wgmma_configs_pair_key_steps_and_fit_two_score_accumulators():
    spec = SPECS["rows+mask"]
    plain = flash.configs(spec, wgmma=(True,))
    both = flash.configs(spec, wgmma=(True,), overlap=(True,))
    overlapped = [c for c in both if c.overlap]
    assert overlapped and [c for c in both if not c.overlap] == plain
    for c in overlapped:
        assert c.wgmma and c.stages == 2 and c.name.endswith(" hp") and flash.parse_config(c.name) == c
        assert spec.seq_k % (2 * c.block_n) == 0
        assert c.block_n + c.block_n // 4 + spec.head_dim_v // 2 <= 160   # S twice, P packed, O
    assert not any(c.overlap for c in flash.configs(spec, wgmma=(False,), overlap=(True,)))   # Hopper only


def test_the_overlapped_kernel_keeps_the_next_score_in_flight_during_the_softmax(tmp_path, cuda):
    """In the main loop each key step waits for the tensor cores once, at its top; the next step's Q·Kᵀ is
    issued before the softmax and this step's P·V after it, and neither is waited for within the step. The
    space offers these kernels on sm_90a."""
    spec, cfg = SPECS["rows+mask"], flash.parse_config("w4 m1 n64 s2 hp")
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    body = src[src.index('extern "C" __global__ void __launch_bounds__(128) main_kernel('):]
    loop = body[body.index("for (int jj = 0;"):]
    events = []
    for ln in loop.splitlines():
        if "wgmma_wait_group" in ln:
            events.append("wait")
        elif "wgmma_f16_ss_mma_async" in ln:
            events.append("S")
        elif "wgmma_f16_rs_mma_async" in ln:
            events.append("PV")
        elif "exp2" in ln and (not events or events[-1] != "softmax"):
            events.append("softmax")
    steps = [e for e in " ".join(events).split("wait") if e.strip()]
    assert len(steps) >= 2, events
    for step in steps[:2]:   # the two unrolled steps of a pair
        kinds = step.split()
        assert kinds.index("S") < kinds.index("softmax") < kinds.index("PV"), kinds
    _, kernel = _attention_kernel(tmp_path, cuda, seq=128, dim=64)
    names = []
    config_schedule(kernel.mod, cuda.target, "flash", lambda n: names.extend(n) or 0)
    assert any(n.endswith(" hp") for n in names)


@pytest.mark.parametrize("case", [*sorted(SPECS), "kT+pairs"])
def test_every_hopper_configs_copies_and_descriptors_land_aligned_in_its_shared_tiles(case):
    """The H200 run of 2026-11-30 found the overlapped kernel's other-slot address written ``base + 1 - par *
    tile`` (a slot expression pasted without parentheses): an odd offset, an illegal access on the GPU, and
    nothing on the CPU. Every cp.async destination and wgmma descriptor start, at every loop value, must be a
    whole 16 bytes inside the shared buffer."""
    spec = SPECS.get(case) or AttentionSpec(batch=(2, 4), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64,
                                            dtype="float16", scale=0.125, mask_shape=(2, 1, 1, 256), k_rows=False)
    cfgs = [c for c in flash.configs(spec, wgmma=(True,), overlap=(True,), max_shared_bytes=227 * 1024) if c.wgmma]
    if case in ("ragged", "ragged-kT", "vit-kT"):   # the Hopper kernels take whole tiles only
        assert not cfgs
    assert any(c.overlap for c in cfgs) or case in ("kT", "ragged", "ragged-kT", "vit-kT")   # kT's 192 keys: no pairs
    for cfg in cfgs:
        assert assert_shared_offsets_aligned(flash.flash_primfunc(spec, cfg)) >= 10, cfg.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,cfg", [("rows+mask", "w4 m1 n64 s1 h"), ("rows+mask", "w8 m1 n128 s2 h"),
                                      ("kT", "w8 m1 n64 s2 h"), ("rows+mask", "w4 m1 n64 s2 hp"),
                                      ("rows+mask", "w8 m1 n64 s2 hp")])
def test_wgmma_flash_kernels_build_for_sm90a_without_register_spills(tmp_path, case, cfg):
    spec, cfg = SPECS[case], flash.parse_config(cfg)
    assert cfg in flash.configs(spec, wgmma=(True,), overlap=(True,), max_shared_bytes=227 * 1024)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert src.count("wgmma.mma_async") >= 2 and "mma.sync" not in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")
    if cfg.stages > 1:   # Q, K and V tiles by cp.async: no chunk of the one shared buffer is filled from two
        assert assert_copy_sources_disjoint(src) >= 3
