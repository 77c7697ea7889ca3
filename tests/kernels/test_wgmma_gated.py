"""The wgmma template's gated epilogue (``rewrites.gated_gemm``): a planner kernel whose epilogue reads the product
at column pairs ``(2j, 2j + 1)`` becomes one gated store per accumulator pair, in the direct and the staged
epilogue, and computes the planner's function. (Built here, not run: wgmma needs the GPU.)"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))   # cuda_checks
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_checks import assert_ptxas_without_spills, twin_and_kernel_outputs  # noqa: E402
from test_wgmma import SM90A, _gemm_kernels, _run_stores  # noqa: E402
from tvmfuse._tvm import tvm  # noqa: E402
from tvmfuse.bench.cases import CASES  # noqa: E402
from tvmfuse.kernels import wgmma as hopper  # noqa: E402
from tvmfuse.kernels.wgmma import config as wcfg  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """The gated kernel of a small LLaMA MLP planned for Hopper (128 rows, hidden 64, intermediate 96)."""
    cuda = resolve_target("cuda")
    model, _, _ = CASES["llama_mlp"](M=128, H=64, I=96)
    kernels = _gemm_kernels(tmp_path_factory.mktemp("gated"), model, cuda)
    (func,) = [k.mod["main"] for k in kernels if hopper.analyze(k.mod["main"], gated=True)[1]["gated"]]
    return func, cuda


def test_the_gated_kernel_reads_its_product_in_column_pairs_and_computes_the_planners_function(gated):
    func, cuda = gated
    spec, info = hopper.analyze(func, gated=True)
    assert (spec.rows, spec.n, spec.k) == (128, 192, 64) and not spec.b_kmajor
    assert "{acc0}" in info["store"] and "{acc1}" in info["store"] and "({col} // 2)" in info["store"]
    with pytest.raises(hopper.Misfit, match="gated"):   # a template that does not say it takes it declines
        hopper.analyze(func)
    from tvmfuse.kernels.gemv.kernel import analyze as gemv_analyze
    with pytest.raises(hopper.Misfit, match="gated"):
        gemv_analyze(func)
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert not np.isnan(outs[0]).any()
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 2e-3
    assert hopper.untuned_config(func, cuda.target) is not None and hopper.default_kernel(func, cuda.target)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", ["g1 m1 n64 k64 s3 r1 z128 f0", "g1 m1 n64 k64 s3 r1 z128 f0 e1",
                                 "g2 m1 n64 k64 s3 r1 z128 f0 t1"])
def test_gated_kernels_build_for_sm90a_without_spills(tmp_path, gated, cfg):
    func, _ = gated
    spec, info = hopper.analyze(func, gated=True)
    c = hopper.parse_config(cfg)
    kernel = hopper.kernel_for(func, spec, info["a"], info["b"], info["store"], c)
    src = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}),
                      target=SM90A).mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in src and "exp2f" in src
    assert_ptxas_without_spills(src, tmp_path, "sm_90a")


@pytest.mark.parametrize("m,n,cfg", [
    (100, 192, "g1 m1 n64 k64 s3 r1 z128 f0"),         # a partial row tile
    (130, 200, "g2 m1 n128 k64 s4 r1 z128 f0"),        # a partial column tile: pairs past N not stored
    (100, 192, "g2 m1 n64 k64 s3 r1 z128 f0 e1"),      # staged through shared memory
    (130, 200, "g1 m2 n128 k64 s4 r1 z128 f1 e1"),     # staged, partial rows and columns
])
def test_each_output_is_its_column_pairs_gate_stored_once(m, n, cfg):
    """The epilogue, emulated from its TVMScript for every thread of every tile: output ``(i, j)`` is the gate of
    the product's ``(i, 2j)`` and ``(i, 2j + 1)``, written once, nothing past the output."""
    spec = hopper.GemmSpec((), m, n, 256, False, False, False)
    c = hopper.parse_config(cfg)
    assert c in hopper.configs(spec, stages=(3, 4), raster=(1,), staged=(0, 1))
    product = np.random.default_rng(0).standard_normal((m, n))

    class T:
        And = staticmethod(lambda x, y: x and y)
        gate = staticmethod(lambda g, u: g - 3 * u)

    out = np.full((m, n // 2), np.nan)
    writes = np.zeros((m, n // 2), int)

    def store(key, value):
        assert key[0] < m and key[1] < n // 2, key
        out[key] = value
        writes[key] += 1

    _, stores = hopper.mma._mma_and_store(spec, c, "out[{row}, {col} // 2] = T.gate({acc0}, {acc1})", "pm", "pn", 0)
    assert "for v in" not in stores.split('T.tvm_storage_sync("shared")\n')[-1]   # one store a pair
    for pm in range(wcfg.tiles_m(spec, c)):
        for pn in range(wcfg.tiles_n(spec, c)):
            tile = np.zeros((c.block_m, c.block_n))
            part = product[pm * c.block_m:(pm + 1) * c.block_m, pn * c.block_n:(pn + 1) * c.block_n]
            tile[:part.shape[0], :part.shape[1]] = part
            _run_stores(stores, tile, c, pm, pn, store, T)
    assert (writes == 1).all(), (writes != 1).sum()
    np.testing.assert_allclose(out, product[:, 0::2] - 3 * product[:, 1::2], rtol=1e-12)


def test_a_tf32_gated_kernel_computes_the_planners_function(tmp_path):
    """An fp32 model under ``--precision tf32``: its gate and up projections are one TF32 wgmma GEMM, gated too."""
    from onnx import numpy_helper

    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import extract_kernels

    model, _, _ = CASES["llama_mlp"](M=128, H=64, I=96)
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype("float32"), init.name))
    for v in [*model.graph.input, *model.graph.output]:
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    path = tmp_path / "mlp32.onnx"
    onnx.save(model, path)
    cuda = resolve_target("cuda")
    fused, plan = partition(import_model(load_model(path, precision="tf32")), target=cuda, precision="tf32")
    assert [g.pattern for g in plan.groups].count("gated_gemm") == 1
    funcs = [k.mod["main"] for k in extract_kernels(fused, target=cuda)]
    (func,) = [f for f in funcs if (_gated_info(f) or {}).get("gated")]
    spec, info = hopper.analyze(func, gated=True)
    assert spec.dtype == "float32" and info["gated"]
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 1e-5
    assert hopper.default_kernel(func, cuda.target) is not None


def _gated_info(func):
    try:
        return hopper.analyze(func, gated=True)[1]
    except Exception:  # noqa: BLE001 - not a GEMM the template takes
        return None


def test_gemmas_gated_kernel_folds_its_batch_into_rows_and_computes_the_planners_function():
    """Gemma's fp16 export at 2 x 64 tokens: x is [2, 64, hidden], so the gated GEMM folds the batch into its rows and
    the epilogue (tanh-GELU written out) indexes the output by (batch, token, column pair)."""
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import extract_kernels

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "user_form"
    cuda = resolve_target("cuda")
    loaded = load_model(folder / "gemma.onnx", input_shapes={"input_ids": (2, 64), "attention_mask": (2, 64)},
                        precision="fp16")
    fused, _ = partition(import_model(loaded), target=cuda, precision="fp16")
    (func,) = [k.mod["main"] for k in extract_kernels(fused, target=cuda)
               if (_gated_info(k.mod["main"]) or {}).get("gated")]
    spec, info = hopper.analyze(func, gated=True)
    assert spec.batch == (2,) and spec.fold_batch and spec.rows == 128 and "T.tanh" in info["store"]
    outs = twin_and_kernel_outputs(hopper.reference_for(func), func)
    assert not np.isnan(outs[0]).any()
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 2e-3
