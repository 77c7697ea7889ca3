"""Pure helpers of tvmfuse.inspect: kernel names -> operators -> pattern, ceilings."""
from __future__ import annotations

import pytest

from tvmfuse.inspect import ceilings_for, ops_from_name, pattern_from_name


@pytest.mark.parametrize("name, ops", [
    ("fused_matmul_add_relu1", ["matmul", "add", "relu"]),
    ("fused_conv2d_add_relu_reshape_transpose", ["conv2d", "add", "relu", "reshape", "transpose"]),
    ("layer_norm", ["layer_norm"]),
    ("fused_add_layer_norm2", ["add", "layer_norm"]),
    ("fused_batch_matmul_add", ["batch_matmul", "add"]),
])
def test_ops_from_name(name, ops):
    assert ops_from_name(name) == ops


@pytest.mark.parametrize("name, pattern", [
    ("fused_matmul_add_relu1", "gemm_epilogue"),
    ("fused_conv2d_add_relu", "conv_epilogue"),
    ("layer_norm", "single"),
    ("fused_add_layer_norm", "norm_prologue"),
    ("fused_softmax_multiply", "normalization"),
    ("fused_add_multiply_tanh", "pointwise_chain"),
    ("fused_attention", "attention"),
])
def test_pattern_from_name(name, pattern):
    assert pattern_from_name(name) == pattern


def test_h200_ceiling_is_the_measured_anchor():
    c = ceilings_for(kind="cuda", device="NVIDIA H200 sm_90")
    assert c.bandwidth_gbs == 4275.0 and "ANCHORS" in c.bandwidth_source
    assert c.ridge_flops_per_byte == pytest.approx(656e12 / 4275e9)


def test_unknown_gpu_has_no_ceiling_unless_given():
    assert ceilings_for(kind="cuda", device="NVIDIA A10 sm_86").bandwidth_gbs is None
    assert ceilings_for(kind="cuda", device="NVIDIA A10 sm_86", bandwidth_gbs=600).bandwidth_gbs == 600


def test_this_cpu_is_measured(llvm_target):
    c = ceilings_for(kind="llvm", device=llvm_target.device)
    assert c.bandwidth_gbs and 0.1 < c.bandwidth_gbs < 2000 and "measured" in c.bandwidth_source
    assert c.flops_per_s and c.flops_per_s > 1e8
    assert ceilings_for(kind="llvm", device="cpu:Some Other CPU x4").bandwidth_gbs is None
