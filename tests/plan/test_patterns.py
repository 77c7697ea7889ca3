"""Each fusion pattern of issue 3: kernel counts, pattern names, bytes, and fused == unfused numerics on llvm."""
from __future__ import annotations

import re

import numpy as np
import pytest

import models
from conftest import build_and_run, import_proto, ort_run, plan_and_run, rel_err
from tvmfuse._tvm import PrimFunc, param_buffers, relax, tvm
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target


def _inputs(model, seed=0):
    inits = {i.name for i in model.graph.initializer}
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype("float32")
            for i in model.graph.input if i.name not in inits]


def _model_layout_plan(mod, llvm):
    """The tvmfuse plan with convs in the model's own layout, as the FuseOps baseline keeps them, and attention
    fused: these tests compare the fusion patterns alone (CPU plans otherwise run convs channels-last, tested apart
    below, and leave attention unfused for the CPU defaults)."""
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    cost = CostModel.for_target(llvm, conv_layout=None, attention_decline=None)
    return plan_tvmfuse(mod, llvm, config=PlannerConfig(cost_model=cost))


def _check(model, llvm, tol=1e-5):
    """Plan with both planners, build both, compare with onnxruntime; returns (tvmfuse plan, fused mod, fuseops plan)."""
    ins = _inputs(model)
    ref = ort_run(model, ins)[0]
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    out = build_and_run(fused, llvm, ins)
    base_mod, base_plan, base_out = plan_and_run(model, llvm, ins, "fuseops")
    assert rel_err(out[0], ref) < tol, "tvmfuse build differs from onnxruntime"
    assert rel_err(out[0], base_out[0]) < tol, "tvmfuse build differs from the FuseOps build"
    # the same unfused baseline as FuseOps (less only where identities were dropped: Dropout, a cast to its own type)
    identities = sum(n.op_type in ("Dropout", "Cast") for n in model.graph.node)
    assert (base_plan.totals["kernels_unfused"] - identities <= plan.totals["kernels_unfused"]
            <= base_plan.totals["kernels_unfused"])
    assert plan.totals["bytes_unfused"] <= base_plan.totals["bytes_unfused"]
    assert plan.totals["kernels_fused"] <= base_plan.totals["kernels_fused"]
    assert plan.totals["bytes_fused"] <= base_plan.totals["bytes_fused"]
    return plan, fused, base_plan


def _launches(mod) -> int:
    call_tir = tvm.ir.Op.get("relax.call_tir")
    n = [0]

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(call_tir):
            n[0] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return n[0]


def test_conv_bn_relu_one_kernel_two_thirds_less_traffic(llvm):
    model = models.conv_bn_relu()
    plan, fused, base = _check(model, llvm)
    assert _launches(fused) == 1 and len(plan.groups) == 1
    g = plan.groups[0]
    assert g.pattern == "conv_epilogue"
    assert any("BatchNorm" in n for n in g.notes)
    # BN folded: the fused kernel takes x, the scaled weights and one bias (not mean/var/gamma/beta)
    prim = fused[g.kernel]
    assert isinstance(prim, PrimFunc) and len(prim.params) == 4
    # ONNX-level accounting (Conv, BatchNormalization, Relu as three kernels): activation traffic x+5y vs x+y
    x = y = 1 * 16 * 16 * 16 * 4
    weights = 16 * 16 * 9 * 4
    unfused_acts = x + 5 * y
    fused_acts = g.bytes_fused - weights - 16 * 4
    assert fused_acts == x + y
    assert 0.64 < 1 - fused_acts / unfused_acts < 0.69  # about 66% less
    assert g.bytes_fused < 0.4 * g.bytes_unfused


def test_conv_bn_residual_relu_is_the_conv_epilogue(llvm):
    plan, fused, _ = _check(models.conv_bn_relu_residual(), llvm)
    assert _launches(fused) == 1
    assert plan.groups[0].pattern == "conv_epilogue"
    assert plan.groups[0].ops[-2:] == ("add", "relu")


def test_pointwise_chain_any_length_is_one_kernel(llvm):
    plan, fused, base = _check(models.pointwise_chain(), llvm)
    assert _launches(fused) == 1
    assert plan.groups[0].pattern == "pointwise_chain"
    assert plan.groups[0].kernels_unfused >= 10
    # residual-aware accounting: x is read by several ops, once by the fused kernel
    assert any(n.startswith("x read once instead of") for n in plan.groups[0].notes)


