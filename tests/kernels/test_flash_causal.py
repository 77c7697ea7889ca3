"""The flash template on causal and grouped-query attention (issue 21): a causal query tile walks the keys only up to
its diagonal, the heaviest tiles launch first, K/V are read per K/V head; the loop bounds and the online softmax with
skipped and masked tiles emulated in numpy, and the CUDA kernels built with nvcc (ptxas: no spills, wgmma kept
asynchronous). The kernels run on the H200 in benchmarks/attention_causal_gpu.py, checked against torch."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

from benchmarks.attention_causal_gpu import attention_onnx  # noqa: E402
from cuda_checks import assert_ptxas_without_spills, assert_shared_offsets_aligned, cuda_source  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.compile.build import build  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.kernels.flash.softmax import full_steps, key_steps  # noqa: E402
from tvmfuse.plan import partition  # noqa: E402
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _spec(**kw) -> AttentionSpec:
    base = dict(batch=(2, 8), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64, dtype="float16", scale=0.125,
                mask_shape=None, k_rows=True, causal=True, causal_offset=0, kv_group=1)
    return AttentionSpec(**{**base, **kw})


def _steps(spec, cfg, bx: int) -> int:
    multiple = 2 if cfg.overlap else 1
    return int(eval(key_steps(spec, cfg.block_m, cfg.block_n, multiple).replace("T.min", "min"), {"bx": bx}))


def _full(spec, cfg, bx: int) -> int:
    """The steps a tile takes unmasked (the overlapped kernels mask every step)."""
    if cfg.overlap:
        return 0
    return int(eval(full_steps(spec, cfg.block_m, cfg.block_n).replace("T.min", "min"), {"bx": bx}))


def _all_configs(spec):
    return flash.configs(spec, wgmma=(False, True), overlap=(False, True), max_shared_bytes=227 * 1024)


@pytest.mark.parametrize("offset,seq_k", [(0, 256), (64, 320), (7, 263 // 32 * 32 + 32)])
def test_a_causal_tile_walks_every_key_it_sees_and_no_tile_past_its_diagonal(offset, seq_k):
    spec = _spec(seq_k=seq_k, causal_offset=offset)
    assert _all_configs(spec)
    for cfg in _all_configs(spec):
        full = -(-spec.seq_k // cfg.block_n)   # (an mma.sync config's last key step may be ragged)
        for bx in range(-(-spec.seq_q // cfg.block_m)):
            n = _steps(spec, cfg, bx)
            last_row = bx * cfg.block_m + cfg.block_m - 1
            visible = min(spec.seq_k, last_row + offset + 1)      # keys the tile's last row sees
            assert n * cfg.block_n >= visible, (cfg.name, bx)    # none missed
            assert n <= full
            unmasked = _full(spec, cfg, bx)
            assert unmasked <= n and unmasked * cfg.block_n <= bx * cfg.block_m + offset + 1   # all seen by row 0
            if not cfg.overlap:   # and the first masked step does hide a key from some row
                assert unmasked == n or (unmasked + 1) * cfg.block_n - 1 > bx * cfg.block_m + offset
            if cfg.overlap:
                assert n % 2 == 0 and n - 2 < -(-visible // cfg.block_n)   # whole pairs, at most one padding step
            else:
                assert (n - 1) * cfg.block_n < visible, (cfg.name, bx)    # no step wholly past the diagonal
    assert _steps(_spec(causal=False), flash.parse_config("w4 m1 n64 s1"), 0) == 4


def _rows_or_zeros(x, rows):
    return np.stack([x[r] if r < len(x) else np.zeros(x.shape[1:]) for r in rows])


def _emulate(spec: AttentionSpec, cfg, q, k, v):
    """The flash kernel's algorithm in numpy at tile granularity: per query tile ``bx``, ``key_steps`` key blocks, the
    first ``full_steps`` unmasked and the rest with scores past the diagonal at -inf before the running max (which
    starts at -1e30), base-2 online softmax, K/V head ``h // kv_group``."""
    out = np.zeros(q.shape, np.float64)
    log2e = 1.4426950408889634
    for h in range(q.shape[0]):
        kh, vh = k[h // spec.kv_group], v[h // spec.kv_group]
        for bx in range(-(-spec.seq_q // cfg.block_m)):
            rows = np.arange(bx * cfg.block_m, min((bx + 1) * cfg.block_m, spec.seq_q))
            m = np.full(len(rows), -1e30)
            lsum = np.zeros(len(rows))
            acc = np.zeros((len(rows), spec.head_dim_v))
            for j in range(_steps(spec, cfg, bx)):
                cols = np.arange(j * cfg.block_n, (j + 1) * cfg.block_n)
                # a ragged last step's keys past the end are zeros in shared memory
                s = q[h, rows] @ _rows_or_zeros(kh, cols).T * (spec.scale * log2e)
                if j >= _full(spec, cfg, bx):
                    s = np.where(cols[None, :] > rows[:, None] + spec.causal_offset, -np.inf, s)
                    s = np.where(cols[None, :] >= spec.seq_k, -np.inf, s)
                red = np.maximum(m, s.max(axis=1))
                alpha = np.exp2(m - red)
                m = red
                p = np.exp2(s - m[:, None])
                lsum = lsum * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + p @ _rows_or_zeros(vh, cols)
            out[h, rows] = acc / lsum[:, None]
    return out


@pytest.mark.parametrize("cfg,seq", [("w4 m2 n32 s1", 256), ("w8 m1 n128 s2", 256), ("w4 m1 n64 s1 h", 256),
                                     ("w4 m1 n64 s2 hp", 256), ("w4 m2 n32 s1", 200), ("w8 m1 n128 s2", 200),
                                     ("w4 m1 n64 s1", 17)])
@pytest.mark.parametrize("offset,group", [(0, 1), (128, 4)])
def test_the_skipping_loop_in_numpy_matches_masked_softmax_without_nans(cfg, seq, offset, group):
    """(``seq`` 200, 17: ragged last tiles of rows and keys, which only the mma.sync kernels take)"""
    spec = _spec(batch=(8,), seq_q=seq, seq_k=seq + offset, causal_offset=offset, kv_group=group)
    cfg = flash.parse_config(cfg)
    assert cfg in _all_configs(spec)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, spec.seq_q, 64))
    k, v = (rng.standard_normal((8 // group, spec.seq_k, 64)) for _ in range(2))
    got = _emulate(spec, cfg, q, k, v)
    kk, vv = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = q @ kk.transpose(0, 2, 1) * spec.scale
    hidden = np.arange(spec.seq_k)[None, :] > np.arange(spec.seq_q)[:, None] + offset
    s = np.where(hidden, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ vv
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() < 1e-10


def test_the_kernel_reads_no_mask_and_kv_heads_by_group_and_launches_the_heaviest_tiles_first():
    spec = _spec(kv_group=4)
    src = flash.flash_source(spec, flash.parse_config("w4 m1 n64 s1"))
    assert "mask" not in src.split("):")[0]
    assert "k: T.Buffer((2, 2, 256, 64)" in src and "v: T.Buffer((2, 2, 256, 64)" in src
    assert "// 4" in src   # K/V head h // 4
    assert 'for byr in T.thread_binding(4, thread="blockIdx.y")' in src and "bx: T.int32 = 3 - byr" in src
    assert "T.min(4, (bx * 64 + 127) // 64)" in src
    # two key loops: the steps every row sees whole without the mask, then the diagonal ones with it
    plain_loop, masked_loop = src.split("for j in T.serial(T.min(4, (bx * 64 + 1) // 64), ")
    assert "T.Select" not in plain_loop and "T.Select" in masked_loop
    plain = flash.flash_source(_spec(causal=False), flash.parse_config("w4 m1 n64 s1"))
    assert "for j in T.serial(4)" in plain and "T.Select" not in plain


@pytest.mark.parametrize("cfg", ["w4 m1 n64 s1 h", "w8 m1 n64 s2 h", "w4 m1 n64 s2 hp", "w8 m1 n64 s2 hp"])
def test_causal_gqa_hopper_copies_and_descriptors_land_aligned(cfg):
    spec = _spec(kv_group=4, seq_k=384, causal_offset=128)
    assert flash.parse_config(cfg) in _all_configs(spec)
    assert assert_shared_offsets_aligned(flash.flash_primfunc(spec, flash.parse_config(cfg))) >= 10


BENCH = {"a": _spec(batch=(8, 16), seq_q=2048, seq_k=2048, scale=0.125),
         "b": _spec(batch=(4, 32), seq_q=4096, seq_k=4096, head_dim=128, head_dim_v=128, scale=128 ** -0.5,
                    kv_group=4)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,cfg", [("a", "w4 m2 n32 s1"), ("a", "w4 m1 n64 s1 h"), ("a", "w4 m1 n64 s2 hp"),
                                      ("b", "w8 m1 n128 s1"), ("b", "w4 m1 n64 s1 h"), ("b", "w8 m1 n64 s2 h"),
                                      ("b", "w4 m1 n64 s2 hp")])
def test_causal_and_gqa_flash_kernels_build_for_sm90a_without_spills(tmp_path, case, cfg):
    """The GPU script's shapes; the overlapped kernels too: with the key count known only at run time ptxas once
    serialized their wgmma pipeline, which this check (C7514/C7515) refuses."""
    spec, cfg = BENCH[case], flash.parse_config(cfg)
    assert cfg in _all_configs(spec)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert ("wgmma.mma_async" in src) == cfg.wgmma and "CUDART_INF_F" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


def test_a_causal_gqa_model_builds_for_cuda_with_the_default_flash_kernel(tmp_path):
    """Through the real planner for the H200: the mask and the repeat recognised, the untuned build runs the default
    flash kernel with no mask argument and K/V at their own head count."""
    cuda = resolve_target("cuda")
    model = attention_onnx(heads=8, kv_heads=2, seq_q=128, dim=64, dtype="float16")
    path = tmp_path / "causal_gqa.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    ((spec, func),) = [(flash.spec_of(f), f) for f in fused.functions.values()
                       if getattr(f, "attrs", None) is not None and SPEC_ATTR in f.attrs]
    assert spec.causal and spec.kv_group == 4 and len(func.params) == 4
    result = build(fused, target=cuda)
    assert [k.schedule for k in result.kernels] == ["flash-default"]
    src = cuda_source(result.executable)
    assert "wgmma.mma_async" in src and "blockIdx.y" in src


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_gpu_scripts_dry_run_plans_recognises_and_builds_every_case():
    """benchmarks/attention_causal_gpu.py --dry-run: each case at its H200 shape planned (mask and repeat recognised)
    and built with its default flash kernel and one more config, without a GPU; --small runs them on llvm."""
    from benchmarks.attention_causal_gpu import dry_run, small

    rows = dry_run(1)
    models = [r for r in rows if r["kernel"] == "model (untuned default)"]
    assert [r["case"] for r in models] == ["a unmasked", "a causal", "b gqa causal", "c d128"]
    assert all(r["recognised"] == "yes" and r["schedules"] == ["flash-default"] for r in models)
    assert len([r for r in rows if r["kernel"] == "built"]) == 8
    assert all(r["ok"] and r["recognised"] == "yes" for r in small())
