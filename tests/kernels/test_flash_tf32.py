"""Flash attention in TF32 (``--precision tf32``): the planner marks fp32 attention for it, its configs are the
``mma.sync`` kernel's (one 16-row tile a warp), its fragment maps compute ``P·V`` with P left in its accumulator's
registers, and its kernels build for sm_90a without spills. (Built here, not run: ``benchmarks/flash_gpu.py --tf32``
checks every config on the GPU against an fp32 reference; see BENCHMARKS.md.)"""
from __future__ import annotations

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
from cuda_checks import assert_ptxas_without_spills, cuda_source  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.compile.build import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.kernels.flash import tf32  # noqa: E402
from tvmfuse.kernels.flash.simt import SimtConfig  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec, simt_gpu_misfit, tiled_gpu_misfit  # noqa: E402
from tvmfuse.plan.tf32 import tf32_rounded  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})

SPECS = {
    # BERT-base at 8 x 512: Kᵀ given, a [B, 1, 1, S] padding mask
    "bert": AttentionSpec(batch=(8, 12), seq_q=512, seq_k=512, head_dim=64, head_dim_v=64, dtype="float32",
                          scale=0.125, mask_shape=(8, 1, 1, 512), k_rows=False, tf32=True),
    # a decoder: causal, four query heads a K/V head, K as rows, head dim 128
    "causal-gqa": AttentionSpec(batch=(2, 8), seq_q=256, seq_k=256, head_dim=128, head_dim_v=128, dtype="float32",
                                scale=None, mask_shape=None, k_rows=True, causal=True, kv_group=4, tf32=True),
    # T5: a relative-position bias beside the padding mask, unscaled
    "t5": AttentionSpec(batch=(8, 4), seq_q=128, seq_k=128, head_dim=16, head_dim_v=16, dtype="float32", scale=None,
                        mask_shape=(1, 4, 128, 128), bias_shape=(8, 1, 1, 128), tf32=True),
    # head dim 80 (multiples of 8 in TF32), mask before the scale
    "d80": AttentionSpec(batch=(4,), seq_q=64, seq_k=96, head_dim=80, head_dim_v=80, dtype="float32", scale=0.1,
                         mask_shape=(64, 96), scale_first=False, k_rows=True, tf32=True),
    # ViT-base's 197 tokens: ragged last tiles of rows and keys
    "ragged": AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64, head_dim_v=64, dtype="float32",
                            scale=0.125, mask_shape=None, k_rows=True, tf32=True),
    # ViT's 197 tokens with Kᵀ given (as the exporters give it): Kᵀ copied one float at a time
    "vit-kT": AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64, head_dim_v=64, dtype="float32",
                            scale=0.125, mask_shape=None, k_rows=False, tf32=True),
    # Whisper's 1500 frames with Kᵀ given (its 4-key vectors whole in fp32) and a padding mask, read at the last row /
    # key past the end
    "ragged-kT": AttentionSpec(batch=(2, 8), seq_q=1500, seq_k=1500, head_dim=64, head_dim_v=64, dtype="float32",
                               scale=0.125, mask_shape=(2, 1, 1, 1500), k_rows=False, tf32=True),
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_tf32_specs_take_the_mma_kernel_one_tile_a_warp_and_fp32_keeps_the_cuda_cores(case):
    spec = SPECS[case]
    assert tiled_gpu_misfit(spec) is None
    options = flash.all_configs(spec, wgmma=True)
    assert options and all(c.m_tiles == 1 and not c.wgmma for c in options)
    assert flash.default_config(spec, wgmma=True) in options
    for cfg in options:
        assert tf32.registers(spec, cfg) <= tf32.REGISTERS and tf32.shared_bytes(spec, cfg) <= 100 * 1024
        flash.flash_primfunc(spec, cfg)
    # without the mark, fp32 attention stays on the CUDA cores (exact to fp32) where they take it
    plain = replace(spec, tf32=False)
    assert "takes fp16, or fp32 under --precision tf32" in tiled_gpu_misfit(plain)
    if simt_gpu_misfit(plain) is None:
        assert isinstance(flash.default_config(plain, wgmma=True), SimtConfig)


