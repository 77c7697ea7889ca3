"""The warp-specialized Hopper flash kernel (configs `` ht`` and `` htp``): which configs it takes, that its TMA boxes
fill each shared tile exactly once from inside their tensors at every key step, and that its CUDA builds for sm_90a
with no spills, its wgmmas asynchronous and no fence ptxas had to inject. (Run and checked against torch on the H200
by benchmarks/attention_causal_gpu.py --names.)"""
from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

from cuda_checks import assert_ptxas_without_spills, assert_shared_offsets_aligned  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.kernels.flash.config import TMA_SHARED_BYTES  # noqa: E402
from tvmfuse.kernels.flash.softmax import key_steps  # noqa: E402
from tvmfuse.kernels.flash.tma import tma_maps  # noqa: E402
from tvmfuse.plan.attention import AttentionSpec  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _spec(**kw) -> AttentionSpec:
    base = dict(batch=(2, 8), seq_q=256, seq_k=384, head_dim=64, head_dim_v=64, dtype="float16", scale=0.125,
                mask_shape=None, k_rows=True, causal=False, causal_offset=0, kv_group=1)
    return AttentionSpec(**{**base, **kw})


SPECS = {
    "rows": _spec(),
    "causal-gqa-d128": _spec(head_dim=128, head_dim_v=128, causal=True, causal_offset=128, kv_group=4),
    "kT+mask": _spec(batch=(3,), head_dim=128, head_dim_v=128, k_rows=False, mask_shape=(3, 1, 256, 384)),
}


def _tma(spec):
    return [c for c in flash.configs(spec, wgmma=(True,), tma=(1, 2, 3)) if c.tma]


def test_tma_configs_take_two_computing_warpgroups_and_are_offered_only_when_asked():
    spec = SPECS["causal-gqa-d128"]
    cfgs = _tma(spec)
    assert {c.name for c in cfgs} == {f"w8 m1 n{n} s{s} {k}" for n in (64, 128) for s in (2, 3)
                                      for k in ("ht", "htp", "hto")}
    for c in cfgs:
        assert flash.parse_config(c.name) == c and c.threads == 384 and c.block_m == 128
        assert c.shared_bytes(spec) <= TMA_SHARED_BYTES
    assert not any(c.tma for c in flash.configs(spec, wgmma=(True,)))   # not unless asked
    assert not _tma(_spec(seq_q=192))                                    # whole 128-row tiles only
    assert not any(c.tma for c in flash.configs(spec, wgmma=(False,), tma=(1, 2, 3)))   # Hopper only


def _value(expr: str, env: dict) -> int:
    return int(eval(expr.replace("T.min", "min"), {}, env))


@pytest.mark.parametrize("case", sorted(SPECS))
def test_the_tma_boxes_fill_each_shared_tile_once_from_inside_their_tensors(case):
    """Each map's boxes tile its shared tile (Q's, a K slot's, a V slot's) without overlap or gap, and every box's
    coordinates (at every query tile, head and key step the kernel walks) lie inside the tensor, so no load reads
    TMA's zero fill where the kernel expects data."""
    spec = SPECS[case]
    for cfg in _tma(spec):
        maps = tma_maps(spec, cfg)
        tile = {"q": cfg.block_m * spec.head_dim, "k": cfg.block_n * spec.head_dim,
                "v": cfg.block_n * spec.head_dim_v}
        for name, m in maps.items():
            box = math.prod(m["box"])
            offsets = sorted(off for off, _ in m["loads"]("j"))
            assert offsets == [i * box for i in range(tile[name] // box)], (cfg.name, name)
            assert m["strides"][0] == 2 * m["dims"][0] and m["strides"][1] == m["strides"][0] * m["dims"][1]
        tiles, heads = spec.seq_q // cfg.block_m, math.prod(spec.batch)
        for bx in range(tiles):
            for by in range(heads):
                steps = _value(key_steps(spec, cfg.block_m, cfg.block_n), {"bx": bx})
                assert 1 <= steps <= spec.seq_k // cfg.block_n
                for j in range(steps):
                    for name, m in maps.items():
                        for _, coords in m["loads"](str(j)):
                            at = [_value(c, {"bx": bx, "by": by, "j": j}) for c in coords]
                            assert all(0 <= a and a + b <= d for a, b, d in zip(at, m["box"], m["dims"])), \
                                (cfg.name, name, at)
        # GQA: query head h reads K/V head h // kv_group
        if spec.kv_group > 1:
            _, coords = maps["k"]["loads"]("0")[0]
            assert [_value(coords[2], {"by": by}) for by in range(8)] == [h // 4 for h in range(8)]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_tma_kernels_wgmma_descriptors_land_aligned_in_their_shared_tiles(case):
    for cfg in _tma(SPECS[case]):
        assert assert_shared_offsets_aligned(flash.flash_primfunc(SPECS[case], cfg)) >= 4, cfg.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case,cfg", [("rows", "w8 m1 n128 s2 ht"), ("rows", "w8 m1 n64 s3 htp"),
                                      ("causal-gqa-d128", "w8 m1 n128 s2 htp"), ("causal-gqa-d128", "w8 m1 n64 s3 ht"),
                                      ("kT+mask", "w8 m1 n128 s3 htp"), ("causal-gqa-d128", "w8 m1 n128 s2 hto")])
def test_tma_flash_kernels_build_for_sm90a_without_spills_or_injected_fences(tmp_path, case, cfg):
    """P packed from the score registers and pinned before each P·V's fence: ptxas injects no warpgroup.arrive
    (C7519) before the wgmmas that read it, which on a divergent path also serialized them (C7520)."""
    spec, cfg = SPECS[case], flash.parse_config(cfg)
    assert cfg in _tma(spec)
    lib = tvm.compile(tvm.IRModule({"main": flash.flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=SM90A)
    src = lib.mod.imports[0].inspect_source()
    assert "cp.async.bulk.tensor.3d" in src and "setmaxnreg" in src and "__launch_bounds__(384)" in src
    assert ("bar.sync %0" in src) == (cfg.tma >= 2)   # ping-pong (htp, hto)
    assert "cp.async.cg" not in src and "__syncthreads" in src   # loads by TMA only; one block barrier, at the start
    report = assert_ptxas_without_spills(src, tmp_path, "sm_90a")
    assert "C7519" not in report and "C7520" not in report, report[-800:]
