"""Shared helpers for the planner tests: import an ONNX proto, build a partitioned module on llvm, run it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from tvmfuse._tvm import from_onnx, relax, tvm
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target


@pytest.fixture(scope="session")
def llvm():
    return resolve_target("llvm")


def import_proto(model: onnx.ModelProto):
    """What tvmfuse's importer does (weights bound as constants, BatchNorm decomposed for inference)."""
    mod = from_onnx(model, keep_params_in_input=False)
    return relax.transform.DecomposeOpsForInference()(mod)


def build_and_run(fused_mod, target, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Build a partitioned module (dataflow-lower + finalize passes, as after FuseTIR) and run it on CPU."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    pipeline = tvm.transform.Sequential(cpu.dataflow_lower_passes(target.target) + cpu.finalize_passes(target.target))
    exe = tvm.compile(fused_mod, target.target, relax_pipeline=pipeline)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
    outs = list(out) if not hasattr(out, "numpy") else [out]
    return [o.numpy() for o in outs]


def ort_run(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, inputs)))


def plan_and_run(model: onnx.ModelProto, target, inputs, planner: str):
    fused, plan = partition(import_proto(model), target=target, planner=planner)
    return fused, plan, build_and_run(fused, target, inputs)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))
