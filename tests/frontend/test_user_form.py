"""Models in the form users have them: Hugging Face exports made with the TorchScript exporter, dynamic batch and
sequence axes, an attention mask and token types (``scripts/user_form.py --tiny``). Each computes its reshapes and
masks from ``Shape`` of the inputs and failed TVM's import before the shape arithmetic was folded; RoBERTa's
position ids are a cumsum of the mask, which TVM's LegalizeOps cannot lower."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tvmfuse import verify
from tvmfuse._tvm import relax, tvm
from tvmfuse.compile import build
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "user_form"
MODELS = ["roberta", "bert", "gemma", "swin", "gpt_neo", "falcon"]


def _load(name: str):
    feeds = dict(np.load(FIXTURES / f"{name}.inputs.npz"))
    loaded = load_model(FIXTURES / f"{name}.onnx", input_shapes={k: v.shape for k, v in feeds.items()})
    return loaded, feeds


@pytest.mark.parametrize("name", MODELS)
def test_a_dynamic_axes_export_builds_untuned_and_matches_onnxruntime(name, llvm_target):
    loaded, feeds = _load(name)
    assert any(f.startswith("shape-arithmetic-folded") for f in loaded.fixups), loaded.fixups
    assert not any(n.op_type == "Shape" for n in loaded.proto.graph.node)
    fused, _ = partition(import_model(loaded), target=llvm_target)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    args = [tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs]
    out = vm["main"](*args, *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(FIXTURES / f"{name}.onnx", feeds)[0]
    assert np.sqrt(np.mean(ref.astype(np.float64) ** 2)) > 1e-3, "degenerate reference"
    assert verify.relative_error(got, ref) < 1e-4
    if name == "roberta":   # the mask's cumsum runs topi's scan, reported as such and never tuned
        assert [k.schedule for k in built.kernels if k.name == "cumsum"] == ["prescheduled"]
        assert "cumsum" not in built.untuned


def test_gpt_neo_and_falcon_attention_fuse_as_on_gpus_and_match_onnxruntime(llvm_target):
    """GPT-Neo hides keys with a Where on constant conditions (causal in its global layer, an 8-key band in its local
    one) and Falcon splits one query_key_value GEMM along its heads. Planned as GPU plans are (attention fused), both
    layers of GPT-Neo are attention kernels (the band read as a mask), Falcon runs no split kernel, and the scalar
    kernels on llvm compute what onnxruntime does."""
    from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    for name in ("gpt_neo", "falcon"):
        loaded, feeds = _load(name)
        cost = CostModel.for_target(llvm_target, attention_decline=None)
        fused, plan = plan_tvmfuse(import_model(loaded), llvm_target, config=PlannerConfig(cost_model=cost))
        specs = [AttentionSpec.from_json(str(f.attrs[SPEC_ATTR])) for f in fused.functions.values()
                 if getattr(f, "attrs", None) is not None and SPEC_ATTR in f.attrs]
        if name == "gpt_neo":
            assert sorted(s.causal for s in specs) == [False, True] and all(s.seq_major_out for s in specs)
            assert [s.mask_shape for s in specs if not s.causal][0][-2:] == (16, 16)
        else:
            assert specs and not any("split" in g.ops for g in plan.groups), [g.ops for g in plan.groups]
        built = build(fused, target=llvm_target, database=None)
        vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
        out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
        got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
        ref = verify.run_onnxruntime(FIXTURES / f"{name}.onnx", feeds)[0]
        assert verify.relative_error(got, ref) < 1e-4, name


def test_an_fp16_conversion_of_a_dynamic_axes_export_verifies(llvm_target):
    # Gemma's RMSNorm casts to fp32 (x.float()): the converter declared those values fp16 but left the casts
    feeds = dict(np.load(FIXTURES / "gemma.inputs.npz"))
    loaded = load_model(FIXTURES / "gemma.onnx", input_shapes={k: v.shape for k, v in feeds.items()}, precision="fp16")
    fused, _ = partition(import_model(loaded), target=llvm_target)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(FIXTURES / "gemma.onnx", feeds)[0]
    assert got.dtype == np.float32 and verify.relative_error(got, ref) < 1e-2


def test_generated_inputs_stay_inside_the_tables_they_index():
    loaded, _ = _load("bert")
    high = {s.name: s.high for s in loaded.inputs}
    assert high == {"input_ids": 1000, "attention_mask": None, "token_type_ids": 2}
    feeds = verify.random_inputs(loaded.inputs, seed=3)
    assert feeds["input_ids"].max() < 1000 and feeds["input_ids"].max() >= 4   # more of the vocabulary than 0..3
    assert set(np.unique(feeds["token_type_ids"])) <= {0, 1}
    mask = feeds["attention_mask"]
    assert mask.dtype == np.int64 and mask[0].all() and mask[1, :12].all() and not mask[1, 12:].any()
    # the bound survives the artifact manifest (run without --inputs generates from it)
    spec = loaded.inputs[2]
    assert type(spec).from_json(spec.to_json()) == spec


@pytest.mark.slow
@pytest.mark.parametrize("name", ["roberta", "gemma"])
def test_a_dynamic_axes_export_builds_for_cuda(name):
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    loaded, _ = _load(name)
    fused, _ = partition(import_model(loaded), target=target)
    result = build(fused, target=target, database=None)
    assert result.kernels and result.cuda_graph
    if name == "roberta":   # TVM's GPU scan for the mask's cumsum
        assert any(k.schedule == "prescheduled" and "cumsum" in k.name for k in result.kernels), result.kernels


def _decoder_feeds(name: str, past: int, seq: int = 3, batch: int = 2) -> dict[str, np.ndarray]:
    """A step of generation: ``seq`` new tokens after ``past`` cached ones (0: the first step), as optimum's
    ORTModelForCausalLM hands them over."""
    rng = np.random.default_rng(past)
    heads = 2 if name == "llama" else 4          # LLaMA's grouped K/V heads, GPT-2's all four
    feeds = {"input_ids": rng.integers(0, 256, (batch, seq), dtype=np.int64),
             "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
             "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))}
    for layer in range(2):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kv}"] = rng.standard_normal((batch, heads, past, 8)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name,past,precision", [("llama", 0, "fp16"), ("llama", 5, "model"), ("gpt2", 5, "fp16")])
def test_a_decoder_with_its_kv_cache_matches_onnxruntime_on_every_output(name, past, precision, llvm_target):
    # optimum's export (scripts/user_form.py --optimum --tiny): the past's length is a dynamic axis, 0 on the first
    # step; present.N.key is returned and read by the layer's own attention, which the fp16 converter's output
    # cast had turned fp32 inside the graph
    path = FIXTURES / f"{name}_past.onnx"
    feeds = _decoder_feeds(name, past)
    loaded = load_model(path, input_shapes={k: v.shape for k, v in feeds.items()}, precision=precision)
    fused, _ = partition(import_model(loaded), target=llvm_target)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    refs = verify.run_onnxruntime(path, feeds)
    assert len(out) == len(refs) == 5   # the logits and four present tensors
    for got, ref, spec in zip(out, refs, loaded.outputs):
        assert got.shape == ref.shape and np.dtype(spec.dtype) == np.float32
        assert verify.relative_error(got.numpy(), ref) < (1e-2 if precision == "fp16" else 1e-4), spec.name


@pytest.mark.parametrize("past", [0, 4])
def test_a_merged_decoder_takes_the_branch_its_past_implies(past, llvm_target, tmp_path):
    # optimum 1.x's decoder_model_merged.onnx: the first step and the later steps under one If on use_cache_branch
    from tvmfuse.errors import TvmfuseError

    path = FIXTURES / "llama_merged.onnx"
    feeds = _decoder_feeds("llama", past)
    loaded = load_model(path, input_shapes={k: v.shape for k, v in feeds.items()})
    assert f"input-fixed use_cache_branch={past > 0}" in loaded.fixups and "branches-inlined x1" in loaded.fixups
    assert not any(n.op_type == "If" for n in loaded.proto.graph.node)
    switch = next(s for s in loaded.inputs if s.name == "use_cache_branch")
    assert switch.fixed == (past > 0,) and type(switch).from_json(switch.to_json()) == switch
    feeds["use_cache_branch"] = verify.random_inputs([switch])["use_cache_branch"]
    fused, _ = partition(import_model(loaded), target=llvm_target)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    refs = verify.run_onnxruntime(path, feeds)
    for got, ref in zip(out, refs):
        assert verify.relative_error(got.numpy(), ref) < 1e-4
    # the branch not compiled gives other outputs: a run handed the other value is refused, not answered wrongly
    other = verify.run_onnxruntime(path, {**feeds, "use_cache_branch": ~feeds["use_cache_branch"]})
    if past:
        assert verify.relative_error(other[0], refs[0]) > 1e-2
    np.savez(tmp_path / "in.npz", **{**feeds, "use_cache_branch": ~feeds["use_cache_branch"]})
    with pytest.raises(TvmfuseError, match="input 'use_cache_branch' is .* compiled for"):
        verify.load_inputs(tmp_path / "in.npz", loaded.inputs)


def test_a_merged_decoder_needs_the_past_length():
    from tvmfuse.errors import ModelError

    with pytest.raises(ModelError, match="use_cache_branch' follows the KV cache's length"):
        load_model(FIXTURES / "llama_merged.onnx", input_shapes={"input_ids": (1, 1)})


@pytest.mark.parametrize("past", [0, 4])
def test_a_merged_seq2seq_decoder_verifies_on_either_branch(past, llvm_target):
    # optimum's T5 decoder_model_merged.onnx: cross-attention K/V from the encoder's states on the first step, read
    # from the cache after it, where the merge returns them as empty constants
    path = FIXTURES / "t5_merged.onnx"
    rng = np.random.default_rng(past)
    seq, enc = (3, 7) if past == 0 else (1, 7)
    feeds = {"encoder_attention_mask": np.ones((2, enc), np.int64),
             "input_ids": rng.integers(0, 256, (2, seq), dtype=np.int64),
             "encoder_hidden_states": rng.standard_normal((2, enc, 32)).astype(np.float32)}
    for layer in range(2):
        for part, length in (("decoder", past), ("encoder", enc)):
            for kv in ("key", "value"):
                value = rng.standard_normal((2, 4, length, 8)).astype(np.float32)
                feeds[f"past_key_values.{layer}.{part}.{kv}"] = value
    loaded = load_model(path, input_shapes={k: v.shape for k, v in feeds.items()})
    feeds["use_cache_branch"] = np.array([past > 0])
    fused, _ = partition(import_model(loaded), target=llvm_target)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    refs = verify.run_onnxruntime(path, feeds)
    assert len(out) == len(refs) == 9   # the logits and each layer's decoder and encoder K/V
    for got, ref, spec in zip(out, refs, loaded.outputs):
        assert got.shape == ref.shape == spec.shape, spec.name
        if ref.size:
            assert verify.relative_error(got.numpy(), ref) < 1e-4, spec.name