def test_the_fragment_maps_compute_q_kt_and_p_v_with_p_in_its_accumulators_registers():
    """One warp's 16 x 8 x 8 step, lane by lane, with ``mma.sync.m16n8k8``'s fragments as the PTX ISA lays them
    out: Q and K read at the kernel's fragment maps give Q·Kᵀ in the m16n8 accumulator layout; that accumulator
    stored to ``pf`` at the kernel's slots, and V read at its maps, give P·V."""
    rng = np.random.default_rng(0)
    q, k, p, v = (rng.standard_normal(s) for s in ((16, 8), (8, 8), (16, 8), (8, 8)))

    def mma(a_regs, b_regs):
        """D = A·B of m16n8k8 from each lane's registers: a_r at (g + 8 (r % 2), t + 4 (r // 2)), b_h at
        (t + 4h, g), d_c at (g + 8 (c // 2), 2t + c % 2)."""
        a, b = np.full((16, 8), np.nan), np.full((8, 8), np.nan)
        for lane in range(32):
            g, t = divmod(lane, 4)
            for r in range(4):
                a[g + 8 * (r % 2), t + 4 * (r // 2)] = a_regs[lane][r]
            for h in range(2):
                b[t + 4 * h, g] = b_regs[lane][h]
        d = a @ b
        lanes = (divmod(x, 4) for x in range(32))
        return [[d[g + 8 * (c // 2), 2 * t + c % 2] for c in range(4)] for g, t in lanes]

    def at(expr: str, g: int, t: int) -> int:
        return int(eval(expr))   # the kernel's index expressions, with the lane's g and t as numbers

    qa = [[q[at(tf32.q_element(r, g, t)[0], g, t), at(tf32.q_element(r, g, t)[1], g, t)] for r in range(4)]
          for g, t in map(lambda x: divmod(x, 4), range(32))]
    kb = [[k[at(tf32.k_element(h, g, t)[0], g, t), at(tf32.k_element(h, g, t)[1], g, t)] for h in range(2)]
          for g, t in map(lambda x: divmod(x, 4), range(32))]
    s = mma(qa, kb)
    for lane in range(32):   # the accumulator layout the shared online softmax reads
        g, t = divmod(lane, 4)
        for i in range(4):
            assert np.isclose(s[lane][i], (q @ k.T)[g + i % 4 // 2 * 8, i // 4 * 8 + t * 2 + i % 2])
    # P in the same accumulator layout, stored at the kernel's slots, is A of P·V as it stands
    pa = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        regs = [np.nan] * 4
        for i in range(4):
            regs[eval(tf32.P_SLOT)] = p[g + i % 4 // 2 * 8, t * 2 + i % 2]
        pa.append(regs)
    vb = [[v[at(tf32.v_element(h, g, t)[0], g, t), at(tf32.v_element(h, g, t)[1], g, t)] for h in range(2)]
          for g, t in map(lambda x: divmod(x, 4), range(32))]
    o = mma(pa, vb)
    ref = p @ v
    for lane in range(32):
        g, t = divmod(lane, 4)
        assert np.allclose(o[lane], [ref[g + 8 * (c // 2), 2 * t + c % 2] for c in range(4)])


def test_the_kernels_rounding_is_the_planners_tf32_rounding():
    """The kernel rounds Q, K, V and P by bit arithmetic (``rna``); the planner rounds weights with
    ``tf32_rounded``: the same rounding, ties away from zero, infinities kept."""
    x = np.array([1.0, 1 + 2 ** -11, 1 + 2 ** -10 + 2 ** -11, -(1 + 2 ** -11), 3.0e38, np.inf, -np.inf, 1e-40,
                  *np.random.default_rng(1).standard_normal(64)], np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    emulated = (((bits + 4096) & 0xFFFFE000) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    assert "T.uint32(4096)" in tf32.rna("x") and "T.uint32(4294959104)" in tf32.rna("x")
    finite = np.isfinite(x) & (np.abs(x) < 3e38)
    assert np.array_equal(emulated[finite], tf32_rounded(x)[finite])
    assert np.array_equal(emulated[~np.isfinite(x)], x[~np.isfinite(x)])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,name", [("bert", None), ("bert", "w8 m1 n128 s1"), ("bert", "w4 m1 n32 s1"),
                                       ("causal-gqa", None), ("t5", None), ("d80", "w4 m1 n32 s2"),
                                       ("ragged", None), ("ragged-kT", "w8 m1 n64 s2"), ("vit-kT", None)])
def test_tf32_flash_kernels_build_for_sm90a_without_spills(tmp_path, case, name):
    spec = SPECS[case]
    cfg = flash.parse_config(name) if name else flash.default_config(spec, wgmma=True)
    assert cfg in flash.all_configs(spec, wgmma=True)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src
    # two stages: K and V come by cp.async and each thread rounds the chunks it copied
    assert ("cp.async" in src and "tvmfuse_round_tf32_16b(" in src) == (cfg.stages == 2)
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def test_precision_tf32_marks_fp32_attention_and_the_build_runs_the_tf32_kernel(tmp_path):
    cuda = resolve_target("cuda")
    path = tmp_path / "attention.onnx"
    onnx.save(models.attention(seq=128, dim=32, mask=True), path)
    mod = import_model(load_model(path))
    fused, plan = partition(mod, target=cuda, precision="tf32")
    (spec,) = [flash.spec_of(f) for f in fused.functions.values() if f.attrs is not None and SPEC_ATTR in f.attrs]
    assert spec.tf32 and spec.dtype == "float32"
    assert any(r.startswith("tf32: ") and "1 attention kernels on the TF32 flash kernel" in r for r in plan.rewrites)
    src = cuda_source(build(fused, target=cuda).executable)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src
    # plain fp32 on Hopper: the same kernel in three TF32 products a fragment (fp32's accuracy)
    fused32, plan32 = partition(mod, target=cuda)
    (spec32,) = [flash.spec_of(f) for f in fused32.functions.values() if f.attrs is not None and SPEC_ATTR in f.attrs]
    assert spec32.tf32 and spec32.x3
    assert any(r.startswith("fp32x3: ") and "three products a fragment" in r for r in plan32.rewrites)
    src = cuda_source(build(fused32, target=cuda).executable)
    assert src.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") >= 6 and "tvmfuse_round_tf32_16b(" not in src
    # on the CUDA cores when asked: the CUDA-core kernel
    simt, _ = partition(mod, target=cuda, fp32_tensor_cores=False)
    (plain,) = [flash.spec_of(f) for f in simt.functions.values() if f.attrs is not None and SPEC_ATTR in f.attrs]
    assert not plain.tf32 and not plain.x3
    assert "mma.sync" not in cuda_source(build(simt, target=cuda).executable)


def test_under_tf32_the_planner_fuses_fp32_attention_only_the_tf32_kernel_takes(tmp_path):
    """Head dim 128: Q's row and O's (256 floats) overflow the CUDA-core kernel's registers, so plain fp32 leaves the
    attention unfused; under tf32 the tensor-core kernel takes it, and the planner fuses it."""
    cuda = resolve_target("cuda")
    path = tmp_path / "attention_d128.onnx"
    onnx.save(models.attention(seq=64, dim=128, mask=True), path)
    mod = import_model(load_model(path))
    _, plain = partition(mod, target=cuda)
    assert not plain.by_pattern("attention")
    assert any(r.reason.startswith("attention not fused: ") and "160 of a thread's registers" in r.reason
               for r in plain.rejected)
    fused, plan = partition(mod, target=cuda, precision="tf32")
    assert plan.by_pattern("attention")
    (spec,) = [flash.spec_of(f) for f in fused.functions.values() if f.attrs is not None and SPEC_ATTR in f.attrs]
    assert spec.tf32 and spec.head_dim == 128


@pytest.mark.parametrize("dim", [16, 32, 48, 64, 80, 96, 112, 128])
def test_the_planners_x3_head_dims_are_the_kernels_register_count(dim):
    """fp32 attention on Hopper (``x3``: three TF32 products a fragment) is fused where the kernel has a config
    within its register cap, and the planner's rule (``plan.attention.X3_HEAD_DIMS``) gives the same answer."""
    from tvmfuse.plan.attention import X3_HEAD_DIMS

    spec = AttentionSpec(batch=(2, 4), seq_q=128, seq_k=128, head_dim=dim, head_dim_v=dim, dtype="float32",
                         scale=None, mask_shape=None, k_rows=True, tf32=True, x3=True)
    fits = tiled_gpu_misfit(spec) is None
    assert fits == bool(flash.configs(spec)) == (dim + dim // 2 <= X3_HEAD_DIMS)
    assert all(tf32.registers(spec, c) <= tf32.X3_REGISTERS for c in flash.configs(spec))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,name", [("bert", None), ("bert", "w8 m1 n64 s2"), ("d80", None), ("ragged-kT", None),
                                       ("vit-kT", None)])
def test_x3_flash_kernels_issue_three_products_a_fragment_and_build_without_spills(tmp_path, case, name):
    spec = replace(SPECS[case], x3=True)
    cfg = flash.parse_config(name) if name else flash.default_config(spec, wgmma=True)
    assert cfg in flash.all_configs(spec, wgmma=True)
    src = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A).mod.imports[0].inspect_source()
    one = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(SPECS[case], cfg).with_attr("global_symbol", "main")}),
                      target=SM90A).mod.imports[0].inspect_source()
    mmas = lambda s: s.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")  # noqa: E731
    assert mmas(src) == 3 * mmas(one) > 0
    # K and V land in shared memory as they are (fp32) and are split in registers, fragment by fragment
    assert "tvmfuse_round_tf32_16b(" not in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")
