"""Gated GEMMs (``rewrites.gated_gemm``): ``act(x @ Wg) * (x @ Wu)`` as one GEMM on interleaved weights whose
epilogue gates column pairs; where it applies, what it leaves alone, the plan it gives on Hopper, and the whole
model against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import tvmfuse.plan.rewrites as rewrites
from conftest import build_and_run, ort_run, rel_err
from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.tags import RewriteLog


def _bind(mod, **params):
    return relax.transform.BindParams("main", {k: np.asarray(v) for k, v in params.items()})(mod)


def _run_llvm(mod, *args):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


@I.ir_module
class SwiGLU:
    """LLaMA's MLP as the importer writes an fp16 export: fp32 products cast back, SiLU as x * sigmoid(x)."""

    @R.function
    def main(x: R.Tensor((4, 8), "float16"), wg: R.Tensor((8, 3), "float16"), wu: R.Tensor((8, 3), "float16"),
             wd: R.Tensor((3, 8), "float16")):
        with R.dataflow():
            g = R.matmul(x, wg, out_dtype="float32")
            gh = R.astype(g, "float16")
            s = R.sigmoid(gh)
            silu = R.multiply(gh, s)
            u = R.matmul(x, wu, out_dtype="float32")
            uh = R.astype(u, "float16")
            h = R.multiply(silu, uh)
            y = R.matmul(h, wd, out_dtype="float32")
            out = R.astype(y, "float16")
            R.output(out)
        return out


_RNG = np.random.default_rng(0)
# small integers: the products are exact in fp16 and fp32, so the rewritten module agrees bitwise
_WG, _WU, _WD = (_RNG.integers(-2, 3, s).astype("float16") for s in ((8, 3), (8, 3), (3, 8)))


def test_a_swiglu_becomes_one_gemm_on_interleaved_weights_and_two_column_slices():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float16"), w: R.Tensor((8, 6), "float16"), wd: R.Tensor((3, 8), "float16")):
            with R.dataflow():
                mm = R.matmul(x, w, out_dtype="float32")
                g = R.strided_slice(mm, axes=[-1], begin=[0], end=[6], strides=[2])
                gh = R.astype(g, "float16")
                s = R.sigmoid(gh)
                silu = R.multiply(gh, s)
                u = R.strided_slice(mm, axes=[-1], begin=[1], end=[6], strides=[2])
                uh = R.astype(u, "float16")
                h = R.multiply(silu, uh)
                y = R.matmul(h, wd, out_dtype="float32")
                out = R.astype(y, "float16")
                R.output(out)
            return out

    log = RewriteLog()
    before = _bind(SwiGLU, wg=_WG, wu=_WU, wd=_WD)
    after = rewrites.GatedGemm(log=log, min_rows=4)(before)
    interleaved = np.stack([_WG, _WU], axis=-1).reshape(8, 6)
    assert (interleaved[:, 0::2] == _WG).all() and (interleaved[:, 1::2] == _WU).all()
    tvm.ir.assert_structural_equal(after, _bind(Expected, w=interleaved, wd=_WD))
    assert log.notes == ["gated GEMM: x @ [Wg | Wu] (8 x 6) interleaved, then astype sigmoid multiply astype "
                         "multiply on each column pair"]
    assert {t.tag for t in log.tags.values()} == {"gated", "pair"}
    x = _RNG.integers(-2, 3, (4, 8)).astype("float16")
    np.testing.assert_array_equal(_run_llvm(after, x), _run_llvm(before, x))


