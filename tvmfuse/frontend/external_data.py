"""Read ONNX external data safely: every tensor file must be a plain file inside the model's folder.

``onnx.load`` follows an external tensor's ``location`` wherever it points. That has been exploited:
path traversal with ``../`` or an absolute path (CVE-2022-25882, CVE-2024-27318), and escapes through a
symbolic or hard link planted inside the folder (CVE-2026-27489, CVE-2026-34446). So tvmfuse never lets
onnx (or TVM's importer, or the onnx checker, which both stat ``location`` themselves) touch a
``location``: it parses the model with ``load_external_data=False``, checks every reference here, and
reads the bytes itself.

Rules, each refused with a one-line :class:`~tvmfuse.errors.ModelError`:

- ``location`` is relative, has no ``..`` / ``.`` / empty component, no backslash, NUL or drive letter;
- every folder on the way is opened with ``O_NOFOLLOW`` relative to the previous one (no symlinked
  folder, and no race between checking a path and opening it), and the file itself with ``O_NOFOLLOW``;
- the file is a regular file with exactly one link (``st_nlink == 1``: a hard link to a file outside the
  folder looks like a plain file otherwise);
- ``offset``/``length`` are non-negative integers inside the file, and ``length`` is exactly what the
  tensor's dims and dtype need.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as onnx_helper

from tvmfuse.errors import ModelError

_READ_CHUNK = 64 << 20


@dataclass(frozen=True)
class ExternalRef:
    """One checked external tensor reference."""

    tensor_name: str
    location: str
    offset: int
    length: int


def iter_tensors(model: onnx.ModelProto):
    """Every TensorProto of the model: initializers and attribute tensors, subgraphs included."""
    def graph_tensors(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g)
                for sub in attr.graphs:
                    yield from graph_tensors(sub)

    yield from graph_tensors(model.graph)
    for func in model.functions:
        for node in func.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors


def is_external(tensor: TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


def tensor_nbytes(tensor: TensorProto) -> int:
    """Bytes the tensor's raw data must have; raises ModelError for types that cannot be external."""
    n = 1
    for d in tensor.dims:
        if d < 0:
            raise ModelError(f"tensor '{tensor.name}' has a negative dimension {d}")
        n *= int(d)
    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        raise ModelError(f"tensor '{tensor.name}' of type {TensorProto.DataType.Name(tensor.data_type)} cannot be external data")
    try:
        np_dtype = onnx_helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except Exception:  # noqa: BLE001 - unknown enum values from a hostile file
        raise ModelError(f"tensor '{tensor.name}' has an unknown data type {tensor.data_type}") from None
    bits = {TensorProto.INT4: 4, TensorProto.UINT4: 4}.get(tensor.data_type)
    if bits is None and hasattr(TensorProto, "FLOAT4E2M1") and tensor.data_type == TensorProto.FLOAT4E2M1:
        bits = 4
    if bits is not None:
        return (n * bits + 7) // 8
    return n * np.dtype(np_dtype).itemsize


def _check_location(location: str, tensor_name: str) -> tuple[str, ...]:
    if not location:
        raise ModelError(f"external data of tensor '{tensor_name}' names no file")
    bad = ("\x00" in location or "\\" in location or location.startswith("/")
           or (len(location) > 1 and location[1] == ":"))
    parts = tuple(location.split("/"))
    if bad or any(p in ("", ".", "..") for p in parts):
        raise ModelError(f"external data of tensor '{tensor_name}' points outside the model folder: '{location[:200]}'",
                         hint="locations must be plain relative paths inside the model's folder")
    return parts


