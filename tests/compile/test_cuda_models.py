"""Every zoo model (tiny fixtures) builds for CUDA untuned, and no generated kernel leans on what nvcc's fast math
breaks. These run on the CPU: TVM builds CUDA code with nvcc without a GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tvmfuse.compile import build
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ZOO = ["bert", "gpt2", "vit", "t5_encoder", "llama", "tinycnn"]


def _cuda_sources(executable) -> str:
    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    return "\n".join(m.inspect_source() for m in walk(executable.mod) if m.kind == "cuda")


@pytest.fixture(scope="module")
def cuda_target():
    from tvmfuse.target import resolve_target

    return resolve_target("cuda")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_builds_for_cuda(name, dtype, cuda_target):
    loaded = load_model(FIXTURES / f"tiny_{name}.{dtype}.onnx")
    fused, _ = partition(import_model(loaded), target=cuda_target)
    result = build(fused, target=cuda_target, database=None)
    assert result.kernels and all(k.schedule for k in result.kernels)
    # on by default: main's static part is one captured CUDA graph (the VM calls run_or_capture)
    assert result.cuda_graph and "vm.builtin.cuda_graph.run_or_capture" in result.executable.as_text()
    src = _cuda_sources(result.executable)
    # nvcc runs with --use_fast_math: powf is __powf, NaN for any negative base (GPT-2's tanh-GELU was NaN on
    # the GPU); a pow may only be left on a magnitude
    bases = [src[m.end():m.end() + 6] for m in re.finditer(r"\bpowf\(", src)]
    assert all(b == "fabsf(" for b in bases), "powf of a signed base"


def test_cuda_graph_can_be_turned_off_and_is_never_used_on_llvm(cuda_target, llvm_target):
    loaded = load_model(FIXTURES / "tiny_gpt2.float32.onnx")
    fused, _ = partition(import_model(loaded), target=cuda_target)
    off = build(fused, target=cuda_target, database=None, cuda_graph=False)
    assert not off.cuda_graph and "cuda_graph" not in off.executable.as_text()
    fused, _ = partition(import_model(loaded), target=llvm_target)
    assert not build(fused, target=llvm_target, database=None).cuda_graph
