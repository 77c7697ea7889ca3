"""Dilated convs whose edge taps read only padding run on their live taps (plan/rewrites/dead_taps.py), checked
against onnxruntime on the ONNX graph they came from."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse.plan.rewrites as rewrites
from tvmfuse import verify
from tvmfuse._tvm import const_numpy, relax, tvm
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.plan.rewrites.dead_taps import live_taps
from tvmfuse.plan.tags import RewriteLog

RNG = np.random.default_rng(0)


def _conv_model(side: int, taps: int, dilation: int, pad: int, cin: int = 8, cout: int = 16):
    w = numpy_helper.from_array((RNG.standard_normal((cout, cin, taps, taps)) * 0.2).astype(np.float32), "w")
    b = numpy_helper.from_array(RNG.standard_normal(cout).astype(np.float32), "b")
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[taps, taps], dilations=[dilation] * 2,
                            pads=[pad] * 4)
    out = side + 2 * pad - dilation * (taps - 1)
    g = helper.make_graph([conv, helper.make_node("Relu", ["c"], ["y"])], "aspp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, side, side])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, out, out])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_live_taps_are_the_run_that_meets_the_input():
    assert live_taps(8, 8, 3, 1, 12, 12) == (1, 1)        # DeepLab's ASPP at 8 x 8: the centre only
    assert live_taps(32, 32, 3, 1, 12, 12) == (0, 2)      # at 32 x 32 every tap reaches the input
    assert live_taps(5, 5, 5, 1, 3, 6) == (1, 3)


@pytest.mark.parametrize("side,taps,dilation,pad,kept", [(8, 3, 12, 12, (1, 1)), (5, 5, 3, 6, (3, 3)),
                                                         (12, 3, 4, 4, None)])
def test_a_conv_runs_on_its_live_taps_and_matches_onnxruntime(side, taps, dilation, pad, kept, tmp_path,
                                                               llvm_target):
    path = tmp_path / "aspp.onnx"
    onnx.save(_conv_model(side, taps, dilation, pad), path)
    mod = import_model(load_model(path))
    log = RewriteLog()
    after = rewrites.TrimDeadTaps(log=log)(mod)
    convs = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.nn.conv2d":
            convs.append(e)

    relax.analysis.post_order_visit(after["main"].body, visit)
    (conv,) = convs
    if kept is None:   # every tap reaches the input: nothing changes
        tvm.ir.assert_structural_equal(after, mod)
        assert not log.notes
    else:
        assert const_numpy(conv.args[1]).shape[2:] == kept and log.notes
    x = RNG.standard_normal((1, 8, side, side)).astype(np.float32)
    fused, plan = partition(mod, target=llvm_target)
    assert (kept is None) != any("dilated convs run on the taps" in n for n in plan.rewrites)
    exe = tvm.compile(fused, tvm.target.Target({"kind": "llvm", "num-cores": 2}), relax_pipeline="default")
    got = relax.VirtualMachine(exe, tvm.cpu(0))["main"](tvm.runtime.tensor(x)).numpy()
    ref = verify.run_onnxruntime(path, {"x": x})[0]
    assert verify.relative_error(got, ref) < 1e-5
