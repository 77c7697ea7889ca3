"""FuseAttention on causal masks and grouped K/V heads (issue 21): what it recognises, what it declines and why, and
each model end to end on llvm against onnxruntime (the planner's scalar attention PrimFunc honours ``causal`` and the
K/V head mapping, so these runs check the semantics the GPU kernels implement)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # benchmarks/: the GPU script's graphs, tested here

from benchmarks.attention_causal_gpu import attention_onnx  # noqa: E402
from conftest import build_and_run, import_proto, ort_run, rel_err  # noqa: E402
from tvmfuse.frontend import import_model, load_model  # noqa: E402
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec  # noqa: E402
from tvmfuse.plan.cost import CostModel  # noqa: E402
from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def partition(mod, *, target):
    """The tvmfuse plan with attention fused as on GPUs (CPU plans leave it unfused for the CPU defaults): these
    tests run the attention kernel's semantics on llvm."""
    cost = CostModel.for_target(target, attention_decline=None)
    return plan_tvmfuse(mod, target, config=PlannerConfig(cost_model=cost))


def _specs(fused) -> list[AttentionSpec]:
    return [AttentionSpec.from_json(str(f.attrs[SPEC_ATTR])) for f in fused.functions.values()
            if getattr(f, "attrs", None) is not None and SPEC_ATTR in f.attrs]


def _planned(model, llvm, tol=1e-5):
    """(spec of its one attention kernel, plan, the attention kernel) after checking the build against onnxruntime."""
    rng = np.random.default_rng(0)
    dt = np.float16 if model.graph.input[0].type.tensor_type.elem_type == 10 else np.float32
    ins = [rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(dt)
           for i in model.graph.input]
    fused, plan = partition(import_proto(model), target=llvm)
    (spec,) = _specs(fused)
    got, ref = build_and_run(fused, llvm, ins)[0], ort_run(model, ins)[0]
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < tol
    (group,) = plan.by_pattern("attention")
    return spec, plan, fused[group.kernel]


@pytest.mark.parametrize("mask", ["const", "where", "trilu"])
def test_a_constant_causal_mask_is_recognised_and_not_read(llvm, mask):
    spec, plan, kernel = _planned(attention_onnx(mask=mask), llvm)
    assert spec.causal and spec.causal_offset == 0 and spec.mask_shape is None
    assert len(kernel.params) == 4   # q, k, v, out: no mask
    assert any("causal (offset 0)" in n for n in plan.rewrites)
    # the scalar kernel walks only the keys a row sees
    assert "if j <= v_i:" in kernel.script() or "if j <= v_i + 0:" in kernel.script(), kernel.script()


def test_fp32_lowest_minus_ten_thousand_and_minus_inf_all_mask(llvm):
    for value in (float(np.finfo(np.float32).min), -1e4, -np.inf):
        spec, _, _ = _planned(attention_onnx(mask="const", mask_value=value), llvm)
        assert spec.causal, value


def test_more_keys_than_queries_is_bottom_right_aligned(llvm):
    spec, _, _ = _planned(attention_onnx(mask="const", seq_q=16, seq_k=40), llvm)
    assert spec.causal and spec.causal_offset == 24


def test_a_near_triangular_mask_is_read_as_a_tensor_with_the_reason(llvm):
    spec, plan, kernel = _planned(attention_onnx(mask="near"), llvm)
    assert not spec.causal and spec.mask_shape == (1, 1, 16, 16) and len(kernel.params) == 5
    assert any("looks causal but element [8, 15]" in n for n in plan.rewrites), plan.rewrites


def test_a_mask_too_weak_to_hide_keys_is_not_causal(llvm):
    # -100 leaves exp(-100) ~ 4e-44 of weight, and a score of +100 would undo it: not an exclusion
    spec, plan, _ = _planned(attention_onnx(mask="const", mask_value=-100.0), llvm)
    assert not spec.causal and spec.mask_shape is not None
    assert any("is -100: kept as a tensor" in n for n in plan.rewrites)


