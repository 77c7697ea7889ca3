"""Rejections: every fusion not taken has a reason (cycle, pressure limit, ops that cannot fuse)."""
from __future__ import annotations

import logging

import models
from conftest import build_and_run, import_proto, ort_run, rel_err
from tvmfuse.plan.cost import CostModel, Score
from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "tvmfuse" / "data" / "example.onnx"


def test_cycle_is_refused_with_reason(llvm):
    # the block input (transpose) feeds both the GEMM and the residual add after it
    _, plan = partition(import_model(load_model(EXAMPLE)), target=llvm, planner="tvmfuse")
    assert any("cycle" in r.reason for r in plan.rejected)
    assert any(r.reason.startswith("two anchors (matmul, layer_norm)") for r in plan.rejected)


def test_pressure_limit_splits_a_group(llvm, caplog):
    model = models.pointwise_chain()
    mod = import_proto(model)
    tight = CostModel.for_target(llvm, max_live_tensors=2)
    with caplog.at_level(logging.INFO, logger="tvmfuse.plan.why"):
        fused, plan = plan_tvmfuse(mod, llvm, config=PlannerConfig(cost_model=tight))
    assert plan.totals["kernels_fused"] > 1
    assert any(r.reason.startswith("pressure: ") for r in plan.rejected)
    assert any("pressure" in rec.getMessage() for rec in caplog.records)  # logged on tvmfuse.plan.why
    # still correct
    import numpy as np
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal((64, 96)).astype("float32") for _ in range(2)]
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5


def test_ops_that_cannot_fuse_are_named(llvm):
    # nothing fuses into the attention kernel; two GEMMs never share a kernel
    _, plan = partition(import_proto(models.gated("SiLU")), target=llvm, planner="tvmfuse")
    assert any("two anchors (matmul, matmul)" in r.reason for r in plan.rejected)
    # (attention fused as on GPUs: CPU plans leave it unfused for the CPU defaults)
    cost = CostModel.for_target(llvm, attention_decline=None)
    _, plan = plan_tvmfuse(import_proto(_attention_then_add()), llvm, config=PlannerConfig(cost_model=cost))
    assert any("the attention kernel is complete" in r.reason for r in plan.rejected)


def _attention_then_add():
    import onnx
    m = models.attention(mask=False)
    # y = attention(...) + q
    m.graph.node[-1].output[0] = "att"
    m.graph.node.append(onnx.helper.make_node("Add", ["att", "q"], ["y"], name="res"))
    return m


def test_cost_model_is_replaceable(llvm):
    class NeverFuse(CostModel):
        def score(self, graph, a, b):
            return Score(True, -1.0, reason="this model never fuses")

    fused, plan = plan_tvmfuse(import_proto(models.conv_bn_relu()), llvm,
                               config=PlannerConfig(cost_model=NeverFuse()))
    assert plan.totals["kernels_fused"] == 3  # conv, bias add (folded BN), relu
    assert all(r.reason == "this model never fuses" for r in plan.rejected)


