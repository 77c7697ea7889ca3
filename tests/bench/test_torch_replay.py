"""The PyTorch baseline of `tvmfuse bench` and bench_gpu.py: the ONNX graph replayed with torch ops must compute
what onnxruntime computes, and torch.compile must see it as one graph. Until 2026-12-01 torch._dynamo traced
no graph of the replay and the "torch.compile" figures of ResNet-50 and BERT-base were eager ones.

Needs torch (CI installs the CPU build this machine keeps on disk; elsewhere these tests are skipped)."""
from __future__ import annotations

import numpy as np
import pytest

from tvmfuse.bench.models import MODELS, SMALL_MODELS

torch = pytest.importorskip("torch")


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


@pytest.fixture
def bench_gpu(monkeypatch):
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    module = importlib.import_module("bench_gpu")
    monkeypatch.setattr(module, "TORCH_DEVICE", "cpu")
    monkeypatch.setattr(module, "KEEP", {})
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
