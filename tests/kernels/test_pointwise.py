"""The pointwise template on CUDA: each thread's register arrays hold its own vector, whatever the kernel reads.

LLaMA's rotary embedding (``x * cos + rotate_half(x) * sin``) reads ``x`` at shifted elements; staging it through
registers gave every thread a local copy of the whole tensor (262144 floats at 8 x 512 tokens), a launch the H200
refused. Built here from the tiny fixtures, not run."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tvmfuse._tvm import PrimFunc, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.kernels.pointwise.sketch import same_index_reads
from tvmfuse.kernels.sketch import inline_all_but_outputs
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune.defaults import untuned_kernel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOCAL = re.compile(r"alignas\(\d+\) \w+ (\w+_local_ptr)\[(\d+)\];")


def _pointwise_kernels(model: str):
    cuda = resolve_target("cuda")
    fused, _ = partition(import_model(load_model(FIXTURES / f"tiny_{model}.float32.onnx")), target=cuda)
    for gv, func in fused.functions.items():
        if isinstance(func, PrimFunc):
            found = untuned_kernel(func, cuda)
            if found is not None and found[0] == "pointwise-default":
                yield gv.name_hint, func, found[1], cuda


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_register_arrays_hold_one_threads_vector(model):
    seen = 0
    for name, _func, kernel, cuda in _pointwise_kernels(model):
        with cuda.target:
            lib = tvm.tirx.build(tvm.IRModule({name: kernel.with_attr("global_symbol", name)}), target=cuda.target)
        arrays = {a: int(n) for a, n in LOCAL.findall(lib.imports[0].inspect_source("cuda"))}
        assert arrays, name
        # a vector of at most 16 bytes a thread, at most 4 vectors (the space's vectors_per_thread)
        assert max(arrays.values()) <= 16, (name, arrays)
        seen += 1
    assert seen


def test_shifted_reads_are_read_in_place():
    rotary = [(n, f) for n, f, _, _ in _pointwise_kernels("llama") if "concatenate" in n]
    assert rotary
    for _name, func in rotary:
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        inline_all_but_outputs(sch)
        (block,) = sch.get_output_blocks(sch.get_sblock("root"))
        staged = same_index_reads(sch, block)
        shifted = {str(r.source.name) for r in sch.get(block).reads} - set(staged)
        assert shifted, "the rotate-half input is read at shifted elements"


CONCAT = """
@T.prim_func(s_tir=True)
def main(a: T.Buffer((T.int64(32), T.int64(7), T.int64(7), T.int64(192)), "float32"),
         b: T.Buffer((T.int64(32), T.int64(7), T.int64(7), T.int64(192)), "float32"),
         out: T.Buffer((T.int64(32), T.int64(7), T.int64(7), T.int64(384)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i0, i1, i2, i3 in T.grid(T.int64(32), T.int64(7), T.int64(7), T.int64(384)):
        with T.sblock("T_concat"):
            v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(b[v0, v1, v2, v3 - T.int64(192)], a[v0, v1, v2, v3])
            T.writes(out[v0, v1, v2, v3])
            out[v0, v1, v2, v3] = T.if_then_else(T.int64(192) <= v3, b[v0, v1, v2, v3 - T.int64(192)],
                                                 a[v0, v1, v2, v3])
"""


def test_a_concatenation_keeps_the_pointwise_default():
    """A concatenation reads its first part at the written index but is not of the output's shape: staged, its
    register cache ran past that input's end (loops of dynamic extent, rejected by the space's postprocessors), and
    the kernel fell to dlight's Fallback (SqueezeNet's fire-module concat at batch 32)."""
    from tvm.script import tirx as T  # noqa: F401 - the script's namespace

    func = tvm.script.from_source(CONCAT)
    found = untuned_kernel(func, resolve_target("cuda"))
    assert found is not None and found[0] == "pointwise-default"