def test_a_gemm_kernel_stores_one_result(llvm):
    """y = x @ W + r, an output, and the mean of y² (LLaMA's residual sum and its RMSNorm's statistics): the GEMM's
    kernel stores y only and y² is computed in the reduction's kernel, because the GEMM templates store one result
    (a second one sent LLaMA fp16's GEMMs to dlight). The plan says why, and the model still matches onnxruntime."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tvmfuse._tvm import PrimFunc

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype("float32") * 0.1, "w")
    axes = numpy_helper.from_array(np.array([-1], dtype="int64"), "axes")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "r"], ["y"]),
         helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [32, 64]) for n in ("x", "r")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 64]),
         helper.make_tensor_value_info("ms", TensorProto.FLOAT, [32, 1])], [w, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    fused, plan = plan_tvmfuse(import_proto(model), llvm)
    assert any("would store 2 results" in r.reason for r in plan.rejected), [r.reason for r in plan.rejected]
    gemm = [gv.name_hint for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "matmul" in gv.name_hint]
    assert len(gemm) == 1 and "multiply" not in gemm[0], gemm
    ins = [rng.standard_normal((32, 64)).astype("float32") for _ in range(2)]
    got, want = build_and_run(fused, llvm, ins), ort_run(model, ins)
    assert all(rel_err(g, w_) < 1e-5 for g, w_ in zip(got, want))


def test_a_gemm_kernel_left_with_two_results_is_split_after_grouping(llvm):
    """The same GEMM with y read by a sigmoid (an output) and by the reduction of y²: grouping takes y² into the GEMM's
    kernel expecting the sigmoid to join too, which it then cannot (the kernel would store three results); the
    kernel left storing y and y² is split after grouping, so the GEMM's kernel stores y alone (T5's fp16 clamp
    chain ended this way). The model still matches onnxruntime."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tvmfuse._tvm import PrimFunc

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype("float32") * 0.1, "w")
    axes = numpy_helper.from_array(np.array([-1], dtype="int64"), "axes")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "r"], ["y"]),
         helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
         helper.make_node("Sigmoid", ["y"], ["gate"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [32, 64]) for n in ("x", "r")],
        [helper.make_tensor_value_info("gate", TensorProto.FLOAT, [32, 64]),
         helper.make_tensor_value_info("ms", TensorProto.FLOAT, [32, 1])], [w, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    fused, plan = plan_tvmfuse(import_proto(model), llvm)
    gemm = [gv.name_hint for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "matmul" in gv.name_hint]
    assert gemm == ["fused_matmul_add"], gemm
    ins = [rng.standard_normal((32, 64)).astype("float32") for _ in range(2)]
    got, want = build_and_run(fused, llvm, ins), ort_run(model, ins)
    assert all(rel_err(g, w_) < 1e-5 for g, w_ in zip(got, want))


def _squeeze_excitation():
    """EfficientNet's squeeze-excitation: x * sigmoid(conv(silu(conv(mean(x))))), 1x1 convs over [n, c, 1, 1]."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 16, 1, 1)) * 0.3).astype("float32"), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((16, 4, 1, 1)) * 0.3).astype("float32"), "w2")
    axes = numpy_helper.from_array(np.array([2, 3], "int64"), "axes")
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("Conv", ["m", "w1"], ["c1"]), helper.make_node("Sigmoid", ["c1"], ["s1"]),
             helper.make_node("Mul", ["c1", "s1"], ["a1"]), helper.make_node("Conv", ["a1", "w2"], ["c2"]),
             helper.make_node("Sigmoid", ["c2"], ["g"]), helper.make_node("Mul", ["x", "g"], ["y"])]
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 8, 8])], [w1, w2, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_gpu_stores_a_squeeze_excitation_scale_a_cpu_broadcasts_in_its_gemms_kernel(llvm):
    """On a GPU the excitation's GEMM does not take the multiply that broadcasts its [n, 1, 1, c] result over the
    feature map: that kernel would compute the GEMM's dot products again for every pixel. The CPU keeps it."""
    import numpy as np

    from tvmfuse.target import resolve_target

    model = _squeeze_excitation()
    _, gpu = partition(import_proto(model), target=resolve_target("cuda"), planner="tvmfuse")
    lone = [g for g in gpu.groups if g.ops == ("multiply",)]
    assert len(lone) == 1 and lone[0].bytes_fused < 3 * 2 * 16 * 64 * 4, [(g.pattern, g.ops) for g in gpu.groups]
    assert any("the kernel would compute its dot products again for each output" in r.reason for r in gpu.rejected)
    fused, cpu = partition(import_proto(model), target=llvm, planner="tvmfuse")
    assert not [g for g in cpu.groups if g.ops == ("multiply",)]
    x = np.random.default_rng(1).standard_normal((2, 16, 8, 8)).astype("float32")
    assert rel_err(build_and_run(fused, llvm, [x])[0], ort_run(model, [x])[0]) < 1e-5
