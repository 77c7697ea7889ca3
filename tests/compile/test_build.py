import json

import numpy as np
import pytest

from tvmfuse.compile import build
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition


@pytest.fixture(scope="module")
def fused(example_model, llvm_target):
    mod = import_model(load_model(example_model))
    return partition(mod, target=llvm_target, planner="fuseops")[0]


def test_untuned_build_reports_every_kernel_as_default(fused, llvm_target):
    result = build(fused, target=llvm_target, database=None)
    names = {gv.name_hint for gv, f in fused.functions.items() if gv.name_hint != "main"}
    assert {k.name for k in result.kernels} == names
    # the CPU default, and TVM's plain lowering for what it leaves (LayerNorm)
    assert "cpu-default" in {k.schedule for k in result.kernels} <= {"cpu-default", "default"}
    assert all(k.schedule == "cpu-default" for k in result.kernels if "layer_norm" not in k.name), result.kernels
    assert sorted(result.untuned) == sorted(names)


def test_weights_are_lifted_out_of_the_library(fused, llvm_target):
    result = build(fused, target=llvm_target, database=None)
    assert len(result.lifted_params) >= 7  # conv, 4 matmul weights, 3 biases of >= 64 elements
    sizes = sorted(int(np.prod(p.shape)) for p in result.lifted_params)
    assert sizes[-1] == 128 * 32


@pytest.mark.slow
def test_tuned_build_applies_every_record(example_artifact):
    _, report = example_artifact
    assert report["untuned"] == []
    assert {k["schedule"] for k in report["kernels"]} == {"tuned"}


@pytest.mark.slow
def test_artifact_manifest_describes_the_build(example_artifact, example_model):
    path, _ = example_artifact
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "x", "shape": [1, 8, 16, 16], "dtype": "float32"}]
    assert manifest["outputs"][0]["name"] == "y"
    assert manifest["target_kind"] == "llvm" and manifest["tvm_version"].startswith("0.27")
    assert manifest["cuda_graph"] is False
    assert manifest["tir_pipeline"] == "tvmfuse-llvm"   # the weight prefetch (kernels/cpu/prefetch.py)
    assert set(manifest["files"]) == {"model.so", "params.npz"}
    assert manifest["model"]["name"] == example_model.name
    assert all(k["schedule"] == "tuned" for k in manifest["kernels"])
