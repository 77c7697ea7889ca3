"""Tiny real exports (PyTorch dynamo exporter via scripts/model_zoo.py --tiny) verify against onnxruntime.

Path: load -> import -> plan.partition(planner="fuseops") -> untuned llvm build -> Relax VM.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan.partition import fused_functions, partition
from tvmfuse.target import resolve_target

from .helpers import rel_err, run_ort, run_tvm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOL = {"float32": 1e-4, "float16": 1e-2}


# fp16 builds are slow on llvm (~30 s for tiny_bert); tiny_tinycnn fp16 is covered by the zoo run
@pytest.mark.parametrize("name,dtype", [("tiny_bert", "float16"), ("tiny_bert", "float32"), ("tiny_tinycnn", "float32")])
def test_fixture_verifies_against_onnxruntime(name, dtype):
    path = FIXTURES / f"{name}.{dtype}.onnx"
    feeds = dict(np.load(FIXTURES / f"{name}.inputs.npz"))
    loaded = load_model(path)
    args = [feeds[s.name].astype(s.dtype) for s in loaded.inputs]
    fused, plan = partition(import_model(loaded), target=resolve_target("llvm"), planner="fuseops")
    assert len(fused_functions(fused)) >= 3 and plan.groups
    got = run_tvm(fused, args)
    ref = run_ort(path, {s.name: a for s, a in zip(loaded.inputs, args)})
    assert np.sqrt(np.mean(ref.astype(np.float64) ** 2)) > 1e-3, "degenerate reference"
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < TOL[dtype]