def test_a_runtime_mask_input_stays_an_input(llvm):
    model = attention_onnx(mask="input")
    fused, _ = partition(import_proto(model), target=llvm)
    (spec,) = _specs(fused)
    assert not spec.causal and spec.mask_shape == (1, 1, 16, 16)


@pytest.mark.parametrize("repeat", ["expand", "tile"])
def test_repeat_kv_is_dropped_and_the_kernel_reads_kv_heads_directly(llvm, repeat):
    spec, plan, kernel = _planned(attention_onnx(heads=8, kv_heads=2, repeat=repeat), llvm)
    assert spec.kv_group == 4 and spec.kv_batch == (1, 2) and spec.causal
    assert [tuple(int(d) for d in p.shape) for p in kernel.params[1:3]] == [(1, 2, 16, 16)] * 2
    (group,) = plan.by_pattern("attention")
    assert group.ops[0] == "repeat_kv"
    assert len(plan.groups) == 1   # no repeat kernel left: K and V are never repeated in memory
    assert any("2 K/V heads for 8 query heads" in n for n in plan.rewrites)


def test_a_single_broadcast_kv_head_is_multi_query_attention(llvm):
    spec, plan, kernel = _planned(attention_onnx(heads=4, kv_heads=1, repeat="broadcast", mask="none"), llvm)
    assert spec.kv_group == 4 and not spec.causal and spec.kv_batch == (1, 1)


def test_a_head_axis_tile_repeats_heads_in_the_other_order_and_is_not_taken(llvm):
    """Tile(k, [1, n, 1, 1]) gives query head h the K/V head h % H_kv, not repeat_kv's h // n: reading K/V head
    h // n would be wrong, so the repeat is kept (its kernels stay) and the attention reads the repeated K/V."""
    spec, plan, _ = _planned(attention_onnx(heads=8, kv_heads=2, repeat="tile_heads"), llvm)
    assert spec.kv_group == 1 and spec.causal
    assert len(plan.groups) == 3


def test_a_head_ratio_that_does_not_divide_is_refused():
    kw = dict(batch=(2, 6), seq_q=8, seq_k=8, head_dim=4, head_dim_v=4, dtype="float32", scale=None, mask_shape=None)
    assert AttentionSpec(**kw, kv_group=3).kv_batch == (2, 2)
    with pytest.raises(ValueError, match="kv_group 4 does not divide"):
        AttentionSpec(**kw, kv_group=4)
    with pytest.raises(ValueError, match="rows that see no key"):
        AttentionSpec(**kw, causal=True, causal_offset=-1)


def test_gqa_with_a_causal_mask_in_fp16(llvm):
    spec, _, _ = _planned(attention_onnx(heads=4, kv_heads=2, dtype="float16", seq_q=32), llvm, tol=1e-2)
    assert spec.causal and spec.kv_group == 2 and spec.dtype == "float16"


@pytest.mark.parametrize("name", ["tiny_gpt2.float32", "tiny_gpt2.float16", "tiny_llama.float32", "tiny_llama.float16"])
def test_the_exported_transformers_masks_are_causal(llvm, name):
    """torch's exports of GPT-2 and LLaMA (the fixtures) add a constant [1, 1, S, S] of 0 and fp32's lowest."""
    loaded = load_model(FIXTURES / f"{name}.onnx")
    fused, plan = partition(import_model(loaded), target=llvm)
    (spec,) = _specs(fused)
    assert spec.causal and spec.causal_offset == 0 and spec.mask_shape is None
    if name.endswith("float32"):   # and the model still computes what onnxruntime does (fp16 on llvm is slow)
        import onnx

        feeds = dict(np.load(FIXTURES / f"{name.split('.')[0]}.inputs.npz"))
        args = [feeds[x.name].astype(x.dtype) for x in loaded.inputs]
        (got,) = build_and_run(fused, llvm, args)[:1]
        (ref,) = ort_run(onnx.load(str(FIXTURES / f"{name}.onnx")), args)[:1]
        assert rel_err(got, ref) < 1e-4


