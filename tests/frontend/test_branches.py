"""An If whose condition is known once the inputs are bound is replaced by its branch (tvmfuse.frontend.branches)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h

from tvmfuse import verify
from tvmfuse.frontend import load_model


def _shape_tested_if(tmp_path):
    """``x * 2`` where x has more than 4 rows, else ``x`` as it is: the condition is a test of the bound shape; two
    such Ifs, whose branches name their values alike."""
    def branches():
        then_g = h.make_graph([h.make_node("Mul", ["x", "two"], ["t"]), h.make_node("Neg", ["t"], ["u"]),
                               h.make_node("Neg", ["u"], ["then_out"])], "then", [],
                              [h.make_tensor_value_info("then_out", TP.FLOAT, None),
                               h.make_tensor_value_info("t", TP.FLOAT, None)],
                              [h.make_tensor("two", TP.FLOAT, [], [2.0])])
        else_g = h.make_graph([h.make_node("Identity", ["x"], ["else_out"]), h.make_node("Identity", ["x"], ["e2"])],
                              "else", [], [h.make_tensor_value_info("else_out", TP.FLOAT, None),
                                           h.make_tensor_value_info("e2", TP.FLOAT, None)])
        return dict(then_branch=then_g, else_branch=else_g)

    nodes = [h.make_node("Shape", ["x"], ["s"], start=0, end=1),
             h.make_node("Greater", ["s", "four"], ["big"]),
             h.make_node("Squeeze", ["big"], ["cond"]),
             h.make_node("If", ["cond"], ["y1", "y2"], **branches()),
             h.make_node("If", ["cond"], ["y3", "y4"], **branches()),
             h.make_node("Sum", ["y1", "y2", "y3", "y4"], ["z"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, ["n", 3])],
                     [h.make_tensor_value_info("z", TP.FLOAT, ["n", 3])],
                     [h.make_tensor("four", TP.INT64, [1], [4])])
    path = tmp_path / "if.onnx"
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def test_a_branch_chosen_by_the_bound_shape_is_inlined(tmp_path):
    path = _shape_tested_if(tmp_path)
    for rows in (2, 6):   # the else branch passes an outer value on; the then branch's t is renamed
        loaded = load_model(path, input_shapes={"x": (rows, 3)})
        assert "branches-inlined x2" in loaded.fixups
        assert not any(n.op_type == "If" for n in loaded.proto.graph.node)
        onnx.checker.check_model(loaded.proto, full_check=True)
        x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        got = verify.run_onnxruntime(tmp_path / "if.onnx", {"x": x})[0]
        import onnxruntime as ort
        ours = ort.InferenceSession(loaded.proto.SerializeToString()).run(None, {"x": x})[0]
        np.testing.assert_allclose(ours, got, rtol=1e-6)
        np.testing.assert_allclose(ours, 4 * (x * 2 if rows > 4 else x), rtol=1e-6)


def test_the_taken_branch_decides_an_outputs_shape(tmp_path):
    # optimum's seq2seq merge: on the with-past branch the encoder's K/V outputs are empty constants, while the
    # graph declares them (batch, heads, encoder length, head dim)
    from onnx import numpy_helper as nh

    empty = h.make_graph([h.make_node("Constant", [], ["e"], value=nh.from_array(np.zeros((0, 3), np.float32), "e"))],
                         "then", [], [h.make_tensor_value_info("e", TP.FLOAT, [0, 3])])
    full = h.make_graph([h.make_node("Identity", ["x"], ["f"])], "else", [],
                        [h.make_tensor_value_info("f", TP.FLOAT, ["n", 3])])
    g = h.make_graph([h.make_node("If", ["use_cache_branch"], ["y"], then_branch=empty, else_branch=full),
                      h.make_node("Relu", ["x"], ["z"])], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, ["n", 3]),
                      h.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, ["n", "past_sequence_length"]),
                      h.make_tensor_value_info("use_cache_branch", TP.BOOL, [1])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["n", 3]),
                      h.make_tensor_value_info("z", TP.FLOAT, ["n", 3])])
    path = tmp_path / "merged.onnx"
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    loaded = load_model(path, input_shapes={"x": (2, 3), "past_key_values.0.key": (2, 5)})
    assert [s.shape for s in loaded.outputs] == [(0, 3), (2, 3)]
    assert next(s for s in loaded.inputs if s.name == "use_cache_branch").fixed == (True,)