@pytest.mark.parametrize("act,batched", [("Relu", False), ("GELU", False), ("SiLU", True)])
def test_gemm_epilogue(llvm, act, batched):
    plan, fused, _ = _check(models.gemm_epilogue(act=act, batched=batched), llvm)
    assert _launches(fused) == 1
    g = plan.groups[0]
    assert g.pattern == "gemm_epilogue" and g.ops[0] == "matmul" and g.ops[-1] == "add"


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "Softmax"])
def test_norm_with_its_residual_add_is_one_kernel(llvm, kind):
    plan, fused, base = _check(models.add_norm(kind), llvm, tol=1e-5)
    assert _launches(fused) == 1
    assert plan.groups[0].pattern == "norm_prologue"
    assert plan.groups[0].ops[0] == "add"
    if kind == "LayerNorm":  # stock FuseOps leaves add and layer_norm in two kernels
        assert base.totals["kernels_fused"] == 2


@pytest.mark.parametrize("kind", ["SiLU", "GELU"])
def test_gating(llvm, kind):
    plan, fused, _ = _check(models.gated(kind), llvm)
    gating = plan.by_pattern("gating")
    assert len(gating) == 1 and "multiply" in gating[0].ops
    assert _launches(fused) == 3  # act(x@W1)*g, x@W3, @W2
    # the GEMM merge was weighed and refused: the gate product fuses better as an epilogue
    assert any("horizontal merge" in r.reason for r in plan.rejected)


@pytest.mark.slow
def test_a_cast_split_off_a_gemm_joins_the_norm_that_reads_it(tmp_path):
    """LLaMA in fp16: a GEMM's kernel took the fp32 cast of the residual sum while grouping, then stored the sum
    alone (its templates store one result), leaving the cast a kernel of its own that wrote 2x the sum's bytes for
    the RMSNorm to read back, twice a layer. The cast now joins the norm's kernel as its prologue, on CUDA and on
    CPUs, and the build still matches the fp32 model at fp16's tolerance."""
    from pathlib import Path

    from tvmfuse import api
    from tvmfuse.frontend import import_model, load_model

    model = Path(__file__).parents[1] / "fixtures" / "tiny_llama.float32.onnx"
    for target in ("cuda", "llvm"):
        loaded = load_model(model, precision="fp16")
        _, plan = partition(import_model(loaded), target=resolve_target(target), precision="fp16")
        assert not any(g.ops == ("cast",) for g in plan.groups), [g.ops for g in plan.groups]
        assert sum(g.ops[:2] == ("cast", "power") for g in plan.groups) >= 3, [g.ops for g in plan.groups]
    cfg = api.ModelConfig(model=model, target="llvm", db=tmp_path / "none.db", precision="fp16")
    api.compile(cfg, out=tmp_path / "art", untuned=True)
    ran = api.run(tmp_path / "art", inputs=model.with_name("tiny_llama.inputs.npz"), verify_against=model, repeat=0)
    assert all(o["ok"] for o in ran["verification"]["outputs"]), ran["verification"]


def test_horizontal_merge_when_it_pays(llvm):
    plan, fused, base = _check(models.wide_branches(), llvm)
    h = plan.by_pattern("horizontal_gemm")
    assert len(h) == 1 and h[0].ops == ("matmul",) * 3
    assert plan.totals["bytes_fused"] < base.totals["bytes_fused"]
    assert plan.totals["kernels_fused"] < base.totals["kernels_fused"]


def test_horizontal_merge_refused_when_it_does_not_pay(llvm):
    plan, fused, base = _check(models.qkv(), llvm)
    assert not plan.by_pattern("horizontal_gemm")
    assert any(r.reason.startswith("horizontal merge of 3 GEMMs") and "no gain" in r.reason for r in plan.rejected)


def test_a_split_gemm_runs_as_one_gemm_a_part(llvm):
    """GPT-2's QKV: one GEMM, split in three, each part reshaped and transposed to heads. Split as it is, its output
    goes through a split kernel and each part through a transpose of its own; one GEMM a part (the weight's column
    blocks) stores each part in its heads' layout from the GEMM's epilogue, and the model still matches."""
    model = models.fused_qkv_attention()
    ins = _inputs(model)
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    assert not any("split" in g.ops for g in plan.groups), [g.ops for g in plan.groups]
    assert sum(g.ops.count("matmul") for g in plan.groups if g.pattern != "attention") == 3
    assert any(g.pattern == "attention" for g in plan.groups)
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5