def _parse_int(value: str, key: str, tensor_name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ModelError(f"external data of tensor '{tensor_name}' has a bad {key} '{value[:50]}'") from None
    if n < 0:
        raise ModelError(f"external data of tensor '{tensor_name}' has a negative {key} {n}")
    return n


def _open_inside(folder: Path, parts: tuple[str, ...], tensor_name: str) -> int:
    """Open ``folder/parts...`` refusing symlinks on every component; return an fd of a regular file."""
    location = "/".join(parts)
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ModelError(f"cannot open the model folder {folder}: {err.strerror}") from None
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags_dir, dir_fd=dir_fd)
            except OSError as err:
                why = "through a link" if _is_link(dir_fd, part) else err.strerror
                raise ModelError(f"external data of tensor '{tensor_name}' at '{location}' is unreadable: {why}",
                                 hint="symbolic links are refused") from None
            os.close(dir_fd)
            dir_fd = nxt
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        except OSError as err:
            if _is_link(dir_fd, parts[-1]):
                raise ModelError(f"external data of tensor '{tensor_name}' at '{location}' is a symbolic link",
                                 hint="links can escape the model folder; copy the file instead") from None
            raise ModelError(f"external data of tensor '{tensor_name}' at '{location}' is unreadable: {err.strerror}") from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ModelError(f"external data of tensor '{tensor_name}' at '{location}' is not a regular file")
    if st.st_nlink != 1:
        os.close(fd)
        raise ModelError(f"external data of tensor '{tensor_name}' at '{location}' is a hard link ({st.st_nlink} links)",
                         hint="links can escape the model folder; copy the file instead")
    return fd


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _ref_of(tensor: TensorProto) -> tuple[str, int | None, int | None]:
    entries = {}
    for kv in tensor.external_data:
        if kv.key in entries:
            raise ModelError(f"external data of tensor '{tensor.name}' repeats the key '{kv.key}'")
        entries[kv.key] = kv.value
    location = entries.get("location", "")
    offset = _parse_int(entries["offset"], "offset", tensor.name) if "offset" in entries else None
    length = _parse_int(entries["length"], "length", tensor.name) if "length" in entries else None
    return location, offset, length


def _checked_refs(model: onnx.ModelProto, folder: Path, fds: dict[str, int]):
    """Yield ``(tensor, ref, fd)`` for every external tensor, each file opened once (into ``fds``) with the
    location checks, and each reference's offset and length checked against the file and the tensor's shape."""
    for tensor in iter_tensors(model):
        if not is_external(tensor):
            continue
        location, offset, length = _ref_of(tensor)
        parts = _check_location(location, tensor.name)
        if location not in fds:
            fds[location] = _open_inside(folder, parts, tensor.name)
        fd = fds[location]
        size = os.fstat(fd).st_size
        offset = offset or 0
        need = tensor_nbytes(tensor)
        if length is None:
            length = size - offset if offset <= size else -1
        if length != need:
            raise ModelError(f"external data of tensor '{tensor.name}' declares {length} bytes, its shape needs {need}")
        if offset + length > size:
            raise ModelError(f"external data of tensor '{tensor.name}' ends at byte {offset + length}, "
                             f"past the end of '{location}' ({size} bytes)", hint="the file is truncated")
        yield tensor, ExternalRef(tensor.name, location, offset, length), fd


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


def check_external_data(model: onnx.ModelProto, folder: Path) -> list[ExternalRef]:
    """Check every external reference of ``model`` (files opened, never read); return them."""
    fds: dict[str, int] = {}
    try:
        return [ref for _, ref, _ in _checked_refs(model, folder, fds)]
    finally:
        _close_all(fds)


def load_external_data(model: onnx.ModelProto, folder: Path) -> int:
    """Check and read every external tensor into ``raw_data``; return the bytes read.

    Files are re-opened with the same checks (no window between check and read).
    """
    total = 0
    fds: dict[str, int] = {}
    try:
        for tensor, ref, fd in _checked_refs(model, folder, fds):
            offset, length, location = ref.offset, ref.length, ref.location
            buf = bytearray(length)
            view = memoryview(buf)
            pos = 0
            while pos < length:
                got = os.preadv(fd, [view[pos:pos + _READ_CHUNK]], offset + pos)
                if got <= 0:
                    raise ModelError(f"external data file '{location}' ended early while reading tensor '{tensor.name}'")
                pos += got
            tensor.raw_data = bytes(buf)
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
            total += length
    finally:
        _close_all(fds)
    return total