def _two_gemms(case: str):
    """x @ Wg and x @ Wu that are no gating: the gate's activation also a result (``escaping``: the kernel would
    store two results), or two results that never meet (``apart``, as Q and K)."""
    from tvmfuse._tvm import TensorType

    bb = relax.BlockBuilder()
    x = relax.Var("x", TensorType((4, 8), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            s = bb.emit(relax.op.sigmoid(bb.emit(relax.op.matmul(x, relax.const(_WG)))))
            u = bb.emit(relax.op.matmul(x, relax.const(_WU)))
            other = relax.op.multiply(s, u) if case == "escaping" else relax.op.sigmoid(u)
            out = bb.emit_output(relax.Tuple([bb.emit(other), s]))
        bb.emit_func_output(out)
    return bb.finalize()


@pytest.mark.parametrize("case", ["escaping", "apart", "few_rows", "inputs", "fp32"])
def test_what_is_no_gated_gemm_is_left_as_it_is(case):
    log = RewriteLog()
    mod, min_rows, dtypes = {
        "escaping": (_two_gemms("escaping"), 4, ("float16",)),
        "apart": (_two_gemms("apart"), 4, ("float16",)),
        "few_rows": (_bind(SwiGLU, wg=_WG, wu=_WU, wd=_WD), 5, ("float16",)),   # the GEMV template's
        "inputs": (SwiGLU, 4, ("float16",)),                                     # weights no constants
        "fp32": (_bind(SwiGLU, wg=_WG, wu=_WU, wd=_WD), 4, ("float32",)),       # no template's type
    }[case]
    cleaned = tvm.transform.Sequential(rewrites._common.CLEAN)(mod)
    tvm.ir.assert_structural_equal(rewrites.GatedGemm(log=log, min_rows=min_rows, dtypes=dtypes)(mod), cleaned)
    assert not log.notes and not log.tags


def _llama_mlp_onnx(tmp_path, m=128, h=64, i=96):
    from tvmfuse.bench.cases import llama_mlp

    model, _, _ = llama_mlp(M=m, H=h, I=i)
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    return model, path


def test_hopper_plans_the_gate_and_up_projections_as_one_gated_kernel(tmp_path):
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.planner import plan_tvmfuse
    from tvmfuse.target import resolve_target

    _, path = _llama_mlp_onnx(tmp_path)
    _, plan = plan_tvmfuse(import_model(load_model(path)), resolve_target("cuda"))
    gated = [g for g in plan.groups if g.pattern == "gated_gemm"]
    assert len(plan.groups) == 2 and len(gated) == 1, [(g.pattern, g.ops) for g in plan.groups]
    assert gated[0].ops.count("matmul") == 2 and "sigmoid" in gated[0].ops
    # the products never reach memory: the kernel reads x and [Wg | Wu] and writes silu(g) * u
    assert gated[0].bytes_fused == (128 * 64 + 64 * 2 * 96 + 128 * 96) * 2
    # the A/B switch benchmarks/bench_gpu.py --ungated uses: the same plan with the rewrite off
    from tvmfuse.plan import partition

    _, apart = partition(import_model(load_model(path)), target=resolve_target("cuda"),
                         cost_overrides={"gated_gemm_rows": 0})
    assert len(apart.groups) == 3 and not [g for g in apart.groups if g.pattern == "gated_gemm"]
    # no other CUDA arch takes the epilogue, and the CPU plans the two GEMMs apart
    sm80 = resolve_target('{"kind": "cuda", "arch": "sm_80"}')
    for target in (sm80, resolve_target("llvm")):
        _, plan = plan_tvmfuse(import_model(load_model(path)), target)
        assert not [g for g in plan.groups if g.pattern == "gated_gemm"]


def test_a_gated_plan_computes_the_model_against_onnxruntime(tmp_path, llvm):
    """The rewrite and the fused gated kernel (TVM's lowering of it, on the CPU) give onnxruntime's outputs."""
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    model, path = _llama_mlp_onnx(tmp_path, m=96, h=32, i=48)
    config = PlannerConfig(cost_model=CostModel.for_target(llvm, gated_gemm_rows=1))
    mod, plan = plan_tvmfuse(import_model(load_model(path)), llvm, config=config)
    assert [g.pattern for g in plan.groups].count("gated_gemm") == 1
    x = (np.random.default_rng(1).standard_normal((96, 32)) * 0.5).astype("float16")
    got, want = build_and_run(mod, llvm, [x])[0], ort_run(model, [x])[0]
    assert rel_err(got.astype("float32"), want.astype("float32")) < 2e-3


def test_gemmas_geglu_as_users_export_it_becomes_a_gated_gemm_and_verifies(llvm):
    """Gemma's MLP from a Hugging Face export (dynamic axes, tanh-GELU written out as Mul / Pow / Tanh, fp16 by the
    converter) is found and, planned gated (forced here on the CPU), gives onnxruntime's outputs."""
    from pathlib import Path

    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "user_form"
    feeds = dict(np.load(folder / "gemma.inputs.npz"))
    loaded = load_model(folder / "gemma.onnx", input_shapes={k: v.shape for k, v in feeds.items()}, precision="fp16")
    config = PlannerConfig(cost_model=CostModel.for_target(llvm, gated_gemm_rows=1))
    fused, plan = plan_tvmfuse(import_model(loaded), llvm, config=config)
    (gated,) = [g for g in plan.groups if g.pattern == "gated_gemm"]
    assert "tanh" in gated.ops and gated.ops.count("matmul") == 2
    built = build(fused, target=llvm, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    assert verify.relative_error(got, verify.run_onnxruntime(folder / "gemma.onnx", feeds)[0]) < 1e-2


def _fused_gate_up(split: str):
    """Phi-3's MLP: one ``gate_up_proj`` GEMM whose result is cut in halves (``Split``, or two ``Slice``s)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 24)) * 0.3).astype("float16"), "w")]
    if split == "split":
        inits.append(numpy_helper.from_array(np.array([12, 12], "int64"), "sizes"))
        cut = [helper.make_node("Split", ["gu", "sizes"], ["g", "u"], axis=-1)]
    else:
        for name, v in (("s0", 0), ("s1", 12), ("s2", 24), ("ax", -1)):
            inits.append(numpy_helper.from_array(np.array([v], "int64"), name))
        cut = [helper.make_node("Slice", ["gu", "s0", "s1", "ax"], ["g"]),
               helper.make_node("Slice", ["gu", "s1", "s2", "ax"], ["u"])]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["gu"]), *cut, helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["silu"]), helper.make_node("Mul", ["silu", "u"], ["y"])]
    graph = helper.make_graph(nodes, "phi3_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [96, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [96, 12])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("split", ["split", "slices"])
def test_a_fused_gate_up_projection_cut_in_halves_gets_its_columns_interleaved(tmp_path, llvm, split):
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse
    from tvmfuse.target import resolve_target

    model = _fused_gate_up(split)
    path = tmp_path / "phi3_mlp.onnx"
    onnx.save(model, path)
    _, plan = plan_tvmfuse(import_model(load_model(path)), resolve_target("cuda"))
    assert [g.pattern for g in plan.groups] == ["gated_gemm"], [(g.pattern, g.ops) for g in plan.groups]
    # a Split is cut into two GEMMs first (plan/rewrites/split_gemm.py), which the gated rewrite merges interleaved;
    # slices are taken by the gated rewrite as they are
    assert plan.rewrites[-1].startswith("gated GEMM: x @ [Wg | Wu] (16 x 24)") and "interleaved" in plan.rewrites[-1]
    assert (split == "split") == any(r.startswith("a GEMM of 2 parts reading x as 2 GEMMs") for r in plan.rewrites)
    config = PlannerConfig(cost_model=CostModel.for_target(llvm, gated_gemm_rows=1))
    mod, plan = plan_tvmfuse(import_model(load_model(path)), llvm, config=config)
    assert [g.pattern for g in plan.groups] == ["gated_gemm"]
    x = (np.random.default_rng(3).standard_normal((96, 16)) * 0.5).astype("float16")
    got, want = build_and_run(mod, llvm, [x])[0], ort_run(model, [x])[0]
    assert rel_err(got.astype("float32"), want.astype("float32")) < 2e-3


def test_a_models_own_every_other_column_slices_stay_out_of_the_gemms_kernel(tmp_path):
    """Stride-2 slices of a GEMM's result that no gated rewrite made (an interleaved rotary embedding's ``x[..., ::2]``)
    are not a gated epilogue: the GEMM keeps a kernel the tensor-core template takes."""
    from onnx import TensorProto, helper, numpy_helper

    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.planner import plan_tvmfuse
    from tvmfuse.target import resolve_target

    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 24)) * 0.3).astype("float16"), "w")]
    for name, v in (("b0", 0), ("b1", 1), ("end", 24), ("ax", -1), ("st", 2)):
        inits.append(numpy_helper.from_array(np.array([v], "int64"), name))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Slice", ["y", "b0", "end", "ax", "st"], ["even"]),
             helper.make_node("Slice", ["y", "b1", "end", "ax", "st"], ["odd"]),
             helper.make_node("Sub", ["even", "odd"], ["z"])]
    graph = helper.make_graph(nodes, "rope_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [96, 16])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [96, 12])], inits)
    path = tmp_path / "rope_like.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _, plan = plan_tvmfuse(import_model(load_model(path)), resolve_target("cuda"))
    gemm = [g for g in plan.groups if "matmul" in g.ops]
    assert len(gemm) == 1 and "strided_slice" not in gemm[0].ops and gemm[0].pattern != "gated_gemm", plan.groups