def test_a_gemm_split_along_the_heads_of_its_view_runs_as_one_gemm_a_part(llvm):
    """Falcon's fused query_key_value: the output viewed as [.., heads, d] and split along the heads (the query heads,
    one K head, one V head). Each part is a GEMM on its heads' columns, no split kernel, and the model still
    matches."""
    model = models.fused_heads_qkv_attention()
    ins = _inputs(model)
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    assert not any("split" in g.ops for g in plan.groups), [g.ops for g in plan.groups]
    assert sum(g.ops.count("matmul") for g in plan.groups if g.pattern != "attention") == 3
    assert any("a GEMM of 3 parts" in n for n in plan.rewrites)
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5


def test_a_split_gate_up_gemm_is_two_gemms_and_still_gated_on_hopper(llvm):
    """Phi-3's MLP: ``chunk(2)`` of one gate/up GEMM. On llvm the parts are two GEMMs (silu and the gating in their
    epilogues, the split kernel gone) and match onnxruntime; on Hopper in fp16 they are still one gated GEMM."""
    model = models.fused_gate_up()
    ins = _inputs(model)
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    assert not any("split" in g.ops for g in plan.groups), [g.ops for g in plan.groups]
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5
    _, plan = partition(import_proto(models.to_fp16(models.fused_gate_up())), target=resolve_target("cuda"))
    assert [g.pattern for g in plan.groups].count("gated_gemm") == 1


def test_a_split_gemm_stays_one_gemm_where_its_input_outweighs_its_output(llvm):
    """Parts 8 columns wide of a 256-wide input: three GEMMs would read the input twice more than the split's
    read and write of the output saves."""
    model = models.fused_qkv_attention(d=256, sizes=[8, 8, 8])
    ins = _inputs(model)
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    assert any("split" in g.ops for g in plan.groups)
    assert any(r.reason.startswith("split GEMM: 3 GEMMs would read") for r in plan.rejected)
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5


@pytest.mark.parametrize("mask", [True, False])
def test_attention_one_kernel_without_scores_in_memory(llvm, mask):
    model = models.attention(mask=mask)
    plan, fused, base = _check(model, llvm)
    assert _launches(fused) == 1
    g = plan.groups[0]
    assert g.pattern == "attention" and g.ops[-2:] == ("softmax", "matmul")
    prim = fused[g.kernel]
    seq = 32
    # no parameter and no buffer of the kernel holds a seq x seq tile
    shapes = [tuple(int(d) for d in p.shape) for p in prim.params]
    allocs = [tuple(int(d) for d in re.findall(r"\d+", m)) for m in re.findall(r"alloc_buffer\(\(([^)]*)\)", prim.script())]
    assert allocs, "the kernel's local scratch was not found"
    assert all(s[-2:] != (seq, seq) for s in shapes + allocs)
    assert all(int(np.prod(s)) <= 16 for s in allocs)  # the scratch: m, l, s, p and one Dv accumulator
    assert base.totals["kernels_fused"] > 1 and plan.totals["bytes_fused"] < base.totals["bytes_fused"]


def test_attention_behind_identity_casts_is_one_kernel(llvm):
    """ViT's exports cast the probabilities from fp32 to fp32 twice before P·V: the casts are identities, dropped
    before the matcher looks (fp32 ViT-B had run Q·Kᵀ, softmax and P·V as three kernels)."""
    model = models.attention(mask=False, casts=2)
    ins = _inputs(model)
    fused, plan = _model_layout_plan(import_proto(model), llvm)
    assert _launches(fused) == 1 and plan.groups[0].pattern == "attention"
    assert rel_err(build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]) < 1e-5


def test_fp16_attention_through_the_frontend_is_still_one_kernel(llvm, tmp_path):
    """The frontend makes fp16 matmuls accumulate in fp32 (astype(matmul(.., f32), f16)); the attention
    pattern must look through those casts, or fp16 transformers lose their attention kernel."""
    import onnx

    from tvmfuse.frontend import import_model, load_model

    model = models.to_fp16(models.attention(mask=True))
    path = tmp_path / "attention16.onnx"
    onnx.save(model, path)
    loaded = load_model(path)
    mod = import_model(loaded)
    assert "out_dtype=\"float32\"" in mod.script()  # the fp32-accumulation fix-up ran: its casts are in the graph
    fused, plan = _model_layout_plan(mod, llvm)
    assert _launches(fused) == 1
    assert plan.groups[0].pattern == "attention"
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s.shape).astype(np.float16) for s in loaded.inputs]
    (got,) = build_and_run(fused, llvm, inputs)
    (ref,) = ort_run(model, [x.astype(np.float16) for x in inputs])
    assert got.dtype == np.float16
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < 1e-2


