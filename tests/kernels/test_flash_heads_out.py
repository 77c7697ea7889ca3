"""Flash kernels that store their output with its rows before its heads (``seq_major_out``: the exporters' transpose
after attention, fused): every kernel family stores the same values as its plain twin, each at the twin's row and
head swapped, and builds for sm_90a without spills. (The plain kernels are the ones checked against torch on the GPU;
``benchmarks/flash_gpu.py``'s ``heads-out`` case runs these too.)"""
from __future__ import annotations

import ast
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks

from cuda_checks import assert_ptxas_without_spills  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.kernels import flash  # noqa: E402
from tvmfuse.plan.attention import AttentionSpec  # noqa: E402

SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
FP16 = AttentionSpec(batch=(2, 4), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64, dtype="float16", scale=0.125,
                     mask_shape=(2, 1, 1, 256), k_rows=True)
FP32 = replace(FP16, dtype="float32")
CASES = {   # name: (spec, config; None: the spec's default)
    "mma": (FP16, "w4 m1 n64 s2"),
    "mma-m2-ragged": (replace(FP16, seq_q=197, seq_k=197, mask_shape=None), "w4 m2 n64 s1"),
    "wgmma": (FP16, "w4 m1 n64 s2 h"),
    "wgmma-pairs": (FP16, "w8 m1 n64 s2 hp"),
    "tma": (replace(FP16, mask_shape=None), "w8 m1 n128 s2 ht"),
    "tma-causal-gqa": (replace(FP16, batch=(2, 8), seq_k=384, head_dim=128, head_dim_v=128, mask_shape=None,
                               causal=True, causal_offset=128, kv_group=4), "w8 m1 n128 s2 hto"),
    "cuda-cores": (FP32, None),
    "tf32": (replace(FP32, tf32=True), None),
    "x3": (replace(FP32, tf32=True, x3=True), None),
}


def _kernel(spec: AttentionSpec, name: str | None):
    cfg = flash.parse_config(name) if name else flash.default_config(spec, wgmma=False)
    return flash.flash_primfunc(spec, cfg)


def _out_stores(func) -> list[tuple[list[str], str]]:
    """Every store into ``out`` in ``func``'s TVMScript, in order: (its indices, the value stored)."""
    stores = []
    for node in ast.walk(ast.parse(func.script())):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                and ast.unparse(node.targets[0].value) == "out"):
            index = node.targets[0].slice
            parts = index.elts if isinstance(index, ast.Tuple) else [index]
            stores.append(([ast.unparse(p) for p in parts], ast.unparse(node.value)))
    return stores


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kernel_stores_its_plain_twins_values_with_row_and_head_swapped(case):
    spec, name = CASES[case]
    plain, heads_out = _kernel(spec, name), _kernel(replace(spec, seq_major_out=True), name)
    twin, ours = _out_stores(plain), _out_stores(heads_out)
    assert twin and len(ours) == len(twin)
    for (index, value), (twin_index, twin_value) in zip(ours, twin):
        assert value == twin_value
        assert index == [*twin_index[:-3], twin_index[-2], twin_index[-3], twin_index[-1]]
    assert [int(d) for d in heads_out.params[-1].shape] == [*spec.batch[:-1], spec.seq_q, spec.batch[-1],
                                                           spec.head_dim_v]


def test_the_spec_knows_the_layout_and_keeps_its_text_without_it():
    spec = replace(FP16, seq_major_out=True)
    assert spec.out_shape == (2, 256, 4, 64) and FP16.out_shape == (2, 4, 256, 64)
    assert spec.out_index(["b", "h"], "i", "d") == ["b", "i", "h", "d"]
    assert "seq_major_out" not in FP16.to_json() and AttentionSpec.from_json(spec.to_json()) == spec
    assert spec != FP16 and hash(spec) != hash(FP16)
    with pytest.raises(ValueError, match="without a head axis"):
        replace(FP16, batch=(), mask_shape=None, seq_major_out=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case", ["mma", "tma-causal-gqa", "x3"])
def test_heads_out_kernels_build_for_sm90a_without_spills(tmp_path, case):
    spec, name = CASES[case]
    func = _kernel(replace(spec, seq_major_out=True), name)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=SM90A)
    assert_ptxas_without_spills(lib.mod.imports[0].inspect_source(), tmp_path, "sm_90a")
