"""One-line errors (ModelError / UnsupportedOpError, exit 2) for files users really bring."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from tvmfuse.errors import ModelError, UnsupportedOpError
from tvmfuse.frontend import import_model, load_model

from .helpers import matmul_model


def _save(tmp_path, model, name="m.onnx"):
    path = tmp_path / name
    path.write_bytes(model.SerializeToString())
    return path


def test_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelError, match="not a readable ONNX model|not an ONNX model"):
        load_model(path)


def test_truncated(tmp_path):
    data = matmul_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    for cut in (len(data) // 3, len(data) - 5):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelError, match="truncated|not an ONNX|invalid ONNX"):
            load_model(path)


def test_missing_and_empty(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "nope.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        load_model(tmp_path / "empty.onnx")
    with pytest.raises(ModelError, match="not a file"):
        load_model(tmp_path)


def _single(op_type, inputs, outputs, opset=17, domain="", out_shape=(2, 2), **attrs):
    ins = [h.make_tensor_value_info(n, TP.FLOAT, [2, 2]) for n in inputs]
    outs = [h.make_tensor_value_info(n, TP.FLOAT, list(out_shape)) for n in outputs]
    node = h.make_node(op_type, inputs, outputs, name="the_node", domain=domain, **attrs)
    imports = [h.make_opsetid("", opset)] + ([h.make_opsetid(domain, 1)] if domain else [])
    return h.make_model(h.make_graph([node], "g", ins, outs), opset_imports=imports)


def test_unsupported_standard_op(tmp_path):
    m = load_model(_save(tmp_path, _single("Det", ["x"], ["y"], out_shape=())))
    with pytest.raises(UnsupportedOpError) as info:
        import_model(m)
    assert str(info.value) == "unsupported ONNX operator 'Det' at node 'the_node', opset 17"
    assert info.value.exit_code == 2


def test_unsupported_custom_domain(tmp_path):
    m = load_model(_save(tmp_path, _single("FusedGelu", ["x"], ["y"], domain="com.microsoft")))
    with pytest.raises(UnsupportedOpError, match="'com.microsoft.FusedGelu' at node 'the_node'"):
        import_model(m)


def test_unknown_op_in_default_domain(tmp_path):
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(_save(tmp_path, _single("NoSuchOp", ["x"], ["y"])))


def test_dangling_input(tmp_path):
    model = _single("Relu", ["x"], ["y"])
    model.graph.node[0].input[0] = "ghost"
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(_save(tmp_path, model))


def test_bad_attribute(tmp_path):
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(_save(tmp_path, _single("Softmax", ["x"], ["y"], axis=7)))


def test_tvm_importer_failure_is_one_line(tmp_path):
    # valid ONNX (Loop with a body) that TVM 0.27's Relax importer cannot convert
    body = h.make_graph([h.make_node("Identity", ["cond_in"], ["cond_out"]), h.make_node("Identity", ["v_in"], ["v_out"])],
                        "body", [h.make_tensor_value_info("i", TP.INT64, []), h.make_tensor_value_info("cond_in", TP.BOOL, []),
                                 h.make_tensor_value_info("v_in", TP.FLOAT, [2, 2])],
                        [h.make_tensor_value_info("cond_out", TP.BOOL, []), h.make_tensor_value_info("v_out", TP.FLOAT, [2, 2])])
    trip = onnx.numpy_helper.from_array(__import__("numpy").array(3, dtype="int64"), "trip")
    node = h.make_node("Loop", ["trip", "", "x"], ["y"], body=body, name="loop")
    g = h.make_graph([node], "g", [h.make_tensor_value_info("x", TP.FLOAT, [2, 2])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [2, 2])], [trip])
    m = load_model(_save(tmp_path, h.make_model(g, opset_imports=[h.make_opsetid("", 17)])))
    with pytest.raises(UnsupportedOpError) as info:
        import_model(m)
    assert "\n" not in str(info.value) and "Loop" in str(info.value)


def test_cli_contract_exit_2_one_line(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("hello")
    code = textwrap.dedent(f"""
        import sys, typer
        from tvmfuse.cli.common import handle_errors
        from tvmfuse.frontend import load_model
        try:
            with handle_errors(False):
                load_model({str(path)!r})
        except typer.Exit as e:
            sys.exit(e.exit_code)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: not a readable ONNX model")


def test_non_utf8_string_field(tmp_path):
    # found by benchmarks/fuzz_frontend.py: protobuf decodes strings lazily, UnicodeDecodeError escaped
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz_regress_non_utf8.onnx"
    with pytest.raises(ModelError):
        load_model(path)