def test_channels_last_convs_match_onnxruntime(llvm):
    """GPU plans run convs NHWC (the tensor-core template then reads its operands along K); the layout change
    must keep the numerics and leave transposes only at the edges of the conv stack."""
    from tvmfuse.bench.models import SMALL_MODELS, resnet50
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    model, _, _ = resnet50(**SMALL_MODELS["resnet50"], dtype="float32")
    mod = import_proto(model)
    fused, plan = plan_tvmfuse(mod, llvm, config=PlannerConfig(cost_model=CostModel.for_target(llvm, conv_layout="NHWC")))
    assert any("channels-last (NHWC): 2 layout transposes" in n for n in plan.rewrites)
    prims = [f.script() for f in fused.functions.values() if isinstance(f, PrimFunc)]
    assert sum("conv2d_nhwc" in s for s in prims) == 17 and not any("conv2d_nchw" in s for s in prims)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    (got,) = build_and_run(fused, llvm, [x])
    (ref,) = ort_run(model, [x])
    assert rel_err(got, ref) < 1e-4
    assert CostModel.for_target(resolve_target("cuda")).conv_layout == "NHWC"  # what GPU plans use


def test_an_nhwc_model_keeps_no_transpose_once_its_convs_run_channels_last(llvm):
    """A model that takes and returns NHWC tensors says so in ONNX as Transpose -> Conv -> ... -> Transpose (the
    conv case of ANCHORS.md, timed channels-last). Run channels-last, the layout transposes undo the model's:
    the plan is the conv kernel alone, with no copy of the input or output, and still matches onnxruntime."""
    from tvmfuse.bench.cases import conv_bn_relu
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    config = PlannerConfig(cost_model=CostModel.for_target(llvm, conv_layout="NHWC"))
    model, _, _ = conv_bn_relu(B=2, C=16, H=6, W=5)
    fused, plan = plan_tvmfuse(import_proto(model), llvm, config=config)
    assert [g.pattern for g in plan.groups] == ["conv_epilogue"] and "transpose" not in plan.groups[0].ops
    assert _launches(fused) == 1 and "permute_dims" not in fused["main"].script()
    assert any("3 transposes that undid each other removed" in n for n in plan.rewrites), plan.rewrites
    x = np.random.default_rng(0).standard_normal((2, 6, 5, 16)).astype(np.float16)
    (got,) = build_and_run(fused, llvm, [x])
    (ref,) = ort_run(model, [x])
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < 1e-2
    # transposes that are not undone stay: the NCHW model's input in a kernel of its own, its output in the epilogue
    _, plan = plan_tvmfuse(import_proto(conv_bn_relu(B=2, C=16, H=6, W=5, layout="NCHW")[0]), llvm, config=config)
    assert [g.ops.count("transpose") for g in plan.groups] == [1, 1] and plan.groups[1].ops[-1] == "transpose"


def test_fp16_batchnorm_folds_through_the_accumulation_cast(llvm, tmp_path):
    """The frontend makes an fp16 conv accumulate in fp32 and cast back (astype(conv2d(.., f32), f16)) before the
    BatchNorm's subtract/divide/multiply/add. The fold must look through that cast: the epilogue is then one bias
    add in fp16 instead of four per-channel ops with four constants, and the numerics still match onnxruntime."""
    import onnx

    from tvmfuse.frontend import import_model, load_model

    model = models.to_fp16(models.conv_bn_relu(n=2, cin=16, cout=24, hw=8))
    path = tmp_path / "cbr16.onnx"
    onnx.save(model, path)
    loaded = load_model(path)
    mod = import_model(loaded)
    assert "out_dtype=\"float32\"" in mod.script() and "R.astype(" in mod.script()
    fused, plan = _model_layout_plan(mod, llvm)
    (g,) = plan.groups
    assert any("BatchNorm" in n and "folded" in n for n in g.notes), g.notes
    prim = fused[g.kernel]
    assert len(prim.params) == 4   # x, the scaled weights, one bias, the output
    assert not any(op in prim.script() for op in ("T_subtract", "T_divide", "T_multiply")), prim.script()
    x = np.random.default_rng(0).standard_normal((2, 16, 8, 8)).astype(np.float16)
    (got,) = build_and_run(fused, llvm, [x])
    (ref,) = ort_run(model, [x])
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < 1e-2


