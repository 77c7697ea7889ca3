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
    src = _cuda_sources(result.executable)
    # nvcc runs with --use_fast_math: powf is __powf, NaN for any negative base (GPT-2's tanh-GELU was NaN on
    # the GPU); a pow may only be left on a magnitude
    bases = [src[m.end():m.end() + 6] for m in re.finditer(r"\bpowf\(", src)]
    assert all(b == "fabsf(" for b in bases), "powf of a signed base"
