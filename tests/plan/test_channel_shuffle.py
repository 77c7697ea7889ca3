"""ShuffleNet's channel shuffles run channels-last (plan/rewrites/channel_shuffle.py): no layout transpose is left
around them, and the model still matches onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmfuse import verify
from tvmfuse._tvm import relax, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.plan.cost import CostModel
from tvmfuse.plan.planner import PlannerConfig, _Dump, _high_level
from tvmfuse.plan.tags import RewriteLog

RNG = np.random.default_rng(0)
C, HW = 16, 8


def _block(i: int, x: str, scaled: bool = False) -> tuple[list, list, str]:
    """One ShuffleNet-v2 unit on ``x`` (NCHW, C channels): split, a 1x1 conv + ReLU on one half, concatenate,
    (``scaled``: times and plus scalars, as a quantized graph's QuantizeLinear arithmetic sits there) shuffle the
    two groups of channels."""
    p = f"b{i}_"
    w = numpy_helper.from_array((RNG.standard_normal((C // 2, C // 2, 1, 1)) * 0.4).astype(np.float32), p + "w")
    shapes = [numpy_helper.from_array(np.array(s, np.int64), p + n)
              for n, s in (("grouped", [1, 2, C // 2, HW, HW]), ("flat", [1, C, HW, HW]))]
    nodes = [helper.make_node("Split", [x], [p + "keep", p + "branch"], axis=1, num_outputs=2),
             helper.make_node("Conv", [p + "branch", p + "w"], [p + "conv"], kernel_shape=[1, 1]),
             helper.make_node("Relu", [p + "conv"], [p + "relu"]),
             helper.make_node("Concat", [p + "keep", p + "relu"], [p + "cat" + ("0" if scaled else "")], axis=1)]
    if scaled:
        shapes += [numpy_helper.from_array(np.array(v, np.float32), p + n) for n, v in (("s", 1.5), ("o", 0.25))]
        nodes += [helper.make_node("Mul", [p + "cat0", p + "s"], [p + "cat1"]),
                  helper.make_node("Add", [p + "cat1", p + "o"], [p + "cat"])]
    nodes += [helper.make_node("Reshape", [p + "cat", p + "grouped"], [p + "g"]),
             helper.make_node("Transpose", [p + "g"], [p + "t"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", [p + "t", p + "flat"], [p + "out"])]
    return nodes, [w, *shapes], p + "out"


def _shufflenet(units: int = 3, scaled: bool = False) -> onnx.ModelProto:
    stem = numpy_helper.from_array((RNG.standard_normal((C, 3, 3, 3)) * 0.3).astype(np.float32), "stem_w")
    nodes, inits, x = [helper.make_node("Conv", ["x", "stem_w"], ["s"], kernel_shape=[3, 3], pads=[1] * 4)], [stem], "s"
    for i in range(units):
        more, weights, x = _block(i, x, scaled)
        nodes += more
        inits += weights
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, HW, HW])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, HW, HW])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _permutes(mod) -> list:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.permute_dims":
            found.append([int(a) for a in e.attrs.axes])

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return found


@pytest.mark.parametrize("scaled", [False, True])
def test_shuffles_run_channels_last_and_match_onnxruntime(tmp_path, llvm_target, scaled):
    path = tmp_path / "shuffle.onnx"
    onnx.save(_shufflenet(scaled=scaled), path)
    mod = import_model(load_model(path))
    log = RewriteLog()
    high = _high_level(mod, llvm_target, PlannerConfig(), log, CostModel.for_target(llvm_target), _Dump(None))
    assert "moved past their layout transposes" in log.notes[0]
    # left: each shuffle's swap of the two channel axes (5-D), the input's transpose to NHWC and the output's back
    perms = _permutes(high)
    assert sorted(p for p in perms if len(p) == 4) == [[0, 2, 3, 1], [0, 3, 1, 2]], perms
    assert sum(p == [0, 1, 2, 4, 3] for p in perms) == 3
    x = RNG.standard_normal((1, 3, HW, HW)).astype(np.float32)
    fused, _ = partition(mod, target=llvm_target)
    exe = tvm.compile(fused, tvm.target.Target({"kind": "llvm", "num-cores": 2}), relax_pipeline="default")
    got = relax.VirtualMachine(exe, tvm.cpu(0))["main"](tvm.runtime.tensor(x)).numpy()
    ref = verify.run_onnxruntime(path, {"x": x})[0]
    assert verify.relative_error(got, ref) < 1e-5
