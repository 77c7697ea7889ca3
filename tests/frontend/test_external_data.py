"""External data is read only from plain files inside the model's folder.

Regression tests for the ONNX external-data escapes: path traversal with ``..`` or an absolute path
(CVE-2022-25882, CVE-2024-27318) and escapes through symbolic or hard links (CVE-2026-27489,
CVE-2026-34446). Every refused model also has a "secret" file the escape would have read; the tests
check it is never read (its bytes would otherwise become weights).
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from tvmfuse.errors import ModelError
from tvmfuse.frontend import import_model, load_model
from tvmfuse.frontend.loader import available_memory

from .helpers import matmul_model, rel_err, run_ort, run_tvm, save_external, set_location


def test_external_data_inside_folder_loads_and_matches_embedded(tmp_path):
    model = matmul_model()
    path = save_external(model, tmp_path / "m", location="data/weights.bin")
    loaded = load_model(path, input_shapes=None)
    assert all(not t.external_data for t in loaded.proto.graph.initializer)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    got = run_tvm(import_model(loaded), [x])
    assert rel_err(got, run_ort(matmul_model(), {"x": x})) < 1e-6


@pytest.fixture
def victim(tmp_path):
    """A model folder, and outside it a secret file the size of the weights (so only the path check stops it)."""
    path = save_external(matmul_model(), tmp_path / "m")
    secret = tmp_path / "secret.bin"
    secret.write_bytes((tmp_path / "m" / "weights.bin").read_bytes())
    return path, secret


@pytest.mark.parametrize("location", ["../secret.bin", "sub/../../secret.bin", "./../secret.bin", "ABSOLUTE",
                                      "..\\secret.bin", "C:/secret.bin", "weights.bin\x00.txt", ""])
def test_traversal_and_absolute_locations_refused(victim, location):
    # CVE-2022-25882 / CVE-2024-27318: onnx resolved '../' and absolute locations outside the folder
    path, secret = victim
    set_location(path, str(secret) if location == "ABSOLUTE" else location)
    with pytest.raises(ModelError, match="outside the model folder|names no file"):
        load_model(path)


def test_symlinked_data_file_refused(victim):
    # CVE-2026-27489: a symlink inside the folder pointing outside it
    path, secret = victim
    (path.parent / "weights.bin").unlink()
    os.symlink(secret, path.parent / "weights.bin")
    with pytest.raises(ModelError, match="symbolic link"):
        load_model(path)


def test_symlink_inside_folder_refused_too(victim):
    # even a link that stays inside: links are refused, not judged
    path, _ = victim
    os.rename(path.parent / "weights.bin", path.parent / "real.bin")
    os.symlink("real.bin", path.parent / "weights.bin")
    with pytest.raises(ModelError, match="symbolic link"):
        load_model(path)


def test_symlinked_folder_component_refused(victim, tmp_path):
    path, secret = victim
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(secret, outside / "weights.bin")
    os.symlink(outside, path.parent / "sub")
    set_location(path, "sub/weights.bin")
    with pytest.raises(ModelError, match="link"):
        load_model(path)


def test_hardlinked_data_file_refused(victim):
    # CVE-2026-34446: a hard link looks like a plain file; st_nlink > 1 gives it away
    path, secret = victim
    (path.parent / "weights.bin").unlink()
    os.link(secret, path.parent / "weights.bin")
    with pytest.raises(ModelError, match="hard link"):
        load_model(path)


def test_data_not_a_regular_file_refused(victim):
    path, _ = victim
    (path.parent / "weights.bin").unlink()
    (path.parent / "weights.bin").mkdir()
    with pytest.raises(ModelError, match="not a regular file|unreadable"):
        load_model(path)


def test_missing_data_file(victim):
    path, _ = victim
    (path.parent / "weights.bin").unlink()
    with pytest.raises(ModelError, match="unreadable"):
        load_model(path)


def test_truncated_data_file(victim):
    path, _ = victim
    data = path.parent / "weights.bin"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(ModelError, match="past the end|declares"):
        load_model(path)


@pytest.mark.parametrize("offset,length,match", [
    (10**15, None, "past the end|declares"), (0, 4, "declares 4 bytes, its shape needs 64"),
    (0, 10**12, "declares"), (-1, None, "negative offset")])
def test_declared_offset_and_length_checked(victim, offset, length, match):
    path, _ = victim
    set_location(path, "weights.bin", offset=offset, length=length)
    with pytest.raises(ModelError, match=match):
        load_model(path)


def test_bad_offset_text(victim):
    path, _ = victim
    model = onnx.load_model(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "offset":
                e.value = "0x10"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match="bad offset"):
        load_model(path)


def test_input_too_large_for_this_machine(tmp_path):
    # a sparse file: declared, in bounds, consistent with the shape, and larger than memory
    n = (available_memory() // 4) + (1 << 20)
    w = onnx.helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [n, 1])
    model = matmul_model(k=4, n=1)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = n
    t = model.graph.initializer[0]
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.ClearField("dims")
    t.dims.extend([n, 1])
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "big.bin"), ("offset", "0"), ("length", str(n * 4))):
        e = t.external_data.add()
        e.key, e.value = key, value
    del w
    folder = tmp_path / "big"
    folder.mkdir()
    with open(folder / "big.bin", "wb") as f:
        f.truncate(n * 4)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match="input too large for this machine"):
        load_model(folder / "model.onnx")


def test_huge_input_shape_too_large(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(matmul_model(batch="n"), str(path))
    with pytest.raises(ModelError, match="input too large for this machine"):
        load_model(path, input_shapes={"x": (10**12, 4)})
