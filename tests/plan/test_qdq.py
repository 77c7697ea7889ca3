"""A quantize / dequantize pair whose input is on its grid already is dropped (plan/rewrites/qdq.py): exactly, so the
graph computes the same floats; pairs that change values (another scale, a concatenation of two grids) or feed a
quantized conv stay."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvmfuse import verify
from tvmfuse._tvm import relax, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.plan.rewrites.qdq import redundant_requantize
from tvmfuse.plan.tags import RewriteLog

RNG = np.random.default_rng(3)
C, HW = 8, 6


def _qdq(x: str, grid: str, out: str) -> list:
    """``x`` quantized to uint8 on ``grid`` (its scale and zero point initialisers) and dequantized into ``out``."""
    return [helper.make_node("QuantizeLinear", [x, grid + "_s", grid + "_z"], [out + "_q"]),
            helper.make_node("DequantizeLinear", [out + "_q", grid + "_s", grid + "_z"], [out])]


def _model() -> onnx.ModelProto:
    """Two convs on one input, concatenated (two grids, requantized onto a third), shuffled (reshape, transpose,
    reshape), split; one half max-pooled, the other through ReLU into a quantized conv; a last pair on another
    scale. Every op's output is requantized, as onnxruntime's quantize_static writes it."""
    grids = {"in": (0.02, 128), "a": (0.03, 120), "b": (0.025, 131), "cat": (0.035, 125), "other": (0.05, 128)}
    inits = []
    for name, (s, z) in grids.items():
        inits += [numpy_helper.from_array(np.array(s, np.float32), name + "_s"),
                  numpy_helper.from_array(np.array(z, np.uint8), name + "_z")]
    for name in ("wa", "wb", "wc"):
        w = RNG.integers(-127, 128, (C, C, 1, 1)).astype(np.int8)
        inits += [numpy_helper.from_array(w, name + "_i8"),
                  numpy_helper.from_array(np.array(0.01, np.float32), name + "_s"),
                  numpy_helper.from_array(np.array(0, np.int8), name + "_z")]
    inits += [numpy_helper.from_array(np.array(s, np.int64), n)
              for n, s in (("grouped", [1, 2, C, HW, HW]), ("flat", [1, 2 * C, HW, HW]))]
    nodes = _qdq("x", "in", "xd")
    for name in ("wa", "wb", "wc"):
        nodes.append(helper.make_node("DequantizeLinear", [name + "_i8", name + "_s", name + "_z"], [name]))
    nodes += [helper.make_node("Conv", ["xd", "wa"], ["ca"]), *_qdq("ca", "a", "cad"),
              helper.make_node("Conv", ["xd", "wb"], ["cb"]), *_qdq("cb", "b", "cbd"),
              helper.make_node("Concat", ["cad", "cbd"], ["cat"], axis=1), *_qdq("cat", "cat", "catd"),
              helper.make_node("Reshape", ["catd", "grouped"], ["g"]), *_qdq("g", "cat", "gd"),
              helper.make_node("Transpose", ["gd"], ["t"], perm=[0, 2, 1, 3, 4]), *_qdq("t", "cat", "td"),
              helper.make_node("Reshape", ["td", "flat"], ["f"]), *_qdq("f", "cat", "fd"),
              helper.make_node("Split", ["fd"], ["h0", "h1"], axis=1, num_outputs=2),
              *_qdq("h0", "cat", "h0d"), *_qdq("h1", "cat", "h1d"),
              helper.make_node("MaxPool", ["h0d"], ["p"], kernel_shape=[2, 2], strides=[2, 2]), *_qdq("p", "cat", "pd"),
              helper.make_node("Relu", ["h1d"], ["r"]), *_qdq("r", "cat", "rd"),
              helper.make_node("Conv", ["rd", "wc"], ["cc"]), *_qdq("cc", "a", "ccd"),
              helper.make_node("Reshape", ["ccd", "flat_c"], ["cf"]), *_qdq("cf", "other", "y2"),
              helper.make_node("Identity", ["pd"], ["y1"])]
    inits.append(numpy_helper.from_array(np.array([1, C, HW, HW], np.int64), "flat_c"))
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, HW, HW])],
                              [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, C, HW // 2, HW // 2]),
                               helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, C, HW, HW])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(mod, x: np.ndarray) -> list[np.ndarray]:
    exe = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out]


def test_pairs_on_their_grid_are_dropped_and_the_floats_stay_the_same(tmp_path):
    path = tmp_path / "qdq.onnx"
    onnx.save(_model(), path)
    mod = import_model(load_model(path))
    log = RewriteLog()
    dropped = redundant_requantize(mod, log=log)
    # the reshape, transpose and reshape of the shuffle, the split's two halves and the max pool's output; not: the
    # concatenation's (two grids onto a third), the ReLU's (the conv reads its uint8 operand) and the last
    # reshape's (another scale)
    assert log.notes and log.notes[0].startswith("6 quantize / dequantize pairs dropped")

    def pairs(m) -> int:
        n = [0]
        relax.analysis.post_order_visit(m["main"].body, lambda e: n.__setitem__(
            0, n[0] + (isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.quantize")))
        return n[0]

    assert pairs(mod) - pairs(dropped) == 6
    x = (RNG.standard_normal((1, C, HW, HW)) * 1.5).astype(np.float32)
    before, after = _run(mod, x), _run(dropped, x)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_a_planned_qdq_graph_matches_onnxruntime(tmp_path, llvm_target):
    """The whole planner (the pairs dropped, then the quantized convs) against onnxruntime."""
    from tvmfuse.compile import build

    path = tmp_path / "qdq.onnx"
    onnx.save(_model(), path)
    fused, plan = partition(import_model(load_model(path)), target=llvm_target)
    assert any("pairs dropped" in n for n in plan.rewrites)
    x = (RNG.standard_normal((1, C, HW, HW)) * 1.5).astype(np.float32)
    built = build(fused, target=llvm_target, database=None)
    out = relax.VirtualMachine(built.executable, tvm.cpu(0))["main"](tvm.runtime.tensor(x), *built.lifted_params)
    ref = verify.run_onnxruntime(path, {"x": x})
    floor = verify.quantization_floor(path, {"x": x}, ref)
    for got, want in zip(out, ref):
        assert verify.relative_error(got.numpy(), want) <= max(1e-5, verify.QUANTIZED_SLACK * floor)
