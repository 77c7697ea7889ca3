"""The GPU figures the templates' defaults read (tvmfuse.target.device_figures): from the device where it is here,
else a table keyed by the target's arch; a target for another GPU (sm_80: 108 SMs, 164 KB of shared memory an SM)
changes the defaults and the sketches that depend on them, and says where its figures came from."""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import pytest

from tvmfuse._tvm import tvm
from tvmfuse.bench.cases import CASES
from tvmfuse.frontend import import_model, load_model
from tvmfuse.kernels import get
from tvmfuse.kernels.space import sketch_info, tune_context
from tvmfuse.plan import partition
from tvmfuse.plan.cost import CostModel
from tvmfuse.target import cuda_available, device_figures, resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.tune.spaces import classify, load_spaces, select_space

SM90A = resolve_target("cuda")
SM80 = resolve_target({"kind": "cuda", "arch": "sm_80", "max_threads_per_block": 1024,
                       "max_shared_memory_per_block": 49152, "thread_warp_size": 32})


@pytest.mark.skipif(cuda_available(), reason="a GPU here: its figures come from the device")
def test_figures_come_from_the_arch_table_without_a_device():
    h, a = device_figures(SM90A), device_figures(SM80)
    assert (h.sm_count, h.source) == (132, "table:sm_90a")
    assert (a.sm_count, a.shared_per_sm, a.source) == (108, 164 << 10, "table:sm_80")
    other = device_figures(resolve_target({"kind": "cuda", "arch": "sm_52"}))
    assert other.source == "default:sm_90a" and other.sm_count == 132
    l2 = device_figures(resolve_target({"kind": "cuda", "arch": "sm_80", "l2_cache_size_bytes": 1 << 22}))
    assert l2.l2_bytes == 1 << 22 and l2.source == "table:sm_80+target:l2"


def test_the_planners_parallel_work_is_a_wave_of_the_targets_sms():
    assert CostModel.for_target(SM90A).min_parallel_units == 132
    assert CostModel.for_target(SM80).min_parallel_units == 108


def _kernel(case, cls, **shape):
    path = Path(tempfile.mkdtemp()) / "m.onnx"
    onnx.save(CASES[case](**shape)[0], path)
    fused, _ = partition(import_model(load_model(path)), target=SM90A)
    (k,) = [k for k in extract_kernels(fused, target=SM90A) if classify(k.mod["main"]) == cls]
    return k


def test_the_pointwise_grid_stride_blocks_are_waves_of_the_targets_sms():
    kernel = _kernel("swiglu", "pointwise", M=64, N=1024)
    blocks = {}
    for t in (SM90A, SM80):
        space = load_spaces("cuda").for_class("pointwise")
        here = cuda_available() and t is SM90A   # an H200 here: its own figures (132 SMs too)
        assert sketch_info(space, t.target)["device_source"] == ("device" if here else
                                                                 f"table:{t.target.attrs['arch']}")
        choice = select_space(kernel.mod, t.target)
        found = set()
        for sketch in tune_context(kernel.mod, t.target, choice.generator).generate_design_space():
            for inst in sketch.trace.insts:
                if inst.kind.name == "SampleCategorical":
                    values = [int(v) for v in inst.attrs[0]]
                    if len(values) == len(space.knobs["grid_stride_waves"].values) and values[0] >= 100:
                        found.add(tuple(values))
        blocks[t.target.attrs["arch"]] = found
    waves = [int(w) for w in load_spaces("cuda").for_class("pointwise").knobs["grid_stride_waves"].values]
    assert blocks["sm_90a"] == {tuple(w * 132 for w in waves)}
    assert blocks["sm_80"] == {tuple(w * 108 for w in waves)}


def test_a_wide_rows_default_stages_in_shared_memory_only_where_the_gpu_has_room():
    """A row of 49152 fp16 (96 KB): the H200 stages it (110 KB a block, two blocks an SM of 228 KB), an A100's
    164 KB an SM leaves 78 KB a block, so it is re-read through L2 there (only a block that keeps part of the row
    in registers, one an SM, may stage the rest: its two rows an SM in flight fit the A100's 40 MB L2)."""
    kernel = _kernel("softmax", "row_reduction", M=8, N=49152)
    rows = get("rows")
    h, a = rows.default_config(kernel.mod["main"], SM90A.target), rows.default_config(kernel.mod["main"], SM80.target)
    assert (h.mode, a.mode) == (1, 2), (h.name, a.name)
    assert any(c.mode == 1 for c in rows.configs(kernel.mod["main"], SM90A.target))
    assert not any(c.mode == 1 and not c.keep for c in rows.configs(kernel.mod["main"], SM80.target))


def test_a_persistent_wgmma_kernel_launches_a_block_per_sm_of_the_target():
    """A persistent TMA kernel's grid is the GPU's SMs: the default's figure (the H200's 132), what the sketch
    annotates (an H100 PCIe's 114 here) and what expand reads back from the annotation."""
    from tvmfuse.kernels import wgmma as hopper

    spec = hopper.GemmSpec((), 4096, 4096, 1024, False, False, False)
    cfg = hopper.parse_config("g2 m1 n256 k64 s4 r8 z128 f0 t1 p1")
    decls = ["a: T.Buffer((4096, 1024), 'float16')", "b: T.Buffer((1024, 4096), 'float16')",
             "c: T.Buffer((4096, 4096), 'float16')"]
    store = "c[{row}, {col}] = T.Cast('float16', {acc})"
    default = hopper.gemm_source(spec, cfg, decls, "a", "b", store)
    assert 'T.thread_binding(132, thread="blockIdx.x")' in default
    pcie = hopper.gemm_source(spec, cfg, decls, "a", "b", store, 114)
    assert 'T.thread_binding(114, thread="blockIdx.x")' in pcie
    # the sketch's annotation carries the SMs to expand (kernels.wgmma.kernel.expand reads info["sms"])
    kernel = _kernel("gemm_bias_relu", "gemm", M=4096, K=1024, N=4096)
    sch = tvm.s_tir.Schedule(kernel.mod)
    assert hopper.schedule(sch, load_spaces("cuda").for_class("gemm"), 114) is not None
    assert hopper.annotated(sch.mod["main"])[1]["sms"] == 114