def test_the_causal_gqa_scalar_kernel_has_candidates_in_the_llvm_space(llvm):
    """The llvm space (MetaSchedule's stock rules) must sample it: with a run-time loop extent (keys up to the
    diagonal) it found no candidate at all and `tune` failed the kernel; the kernel guards the hidden keys instead."""
    from tvmfuse.tune import extract_kernels
    from tvmfuse.tune.spaces import sample_schedules, select_space

    fused, _ = partition(import_proto(attention_onnx(heads=4, kv_heads=2)), target=llvm)
    (kernel,) = [k for k in extract_kernels(fused, target=llvm) if SPEC_ATTR in k.mod["main"].attrs]
    mods = sample_schedules(kernel.mod, llvm.target, select_space(kernel.mod, llvm.target), n=4, seed=1)
    assert len(mods) >= 2


@pytest.mark.parametrize("mask", ["const", "input"])
def test_a_second_addition_to_the_scores_is_read_beside_the_mask(llvm, mask):
    """A padding mask added after a causal one: the causal one becomes the flag and the padding is the mask; after a
    runtime mask, the two are the kernel's mask and bias, both read where the score is formed."""
    spec, _, kernel = _planned(attention_onnx(batch=2, mask=mask, padding=True), llvm)
    if mask == "const":
        assert spec.causal and spec.mask_shape == (2, 1, 1, 16) and spec.bias_shape is None
        assert len(kernel.params) == 5   # q, k, v, the padding, out
    else:
        assert not spec.causal and (spec.mask_shape, spec.bias_shape) == ((1, 1, 16, 16), (2, 1, 1, 16))
        assert len(kernel.params) == 6


def test_t5s_position_bias_and_mask_fuse_and_compute_what_onnxruntime_does(llvm):
    """T5 adds its relative-position bias and its mask to the scores, unscaled: both are additions of the kernel."""
    import onnx

    loaded = load_model(FIXTURES / "tiny_t5_encoder.float32.onnx")
    fused, plan = partition(import_model(loaded), target=llvm)
    specs = _specs(fused)
    assert specs and all(s.scale is None and s.mask_shape is not None and s.bias_shape is not None for s in specs)
    feeds = dict(np.load(FIXTURES / "tiny_t5_encoder.inputs.npz"))
    args = [feeds[x.name].astype(x.dtype) for x in loaded.inputs]
    (got,) = build_and_run(fused, llvm, args)[:1]
    (ref,) = ort_run(onnx.load(str(FIXTURES / "tiny_t5_encoder.float32.onnx")), args)[:1]
    assert rel_err(got, ref) < 1e-4


def test_t5_in_fp16_fuses_too_through_the_cast_of_its_scores(llvm):
    """In fp16 the scores are cast back from the fp32-accumulated product before the bias is added: the matcher
    walks through that cast to the product."""
    fused, _ = partition(import_model(load_model(FIXTURES / "tiny_t5_encoder.float16.onnx")), target=llvm)
    specs = _specs(fused)
    assert specs and all(s.dtype == "float16" and s.bias_shape is not None for s in specs)


@pytest.mark.parametrize("model,rows,tol", [("tiny_vit.float32", True, 1e-4), ("tiny_vit.float16", True, 1e-2),
                                            ("tiny_bert.float32", False, 1e-4)])
