"""Cross-compiling: `compile --target aarch64` on this x86 machine links with zig (the ziglang wheel) into an
aarch64 ELF library, names its machine in the manifest, and `run` refuses it here with one line and exit 2."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tvmfuse.machine import host_arch

EM_AARCH64 = 183

needs_zig = pytest.mark.skipif(importlib.util.find_spec("ziglang") is None,
                               reason="the ziglang package is not installed (pip install 'tvmfuse[cross]'): no "
                                      "cross linker for aarch64")
on_x86 = pytest.mark.skipif(host_arch() != "x86_64", reason="checks a foreign (aarch64) build on an x86_64 host")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "250"})


def _tiny_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    w = nh.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "W")
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["xw"]), h.make_node("Relu", ["xw"], ["y"])], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, [8, 16])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [8, 16])], [w])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture(scope="module")
def aarch64_artifact(tmp_path_factory):
    work = tmp_path_factory.mktemp("cross")
    out = work / "tiny.aarch64"
    done = _cli("compile", str(_tiny_model(work / "tiny.onnx")), "--target", "aarch64", "--untuned", "-o", str(out),
                "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads(done.stdout)


def _elf_machine(path: Path) -> int:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF", head[:4]
    return struct.unpack("<H" if head[5] == 1 else ">H", head[18:20])[0]


@needs_zig
@on_x86
def test_an_aarch64_build_is_an_aarch64_library_and_its_manifest_says_so(aarch64_artifact):
    out, report = aarch64_artifact
    assert _elf_machine(out / "model.so") == EM_AARCH64
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["machine"] == {"arch": "aarch64", "triple": "aarch64-linux-gnu", "cuda_arch": None}
    assert report["machine"] == manifest["machine"]
    # a foreign triple gets no host CPU name: this machine's mcpu means nothing on an aarch64 core
    assert manifest["target"] == {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}
    assert manifest["device"] == "cpu:aarch64-linux-gnu"


@needs_zig
@on_x86
def test_run_refuses_an_artifact_built_for_another_machine(aarch64_artifact):
    out, _ = aarch64_artifact
    done = _cli("run", str(out))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: the artifact was built for aarch64") and "this machine is x86_64" in lines[0]


def test_a_foreign_build_without_zig_is_one_line_naming_the_extra():
    from tvmfuse.compile.cross import export_options, zig_available
    from tvmfuse.errors import TargetError
    from tvmfuse.target import resolve_target

    native = resolve_target("llvm")
    assert export_options(native) == {}  # this machine's own architecture: the system's cc, as before
    foreign = resolve_target({"kind": "llvm", "mtriple": "riscv64-linux-gnu"} if host_arch() == "aarch64"
                             else "aarch64")
    if zig_available():
        linker = export_options(foreign)["fcompile"]
        assert linker.command("o.so", ["a.o"])[:6] == [sys.executable, "-m", "ziglang", "cc", "-target",
                                                      linker.triple]
    else:
        with pytest.raises(TargetError, match=r"tvmfuse\[cross\]"):
            export_options(foreign)
