"""--precision: fp16 conversion with fp32 statistics and fp32 inputs/outputs, verified at the fp16 tolerance."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _float_type(model: onnx.ModelProto, name: str) -> int:
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    raise KeyError(name)


def test_fp16_keeps_inputs_outputs_and_rmsnorm_statistics_in_fp32():
    loaded = load_model(FIXTURES / "tiny_llama.float32.onnx", precision="fp16")
    g = loaded.proto.graph
    assert loaded.precision == "fp16"
    assert [s.dtype for s in loaded.outputs] == ["float32"] and loaded.inputs[0].dtype == "int64"
    weights = [t for t in g.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
               and len(t.dims) == 2]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)   # GEMM weights in fp16
    # RMSNorm's x.pow(2).mean(): the square and the mean stay fp32 (a square of fp16 overflows above 256)
    inferred = onnx.shape_inference.infer_shapes(loaded.proto)
    stats = [n for n in g.node if n.op_type in ("Pow", "ReduceMean")]
    assert stats and all(_float_type(inferred, n.output[0]) == onnx.TensorProto.FLOAT for n in stats)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
def test_a_model_past_protobufs_2_gib_is_typed_from_its_skeleton_and_converts_alike(fixture, monkeypatch):
    """The converter's shape inference serializes the model, which protobuf refuses past 2 GiB (TinyLlama-1.1B in
    fp32: "Failed to serialize proto"). Such a model is typed from its skeleton instead; with the limit set to 0
    every model takes that path, and converts to the same graph, types and weights as through the converter's own
    inference."""
    from tvmfuse.errors import TvmfuseError
    from tvmfuse.frontend import precision

    def graph(loaded):
        g = loaded.proto.graph
        nodes = [(n.op_type, tuple(n.input), tuple(n.output), tuple(a.i for a in n.attribute if a.name == "to"))
                 for n in g.node]
        types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output)}
        return nodes, types, {t.name: t.data_type for t in g.initializer}

    plain = graph(load_model(FIXTURES / f"{fixture}.float32.onnx", precision="fp16"))
    monkeypatch.setattr(precision, "SERIALIZE_LIMIT", 0)
    big = graph(load_model(FIXTURES / f"{fixture}.float32.onnx", precision="fp16"))
    assert big[0] == plain[0] and big[2] == plain[2]
    assert {k: v for k, v in big[1].items() if k in plain[1]} == plain[1]
    with pytest.raises(TvmfuseError, match="2 GiB"):
        precision.convert(onnx.load(FIXTURES / f"{fixture}.float32.onnx"), "fp16")


def test_fp16_layer_norm_kernels_accumulate_in_fp32(llvm_target):
    loaded = load_model(FIXTURES / "tiny_gpt2.float32.onnx", precision="fp16")
    fused, _ = partition(import_model(loaded), target=llvm_target)
    norms = [f for gv, f in fused.functions.items() if "layer_norm" in gv.name_hint]
    assert norms
    for f in norms:
        text = f.script()
        assert '"float16"' in text   # the kernel reads or writes fp16 ...
        sums = [line for line in text.splitlines() if "_sum = T.sblock_alloc_buffer" in line]
        assert sums and all('"float16"' not in line for line in sums)   # ... and sums in fp32 (the default)


@pytest.mark.slow
def test_fp16_build_verifies_against_the_fp32_model_at_the_fp16_tolerance(tmp_path):
    from tvmfuse import api

    model = FIXTURES / "tiny_gpt2.float32.onnx"
    cfg = api.ModelConfig(model=model, target="llvm", db=tmp_path / "none.db", precision="fp16")
    built = api.compile(cfg, out=tmp_path / "art", untuned=True)
    assert built["precision"] == "fp16"
    ran = api.run(tmp_path / "art", inputs=FIXTURES / "tiny_gpt2.inputs.npz", verify_against=model, repeat=0)
    check = ran["verification"]["outputs"][0]
    assert check["ok"] and check["tolerance"] == 1e-2 and 1e-6 < check["rel_error"] < 1e-2   # fp16, not fp32


@pytest.mark.parametrize("precision,message", [("fp8", "unknown precision")])
def test_unavailable_precisions_are_one_line_and_exit_2(tmp_path, precision, message):
    proc = subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", "compile", str(FIXTURES / "tiny_gpt2.float32.onnx"),
                           "-o", str(tmp_path / "a"), "--target", "llvm", "--precision", precision],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_fp32_of_an_fp16_model_is_refused():
    from tvmfuse.errors import TvmfuseError

    for precision in ("fp32", "tf32"):
        with pytest.raises(TvmfuseError, match=f"--precision {precision} on a model stored in fp16"):
            load_model(FIXTURES / "tiny_gpt2.float16.onnx", precision=precision)
    assert load_model(FIXTURES / "tiny_gpt2.float32.onnx", precision="tf32").precision == "tf32"
    assert np.dtype(load_model(FIXTURES / "tiny_gpt2.float16.onnx").outputs[0].dtype) == np.float16


def _identity_cast_conv() -> onnx.ModelProto:
    """``conv(x.float())`` of an fp32 ``x``, and a mask cast to float: a TorchScript export's casts."""
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    nodes = [h.make_node("Cast", ["x"], ["xf"], to=TP.FLOAT),
             h.make_node("Conv", ["xf", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             h.make_node("Cast", ["mask"], ["mf"], to=TP.FLOAT),
             h.make_node("Mul", ["c", "mf"], ["y"])]
    g = h.make_graph(nodes, "casts", [h.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8, 8]),
                                      h.make_tensor_value_info("mask", TP.INT64, [1, 1, 8, 8])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [1, 8, 8, 8])],
                     [nh.from_array((rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32), "w")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_fp16_of_a_graph_with_its_own_float_casts_is_valid_and_verifies(tmp_path, llvm_target):
    import onnxruntime as ort

    from tvmfuse import verify

    path = tmp_path / "casts.onnx"
    onnx.save(_identity_cast_conv(), path)
    loaded = load_model(path, precision="fp16")
    casts = [n for n in loaded.proto.graph.node if n.op_type == "Cast"]
    # x.float() of an fp32 x is gone; the mask's cast casts to fp16, the type its output now has
    assert not any(n.input[0] == "x" and n.output[0] == "xf" for n in casts)
    assert [a.i for n in casts if n.input[0] == "mask" for a in n.attribute] == [onnx.TensorProto.FLOAT16]
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32),
             "mask": (np.arange(64).reshape(1, 1, 8, 8) % 3 > 0).astype(np.int64)}
    got = ort.InferenceSession(loaded.proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    ref = verify.run_onnxruntime(path, feeds)
    assert verify.relative_error(got[0], ref[0]) < 1e-2
    partition(import_model(loaded), target=llvm_target)   # TVM imports it: no fp32 conv input with fp16 weights


def test_an_fp32_model_built_for_a_gpu_in_its_own_types_is_told_of_tf32_and_fp16(tmp_path):
    """The hint is in the compile report (and printed as a note): only for an fp32 model, on a GPU, in its own types."""
    from tvmfuse import api
    from tvmfuse.frontend.precision import hint

    fp32, fp16 = (onnx.load(FIXTURES / "tiny_gpt2.float32.onnx"), onnx.load(FIXTURES / "tiny_bert.float16.onnx"))
    assert "--precision tf32" in hint(fp32, "model", gpu=True) and "--precision fp16" in hint(fp32, "model", gpu=True)
    assert hint(fp32, "model", gpu=False) is None and hint(fp32, "tf32", gpu=True) is None
    assert hint(fp16, "model", gpu=True) is None
    model = FIXTURES / "tiny_gpt2.float32.onnx"
    for target, told in (("cuda", True), ("llvm", False)):
        cfg = api.ModelConfig(model=model, target=target, db=tmp_path / "none.db")
        built = api.compile(cfg, out=tmp_path / f"art-{target}", untuned=True)
        assert bool(built["precision_hint"]) == told
