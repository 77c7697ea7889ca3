"""The CUDA-core flash kernel for fp32 attention: the planner fuses fp32 attention on GPUs because of it, its configs
fit a thread's registers (ptxas: no spills), ragged, causal, GQA and masked specs generate, and the search space
samples its configs. (Built here, not run: its numerics are checked on the H200 against onnxruntime by
``tvmfuse bench`` / ``scripts/gpu_model_check.py``, see BENCHMARKS.md.)"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

import models  # noqa: E402
from cuda_checks import assert_ptxas_without_spills, cuda_source  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.compile.build import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.kernels.flash.simt import REGISTER_BUDGET, SimtConfig, simt_configs, simt_default  # noqa: E402
from tvmfuse.kernels.mutator import knob_vector  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec, gpu_misfit, simt_gpu_misfit  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402
from tvmfuse.tune.defaults import config_schedule  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})

SPECS = {
    # BERT's small export at 8 x 512: a [B, 1, 1, S] mask, Kᵀ given
    "bert": AttentionSpec(batch=(8, 4), seq_q=512, seq_k=512, head_dim=16, head_dim_v=16, dtype="float32",
                          scale=0.25, mask_shape=(8, 1, 1, 512), k_rows=False),
    # ViT's 197 tokens: no tile divides them
    "ragged": AttentionSpec(batch=(2, 12), seq_q=197, seq_k=197, head_dim=64, head_dim_v=64, dtype="float32",
                            scale=0.125, mask_shape=None, k_rows=True),
    # a decoder: causal, two query heads a K/V head, ragged
    "causal-gqa": AttentionSpec(batch=(2, 8), seq_q=100, seq_k=100, head_dim=32, head_dim_v=32, dtype="float32",
                                scale=None, mask_shape=None, causal=True, kv_group=2),
    # T5: a relative-position bias per head and a padding mask, unscaled
    "t5": AttentionSpec(batch=(8, 4), seq_q=512, seq_k=512, head_dim=16, head_dim_v=16, dtype="float32", scale=None,
                        mask_shape=(1, 4, 512, 512), bias_shape=(8, 1, 1, 512)),
    "mask-first": AttentionSpec(batch=(4,), seq_q=64, seq_k=80, head_dim=80, head_dim_v=80, dtype="float32",
                                scale=0.1, mask_shape=(64, 80), scale_first=False),
}


@pytest.fixture(scope="module")
def cuda():
    return resolve_target("cuda")


def _fp32_attention(tmp_path, seq=64, dim=16):
    path = tmp_path / f"attention_fp32_{seq}_{dim}.onnx"
    onnx.save(models.attention(seq=seq, dim=dim, mask=True), path)
    return import_model(load_model(path))


def test_fp32_attention_fuses_on_gpus_and_builds_the_cuda_core_kernel(tmp_path, cuda):
    # (on Hopper an fp32 build takes the TF32 kernel in three products: tests/kernels/test_flash_tf32.py; the CUDA-core
    # kernel is every other GPU's, and Hopper's where asked)
    fused, plan = partition(_fp32_attention(tmp_path), target=cuda, fp32_tensor_cores=False)
    assert [g.pattern for g in plan.groups] == ["attention"]
    (func,) = [f for f in fused.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and SPEC_ATTR in f.attrs]
    spec = AttentionSpec.from_json(str(func.attrs[SPEC_ATTR]))
    assert spec.dtype == "float32" and gpu_misfit(spec) is None
    assert flash.default_config(spec, wgmma=True) == simt_default(spec, 132)
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["flash-default"]
    src = cuda_source(result.executable)
    assert "mma" not in src and "__shfl_xor_sync" in src   # CUDA cores; the lanes of a row meet by shuffles
    assert "float4" in src   # K and V read from shared memory 4 floats at a time


def test_the_search_space_samples_cuda_core_configs_for_fp32(tmp_path, cuda):
    from tvmfuse.tune import extract_kernels

    fused, _ = partition(_fp32_attention(tmp_path, seq=96, dim=32), target=cuda, fp32_tensor_cores=False)
    (kernel,) = [k for k in extract_kernels(fused, target=cuda) if SPEC_ATTR in k.mod["main"].attrs]
    names = []
    config_schedule(kernel.mod, cuda.target, "flash", lambda n: names.extend(n) or 0)
    spec = flash.spec_of(kernel.mod["main"])
    # the space's flash_simt_* knobs name every choice: all configs that fit, in the knobs' order
    assert sorted(names) == sorted(c.name for c in simt_configs(spec)) and len(names) > 20
    for name in names:
        assert flash.parse_config(name) == SimtConfig(**{f: v for f, v in zip(
            ("threads", "rows", "lanes", "block_n"), [knob_vector(name)[k] for k in "trln"])})
    # configs that differ differ in the knobs the cost model's features read
    assert len({tuple(sorted(knob_vector(n).items())) for n in names}) == len(names)


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_config_generates_and_fits_a_threads_registers(case):
    spec = SPECS[case]
    assert simt_gpu_misfit(spec) is None
    options = simt_configs(spec)
    assert options and simt_default(spec, 132) in options
    for cfg in options:
        assert cfg.registers(spec) <= REGISTER_BUDGET and cfg.block_n % cfg.lanes == 0
        flash.flash_primfunc(spec, cfg)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,name", [("bert", None), ("bert", "c t256 r2 l4 n32"), ("ragged", None),
                                       ("ragged", "c t64 r1 l1 n16"), ("causal-gqa", None),
                                       ("causal-gqa", "c t128 r2 l4 n32"), ("mask-first", None), ("t5", None)])
def test_cuda_core_kernels_build_for_sm90a_without_register_spills(tmp_path, case, name):
    """The register budget keeps every config's rows, outputs and scores in registers: a sweep of all configs at
    head dims 16-80 (ptxas, sm_90a) spilled none within it; these cover each spec's default and a corner."""
    spec = SPECS[case]
    cfg = flash.parse_config(name) if name else simt_default(spec, 132)
    assert cfg in simt_configs(spec)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    assert_ptxas_without_spills(lib.mod.imports[0].inspect_source(), tmp_path, "sm_90a")


