"""The end-to-end benchmark models (ResNet-50, BERT-base) at tiny sizes: valid ONNX, and tvmfuse agrees with
onnxruntime on them through the whole pipeline (import, planner, build, run)."""
from __future__ import annotations

import onnx
import pytest

from tvmfuse import api
from tvmfuse.bench.models import MODELS, SMALL_MODELS


@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_model_runs_and_matches_onnxruntime(name, tmp_path):
    model, bytes_min, flops = MODELS[name](**SMALL_MODELS[name], dtype="float32")
    onnx.checker.check_model(model, full_check=True)
    assert bytes_min > 0 and flops > 0
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    cfg = api.ModelConfig(model=path, target="llvm", db=tmp_path / "none.db")
    built = api.compile(cfg, out=tmp_path / "art", untuned=True)
    assert built["planner"] == "tvmfuse"
    report = api.run(tmp_path / "art", verify_against=path, repeat=1)
    assert report["verification"]["ok"], report["verification"]


def test_full_size_figures_are_the_published_ones():
    _, weight_and_io, flops = MODELS["resnet50"](batch=1, dtype="float16")
    assert flops == pytest.approx(8.2e9, rel=0.03)           # ResNet-50: 4.1 GMAC per 224x224 image
    assert weight_and_io == pytest.approx(2 * 25.5e6, rel=0.03)  # 25.5 M parameters, fp16