def _as_the_conv(plan, fused, model, llvm, shape):
    """A rewritten conv's plan accounts its nodes as the model's one conv (kernels and bytes before fusion), and
    its fused module computes the conv on llvm (fp16, against onnxruntime)."""
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    _, as_conv = plan_tvmfuse(import_proto(model), llvm, config=PlannerConfig(
        cost_model=CostModel.for_target(llvm, conv_layout="NHWC", conv_kernel_layout="OHWI")))
    assert plan.totals["kernels_unfused"] == as_conv.totals["kernels_unfused"]
    assert plan.totals["bytes_unfused"] == as_conv.totals["bytes_unfused"]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float16)
    (got,) = build_and_run(fused, llvm, [x])
    (ref,) = ort_run(model, [x])
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < 1e-2


@pytest.mark.parametrize("cin,k,stride,pad,dilation", [(3, 7, 2, 3, 1), (5, 3, 1, 2, 2)])
def test_narrow_convs_run_as_im2col_and_a_gemm(llvm, cin, k, stride, pad, dilation):
    """GPU plans run a channels-last conv with fewer than 16 input channels (a stem's 3) as an im2col kernel
    (K = taps x channels, zero-padded to 64) and a GEMM the tensor-core template takes; the numerics must stay
    those of the conv: a stem (7x7, stride 2, padding 3) and a dilated conv with padding. 16 channels and more,
    and fp32, stay convs."""
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    b = models._B(5)
    conv = b.op("Conv", ["x", b.w(16, cin, k, k)], kernel_shape=[k, k], strides=[stride] * 2, pads=[pad] * 4,
                dilations=[dilation] * 2)
    bn = b.op("BatchNormalization", [conv, b.const(1 + 0.1 * b.rng.standard_normal(16)),
                                     b.const(0.1 * b.rng.standard_normal(16)), b.const(0.1 * b.rng.standard_normal(16)),
                                     b.const(1 + 0.1 * b.rng.random(16))], epsilon=1e-5)
    out = (13 + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    model32 = b.model({"x": [2, cin, 13, 13]}, b.op("Relu", [bn]), [2, 16, out, out])
    model = type(model32)()
    model.CopyFrom(model32)
    model = models.to_fp16(model)
    config = PlannerConfig(cost_model=CostModel.for_target(llvm, conv_layout="NHWC", conv_kernel_layout="OHWI",
                                                           im2col_k=512))
    fused, plan = plan_tvmfuse(import_proto(model), llvm, config=config)
    kpad = -(-k * k * cin // 64) * 64
    assert any(f"runs as im2col + GEMM (K {k * k * cin} padded to {kpad})" in n for n in plan.rewrites), plan.rewrites
    prims = [f.script() for f in fused.functions.values() if isinstance(f, PrimFunc)]
    assert not any("conv2d" in p for p in prims) and any("im2col" in p for p in prims)
    assert [g.pattern for g in plan.groups if "matmul" in g.kernel] == ["gemm_epilogue"]
    # the plan accounts the rows, the GEMM and the reshape as the one conv they replace
    _as_the_conv(plan, fused, model, llvm, (2, cin, 13, 13))
    assert CostModel.for_target(resolve_target("cuda")).im2col_k and not CostModel.for_target(llvm).im2col_k
    wide = models._B(6)
    y = wide.op("Conv", ["x", wide.w(16, 16, 3, 3)], kernel_shape=[3, 3], pads=[1] * 4)
    _, plan = plan_tvmfuse(import_proto(models.to_fp16(wide.model({"x": [1, 16, 8, 8]}, y, [1, 16, 8, 8]))), llvm,
                           config=config)
    assert not any("im2col" in n for n in plan.rewrites)
    _, plan = plan_tvmfuse(import_proto(model32), llvm, config=config)   # fp32: the wgmma template would not take it
    assert not any("im2col" in n for n in plan.rewrites)


@pytest.mark.parametrize("cin,k,stride,pad", [(3, 7, 2, 3), (12, 3, 1, 1)])
def test_narrow_fp16_convs_run_on_padded_channels(llvm, cin, k, stride, pad):
    """GPU plans keep an fp16 conv of fewer than 16 input channels a conv, on its channels zero-padded to whole
    16-byte copies (8 or 16 fp16 channels), which the tensor-core conv template takes; the pad joins the input's
    cast and transpose in one kernel, the plan accounts the conv as the model's, and the numerics stay the conv's.
    fp32 keeps im2col; 8 channels need no padding."""
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    def stem(cin, dtype_fp16=True):
        b = models._B(7)
        conv = b.op("Conv", ["x", b.w(16, cin, k, k)], kernel_shape=[k, k], strides=[stride] * 2, pads=[pad] * 4)
        out = (15 + 2 * pad - k) // stride + 1
        model = b.model({"x": [2, cin, 15, 15]}, b.op("Relu", [conv]), [2, 16, out, out])
        return models.to_fp16(model) if dtype_fp16 else model

    config = PlannerConfig(cost_model=CostModel.for_target(llvm, conv_layout="NHWC", conv_kernel_layout="OHWI",
                                                           im2col_k=512, narrow_conv_pad=("float16",)))
    model = stem(cin)
    fused, plan = plan_tvmfuse(import_proto(model), llvm, config=config)
    cpad = -(-cin // 8) * 8
    assert any(f"({cin} input channels) runs on its channels zero-padded to {cpad}" in n for n in plan.rewrites)
    prims = {name: f for name, f in ((gv.name_hint, f) for gv, f in fused.functions.items())
             if isinstance(f, PrimFunc)}
    (conv,) = [f for name, f in prims.items() if "conv2d" in name]
    assert [int(d) for d in param_buffers(conv)[0].shape][3] == cpad
    assert [int(d) for d in param_buffers(conv)[1].shape] == [16, k, k, cpad]
    (pad_kernel,) = [name for name in prims if "pad_channels" in name]
    assert "transpose" in pad_kernel   # one kernel reads the NCHW image and writes the padded NHWC input
    _as_the_conv(plan, fused, model, llvm, (2, cin, 15, 15))
    for other in (stem(cin, dtype_fp16=False), stem(8)):
        _, plan = plan_tvmfuse(import_proto(other), llvm, config=config)
        assert not any("zero-padded" in n for n in plan.rewrites), plan.rewrites
    assert CostModel.for_target(resolve_target("cuda")).narrow_conv_pad == ("float16",)
    assert not CostModel.for_target(resolve_target('{"kind": "cuda", "arch": "sm_80"}')).narrow_conv_pad
    assert not CostModel.for_target(llvm).narrow_conv_pad


def test_a_patch_embedding_runs_as_im2col_rows_at_any_k(llvm):
    """A conv of non-overlapping patches (kernel = stride, no padding: a ViT's) takes im2col rows even past
    ``im2col_k``, its K exact (4 x 4 x 3 = 48, padded to 64 here): the rows are the input's elements reordered.
    Without that it stayed a 3-channel conv (dlight's CUDA cores on a GPU); it is never padded instead."""
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    b = models._B(8)
    conv = b.op("Conv", ["x", b.w(32, 3, 4, 4)], kernel_shape=[4, 4], strides=[4, 4])
    model = models.to_fp16(b.model({"x": [2, 3, 16, 16]}, b.op("Relu", [conv]), [2, 32, 4, 4]))
    config = PlannerConfig(cost_model=CostModel.for_target(llvm, conv_layout="NHWC", conv_kernel_layout="OHWI",
                                                           im2col_k=32, narrow_conv_pad=("float16",)))
    fused, plan = plan_tvmfuse(import_proto(model), llvm, config=config)
    assert any("runs as im2col + GEMM (K 48 padded to 64)" in n for n in plan.rewrites), plan.rewrites
    assert not any("zero-padded" in n for n in plan.rewrites)
    _as_the_conv(plan, fused, model, llvm, (2, 3, 16, 16))


def test_a_pad_joins_the_pointwise_kernel_before_it(llvm):
    """A model's Pad after an elementwise op: TVM's pattern annotation calls TOPI's pad elementwise, which the
    legality read as a broadcast of the intermediate; the planner classifies it as the injective op it is, so the
    sigmoid and the pad run as one kernel, computing what onnxruntime computes."""
    b = models._B(9)
    s = b.op("Sigmoid", ["x"])
    from onnx import numpy_helper

    b.inits.append(numpy_helper.from_array(np.array([0, 0, 1, 2, 0, 0, 1, 2], np.int64), "pads"))
    pads = "pads"
    model = b.model({"x": [2, 3, 5, 6]}, b.op("Pad", [s, pads], mode="constant"), [2, 3, 7, 10])
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 6)).astype(np.float32)
    _, plan, (got,) = plan_and_run(model, llvm, [x], "tvmfuse")
    assert [g.ops for g in plan.groups] == [("sigmoid", "pad")], [(g.ops, g.pattern) for g in plan.groups]
    (ref,) = ort_run(model, [x])
    assert rel_err(got, ref) < 1e-6
