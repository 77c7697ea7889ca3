"""T5's fp16 clamp on a real export: a whole-tensor reduction (is any element infinite) and ONNX Max / Min.

The planner had fused the whole-tensor reduction into each layer's RMSNorm kernel, and TVM imports Max / Min as
reductions over a stacked axis: no rule split those kernels over threads, and dlight's Fallback ran them (T5 fp16
took 15x its fp32 time on the H200). The reduction is now a kernel of its own and Max / Min are elementwise.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tvmfuse._tvm import relax, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.verify import relative_error, run_onnxruntime, tolerance

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
T5_FP16 = FIXTURES / "tiny_t5_encoder.float16.onnx"


def _reductions(func) -> list[bool]:
    """For each reduction block of a kernel: whether it reduces to one value (no spatial axis)."""
    kinds = re.findall(r'T\.axis\.remap\("([SR]+)"', func.script())
    return ["S" not in k for k in kinds if "R" in k]


@pytest.fixture(scope="module")
def t5_cuda():
    target = resolve_target("cuda")
    fused, plan = partition(import_model(load_model(T5_FP16)), target=target)
    return extract_kernels(fused, target=target), plan


def test_a_whole_tensor_reduction_is_a_kernel_of_its_own(t5_cuda):
    kernels, _ = t5_cuda
    kinds = {k.name: _reductions(k.mod["main"]) for k in kernels}
    whole = [n for n, r in kinds.items() if any(r)]
    assert whole, "the fixture's isinf reduction is gone: the test no longer sees what it checks"
    assert all(all(kinds[n]) for n in whole), {n: kinds[n] for n in whole}


def test_onnx_max_and_min_plan_as_elementwise_ops(t5_cuda):
    kernels, plan = t5_cuda
    scripts = "\n".join(k.mod["main"].script() for k in kernels)
    assert "T_stack" not in scripts and "T_maximum" in scripts and "T_minimum" in scripts
    assert any("pairwise" in note for note in plan.rewrites)


def test_gpu_plans_keep_one_result_a_row_kernel(t5_cuda):
    """The GPU's row templates store one result: the embedding's sum kept as the residual beside the first RMSNorm
    (LLaMA, T5) is stored by a kernel of its own, and the RMSNorm kernel reads it back."""
    from tvmfuse.tune.check import output_names

    kernels, plan = t5_cuda
    rows = [k for k in kernels if any(not whole for whole in _reductions(k.mod["main"]))]
    assert rows and all(len(output_names(k.mod["main"])) == 1 for k in rows), \
        {k.name: sorted(output_names(k.mod["main"])) for k in rows}
    assert any(r["reason"].startswith("a reduction's kernel would store") for r in plan.to_json()["rejected"])


@pytest.mark.parametrize("name,dtype,target", [("tiny_t5_encoder", "float16", "llvm"),
                                               ("tiny_t5_encoder", "float32", "cuda"),
                                               ("tiny_llama", "float32", "cuda")])
def test_plans_verify_on_llvm(name, dtype, target):
    """The plan's kernels computed by TVM's plain lowering: the GPU plan's semantics, whatever its schedules."""
    path = FIXTURES / f"{name}.{dtype}.onnx"
    loaded = load_model(path)
    feeds = dict(np.load(FIXTURES / f"{name}.inputs.npz"))
    args = [feeds[s.name].astype(s.dtype) for s in loaded.inputs]
    fused, _ = partition(import_model(loaded), target=resolve_target(target))
    vm = relax.VirtualMachine(tvm.compile(fused, tvm.target.Target({"kind": "llvm", "num-cores": 2})), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    (ref, *_) = run_onnxruntime(path, {s.name: a for s, a in zip(loaded.inputs, args)})
    assert relative_error(got, ref) < max(tolerance(dtype), 1e-5)
