"""The PyTorch baseline of `tvmfuse bench` and bench_gpu.py: the ONNX graph replayed with torch ops must compute
what onnxruntime computes, and torch.compile must see it as one graph. Until 2026-12-01 torch._dynamo traced
no graph of the replay and the "torch.compile" figures of ResNet-50 and BERT-base were eager ones.

Needs torch (CI installs the CPU build this machine keeps on disk; elsewhere these tests are skipped)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tvmfuse.bench.models import MODELS, SMALL_MODELS

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRANSFORMERS = ["tiny_bert", "tiny_gpt2", "tiny_vit", "tiny_t5_encoder", "tiny_llama", "tiny_whisper_encoder"]


@pytest.mark.parametrize("name", ["resnet50", "bert_base"])
def test_the_replay_matches_onnxruntime_and_traces_as_one_graph(name):
    import onnxruntime as ort

    from tvmfuse.bench.torch_onnx import build_fn

    model, _, _ = MODELS[name](**SMALL_MODELS[name], dtype="float32")
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    (ref,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    replay = build_fn(model, "cpu", channels_last=len(shape) == 4)
    assert isinstance(replay, torch.nn.Module) and len(list(replay.buffers())) == len(model.graph.initializer)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        (got,) = replay(xt.contiguous(memory_format=torch.channels_last) if len(shape) == 4 else xt)
        explained = torch._dynamo.explain(replay)(xt)
    torch._dynamo.reset()
    got = got.numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons



def _rel(got, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _replay(model: onnx.ModelProto, feeds: dict):
    """The replay's outputs as numpy arrays, and torch._dynamo.explain's view of it."""
    from tvmfuse.bench.torch_onnx import build_fn

    replay = build_fn(model, "cpu")
    args = [torch.from_numpy(feeds[i.name]) for i in model.graph.input if i.name in feeds]
    with torch.no_grad():
        got = [o.numpy() for o in replay(*args)]
        explained = torch._dynamo.explain(replay)(*args)
    torch._dynamo.reset()
    return got, explained


def _fixture(name: str, dtype: str):
    model = onnx.load(FIXTURES / f"{name}.{dtype}.onnx")
    types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    feeds = {k: v.astype(types[k]) for k, v in np.load(FIXTURES / f"{name}.inputs.npz").items()}
    return model, feeds


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", TRANSFORMERS)
def test_the_replay_of_a_transformer_fixture_matches_onnxruntime(name, dtype):
    """Gather/GatherElements embeddings, GPT-2's three-way Split, LLaMA's rotary Slices, T5's fp16 clamp
    (IsInf, ReduceMax, Min/Max): each fixture replays as one graph and computes what onnxruntime does."""
    model, feeds = _fixture(name, dtype)
    got, explained = _replay(model, feeds)
    try:
        (ref,) = _ort(model, feeds)
        tol = 1e-4 if dtype == "float32" else 5e-3
    except Exception:  # an onnxruntime whose CPU provider lacks an fp16 kernel: the fp32 model is the reference
        model32, feeds32 = _fixture(name, "float32")
        (ref,) = _ort(model32, feeds32)
        tol = 1e-2
    assert got[0].dtype == np.dtype(dtype) and got[0].shape == ref.shape
    assert _rel(got[0], ref) < tol
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _other_ops_model():
    """Ops other exporters emit: a shape computed in the graph (Shape of an input and of an intermediate value
    without value_info, Gather, Mul, Concat), ConstantOfShape, Range, Trilu, Split by sizes, a negative Slice
    step, Expand, negative Gather indices, integer Div."""
    def i64(*v):
        return np.array(v, np.int64)

    rng = np.random.default_rng(1)
    inits = {"emb": rng.standard_normal((10, 4)).astype(np.float32), "cols": i64(1, -1), "zero": i64(0),
             "one": i64(1), "zero_s": np.array(0), "one_s": np.array(1), "three": i64(3), "axm1": i64(-1),
             "sizes": i64(3, 5), "rev_start": i64(-1), "rev_end": i64(-(2**63)), "rev_step": i64(-2), "rep": i64(3, 1, 1),
             "half": np.array(0.5, np.float32), "onef": np.array(1.0, np.float32),
             "gidx": rng.integers(-8, 8, (2, 3, 2))}
    N = h.make_node
    nodes = [
        N("Shape", ["x"], ["s"]),
        N("Gather", ["s", "zero_s"], ["d0"]), N("Gather", ["s", "one_s"], ["d1"]), N("Mul", ["d0", "d1"], ["rows"]),
        N("Unsqueeze", ["rows", "axm1"], ["rows1"]),
        N("Sin", ["x"], ["sx"]), N("Shape", ["sx"], ["slast"], start=-1),
        N("Concat", ["rows1", "slast"], ["flat"], axis=0), N("Reshape", ["x", "flat"], ["r"]),  # [6, 8]
        N("Concat", ["slast", "slast"], ["sq_shape"], axis=0),
        N("ConstantOfShape", ["sq_shape"], ["ones"], value=nh.from_array(np.ones(1, np.float32))),
        N("Trilu", ["ones"], ["causal"], upper=0), N("MatMul", ["r", "causal"], ["m"]),
        N("Squeeze", ["slast", "zero"], ["n"]), N("Range", ["zero_s", "n", "one_s"], ["ar"]),
        N("Cast", ["ar"], ["arf"], to=TP.FLOAT), N("Add", ["m", "arf"], ["m2"]),
        N("Cos", ["m2"], ["c"]), N("Softplus", ["c"], ["sp"]), N("Sub", ["sp", "onef"], ["sp1"]),
        N("LeakyRelu", ["sp1"], ["a3"], alpha=0.1), N("Trilu", ["a3", "one"], ["tri"]),
        N("Split", ["a3", "sizes"], ["p0", "p1"], axis=1),
        N("Slice", ["p1", "zero", "three", "one", "one"], ["p1a"]),
        N("Max", ["p1a", "p0", "half"], ["mx"]), N("Neg", ["p0"], ["np0"]), N("Min", ["p0", "np0"], ["mn"]),
        N("Slice", ["a3", "rev_start", "rev_end", "one", "rev_step"], ["rev"]),  # [6, 4], read backwards
        N("Unsqueeze", ["rev", "zero"], ["rev1"]), N("Expand", ["rev1", "rep"], ["e"]),  # [3, 6, 4]
        N("ReduceSum", ["e", "zero"], ["es"], keepdims=1), N("Squeeze", ["es", "zero"], ["sq"]),
        N("ReduceMax", ["sq", "axm1"], ["rmax"], keepdims=0), N("ReduceMin", ["sq"], ["rmin"], keepdims=0),
        N("GreaterOrEqual", ["sq", "half"], ["ge"]), N("LessOrEqual", ["sq", "onef"], ["le"]),
        N("Not", ["le"], ["nle"]), N("Or", ["ge", "nle"], ["o"]), N("Xor", ["ge", "le"], ["xo"]),
        N("And", ["o", "xo"], ["an"]), N("Where", ["an", "sq", "rev"], ["w"]),
        N("Div", ["w", "w"], ["ww"]), N("IsNaN", ["ww"], ["nan"]), N("IsInf", ["ww"], ["inf"], detect_negative=0),
        N("Or", ["nan", "inf"], ["bad"]),
        N("Gather", ["emb", "ids"], ["g"]),  # run-time indices, some negative
        N("Gather", ["x", "cols"], ["gc"], axis=1),  # constant indices into a run-time tensor
        N("GatherElements", ["x", "gidx"], ["ge2"], axis=2),
        N("Div", ["ids", "three"], ["idiv"]),  # integer Div truncates toward zero
        N("Slice", ["s", "rev_start", "rev_end", "zero", "axm1"], ["srev"]),  # folded: an output known when built
    ]
    outs = [("tri", TP.FLOAT, [6, 8]), ("mx", TP.FLOAT, [6, 3]), ("mn", TP.FLOAT, [6, 3]), ("w", TP.FLOAT, [6, 4]),
            ("rmax", TP.FLOAT, [6]), ("rmin", TP.FLOAT, []), ("bad", TP.BOOL, [6, 4]), ("g", TP.FLOAT, [2, 4, 4]),
            ("gc", TP.FLOAT, [2, 2, 8]), ("ge2", TP.FLOAT, [2, 3, 2]), ("idiv", TP.INT64, [2, 4]),
            ("srev", TP.INT64, [3])]
    graph = h.make_graph(nodes, "other_ops", [h.make_tensor_value_info("x", TP.FLOAT, [2, 3, 8]),
                                              h.make_tensor_value_info("ids", TP.INT64, [2, 4])],
                         [h.make_tensor_value_info(*o) for o in outs], [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    return model, {"x": x, "ids": np.array([[0, 3, -1, 9], [-10, 2, -4, 5]])}


def _old_opset_model():
    """Opset 9, where Slice bounds, Split sizes, Squeeze/Unsqueeze and Reduce axes are attributes, and a Split
    without sizes splits in equal parts."""
    N = h.make_node
    nodes = [N("Unsqueeze", ["x"], ["u"], axes=[0, 4]), N("Squeeze", ["u"], ["q"], axes=[0]),  # [2, 3, 8, 1]
             N("Slice", ["q"], ["sl"], starts=[1, -7], ends=[100, -1], axes=[1, 2]),  # [2, 2, 6, 1]
             N("Split", ["sl"], ["s0", "s1"], axis=2, split=[2, 4]),
             N("ReduceSum", ["s1"], ["rs"], axes=[2], keepdims=0), N("ReduceMax", ["s0"], ["rm"], axes=[2]),
             N("Squeeze", ["rm"], ["out2"]), N("Split", ["x"], ["h0", "h1"], axis=2),
             N("Sub", ["h0", "h1"], ["out3"])]
    outs = [("rs", TP.FLOAT, [2, 2, 1]), ("out2", TP.FLOAT, [2, 2]), ("out3", TP.FLOAT, [2, 3, 4])]
    graph = h.make_graph(nodes, "old_opset", [h.make_tensor_value_info("x", TP.FLOAT, [2, 3, 8])],
                         [h.make_tensor_value_info(*o) for o in outs])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 9)], ir_version=4)
    onnx.checker.check_model(model, full_check=True)
    return model, {"x": np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)}


@pytest.mark.parametrize("fold_limit", [None, 4], ids=["folded", "run_in_torch"])
@pytest.mark.parametrize("make", [_other_ops_model, _old_opset_model], ids=["opset20", "opset9"])
def test_the_replay_of_other_exporters_ops_matches_onnxruntime(make, fold_limit, monkeypatch):
    """With fold_limit 4, only the tiny shape vectors are folded at build time: ConstantOfShape, Range, Trilu and
    the rest run as torch ops on the buffers, as they do when a folded result would be too big to hold."""
    from tvmfuse.bench import torch_onnx

    if fold_limit is not None:
        monkeypatch.setattr(torch_onnx, "_FOLD_LIMIT", fold_limit)
    model, feeds = make()
    ref = _ort(model, feeds)
    got, explained = _replay(model, feeds)
    for out, g, r in zip(model.graph.output, got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, out.name
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=out.name)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_the_replay_sums_cumulatively_as_onnxruntime(exclusive, reverse):
    """CumSum on either axis, exclusive and reversed, of int32 (kept int32: torch would sum in int64) and fp32."""
    N = h.make_node
    nodes = [N("CumSum", ["i", "ax0"], ["ci"], exclusive=exclusive, reverse=reverse),
             N("CumSum", ["x", "axm1"], ["cx"], exclusive=exclusive, reverse=reverse)]
    graph = h.make_graph(nodes, "cumsum", [h.make_tensor_value_info("i", TP.INT32, [3, 5]),
                                           h.make_tensor_value_info("x", TP.FLOAT, [3, 5])],
                         [h.make_tensor_value_info("ci", TP.INT32, [3, 5]),
                          h.make_tensor_value_info("cx", TP.FLOAT, [3, 5])],
                         [nh.from_array(np.array(0, np.int64), "ax0"), nh.from_array(np.array(-1, np.int64), "axm1")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(0)
    feeds = {"i": rng.integers(-5, 5, (3, 5)).astype(np.int32), "x": rng.standard_normal((3, 5)).astype(np.float32)}
    ref = _ort(model, feeds)
    got, explained = _replay(model, feeds)
    assert got[0].dtype == np.int32 and np.array_equal(got[0], ref[0])
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_replay_of_roberta_as_users_export_it_matches_onnxruntime():
    """RoBERTa's TorchScript export computes its position ids with CumSum: with it, the baselines run the user-form
    models (`zoo_gpu.py --models uf:roberta`) beside tvmfuse."""
    from tvmfuse.frontend import load_model

    path = FIXTURES / "user_form" / "roberta.onnx"
    feeds = dict(np.load(FIXTURES / "user_form" / "roberta.inputs.npz"))
    loaded = load_model(path, input_shapes={k: v.shape for k, v in feeds.items()})
    feeds = {i.name: feeds[i.name] for i in loaded.proto.graph.input}
    got, explained = _replay(loaded.proto, feeds)
    (ref, *_) = _ort(loaded.proto, feeds)
    assert got[0].shape == ref.shape and _rel(got[0], ref) < 1e-5
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_shape_the_graph_computes_from_input_values_is_refused():
    from tvmfuse.bench.torch_onnx import Unsupported, build_fn

    x = h.make_tensor_value_info("x", TP.FLOAT, [2, 6])
    by_value = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                            [x, h.make_tensor_value_info("shape", TP.INT64, [2])],
                            [h.make_tensor_value_info("y", TP.FLOAT, [3, 4])])
    with pytest.raises(Unsupported, match="Reshape with a computed shape"):
        build_fn(h.make_model(by_value), "cpu")
    symbolic = h.make_graph([h.make_node("Shape", ["x"], ["s"]), h.make_node("Reshape", ["x", "s"], ["y"])], "g",
                            [h.make_tensor_value_info("x", TP.FLOAT, ["batch", 6])],
                            [h.make_tensor_value_info("y", TP.FLOAT, ["batch", 6])])
    with pytest.raises(Unsupported, match="whose shape is not known"):
        build_fn(h.make_model(symbolic), "cpu")

@pytest.fixture
def bench_gpu(monkeypatch):
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    module = importlib.import_module("bench_gpu")
    monkeypatch.setattr(module, "TORCH_DEVICE", "cpu")
    monkeypatch.setattr(module, "KEEP", {})
    # one call a sample: the tests check that each case runs and is timed, not the time
    monkeypatch.setattr(module, "TORCH_TIMING", {"repeat": 1, "min_number": 1, "min_sample_s": 0.0, "warmup_s": 0.0})
    yield module
    sys.modules.pop("bench_gpu", None)


@pytest.mark.slow
def test_bench_gpu_torch_side_runs_every_case(bench_gpu):
    """bench_gpu.py's PyTorch side of every case and model (eager and torch.compile, a CNN in both layouts), on the
    CPU at tiny sizes: an error here would otherwise first show on the H200, at the cost of its minutes."""
    from tvmfuse.bench.cases import CASES, SMALL

    torch._dynamo.reset()
    for name in [*CASES, *MODELS]:
        size = {**SMALL, **SMALL_MODELS}[name]
        model = MODELS[name](**size)[0] if name in MODELS else None
        r = bench_gpu.torch_case(name, size, model)
        assert r["eager_s"] > 0 and r["compile_s"] > 0 and r["compile_build_s"] > 0, (name, r)
        assert callable(bench_gpu.KEEP[name]["compile_s"]), name
        if name == "resnet50":
            assert set(r["by_layout"]) == {"NCHW", "channels_last"} and r["layout"].split()[0] in r["by_layout"]
        if name == "gemm_bias_relu":
            assert r["cublas_gemm_alone_s"] > 0 and callable(bench_gpu.KEEP[name]["cublas_gemm_alone_s"])