def test_the_default_splits_rows_among_lanes_until_the_gpu_is_full():
    spec = SPECS["bert"]   # 8 x 4 x 512 = 16384 rows
    assert simt_default(spec, 132).lanes == 8                # 132 SMs x 1024 threads: 8 lanes a row
    assert simt_default(spec, 16) == SimtConfig(128, 1, 1, 32)   # 16 SMs: a thread a row fills them
    many = AttentionSpec(**{**spec.__dict__, "batch": (64, 16)})   # 16x the rows: two rows a thread
    assert simt_default(many, 132) == SimtConfig(128, 2, 1, 32)


def test_what_neither_flash_kernel_takes_is_named():
    big = AttentionSpec(batch=(2,), seq_q=64, seq_k=64, head_dim=128, head_dim_v=128, dtype="float32", scale=None,
                        mask_shape=None)
    assert "fit 160" in simt_gpu_misfit(big) and "takes fp16" in gpu_misfit(big)
    odd = AttentionSpec(batch=(2,), seq_q=64, seq_k=64, head_dim=18, head_dim_v=18, dtype="float32", scale=None,
                        mask_shape=None)
    assert "multiples of 4" in gpu_misfit(odd) and simt_configs(odd) == []
    fp16 = AttentionSpec(**{**SPECS["bert"].__dict__, "dtype": "float16"})
    assert gpu_misfit(fp16) is None and "takes fp32" in simt_gpu_misfit(fp16)   # the tensor-core kernel's


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", ["w4 m2 n32 s1", "w4 m1 n64 s1 h"])
def test_the_tensor_core_kernels_read_a_bias_beside_the_mask(tmp_path, cfg):
    """T5 in fp16: both additions are read where the tensor-core kernels form the score."""
    spec = AttentionSpec(batch=(2, 4), seq_q=512, seq_k=512, head_dim=64, head_dim_v=64, dtype="float16", scale=None,
                         mask_shape=(1, 4, 512, 512), mask_dtype="float16", bias_shape=(2, 1, 1, 512),
                         bias_dtype="float16")
    func = flash.flash_primfunc(spec, flash.parse_config(cfg))
    assert [p.name for p in func.params] == ["q", "k", "v", "mask", "bias", "out"]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert "bias_ptr[" in src and "mask_ptr[" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")
