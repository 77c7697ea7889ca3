"""Causal and grouped-query attention through the real planner on the GPU, beside PyTorch SDPA.

Each case is an ONNX graph made with onnx.helper (Q, K, V inputs; a constant causal mask as torch exports it; K/V
heads repeated as transformers' ``repeat_kv`` exports them), imported and partitioned by tvmfuse's planner for CUDA
(so the mask and the head repeat are recognised there, or the run says they were not), built with the untuned
default flash kernel, checked against torch in fp32 on the model's outputs (output poisoned first), and timed with
TVM's time evaluator beside ``torch.nn.functional.scaled_dot_product_attention`` in the same process:

(a) B8 H16 S2048 D64 fp16: unmasked vs causal (mask recognised) vs SDPA(is_causal=False / True);
(b) GQA B4 Hq32 Hkv8 S4096 D128 causal vs SDPA(is_causal=True, enable_gqa=True).

    python benchmarks/attention_causal_gpu.py [--configs N] [--small] [--dry-run]

``--configs N`` also times the first N other tile configs of the template's space for each case, one by one.
``--dry-run`` plans each case for CUDA and builds every kernel it would run with nvcc, without a GPU;
``--small`` runs small shapes on llvm end to end against onnxruntime (no GPU, no torch needed).
Writes ``$OUT/attention_causal_gpu.json`` when ``$OUT`` is set; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def attention_onnx(*, batch=1, heads=4, kv_heads=None, seq_q=16, seq_k=None, dim=16, mask="const", repeat="expand",
                   dtype="float32", mask_value=None, scale=None) -> onnx.ModelProto:
    """softmax(Q Kᵀ * scale + mask) V as an ONNX graph with inputs q [B, H, Sq, D], k and v [B, Hkv, Sk, D].

    ``mask``: ``none``; ``const`` (a [1, 1, Sq, Sk] constant, 0 where key j <= i + Sk - Sq, ``mask_value``
    elsewhere, as torch exports it); ``where`` (Where(constant triangular condition, 0, -inf)); ``trilu``
    ((1 - Trilu(ones)) * -big, computed in the graph from constants); ``near`` (``const`` with one hidden element
    set to 0: not causal); ``input`` (a runtime mask input of that shape).
    ``repeat`` (when Hkv < H): ``expand`` (Unsqueeze -> Expand -> Reshape, transformers' repeat_kv), ``tile``
    (Unsqueeze -> Tile -> Reshape, the same order), ``tile_heads`` (Tile of the head axis: the other head order,
    h % Hkv), ``broadcast`` (Hkv 1 only: the matmuls broadcast K and V)."""
    seq_k = seq_k or seq_q
    kv_heads = kv_heads or heads
    np_dt = np.float16 if dtype == "float16" else np.float32
    et = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    if mask_value is None:
        mask_value = float(np.finfo(np_dt).min)
    scale = dim ** -0.5 if scale is None else scale
    inits, nodes, k = [], [], [0]

    def const(arr, name=None):
        k[0] += 1
        name = name or f"c{k[0]}"
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def op(op_type, ins, **attrs):
        k[0] += 1
        out = f"t{k[0]}"
        nodes.append(helper.make_node(op_type, ins, [out], name=f"n{k[0]}", **attrs))
        return out

    def rep(x):
        if kv_heads == heads or repeat == "broadcast":
            return x
        n = heads // kv_heads
        if repeat == "tile_heads":
            return op("Tile", [x, const(np.array([1, n, 1, 1], np.int64))])
        u = op("Unsqueeze", [x, const(np.array([2], np.int64))])
        shape5 = np.array([batch, kv_heads, n, seq_k, dim], np.int64)
        w = (op("Expand", [u, const(shape5)]) if repeat == "expand"
             else op("Tile", [u, const(np.array([1, 1, n, 1, 1], np.int64))]))
        return op("Reshape", [w, const(np.array([batch, heads, seq_k, dim], np.int64))])

    s = op("Mul", [op("MatMul", ["q", op("Transpose", [rep("k")], perm=[0, 1, 3, 2])]), const(np.array(scale, np_dt))])
    keep = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + (seq_k - seq_q)
    ins = {"q": [batch, heads, seq_q, dim], "k": [batch, kv_heads, seq_k, dim], "v": [batch, kv_heads, seq_k, dim]}
    if mask in ("const", "near"):
        m = np.where(keep, 0, mask_value).astype(np_dt)[None, None]
        if mask == "near":
            m[0, 0, seq_q // 2, seq_k - 1] = 0   # one hidden key made visible: not causal any more
        s = op("Add", [s, const(m)])
    elif mask == "where":
        s = op("Add", [s, op("Where", [const(keep), const(np.array(0, np_dt)), const(np.array(-np.inf, np_dt))])])
    elif mask == "trilu":
        tri = op("Trilu", [const(np.ones((seq_q, seq_k), np_dt)), const(np.array(seq_k - seq_q, np.int64))], upper=0)
        hidden = op("Sub", [const(np.array(1, np_dt)), tri])
        s = op("Add", [s, op("Mul", [hidden, const(np.array(mask_value, np_dt))])])
    elif mask == "input":
        ins["mask"] = [1, 1, seq_q, seq_k]
        s = op("Add", [s, "mask"])
    y = op("MatMul", [op("Softmax", [s], axis=-1), rep("v")])
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, et, sh) for n, sh in ins.items()],
                              [helper.make_tensor_value_info("y", et, [batch, heads, seq_q, dim])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    del y
    return model
