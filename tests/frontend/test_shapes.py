"""--input-shape and symbolic dims: bound consistently across inputs, clear errors naming the input."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from tvmfuse.errors import ModelError
from tvmfuse.frontend import import_model, load_model, parse_input_shapes


def _two_inputs(tmp_path, a_dims, b_dims, out_dims):
    g = h.make_graph([h.make_node("Add", ["a", "b"], ["y"])], "g",
                     [h.make_tensor_value_info("a", TP.FLOAT, a_dims), h.make_tensor_value_info("b", TP.FLOAT, b_dims)],
                     [h.make_tensor_value_info("y", TP.FLOAT, out_dims)])
    path = tmp_path / "add.onnx"
    onnx.save_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def _decoder_step(tmp_path):
    """A KV-cached decoder's inputs as optimum declares them: the mask spans the past and the new tokens."""
    g = h.make_graph([h.make_node("Concat", ["past", "new"], ["kv"], axis=1),
                      h.make_node("ReduceSum", ["mask"], ["y"], keepdims=0)], "g",
                     [h.make_tensor_value_info("past", TP.FLOAT, ["batch", "past_sequence_length", 4]),
                      h.make_tensor_value_info("new", TP.FLOAT, ["batch", "sequence_length", 4]),
                      h.make_tensor_value_info("mask", TP.INT64, ["batch", "past_sequence_length + sequence_length"])],
                     [h.make_tensor_value_info("kv", TP.FLOAT, ["batch", "total", 4]),
                      h.make_tensor_value_info("y", TP.INT64, [])])
    path = tmp_path / "step.onnx"
    onnx.save_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def test_a_dim_declared_as_a_sum_of_names_follows_them(tmp_path):
    path = _decoder_step(tmp_path)
    m = load_model(path, input_shapes={"past": (2, 0, 4), "new": (2, 3, 4)})   # the first step: no past yet
    assert [s.shape for s in m.inputs] == [(2, 0, 4), (2, 3, 4), (2, 3)]
    with pytest.raises(ModelError, match="gives 9 for 'past_sequence_length \\+ sequence_length', which the other "
                                         "inputs make 8"):
        load_model(path, input_shapes={"past": (1, 5, 4), "new": (1, 3, 4), "mask": (1, 9)})
    # unbound: the suggested flags agree with each other (the mask's suggested length is past + new)
    with pytest.raises(ModelError) as err:
        load_model(path)
    assert "past=1x1x4" in err.value.hint and "new=1x1x4" in err.value.hint and "mask=1x2" in err.value.hint
    assert "(batch x past_sequence_length + sequence_length)" in str(err.value)


def test_symbol_given_once_binds_every_input(tmp_path):
    path = _two_inputs(tmp_path, ["batch", "seq"], ["batch", "seq"], ["batch", "seq"])
    m = load_model(path, input_shapes={"a": (2, 7)})
    assert [s.shape for s in m.inputs] == [(2, 7), (2, 7)]
    assert m.outputs[0].shape == (2, 7)
    main = import_model(m)["main"]
    assert [tuple(int(d) for d in p.ty.shape) for p in main.params] == [(2, 7), (2, 7)]


def test_symbol_given_two_sizes_refused(tmp_path):
    path = _two_inputs(tmp_path, ["batch", "seq"], ["batch", "seq"], ["batch", "seq"])
    with pytest.raises(ModelError, match="dynamic dim 'seq' is 7 for input 'a' but 9 for input 'b'"):
        load_model(path, input_shapes={"a": (2, 7), "b": (2, 9)})


def test_dynamic_input_error_names_the_input(tmp_path):
    path = _two_inputs(tmp_path, [2, 3], ["batch", 3], [2, 3])
    with pytest.raises(ModelError, match=r"input 'b' has a dynamic shape \(batch x 3\).*--input-shape b=1x3"):
        load_model(path)


def test_every_dynamic_input_is_named_in_one_error(tmp_path):
    # a tokenizer's inputs (ids, mask) each dynamic: one run names both and the flags that bind them
    path = _two_inputs(tmp_path, ["batch", "seq"], ["batch", "seq"], ["batch", "seq"])
    with pytest.raises(ModelError, match=r"inputs 'a' \(batch x seq\), 'b' \(batch x seq\) have dynamic shapes") as err:
        load_model(path)
    assert "--input-shape a=1x1 --input-shape b=1x1" in err.value.hint


def test_anonymous_dynamic_dim(tmp_path):
    path = _two_inputs(tmp_path, [2, 3], [None, 3], [2, 3])
    with pytest.raises(ModelError, match=r"input 'b' has a dynamic shape \(\? x 3\)"):
        load_model(path)


def test_override_contradicting_model(tmp_path):
    path = _two_inputs(tmp_path, [2, 3], [2, 3], [2, 3])
    with pytest.raises(ModelError, match="model fixes it to 2x3"):
        load_model(path, input_shapes={"a": (4, 3)})
    with pytest.raises(ModelError, match="rank 3"):
        load_model(path, input_shapes={"a": (2, 3, 1)})
    with pytest.raises(ModelError, match="names no input of the model: c"):
        load_model(path, input_shapes={"c": (2, 3)})


def test_shapes_that_do_not_broadcast_refused(tmp_path):
    path = _two_inputs(tmp_path, ["n", 3], ["m", 3], ["n", 3])
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(path, input_shapes={"a": (2, 3), "b": (5, 3)})


@pytest.mark.parametrize("item", ["x", "x=", "=1x2", "x=1x-2", "x=1xa", "x=-1"])
def test_bad_input_shape_syntax(item):
    with pytest.raises(ModelError, match="bad --input-shape"):
        parse_input_shapes([item])


def test_input_shape_parse():
    assert parse_input_shapes(["input_ids=1x16", "a=b=2X3"]) == {"input_ids": (1, 16), "a=b": (2, 3)}
    # a decoder's first step: its KV cache holds no token yet
    assert parse_input_shapes(["past_key_values.0.key=1x2x0x64"]) == {"past_key_values.0.key": (1, 2, 0, 64)}