def test_kt_of_keys_no_16_byte_vector_divides_is_read_as_rows_and_computes_what_onnxruntime_does(llvm, model, rows,
                                                                                                 tol):
    """The exporters turn K with the same transpose that splits its heads (perm 0, 2, 3, 1): ViT's 17 keys of 4 or 2
    bytes leave Kᵀ's rows unaligned for 16-byte copies, so the planner emits that permute with its last two axes
    swapped back (K as rows) for the kernel; BERT's 8 fp32 keys (32 bytes) keep Kᵀ."""
    import onnx

    loaded = load_model(FIXTURES / f"{model}.onnx")
    fused, plan = partition(import_model(loaded), target=llvm)
    specs = _specs(fused)
    assert specs and all(s.k_rows == rows for s in specs)
    feeds = dict(np.load(FIXTURES / f"{model.split('.')[0]}.inputs.npz"))
    args = [feeds[x.name].astype(x.dtype) for x in loaded.inputs]
    (got,) = build_and_run(fused, llvm, args)[:1]
    (ref,) = ort_run(onnx.load(str(FIXTURES / f"{model}.onnx")), args)[:1]
    assert rel_err(got.astype(np.float32), ref.astype(np.float32)) < tol
    # and the transpose of heads and rows after it is the kernel's store
    assert all(s.seq_major_out for s in specs)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_the_transpose_after_attention_is_its_store_and_computes_what_onnxruntime_does(llvm, kv_heads):
    """The exporters' Transpose(0, 2, 1, 3) of the attention's output before its projection: the kernel stores each
    row's heads side by side ([B, S, H, D]), no kernel moves them, and the output is what onnxruntime computes."""
    spec, plan, kernel = _planned(attention_onnx(batch=2, heads=4, kv_heads=kv_heads, heads_out=True), llvm)
    assert spec.seq_major_out and spec.out_shape == (2, 16, 4, 16)
    assert [int(d) for d in kernel.params[-1].shape] == [2, 16, 4, 16]
    # the kernel's ops: K's transpose and the output's; no other kernel moves data but the graph output's reshape
    assert plan.by_pattern("attention")[0].ops.count("transpose") == 2
    assert all(g.ops == ("reshape",) for g in plan.groups if g.pattern != "attention")
    assert any("rows before its heads" in n for n in plan.rewrites)
    # without the transpose the layout stays the matmul's, and so does the spec's text (a tuned record's key)
    plain, _, _ = _planned(attention_onnx(batch=2, heads=4, kv_heads=kv_heads), llvm)
    assert not plain.seq_major_out and "seq_major_out" not in plain.to_json()
    assert AttentionSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("form", ["where_scores", "masked_fill"])
@pytest.mark.parametrize("value", [-1e4, float(np.finfo(np.float32).min)])
def test_a_where_between_the_scores_and_a_hiding_value_is_a_causal_mask(llvm, form, value):
    """GPT-Neo (and GPT-2 as older exporters wrote it) choose between the scores and a large negative value with a
    constant condition; masked_fill writes the value where the condition holds. Both are the causal mask."""
    spec, _, kernel = _planned(attention_onnx(mask=form, mask_value=value, padding=True, batch=2), llvm)
    assert spec.causal and spec.causal_offset == 0 and spec.mask_shape == (2, 1, 1, 16)
    assert len(kernel.params) == 5   # q, k, v, the padding, out


def test_a_local_window_by_where_is_read_as_a_mask_tensor_and_computes_what_onnxruntime_does(llvm):
    """GPT-Neo's local layers keep only the last keys before each query: a band, not causal, so the condition
    becomes a constant additive mask the kernel reads."""
    spec, plan, kernel = _planned(attention_onnx(mask="where_scores", mask_value=-1e4, window=5), llvm)
    assert not spec.causal and spec.mask_shape == (1, 1, 16, 16) and len(kernel.params) == 5
    assert "where" in plan.by_pattern("attention")[0].ops


@pytest.mark.parametrize("value", [-1.0, 0.0])
def test_a_where_whose_value_does_not_hide_the_key_is_not_attention(llvm, value):
    """where(c, s, -1) is not s + (c ? 0 : -1): the replaced scores still count in the softmax, so nothing fuses."""
    fused, plan = partition(import_proto(attention_onnx(mask="where_scores", mask_value=value)), target=llvm)
    assert not _specs(fused) and not plan.by_pattern("attention")


def test_a_where_that_hides_every_key_of_a_row_is_not_attention(llvm):
    """A row whose keys are all replaced is uniform under where but softmax(s + fill) under an additive mask."""
    import onnx
    from onnx import numpy_helper

    model = attention_onnx(mask="where_scores", mask_value=-1e4, seq_q=16, seq_k=40)
    (cond,) = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.BOOL]
    keep = numpy_helper.to_array(cond).copy()
    keep[..., 3, :] = False
    cond.CopyFrom(numpy_helper.from_array(keep, cond.name))
    fused, plan = partition(import_proto(model), target=llvm)
    assert not _specs(fused)
